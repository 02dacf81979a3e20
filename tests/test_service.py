"""Service base: config loading, JSON logs, lifecycle (health, drain, deregister), real processes."""

import asyncio
import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import urllib.request

import orjson
import pytest

from libs.bus import HeartbeatConfig, Registry
from libs.service import ConfigError, JsonFormatter, Service, ServiceConfig, load_config
from protos import subjects
from protos.messages import HealthReply, HealthRequest, Role, RouteReply, RouteRequest, ServiceState
from services.gateway.config import GatewayConfig
from services.router.config import RouterConfig
from tests.fixtures.nats import free_port

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- config (unit) --------------------------------------------------------------------------


@pytest.mark.unit
def test_config_reads_prefixed_env_and_keeps_defaults():
    cfg = load_config(
        GatewayConfig,
        {
            "WINDSERVE_HTTP_PORT": "9001",
            "WINDSERVE_REGISTRY_TTL_S": "3",
            "WINDSERVE_LABELS": '{"bucket": "32k"}',
            "WINDSERVE_INSTANCE_ID": "gw-1",
            "OTHER_HTTP_PORT": "1",
            "WINDSERVE_UNRELATED": "x",  # another service's variable: ignored
        },
    )
    assert (cfg.http_port, cfg.registry_ttl_s, cfg.labels, cfg.instance_id) == (9001, 3, {"bucket": "32k"}, "gw-1")
    assert cfg.nats_url == ServiceConfig.model_fields["nats_url"].default


@pytest.mark.unit
def test_config_errors_name_the_variable():
    with pytest.raises(ConfigError, match="WINDSERVE_METRICS_PORT.*70000"):
        load_config(RouterConfig, {"WINDSERVE_METRICS_PORT": "70000"})
    with pytest.raises(ConfigError, match="WINDSERVE_LABELS.*JSON"):
        load_config(RouterConfig, {"WINDSERVE_LABELS": "{oops"})
    with pytest.raises(ConfigError, match="must be below registry_ttl_s"):
        load_config(RouterConfig, {"WINDSERVE_REGISTRY_TTL_S": "1", "WINDSERVE_HEARTBEAT_INTERVAL_S": "2"})
    with pytest.raises(ConfigError, match="WINDSERVE_INSTANCE_ID"):
        load_config(RouterConfig, {"WINDSERVE_INSTANCE_ID": "has.dot"})


@pytest.mark.unit
def test_config_is_frozen_and_instance_ids_differ():
    a, b = load_config(RouterConfig, {}), load_config(RouterConfig, {})
    assert a.instance_id != b.instance_id
    with pytest.raises(Exception, match="frozen"):
        a.capacity = 3  # type: ignore[misc]


