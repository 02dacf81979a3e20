"""The planner's pure parts (services/planner): histogram quantiles, the load model, prediction, hysteresis, the
connectors, and the `make run` supervisor acting on a desired map with real processes. The planner against real
services (mock engines) is tests/test_e2e_planner.py."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from libs.engine.mock_profile import MockProfile
from scripts.run import Child, RunConfig, Supervisor, parse_services
from services.planner.config import PlannerConfig, parse_limits
from services.planner.connectors import Compose, ConnectorError, read_desired, write_desired
from services.planner.core import (
    LoadForecast,
    Observation,
    Planner,
    PlannerSettings,
    RoleLoad,
    Sla,
    decode_batch,
    direction_changes,
    needed,
)
from services.planner.observe import Reading, observe, p90

PROFILE = MockProfile(fixed_s=0.02, per_token_s=0.004, per_pair_s=1e-6, per_prefill_seq_s=0.005)


def settings(**kw) -> PlannerSettings:
    base = dict(sla=Sla(ttft_p90_s=1.0, itl_p90_s=0.06), limits={"worker": (1, 8)}, profile=PROFILE,
                interval_s=5.0, lead_s=10.0, down_after=3, cooldown_s=20.0)
    return PlannerSettings(**{**base, **kw})


def exposition(ttft: list[float], finished: int, prompt: int, output: int, in_flight: int = 0) -> str:
    reg = CollectorRegistry()
    h = Histogram("windserve_gateway_ttft_seconds", "", buckets=(0.1, 0.25, 0.5, 1, 2.5), registry=reg)
    for v in ttft:
        h.observe(v)
    text = generate_latest(reg).decode()
    return text + (f"windserve_gateway_request_seconds_count {finished}\nwindserve_gateway_prompt_tokens_total "
                   f"{prompt}\nwindserve_gateway_output_tokens_total {output}\nwindserve_gateway_in_flight "
                   f"{in_flight}\n")


def test_p90_of_an_interval_is_read_from_bucket_differences():
    rng = np.random.default_rng(0)
    first = list(rng.uniform(0.0, 0.1, 500))  # an earlier interval: fast
    later = list(rng.uniform(0.3, 0.5, 500))  # this interval: every request in (0.25, 0.5]
    a, b = Reading(), Reading()
    a.add(exposition(first, 500, 500 * 100, 500 * 10))
    b.add(exposition(first + later, 1000, 1000 * 100, 1000 * 10, in_flight=7))
    obs = observe(a, b, 10.0, {})
    assert 0.25 < obs.ttft_p90_s <= 0.5  # the interval alone (over both it would be lower)
    assert obs.itl_p90_s is None  # no ITL observed
    assert obs.finished == 500 and obs.prompt_tokens == 500 * 100 and obs.output_tokens == 500 * 10
    assert obs.arrival_rate == pytest.approx((500 + 7) / 10)  # finished plus the growth of those in flight
    assert p90({0.1: 0, math.inf: 0}, {}) is None
    assert p90({0.1: 0, 1.0: 0, math.inf: 10}, {}) == 1.0  # all past the last finite edge: that edge


def test_decode_instances_grow_with_rate_and_a_tighter_itl_target():
    s = settings(limits={"decode": (1, 64)})
    pred = LoadForecast(rate=4.0, prompt=200, cached_share=0.5, output=50)
    base = needed(s, pred, {})["decode"]
    assert needed(s, LoadForecast(8.0, 200, 0.5, 50), {})["decode"] == pytest.approx(2 * base)
    tight = settings(sla=Sla(1.0, 0.03), limits={"decode": (1, 64)})
    assert needed(tight, pred, {})["decode"] > base  # fewer sequences per step fit 30 ms than 60 ms


def test_the_kv_pools_bound_the_decode_batch():
    s = settings()
    free = decode_batch(s, context=300, units_per_seq=None, units_total=0)
    assert free == int((0.06 - 0.02) / (0.004 + 1e-6 * 300))
    # observed: each running sequence holds 100 units of a 500-unit arena -> 5 fit, whatever the ITL allows
    assert decode_batch(s, context=300, units_per_seq=100, units_total=500) == 5
    load = RoleLoad(instances=2, running=4, kv_units_used=400, kv_units_total=1000)
    pred = LoadForecast(rate=2.0, prompt=200, cached_share=0.0, output=50)
    assert needed(s, pred, {"worker": load})["worker"] > needed(s, pred, {})["worker"]


def test_a_cache_hit_share_lowers_the_prefill_need():
    s = settings(limits={"prefill": (1, 64)})
    cold = needed(s, LoadForecast(4.0, 2000, 0.0, 50), {})["prefill"]
    warm = needed(s, LoadForecast(4.0, 2000, 0.9, 50), {})["prefill"]
    assert warm < cold / 3


def ramp(rate_at, seconds: float, s: PlannerSettings) -> tuple[Planner, list[tuple[float, float, int]]]:
    """Feed the planner an ideal observation of the load `rate_at(t)` every interval; (planner, [(t, rate,
    desired workers)])."""
    p = Planner(s, {"worker": 1})
    trace = []
    for k in range(int(seconds / s.interval_s)):
        t = k * s.interval_s
        rate = rate_at(t)
        n = rate * s.interval_s
        d = p.step(Observation(s.interval_s, finished=n, prompt_tokens=n * 200, cached_tokens=n * 100,
                               output_tokens=n * 40), t)
        trace.append((t, rate, d.desired["worker"]))
    return p, trace


def test_a_ramp_up_and_down_is_followed_ahead_without_flapping():
    s = settings()

    def rate_at(t: float) -> float:  # 1 -> 4 req/s over 60 s, 60 s at the peak, back to 1 over 60 s, then 1
        return 1 + 3 * min(t / 60, 1) if t < 120 else max(1.0, 4 - 3 * (t - 120) / 60)

    p, trace = ramp(rate_at, 300, s)
    peak = max(n for _, _, n in trace)
    ideal_peak = math.ceil(needed(s, LoadForecast(4.0, 200, 0.5, 40), {})["worker"])
    assert peak >= ideal_peak >= 2
    # ahead of the load: at every interval of the ramp up, at least what the load then needs
    for t, rate, n in trace:
        if t < 60:
            assert n >= math.ceil(needed(s, LoadForecast(rate, 200, 0.5, 40), {})["worker"] - 1e-9), (t, rate, n)
    assert trace[-1][2] < peak  # and back down
    assert direction_changes(p.roles["worker"].changes) == 1  # up, then down: one turn
    downs = [t for t, d in p.roles["worker"].changes if d < 0]
    # one step at a time
    assert all(b - a >= s.interval_s * s.down_after for a, b in zip(downs, downs[1:], strict=False))


def test_limits_bound_every_decision_and_an_sla_miss_with_waiting_adds_one():
    s = settings(limits={"worker": (2, 3)})
    p, trace = ramp(lambda t: 50.0, 30, s)
    assert {n for _, _, n in trace} == {3}
    p, trace = ramp(lambda t: 0.0, 30, s)
    assert {n for _, _, n in trace} == {2}
    p = Planner(settings(), {"worker": 1})
    quiet = Observation(5.0, finished=1, prompt_tokens=10, output_tokens=5, ttft_p90_s=3.0,
                        roles={"worker": RoleLoad(instances=1, waiting=4)})
    assert p.step(quiet, 0.0).desired["worker"] == 2  # the model says 1; the observation wins
    calm = Observation(5.0, finished=1, prompt_tokens=10, output_tokens=5, ttft_p90_s=3.0,
                       roles={"worker": RoleLoad(instances=2, waiting=0)})
    assert p.step(calm, 5.0).desired["worker"] == 2  # slow but nothing waits: no more


def test_limits_parse_and_bad_ones_are_named():
    assert parse_limits("worker=1:8, decode=0:4") == {"worker": (1, 8), "decode": (0, 4)}
    for bad, why in (("worker=3:1", "min <= max"), ("router=1:2", "not a role"), ("worker=1", "role=min:max")):
        with pytest.raises(ValueError, match=why):
            parse_limits(bad)
    with pytest.raises(ValueError):
        PlannerConfig(planner_roles="")


def test_compose_command_and_supervisor_file(tmp_path):
    c = Compose("docker compose -p ws -f compose.yaml")
    assert c.argv({"worker": 3, "decode": 2}) == ["docker", "compose", "-p", "ws", "-f", "compose.yaml", "up", "-d",
                                                 "--no-deps", "--no-recreate", "--scale", "decode=2", "--scale",
                                                 "worker=3", "decode", "worker"]
    path = tmp_path / "desired.json"
    assert read_desired(path) is None
    write_desired(path, {"worker": 3})
    assert read_desired(path) == {"worker": 3}
    path.write_text("{not json")
    assert read_desired(path) is None
    with pytest.raises(ConnectorError, match="cannot write"):
        write_desired(tmp_path / "missing" / "d.json", {"worker": 1})


async def test_compose_connector_names_a_failing_command():
    with pytest.raises(ConnectorError, match="exited 3"):
        await Compose(f"{sys.executable} -c 'import sys; sys.exit(3)'").apply({"worker": 2})
    with pytest.raises(ConnectorError, match="cannot run"):
        await Compose("/nonexistent/docker compose").apply({"worker": 2})


def test_supervisor_starts_and_drains_instances_as_the_planner_asks(tmp_path, monkeypatch):
    sup = Supervisor(RunConfig(parse_services("gateway,worker,planner"), run_dir=tmp_path))
    started: list[Child] = []

    def spawn(service: str, label: str) -> Child:  # a process that exits 0 on SIGTERM, as a draining service
        code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(60)"
        popen = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        child = Child(label, popen, tmp_path / f"{label}.log", f"{label}-id", service)
        started.append(child)
        return child

    monkeypatch.setattr(sup, "_spawn_service", spawn)
    try:
        sup.desired_file.parent.mkdir(parents=True)
        sup.children = [spawn("gateway", "gateway"), spawn("worker", "worker"), spawn("planner", "planner")]
        assert sup.apply_plan() == []  # no file yet
        write_desired(sup.desired_file, {"worker": 3, "prefill": 2})  # prefill is not in this topology
        lines = sup.apply_plan()
        assert [c.name for c in sup.children if c.service == "worker"] == ["worker", "worker-1", "worker-2"]
        assert len(lines) == 2 and all("started" in line for line in lines)
        assert sup.apply_plan() == []  # the same file: nothing
        time.sleep(0.5)  # (a new mtime)
        write_desired(sup.desired_file, {"worker": 1})
        lines = sup.apply_plan()
        assert [c.name for c in sup.children if c.service == "worker"] == ["worker"]  # the oldest stays
        assert sorted(c.name for c in sup.retiring) == ["worker-1", "worker-2"]
        for c in sup.retiring:
            assert c.popen.wait(10) == 0  # SIGTERM, not a kill
        lines = sup.apply_plan()
        assert len(lines) == 2 and all("drained and exited" in line for line in lines) and not sup.retiring
        assert sup.supervise(time.monotonic()) == []  # a drained instance is not restarted
    finally:
        for c in started:
            if c.popen.poll() is None:
                c.popen.send_signal(signal.SIGKILL)
                c.popen.wait()


def test_the_planner_child_gets_the_supervisor_connector(tmp_path):
    sup = Supervisor(RunConfig(parse_services("gateway,worker,planner"), run_dir=tmp_path))
    sup.http_port = 8123
    env = sup.service_env("planner", "planner-x")
    assert env["WINDSERVE_PLANNER_CONNECTOR"] == "supervisor"
    assert env["WINDSERVE_PLANNER_DESIRED_FILE"] == str(sup.desired_file)
    assert env["WINDSERVE_PLANNER_GATEWAYS"] == "http://127.0.0.1:8123"


def test_observed_misses_raise_the_models_needs_until_the_targets_hold():
    s = settings()
    p = Planner(s, {"worker": 1})
    busy = RoleLoad(instances=1, waiting=3)
    base = Observation(5.0, finished=10, prompt_tokens=2000, cached_tokens=1000, output_tokens=400,
                       roles={"worker": busy})
    first = p.step(base, 0.0).needed["worker"]
    late = replace(base, itl_p90_s=0.5)
    p.step(late, 5.0)
    p.step(late, 10.0)
    assert p.correction == pytest.approx(1.15 ** 2)
    assert p.step(base, 15.0).needed["worker"] > first * 1.2  # the same load now needs more
    for k in range(200):
        p.step(replace(base, ttft_p90_s=0.1, itl_p90_s=0.01), 20.0 + 5 * k)
    assert p.correction == 1.0  # eased back while the targets held
