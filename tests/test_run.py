"""`make run` supervisor: comes up, lists every service, and leaves no process after Ctrl-C."""

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from scripts.run import TINY_WEIGHTS, RunConfig, Supervisor, parse_services
from tests.fixtures.nats import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
ROOT = Path(__file__).resolve().parent.parent


def start_run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "scripts.run", "--run-dir", str(tmp_path / "run"), "--grace", "5", *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env or dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not printed in {timeout}s; got {lines}; stderr {proc.stderr.read()}")


@contextlib.contextmanager
def supervised(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
               stop: signal.Signals = signal.SIGTERM) -> Iterator[subprocess.Popen[str]]:
    """`scripts.run` running for the body; then `stop` must end it cleanly (exit 0) and leave no process
    behind (strays are killed even when an assertion fails)."""
    proc = start_run(tmp_path, *args, env=env)
    descendants: list[psutil.Process] = []
    try:
        yield proc
        descendants = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(stop)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            if not descendants:  # the body failed: the supervisor's children are not known yet
                with contextlib.suppress(psutil.NoSuchProcess):
                    descendants = psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
            proc.wait(10)
        _, alive = psutil.wait_procs(descendants, timeout=5)
        for p in alive:
            p.kill()
    assert alive == [], f"left behind: {[p.pid for p in alive]}"


def test_run_starts_every_service_and_ctrl_c_leaves_nothing(tmp_path):
    http_port = free_port()
    with supervised(tmp_path, "--http-port", str(http_port), "--services", "gateway,router,prefill,decode,worker=2",
                    stop=signal.SIGINT) as proc:
        wait_for_line(proc, "windserve: ready", timeout=60)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as resp:
            body = json.loads(resp.read())
        counts = {role: len(ids) for role, ids in body["services"].items()}
        assert counts == {"gateway": 1, "router": 1, "prefill": 1, "decode": 1, "worker": 2}
        names = {p.name() for p in descendants}
        assert "nats-server" in names and len(descendants) >= 7  # nats + 6 services
    logs = tmp_path / "run" / "logs"
    assert {p.name for p in logs.iterdir()} == {
        "nats.log", "gateway.log", "router.log", "prefill.log", "decode.log", "worker-0.log", "worker-1.log"
    }
    first = (logs / "router.log").read_text().splitlines()[0]
    assert json.loads(first)["service"] == "router"  # structured logs per service


def test_crashing_service_tears_everything_down_with_clear_error(tmp_path):
    env = {**os.environ, "WINDSERVE_REGISTRY_TTL_S": "zero"}  # every service rejects its config
    proc = start_run(tmp_path, "--http-port", "0", "--services", "router", env=env)
    try:
        rc = proc.wait(60)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert rc == 1
    assert "router exited with code 2" in err and "router.log" in err
    assert "WINDSERVE_REGISTRY_TTL_S" in (tmp_path / "run" / "logs" / "router.log").read_text()
    nats_store = str(tmp_path / "run" / "nats")
    strays = [p for p in psutil.process_iter(["cmdline"]) if nats_store in " ".join(p.info["cmdline"] or [])]
    assert strays == []


def test_unknown_service_is_rejected_before_starting_anything(tmp_path):
    proc = start_run(tmp_path, "--services", "gateway,nosuch")
    assert proc.wait(30) == 2
    assert "unknown service 'nosuch'" in proc.stderr.read()
    assert not (tmp_path / "run").exists()


def _descendants_named(proc: subprocess.Popen[str], needle: str) -> list[psutil.Process]:
    return [p for p in psutil.Process(proc.pid).children(recursive=True) if needle in " ".join(p.cmdline())]