@pytest.mark.unit
def test_json_formatter_emits_one_object_with_extras():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter({"service": "router"}))
    logger = logging.getLogger("test.json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("hello %s", "world", extra={"request_id": "q1"})
    finally:
        logger.removeHandler(handler)
    doc = orjson.loads(stream.getvalue())
    assert doc["msg"] == "hello world" and doc["level"] == "WARNING"
    assert doc["service"] == "router" and doc["request_id"] == "q1"


# --- lifecycle in-process (integration) -----------------------------------------------------


class EchoService(Service):
    role = Role.ROUTER

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def setup(self) -> None:
        assert self.bus is not None
        await self.bus.serve(f"t.svc.{self.config.instance_id}", RouteRequest, self.route)

    async def route(self, req: RouteRequest) -> RouteReply:
        self.entered.set()
        await self.release.wait()
        return RouteReply(prefill_instance="p", decode_instance="d", predicted_hit_tokens=req.num_tokens)


def svc_config(nats_url: str, **kw) -> ServiceConfig:
    base = {"nats_url": nats_url, "namespace": "test_service", "registry_ttl_s": 2, "heartbeat_interval_s": 0.3}
    return ServiceConfig(**{**base, **kw})


@pytest.mark.integration
async def test_service_registers_answers_health_and_drains_before_deregistering(bus, nats_url):
    svc = EchoService(svc_config(nats_url, metrics_port=free_port()))
    await svc.start()
    try:
        registry = await Registry.open(bus, bucket=subjects.registry_bucket("test_service"))
        assert [e.instance_id for e in await registry.list(Role.ROUTER)] == [svc.config.instance_id]
        health = await bus.request(subjects.health("test_service", svc.config.instance_id), HealthRequest(),
                                   HealthReply, 2)
        assert (health.role, health.state, health.in_flight) == (Role.ROUTER, ServiceState.RUNNING, 0)

        body = urllib.request.urlopen(svc.metrics_server.url, timeout=5).read().decode()
        assert 'windserve_service_state{state="running"} 1.0' in body

        pending = asyncio.create_task(
            bus.request(f"t.svc.{svc.config.instance_id}", RouteRequest(request_id="a", num_tokens=5), RouteReply, 10)
        )
        await asyncio.wait_for(svc.entered.wait(), 5)
        stopping = asyncio.create_task(svc.stop())
        await asyncio.sleep(0.3)
        assert svc.state == ServiceState.DRAINING and not stopping.done()  # waits for the handler
        assert await registry.list(Role.ROUTER) == []  # already deregistered: nobody picks it now
        svc.release.set()
        assert (await pending).predicted_hit_tokens == 5  # the in-flight request still got its answer
        await asyncio.wait_for(stopping, 10)
        assert svc.state == ServiceState.STOPPED
    finally:
        svc.release.set()
        await svc.stop()


@pytest.mark.integration
async def test_namespaces_on_one_nats_server_never_answer_each_other(bus, nats_url):
    """Two deployments share a nats-server: each gateway's route requests reach only its own routers."""
    from protos.messages import RegistryEntry
    from services.router.service import RouterService

    routers, registrations = [], []
    for ns in ("ns_a", "ns_b"):
        router = RouterService(RouterConfig(nats_url=nats_url, namespace=ns, instance_id=f"router-{ns}"))
        await router.start()
        routers.append(router)
        registry = await Registry.open(bus, bucket=subjects.registry_bucket(ns))
        reg = registry.register(RegistryEntry(role=Role.WORKER, instance_id=f"worker-{ns}"), HeartbeatConfig(5, 1))
        await reg.start()
        registrations.append(reg)
    try:
        for ns in ("ns_a", "ns_b"):
            picks = {(await bus.request(subjects.route(ns), RouteRequest(request_id=f"r{i}", num_tokens=8),
                                        RouteReply, 5)).prefill_instance for i in range(12)}
            assert picks == {f"worker-{ns}"}
    finally:
        for reg in registrations:
            await reg.stop()
        for router in routers:
            await router.stop()


@pytest.mark.integration
async def test_failing_critical_background_task_stops_service(nats_url):
    svc = EchoService(svc_config(nats_url))

    async def boom():
        raise RuntimeError("lost the model")

    runner = asyncio.create_task(svc.run())
    try:
        async with asyncio.timeout(10):
            while svc.state != ServiceState.RUNNING:
                await asyncio.sleep(0.02)
        svc.spawn(boom(), name="boom", critical=True)
        await asyncio.wait_for(runner, 10)
        assert svc.state == ServiceState.STOPPED
    finally:
        svc.request_stop()
        await asyncio.wait_for(runner, 10)


# --- real processes (e2e) -------------------------------------------------------------------


def start_router(nats_url: str, instance: str, namespace: str) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "WINDSERVE_NATS_URL": nats_url,
        "WINDSERVE_INSTANCE_ID": instance,
        "WINDSERVE_NAMESPACE": namespace,
        "WINDSERVE_REGISTRY_TTL_S": "1",
        "WINDSERVE_HEARTBEAT_INTERVAL_S": "0.25",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "services.router"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


async def wait_listed(registry: Registry, instance: str, present: bool, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while (instance in [e.instance_id for e in await registry.list()]) != present:
            await asyncio.sleep(0.05)


@pytest.mark.e2e
async def test_sigkilled_service_leaves_registry_within_ttl_and_sigterm_deregisters(bus, nats_url):
    namespace = "test_service_kill"
    registry = await Registry.open(bus, bucket=subjects.registry_bucket(namespace))
    killed = start_router(nats_url, "doomed", namespace)
    stopped = start_router(nats_url, "polite", namespace)
    try:
        await wait_listed(registry, "doomed", True, 60)  # start-up only; slow on a loaded 2-core machine
        await wait_listed(registry, "polite", True, 60)  # start-up only; slow on a loaded 2-core machine
        reply = await bus.request(subjects.health(namespace, "doomed"), HealthRequest(), HealthReply, 2)
        assert reply.instance_id == "doomed" and "bucket_edges" in reply.details

        killed.send_signal(signal.SIGKILL)
        killed.wait(5)
        # TTL is 1 s; allow the server's expiry scan one more second. Heartbeats of the other
        # instance meanwhile keep it listed.
        await wait_listed(registry, "doomed", False, HeartbeatConfig(ttl_s=1, interval_s=0.25).ttl_s + 1.5)
        assert [e.instance_id for e in await registry.list()] == ["polite"]

        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(10) == 0, stopped.stderr.read().decode()[-2000:] if stopped.stderr else ""
        assert await registry.list() == []  # deregistered on the way out, no TTL wait needed
    finally:
        for proc in (killed, stopped):
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            if proc.stderr:
                proc.stderr.close()


@pytest.mark.e2e
def test_bad_config_exits_2_with_clear_message():
    env = {**os.environ, "WINDSERVE_REGISTRY_TTL_S": "zero"}
    proc = subprocess.run(
        [sys.executable, "-m", "services.decode"], cwd=ROOT, env=env, capture_output=True, timeout=30
    )
    assert proc.returncode == 2
    assert b"WINDSERVE_REGISTRY_TTL_S" in proc.stderr and b"decode" in proc.stderr


@pytest.mark.e2e
def test_unreachable_nats_exits_1():
    env = {**os.environ, "WINDSERVE_NATS_URL": f"nats://127.0.0.1:{free_port()}", "WINDSERVE_CONNECT_TIMEOUT_S": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "services.prefill"], cwd=ROOT, env=env, capture_output=True, timeout=30
    )
    assert proc.returncode == 1
    assert b"cannot connect to NATS" in proc.stderr


@pytest.mark.unit
def test_gateway_health_groups_by_role_and_reports_registry_failure():
    from fastapi.testclient import TestClient

    from protos.messages import RegistryEntry
    from services.gateway.handlers import build_app

    entries = [
        RegistryEntry(role=Role.DECODE, instance_id="d2"),
        RegistryEntry(role=Role.DECODE, instance_id="d1"),
        RegistryEntry(role=Role.ROUTER, instance_id="r1"),
    ]

    async def listing():
        return entries

    body = TestClient(build_app(listing, "gw")).get("/health").json()
    assert body["services"] == {"decode": ["d1", "d2"], "router": ["r1"]}
    assert len(body["instances"]) == 3

    async def broken():
        raise TimeoutError("registry bucket windserve_registry took over 2s")

    resp = TestClient(build_app(broken, "gw")).get("/health")
    assert resp.status_code == 503 and "took over 2s" in resp.json()["error"]


# --- the event-loop watchdog ------------------------------------------------------------------


@pytest.mark.unit
async def test_loop_watchdog_fires_on_a_blocked_loop_not_on_a_busy_one():
    import time

    from libs.service.watchdog import LoopWatchdog

    stalls: list[float] = []
    dog = LoopWatchdog(0.4, "test", on_stall=stalls.append)
    dog.start()
    try:
        deadline = time.monotonic() + 1.5  # busy but running: many short steps, never 0.4 s without a tick
        while time.monotonic() < deadline:
            time.sleep(0.01)
            await asyncio.sleep(0)
        assert stalls == []
        time.sleep(1.5)  # the loop blocked: no tick for longer than stall_s
        assert len(stalls) == 1 and stalls[0] >= 0.4
    finally:
        await dog.stop()


_STALLING_SERVICE = """
import asyncio, time
from libs.service import Service, ServiceConfig
from libs.service.service import main
from protos.messages import Role

class Stalling(Service):
    role = Role.ROUTER
    async def setup(self):
        asyncio.get_running_loop().call_later(1.0, time.sleep, 120)  # a call that never returns, on the loop

raise SystemExit(main(Stalling, ServiceConfig))
"""


def _env(nats_url: str, instance: str, namespace: str, **kw: str) -> dict[str, str]:
    return {**os.environ, "WINDSERVE_NATS_URL": nats_url, "WINDSERVE_INSTANCE_ID": instance,
            "WINDSERVE_NAMESPACE": namespace, "WINDSERVE_REGISTRY_TTL_S": "1",
            "WINDSERVE_HEARTBEAT_INTERVAL_S": "0.25", **kw}


@pytest.mark.e2e
async def test_a_service_whose_loop_stalls_exits_70_and_a_stopped_one_resumes(bus, nats_url):
    """A real service process whose event loop blocks ends itself with code 70 (so compose's restart policy or
    the supervisor restarts it) within the watchdog's bound; a SIGSTOPped one resumed after longer than that
    bound is not killed by it (frozen time is not counted) and serves again."""
    namespace = "test_watchdog"
    registry = await Registry.open(bus, bucket=subjects.registry_bucket(namespace))
    stalls = subprocess.Popen([sys.executable, "-c", _STALLING_SERVICE], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=_env(nats_url, "stalls", namespace,
                                                               WINDSERVE_LOOP_WATCHDOG_S="2"))
    frozen = subprocess.Popen([sys.executable, "-m", "services.router"], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, env=_env(nats_url, "frozen", namespace,
                                                                  WINDSERVE_LOOP_WATCHDOG_S="1"))
    try:
        await wait_listed(registry, "stalls", True, 60)  # start-up only; slow on a loaded 2-core machine
        await wait_listed(registry, "frozen", True, 60)
        code = await asyncio.to_thread(stalls.wait, 30)  # 1 s to the stall + 2 s of watchdog + exit
        err = stalls.stderr.read().decode() if stalls.stderr else ""
        assert code == 70, err[-2000:]
        assert "event loop stalled" in err and "stalled_s" in err
        await wait_listed(registry, "stalls", False, 5)  # no deregistration on the way out: the TTL drops it

        frozen.send_signal(signal.SIGSTOP)
        await asyncio.sleep(4)  # four watchdog bounds
        frozen.send_signal(signal.SIGCONT)
        await asyncio.sleep(3)
        assert frozen.poll() is None
        reply = await bus.request(subjects.health(namespace, "frozen"), HealthRequest(), HealthReply, 5)
        assert reply.state == ServiceState.RUNNING
    finally:
        for proc in (stalls, frozen):
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            if proc.stderr:
                proc.stderr.close()


# --- the bus self-check ---------------------------------------------------------------------------


async def _health_sub_lost(svc: Service) -> None:
    """Unsubscribe the service's own health subscription behind its back (as a subscription lost in a reconnect
    would be): its loop runs, its bus is connected, nothing answers `windserve.<ns>.health.<id>`."""
    assert svc.bus is not None
    subject = subjects.health(svc.config.namespace, svc.config.instance_id)
    sub = next(s for s in svc.bus._servers if s.subject == subject)
    await sub.unsubscribe()


@pytest.mark.integration
async def test_self_check_ignores_a_nats_outage_and_stops_a_service_whose_subscription_is_gone(tmp_path):
    """nats-server stopped for three self-check bounds, then restarted on its port and store: the service is not
    stopped (a NATS outage is not the service's), its asks are answered again after the reconnect; then its
    health subscription is removed while the connection is up: it stops with exit code 69 within the bound,
    naming the cause."""
    from libs.service.selfcheck import EXIT_CODE
    from tests.fixtures.nats import start_nats_server

    nats = start_nats_server(str(tmp_path / "nats"))
    svc = EchoService(svc_config(nats.url, self_check_s=1.0))
    runner = asyncio.create_task(svc.run(self_check=False))
    try:
        async with asyncio.timeout(10):
            while svc.state != ServiceState.RUNNING:
                await asyncio.sleep(0.02)
        check = svc.start_self_check(interval_s=0.2, timeout_s=0.2)
        async with asyncio.timeout(5):
            while check.asks < 3:
                await asyncio.sleep(0.05)
        nats.stop()
        await asyncio.sleep(3.0)  # 3 x self_check_s without NATS
        assert not runner.done() and svc.exit_code == 0 and svc.state == ServiceState.RUNNING
        nats = start_nats_server(str(tmp_path / "nats"), port=nats.port)
        asks = check.asks
        async with asyncio.timeout(15):  # reconnected (reconnect_wait 1 s) and its restored subscription answers
            while check.asks < asks + 3:
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)
        assert not runner.done() and svc.exit_code == 0

        loop = asyncio.get_running_loop()
        lost_at = loop.time()
        await _health_sub_lost(svc)
        await asyncio.wait_for(asyncio.shield(runner), 15)
        assert svc.exit_code == EXIT_CODE == 69 and svc.state == ServiceState.STOPPED
        # bound: self_check_s of failed asks (+ one ask's timeout), then a graceful stop (nothing in flight)
        assert loop.time() - lost_at < 1.0 + 0.2 + 0.2 + 5.0
    finally:
        svc.request_stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(runner, 15)
        nats.stop()


