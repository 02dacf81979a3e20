"""Wiring of the planner service: every `planner_interval_s` it reads the gateways' /metrics and the registry,
steps the pure `Planner` (services/planner/core.py) and hands the desired instances per role to its connector
(services/planner/connectors.py). It serves no subject; its health details and metrics show its last decision.

Failure behaviour: a gateway that does not answer within half an interval is left out of that reading (none
answering: no decision that interval); a connector error is logged, counted and retried next interval; the
planner holding no state another could not rebuild, a restarted planner starts from the instances it sees live.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from libs.bus import RegistryView, ViewConfig
from libs.engine.mock_profile import MockProfile
from libs.service import Service
from protos.messages import Role
from services.planner import metrics
from services.planner.config import PlannerConfig
from services.planner.connectors import Connector, ConnectorError, connector
from services.planner.core import Decision, Observation, Planner, PlannerSettings, RoleLoad, Sla
from services.planner.observe import Reading, observe, read_gateways, role_loads

log = logging.getLogger("windserve.planner")


class PlannerService(Service):
    role = Role.PLANNER
    config: PlannerConfig

    def __init__(self, config: PlannerConfig) -> None:
        super().__init__(config)
        self.settings = PlannerSettings(
            sla=Sla(config.sla_ttft_p90_ms / 1000, config.sla_itl_p90_ms / 1000), limits=config.limits(),
            profile=MockProfile.load(config.planner_profile), interval_s=config.planner_interval_s,
            lead_s=config.planner_lead_s, utilization=config.planner_utilization,
            down_after=config.planner_down_after, cooldown_s=config.planner_cooldown_s)
        self.connector: Connector = connector(config.planner_connector, config.planner_desired_file,
                                              config.planner_compose_command)
        self.gateways = [u.strip() for u in config.planner_gateways.split(",") if u.strip()]
        self.planner: Planner | None = None
        self.last: Decision | None = None
        self.view: RegistryView | None = None

    async def setup(self) -> None:
        assert self.registry is not None
        self.view = RegistryView(self.registry, config=ViewConfig(list_timeout_s=self.config.registry_timeout_s),
                                 outages=self.registry_outages)
        await self.view.start()
        self.spawn(self._loop(), name="planner")

    async def teardown(self) -> None:
        if self.view is not None:
            await self.view.stop()

    def health_details(self) -> dict[str, str]:
        d = {"connector": self.connector.name, "roles": self.config.planner_roles}
        if self.last is not None:
            d["desired"] = ",".join(f"{r}={n}" for r, n in sorted(self.last.desired.items()))
            d["predicted_rate"] = f"{self.last.prediction.rate:.2f}"
        return d

    async def _loop(self) -> None:
        interval = self.config.planner_interval_s
        async with httpx.AsyncClient() as client:
            before: Reading | None = None
            taken = time.monotonic()
            while True:
                reading, failed = await read_gateways(client, self.gateways, interval / 2)
                now = time.monotonic()
                if failed:
                    metrics.SCRAPE_ERRORS.inc(failed)
                if reading.gateways == 0:
                    log.warning("no gateway answered; no decision this interval", extra={"gateways": self.gateways})
                    before = None
                elif before is not None and reading.gateways == before.gateways:
                    await self._decide(observe(before, reading, now - taken, self._loads()), now)
                if reading.gateways:
                    before, taken = reading, now
                await _sleep_until(taken + interval)

    def _loads(self) -> dict[str, RoleLoad]:
        assert self.view is not None
        return role_loads(self.view.live(time.time()))

    async def _decide(self, obs: Observation, now: float) -> None:
        if self.planner is None:  # start from what runs
            self.planner = Planner(self.settings, {r: load.instances for r, load in obs.roles.items()})
        previous = {r: st.desired for r, st in self.planner.roles.items()}
        decision = self.last = self.planner.step(obs, now)
        metrics.OBSERVED_RATE.set(obs.arrival_rate)
        metrics.PREDICTED_RATE.set(decision.prediction.rate)
        metrics.CORRECTION.set(self.planner.correction)
        for role, n in decision.desired.items():
            metrics.DESIRED.labels(role).set(n)
            metrics.ACTUAL.labels(role).set(obs.roles[role].instances if role in obs.roles else 0)
            metrics.NEEDED.labels(role).set(decision.needed.get(role, 0.0))
            if n != previous[role]:
                metrics.STEPS.labels(role, "up" if n > previous[role] else "down").inc()
                log.info("scale", extra={"role": role, "from": previous[role], "to": n,
                                         "why": decision.reasons[role],
                                         "predicted_rate": round(decision.prediction.rate, 3)})
        try:
            await self.connector.apply(decision.desired)
        except ConnectorError as exc:
            metrics.CONNECTOR_ERRORS.inc()
            log.error("connector failed; retried next interval", extra={"error": str(exc)})


async def _sleep_until(deadline: float) -> None:
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
