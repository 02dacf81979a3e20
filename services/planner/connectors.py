"""How the planner's decisions act (docs/planner.md, "Connectors"). A connector gets the whole desired map each
interval (idempotent: applying the same map twice changes nothing) and raises ConnectorError when it could not.

- `dry-run`: nothing; the decision is only logged and exposed as metrics.
- `supervisor`: `make run`'s supervisor (scripts/run.py) owns the processes; the planner writes the desired map
  to a JSON file (atomically: a temporary file renamed over it) that the supervisor reads every pass, starting
  instances and draining (SIGTERM) the newest ones it no longer needs.
- `compose`: `docker compose ... up -d --no-deps --no-recreate --scale role=n role...` (the compose file's
  services are the roles); compose starts or removes containers, a removed one gets SIGTERM and drains.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import time
from pathlib import Path
from typing import Protocol

COMPOSE_TIMEOUT_S = 120.0


class ConnectorError(Exception):
    pass


class Connector(Protocol):
    name: str

    async def apply(self, desired: dict[str, int]) -> None: ...


class DryRun:
    name = "dry-run"

    async def apply(self, desired: dict[str, int]) -> None:
        return None


class SupervisorFile:
    name = "supervisor"

    def __init__(self, path: str) -> None:
        if not path:
            raise ConnectorError("the supervisor connector needs WINDSERVE_PLANNER_DESIRED_FILE (make run sets it)")
        self.path = Path(path)

    async def apply(self, desired: dict[str, int]) -> None:
        write_desired(self.path, desired)


def write_desired(path: Path, desired: dict[str, int]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps({"desired": desired, "at": time.time()}))
        os.replace(tmp, path)
    except OSError as exc:
        raise ConnectorError(f"cannot write {path}: {exc}") from exc


def read_desired(path: Path) -> dict[str, int] | None:
    """The supervisor's side: the map last written, or None when there is none (yet) or it does not parse."""
    try:
        data = json.loads(path.read_text())
        return {str(k): int(v) for k, v in data["desired"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class Compose:
    name = "compose"

    def __init__(self, command: str) -> None:
        self.command = shlex.split(command)
        self.applied: dict[str, int] = {}

    def argv(self, desired: dict[str, int]) -> list[str]:
        scale = [a for role, n in sorted(desired.items()) for a in ("--scale", f"{role}={n}")]
        return [*self.command, "up", "-d", "--no-deps", "--no-recreate", *scale, *sorted(desired)]

    async def apply(self, desired: dict[str, int]) -> None:
        if desired == self.applied:
            return
        argv = self.argv(desired)
        try:
            proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.STDOUT)
        except OSError as exc:
            raise ConnectorError(f"cannot run {argv[0]!r}: {exc}") from exc
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), COMPOSE_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise ConnectorError(f"`{shlex.join(argv)}` took over {COMPOSE_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            raise ConnectorError(f"`{shlex.join(argv)}` exited {proc.returncode}: {out.decode()[-500:]}")
        self.applied = dict(desired)


def connector(kind: str, desired_file: str = "", compose_command: str = "docker compose") -> Connector:
    if kind == "supervisor":
        return SupervisorFile(desired_file)
    if kind == "compose":
        return Compose(compose_command)
    return DryRun()