_LOSING_SERVICE = """
import asyncio
import contextlib
from libs.service import Service, ServiceConfig
from libs.service.service import main
from protos import subjects
from protos.messages import Role

class Losing(Service):
    role = Role.ROUTER
    async def setup(self):
        async def lose():
            await asyncio.sleep(1.0)
            subject = subjects.health(self.config.namespace, self.config.instance_id)
            await next(s for s in self.bus._servers if s.subject == subject).unsubscribe()  # behind the bus's back
        self.spawn(lose(), name="lose-health-subscription")

raise SystemExit(main(Losing, ServiceConfig))
"""


@pytest.mark.e2e
async def test_a_service_whose_subscription_is_gone_exits_69_and_deregisters(bus, nats_url):
    """A real service process (its entry point: the self-check on by default) whose health subscription is gone
    while its loop runs and its connection is up ends itself with code 69 within WINDSERVE_SELF_CHECK_S (+ one
    ask), names the cause in its log, and deregisters on the way out (a graceful stop)."""
    namespace = "test_selfcheck"
    registry = await Registry.open(bus, bucket=subjects.registry_bucket(namespace))
    proc = subprocess.Popen([sys.executable, "-c", _LOSING_SERVICE], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=_env(nats_url, "loses", namespace, WINDSERVE_SELF_CHECK_S="2",
                                                             WINDSERVE_REGISTRY_TTL_S="30",
                                                             WINDSERVE_DRAIN_TIMEOUT_S="2"))
    try:
        await wait_listed(registry, "loses", True, 60)  # start-up only; slow on a loaded 2-core machine
        listed_at = asyncio.get_running_loop().time()
        code = await asyncio.to_thread(proc.wait, 30)
        took = asyncio.get_running_loop().time() - listed_at
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert code == 69, err[-2000:]
        assert "own health subscription" in err and "its subscriptions are gone" in err, err[-2000:]
        assert 1.5 <= took < 20, took  # lost 1 s in; 2 s of failed asks (0.5 s apart); a graceful stop
        assert "loses" not in [e.instance_id for e in await registry.list()]  # deregistered (its TTL is 30 s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        if proc.stderr:
            proc.stderr.close()