def _complete(http_port: int) -> dict:
    body = json.dumps({"model": "windserve-tiny", "prompt": "hello", "max_tokens": 3}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("target, restarted", [
    ("services.worker", "worker restarted as worker-"),
    ("nats-server", "nats-server restarted on port"),  # services reconnect: none of them is restarted
], ids=["worker", "nats-server"])
def test_killed_child_is_restarted_and_the_deployment_serves_again(tmp_path, target, restarted):
    http_port = free_port()
    with supervised(tmp_path, "--http-port", str(http_port), "--services", "gateway,worker") as proc:
        wait_for_line(proc, "windserve: ready", timeout=60)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health/ready", timeout=5) as resp:
            assert resp.status == 200  # "ready" is printed only once the gateway says so
        before = {p.pid for p in _descendants_named(proc, "services.")}
        [victim] = _descendants_named(proc, target)
        victim.kill()
        said = "".join(wait_for_line(proc, "windserve: ready again", timeout=60))
        name = "nats" if target == "nats-server" else "worker"
        assert f"{name} exited with code -9 (killed by SIGKILL); restarting in 1 s (restart 1" in said
        assert restarted in said
        assert len(_complete(http_port)["choices"]) == 1  # the deployment serves again
        after = {p.pid for p in _descendants_named(proc, "services.")}
        assert after - before == ({p.pid for p in _descendants_named(proc, target)} if name == "worker" else set())


def test_hung_service_is_killed_and_restarted_and_the_deployment_serves_again(tmp_path):
    """A SIGSTOPped worker (its process exists, its port accepts, nothing answers) fails its liveness probes: the
    supervisor says so, kills it, restarts it, and the deployment serves again."""
    http_port = free_port()
    with supervised(tmp_path, "--http-port", str(http_port), "--services", "gateway,worker",
                    "--liveness-timeout", "3", "--liveness-grace", "30") as proc:
        wait_for_line(proc, "windserve: ready", timeout=60)
        [victim] = _descendants_named(proc, "services.worker")
        victim.send_signal(signal.SIGSTOP)
        said = "".join(wait_for_line(proc, "windserve: ready again", timeout=60))
        # the silence is printed as measured: 3 s, or a little more when a probe round ran long on a busy machine
        assert re.search(r"worker \(worker-\w+, pid \d+\) answered no health probe for [3-9] s: hung; killing it", said)
        assert "worker exited with code -9 (killed by SIGKILL) (killed by the supervisor: unresponsive" in said
        assert "worker restarted as worker-" in said and not victim.is_running()
        assert len(_complete(http_port)["choices"]) == 1


def test_hung_nats_server_is_killed_and_restarted_and_no_service_is_blamed(tmp_path):
    """A SIGSTOPped nats-server (its port accepts, it answers nothing) fails the supervisor's PING: it is named as
    hung, killed and restarted on its port and store; meanwhile the services' failed health probes do not count
    against them (none is killed or restarted), they reconnect, and the deployment serves again."""
    http_port = free_port()
    with supervised(tmp_path, "--http-port", str(http_port), "--services", "gateway,worker",
                    "--liveness-timeout", "4", "--liveness-grace", "30") as proc:
        wait_for_line(proc, "windserve: ready", timeout=60)
        before = {p.pid for p in _descendants_named(proc, "services.")}
        [victim] = _descendants_named(proc, "nats-server")
        victim.send_signal(signal.SIGSTOP)
        said = "".join(wait_for_line(proc, "windserve: ready again", timeout=60))
        assert re.search(r"answered no PING for [4-9] s: hung; killing it to restart it", said)
        assert "nats exited with code -9 (killed by SIGKILL) (killed by the supervisor: unresponsive" in said
        assert "nats-server restarted on port" in said and not victim.is_running()
        assert "answered no health probe" not in said and "worker restarted" not in said, said
        assert len(_complete(http_port)["choices"]) == 1
        assert {p.pid for p in _descendants_named(proc, "services.")} == before  # no service was restarted


def test_http_port_in_use_fails_fast_naming_it_and_starts_nothing(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = start_run(tmp_path, "--http-port", str(port), "--services", "gateway,worker")
        rc = proc.wait(30)
    err, out = proc.stderr.read(), proc.stdout.read()
    assert rc == 1
    assert f"HTTP port 127.0.0.1:{port} is not available" in err and "--http-port" in err
    assert not (tmp_path / "run").exists()  # neither nats-server nor any service was started
    assert "stopping" not in out and "stopped" not in out  # nothing ran: nothing to stop


def _stream_until_closed(http_port: int, events: list, started: threading.Event) -> None:
    """A long streaming completion; every SSE data payload lands in `events` until the connection closes."""
    body = json.dumps({"model": "windserve-tiny", "prompt": "hello", "max_tokens": 3800, "ignore_eos": True,
                       "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except OSError as exc:  # a connection dropped without an error event
        events.append(f"connection error: {exc!r}")


def test_ctrl_c_during_a_stream_ends_it_with_an_error_event_within_the_drain_bound(tmp_path):
    """The services drain for WINDSERVE_DRAIN_TIMEOUT_S; the supervisor waits past that before it kills, so a
    stop never kills a draining service, and the stream cut by the stop ends with an error event naming it."""
    drain = 3.0
    env = {**os.environ, "WINDSERVE_DRAIN_TIMEOUT_S": str(drain)}
    http_port = free_port()
    proc = start_run(tmp_path, "--http-port", str(http_port), "--services", "gateway,worker", "--grace", "0",
                     env=env)
    descendants: list[psutil.Process] = []
    try:
        wait_for_line(proc, "windserve: ready", timeout=60)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        events: list[str] = []
        started = threading.Event()
        reader = threading.Thread(target=_stream_until_closed, args=(http_port, events, started), daemon=True)
        reader.start()
        assert started.wait(30), events
        proc.send_signal(signal.SIGINT)
        stopped_at = time.monotonic()
        assert proc.wait(30) == 0
        took = time.monotonic() - stopped_at
        reader.join(10)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        _, alive = psutil.wait_procs(descendants, timeout=5)
        for p in alive:
            p.kill()
    assert alive == []
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutdown" and "shutting down" in error["message"]
    assert "killing" not in err and "ignored SIGTERM" not in err, err
    assert took < drain + 5.0  # the supervisor's grace: nothing needed to be killed


def test_a_clean_stop_leaves_no_registry_entries_and_a_killed_run_does(tmp_path):
    """`cleared N registry entries` is printed for entries a killed run left, not after a clean stop."""
    http_port = free_port()
    nats_port = free_port()
    args = ("--http-port", str(http_port), "--nats-port", str(nats_port), "--services", "gateway,worker")
    with supervised(tmp_path, *args) as proc:
        wait_for_line(proc, "windserve: ready", timeout=60)
    proc = start_run(tmp_path, *args)
    try:
        lines = wait_for_line(proc, "windserve: ready", timeout=60)
        assert not any("cleared" in line for line in lines), lines
        run = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()  # a crashed run: the supervisor and every service die without a word (no deregistration)
        for child in run:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(run, timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
    with supervised(tmp_path, *args) as proc:
        lines = wait_for_line(proc, "windserve: ready", timeout=60)
        assert any(re.search(r"cleared [1-9]\d* registry entries", line) for line in lines), lines


def test_bad_model_path_fails_fast_naming_it(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = start_run(tmp_path, "--model", str(missing), "--services", "worker")
    assert proc.wait(30) == 1
    assert f"bad --model: model directory {missing} does not exist" in proc.stderr.read()
    assert not (tmp_path / "run").exists()


async def _replicas_and_listing(urls: str) -> tuple[dict[str, int], set[str]]:
    from libs.bus import Bus, Registry
    from protos import subjects

    bus = await Bus.connect(urls, name="cluster-probe", timeout=10)
    try:
        streams = {}
        for name in ("KV_windserve_registry_default", "OBJ_windserve_payloads"):
            streams[name] = (await bus.js.stream_info(name)).config.num_replicas
        entries = await (await Registry.open(bus, subjects.registry_bucket("default"))).list(timeout=10)
        return streams, {e.role.value for e in entries}
    finally:
        await bus.close()


def test_nats_cluster_of_three_loses_nothing_when_one_node_dies(tmp_path):
    http_port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "WINDSERVE_NAMESPACE"}
    with supervised(tmp_path, "--http-port", str(http_port), "--services", "gateway,worker", "--nats-cluster", "3",
                    env=env) as proc:
        lines = wait_for_line(proc, "windserve: ready", timeout=60)
        urls = next(line for line in lines if "nats-server at" in line).split(" at ")[1].split(" ")[0]
        assert len(urls.split(",")) == 3 and "3-node cluster" in "".join(lines)
        streams, roles = asyncio.run(_replicas_and_listing(urls))
        assert streams == {"KV_windserve_registry_default": 3, "OBJ_windserve_payloads": 3}
        assert roles == {"gateway", "worker"}

        [node0] = [p for p in _descendants_named(proc, "nats-server") if "windserve-nats-0" in p.cmdline()]
        node0.kill()
        survivors = ",".join(urls.split(",")[1:])
        # Within the bound (the streams elect a new leader, the services reconnect with 1 s waits): the
        # registry on the survivors still lists both instances, and the deployment serves.
        deadline = time.monotonic() + 20
        def both_listed() -> set[str]:
            _, listed = asyncio.run(_replicas_and_listing(survivors))
            assert listed == {"gateway", "worker"}, listed  # retried: the worker re-puts its entry after reconnecting
            return listed

        assert _retry_until(deadline, both_listed) == {"gateway", "worker"}
        assert len(_retry_until(deadline, lambda: _complete(http_port))["choices"]) == 1


def test_buckets_created_at_r1_are_raised_to_r3_on_a_cluster(tmp_path, monkeypatch):
    """A registry bucket and payload store that already exist at R1 (created before the deployment was clustered)
    are scaled to R3 when the supervisor (or a service) asks for 3 replicas; asking for 1 never scales them down."""
    from scripts.run import _prepare_buckets

    monkeypatch.delenv("WINDSERVE_NAMESPACE", raising=False)
    sup = Supervisor(RunConfig(parse_services("worker"), nats_cluster=3, run_dir=tmp_path))
    try:
        sup.start_nats()
        asyncio.run(_prepare_buckets(sup.nats_url, 1))
        assert asyncio.run(_replicas_and_listing(sup.nats_url))[0] == {
            "KV_windserve_registry_default": 1, "OBJ_windserve_payloads": 1}
        asyncio.run(_prepare_buckets(sup.nats_url, 3))
        want = {"KV_windserve_registry_default": 3, "OBJ_windserve_payloads": 3}
        assert asyncio.run(_replicas_and_listing(sup.nats_url))[0] == want
        asyncio.run(_prepare_buckets(sup.nats_url, 1))  # a service without WINDSERVE_NATS_REPLICAS
        assert asyncio.run(_replicas_and_listing(sup.nats_url))[0] == want
    finally:
        sup.stop_all()


def _retry_until(deadline: float, attempt):
    """attempt() until it returns, retrying any failure until `deadline` (then the last one is raised)."""
    while True:
        try:
            return attempt()
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_cache_nodes_come_up_each_with_its_own_disk_dir_kept_across_a_restart(tmp_path):
    with supervised(tmp_path, "--services", "cache=2") as proc:
        wait_for_line(proc, "windserve: ready", timeout=60)
        nodes = _descendants_named(proc, "services.gcache")
        dirs = {p.environ()["WINDSERVE_DISK_DIR"] for p in nodes}
        assert dirs == {str(tmp_path / "run" / "cache" / f"cache-{i}") for i in range(2)}
        assert all(os.path.isdir(d) for d in dirs)
        victim = next(p for p in nodes if p.environ()["WINDSERVE_DISK_DIR"].endswith("cache-0"))
        victim.kill()
        wait_for_line(proc, "cache-0 restarted as cache-0-", timeout=30)
        again = [p for p in _descendants_named(proc, "services.gcache") if p.pid != victim.pid]
        assert {p.environ()["WINDSERVE_DISK_DIR"] for p in again} == dirs  # the restarted node finds its disk


def test_storage_nodes_in_the_topology_turn_gcache_on_in_the_engines(tmp_path, monkeypatch):
    monkeypatch.delenv("WINDSERVE_GCACHE", raising=False)
    with_cache = Supervisor(RunConfig(parse_services("gateway,router,worker,prefill,decode,cache=2"),
                                      run_dir=tmp_path))
    for role in ("worker", "prefill", "decode"):
        env = with_cache.service_env(role, f"{role}-1")
        assert env["WINDSERVE_GCACHE"] == "1" and "UCX_TLS" in env, role
    assert "WINDSERVE_GCACHE" not in with_cache.service_env("gateway", "gateway-1")
    without = Supervisor(RunConfig(parse_services("gateway,router,worker"), run_dir=tmp_path))
    assert "WINDSERVE_GCACHE" not in without.service_env("worker", "worker-1")
    monkeypatch.setenv("WINDSERVE_GCACHE", "0")  # an operator's setting wins
    assert with_cache.service_env("worker", "worker-1")["WINDSERVE_GCACHE"] == "0"


def test_default_topology_has_an_encoder_when_the_model_takes_images(tmp_path, monkeypatch):
    from scripts.run import default_services, parse_args

    text_only, multimodal = tmp_path / "text", tmp_path / "mm"
    for path, cfg in ((text_only, {"hidden_size": 8}), (multimodal, {"hidden_size": 8, "vision_config": {}})):
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
    assert parse_services(default_services("")) == (("gateway", 1), ("router", 1), ("prefill", 1), ("decode", 1),
                                                     ("encoder", 1))  # the tiny model has a vision tower
    assert "encoder" not in default_services(str(text_only))
    assert parse_args(["--model", str(multimodal)]).roles == {"gateway", "router", "prefill", "decode", "encoder"}
    assert parse_args(["--services", "gateway,worker"]).roles == {"gateway", "worker"}  # explicit wins

    monkeypatch.delenv("UCX_TLS", raising=False)
    sup = Supervisor(RunConfig(parse_services("gateway,worker,encoder=2"), model=str(multimodal), run_dir=tmp_path))
    env = sup.service_env("encoder", "encoder-0-abc")
    assert env["WINDSERVE_INSTANCE_ID"] == "encoder-0-abc" and env["WINDSERVE_MODEL"] == str(multimodal)
    assert env["UCX_TLS"] == "tcp,self" and int(env["WINDSERVE_METRICS_PORT"]) > 0 and "WINDSERVE_NATS_URL" in env
    assert sup.service_env("worker", "worker-1")["UCX_TLS"] == "tcp,self"  # a worker fetches embeddings


def test_encoders_come_up_and_are_listed(tmp_path):
    http_port = free_port()
    with supervised(tmp_path, "--http-port", str(http_port), "--services", "gateway,worker,encoder=2") as proc:
        wait_for_line(proc, "windserve: ready", timeout=60)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as resp:
            body = json.loads(resp.read())
        assert {role: len(ids) for role, ids in body["services"].items()} == {"gateway": 1, "worker": 1, "encoder": 2}
        assert len(_descendants_named(proc, "services.encoder")) == 2


def _letters_and_spaces(text: str) -> float:
    return sum(ch.isalpha() or ch == " " for ch in text) / max(len(text), 1)


@pytest.mark.skipif(not TINY_WEIGHTS.is_file(), reason="models/windserve-tiny is written by scripts.train_tiny")
def test_the_readme_first_requests_return_words(tmp_path):
    """The README's first curl and chat, verbatim, against `make run` with its default model (the tiny model
    trained on the repository's docs): text that reads as words, and a tool call that parses."""
    import openai

    http_port = free_port()
    with supervised(tmp_path, "--http-port", str(http_port), "--services", "gateway,worker") as proc:
        lines = wait_for_line(proc, "windserve: model:", timeout=60)
        assert any("trained on this repository's docs" in line for line in lines), lines
        base = f"http://127.0.0.1:{http_port}"
        completion = json.loads(subprocess.run(
            ["curl", "-s", f"{base}/v1/completions", "-H", "content-type: application/json", "-d",
             '{"model": "windserve-tiny", "prompt": "Hello", "max_tokens": 16}'],
            capture_output=True, text=True, timeout=60, check=True).stdout)
        text = completion["choices"][0]["text"]
        assert len(text) >= 8 and _letters_and_spaces(text) >= 0.7, text
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        streamed = "".join(ev.choices[0].delta.content or "" for ev in client.chat.completions.create(
            model="windserve-tiny", messages=[{"role": "user", "content": "Hi"}], stream=True, max_tokens=32)
            if ev.choices)
        assert len(streamed) >= 8 and _letters_and_spaces(streamed) >= 0.7, streamed
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
            "required": ["city"]}}}
        called = client.chat.completions.create(
            model="windserve-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[weather],
            tool_choice="required", max_tokens=256)
        call = called.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")


def test_one_metrics_view_holds_every_instance_series(tmp_path):
    """The gateway's /metrics/cluster, read with prometheus-client's parser: gateway, router, engine and GCache
    series, each labelled with the role and instance of every running instance."""
    from prometheus_client.parser import text_string_to_metric_families

    http_port = free_port()
    with supervised(tmp_path, "--http-port", str(http_port), "--services", "gateway,router,worker=2,cache") as proc:
        wait_for_line(proc, "windserve: ready", timeout=90)
        _complete(http_port)  # one request through, so request series have samples
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as resp:
            services = json.loads(resp.read())["services"]
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics/cluster", timeout=30) as resp:
            families = list(text_string_to_metric_families(resp.read().decode()))
    seen: dict[tuple[str, str], set[str]] = {}
    for family in families:
        for sample in family.samples:
            seen.setdefault((sample.labels["role"], sample.labels["instance"]), set()).add(family.name)
    for role, prefix in (("gateway", "windserve_gateway_"), ("router", "windserve_router_"),
                         ("worker", "windserve_worker_"), ("cache", "windserve_cache_")):
        for instance in services[role]:
            names = seen.get((role, instance), set())
            assert any(n.startswith(prefix) for n in names), (role, instance, sorted(names)[:10])
    up = {(s.labels["role"], s.labels["instance"]): s.value for f in families if f.name == "windserve_cluster_scrape_up"
          for s in f.samples}
    assert set(up) == {(r, i) for r, ids in services.items() for i in ids if r != "nats"} and set(up.values()) == {1.0}
