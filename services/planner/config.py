"""Planner settings (env prefix WINDSERVE_)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from libs.service import ServiceConfig
from services.planner.core import ROLES

_LIMIT = re.compile(r"^(\w+)=(\d+):(\d+)$")


def parse_limits(spec: str) -> dict[str, tuple[int, int]]:
    """"worker=1:8,prefill=1:4" -> {"worker": (1, 8), "prefill": (1, 4)}; ValueError naming what is wrong."""
    out: dict[str, tuple[int, int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = _LIMIT.match(part)
        if m is None:
            raise ValueError(f"{part!r} is not role=min:max")
        role, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
        if role not in ROLES:
            raise ValueError(f"{role!r} is not a role the planner sizes ({', '.join(ROLES)})")
        if not 0 <= lo <= hi or hi == 0:
            raise ValueError(f"{part!r}: need 0 <= min <= max and max >= 1")
        out[role] = (lo, hi)
    return out


class PlannerConfig(ServiceConfig):
    sla_ttft_p90_ms: float = Field(default=2000.0, gt=0, description="SLA: time to first token, p90, ms")
    sla_itl_p90_ms: float = Field(default=100.0, gt=0, description="SLA: inter-token latency, p90, ms")
    planner_roles: str = Field(default="worker=1:4", description="roles the planner sizes with their bounds, "
                               "`role=min:max` comma-separated (worker, prefill, decode)")
    planner_interval_s: float = Field(default=5.0, gt=0, description="one observation and decision this often")
    planner_lead_s: float = Field(default=15.0, ge=0, description="how far ahead the load is predicted: about "
                                  "the time a new instance takes to serve")
    planner_utilization: float = Field(default=0.75, gt=0, le=1, description="the busiest an instance is planned "
                                       "to be")
    planner_down_after: int = Field(default=3, ge=1, description="intervals in a row that need fewer instances "
                                    "before one leaves")
    planner_cooldown_s: float = Field(default=30.0, ge=0, description="no step down this soon after a step up")
    planner_profile: str = Field(default="", description="step-cost profile the capacity comes from (a name in "
                                 "libs/engine/profiles or a JSON path, as WINDSERVE_MOCK_PROFILE; `python -m "
                                 "bench.profile` fits one); empty = the default")
    planner_gateways: str = Field(default="http://127.0.0.1:8000", description="gateway base URLs whose "
                                  "/metrics the planner reads, comma-separated")
    planner_connector: Literal["dry-run", "supervisor", "compose"] = Field(
        default="dry-run", description="how decisions act: dry-run (log and metrics only), supervisor (`make "
        "run`'s, through WINDSERVE_PLANNER_DESIRED_FILE), compose (`docker compose up -d --scale`)")
    planner_desired_file: str = Field(default="", description="supervisor connector: the JSON file the planner "
                                      "writes its desired instances to (`make run` sets it)")
    planner_compose_command: str = Field(default="docker compose", description="compose connector: the command, "
                                         "with its -f / -p arguments, that `up -d --scale` is appended to")

    @field_validator("planner_roles")
    @classmethod
    def _roles(cls, v: str) -> str:
        if not parse_limits(v):
            raise ValueError("names no role")
        return v

    def limits(self) -> dict[str, tuple[int, int]]:
        return parse_limits(self.planner_roles)
