"""compose/: schema-valid per the compose spec, plus the structural rules windserve relies on."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose" / "docker-compose.yml"
ROLES = {"gateway", "router", "prefill", "decode", "cache"}


@pytest.fixture(scope="module")
def spec() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # resolves the x-* anchors like compose does


def test_valid_against_compose_spec():
    checker = Path(sys.executable).parent / "check-jsonschema"
    proc = subprocess.run(
        [str(checker), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_one_service_per_role_plus_nats(spec):
    assert set(spec["services"]) == ROLES | {"nats"}
    for role in ROLES:
        assert spec["services"][role]["command"] == ["python", "-m", f"services.{role}"]
        assert (ROOT / "services" / role / "__main__.py").exists()


def test_only_gateway_publishes_ports(spec):
    publishing = {name for name, svc in spec["services"].items() if svc.get("ports")}
    assert publishing == {"gateway"}


def test_no_container_name_so_scale_works(spec):
    assert [n for n, svc in spec["services"].items() if "container_name" in svc] == []


def test_every_windserve_service_reaches_nats_by_name(spec):
    for role in ROLES:
        svc = spec["services"][role]
        assert svc["environment"]["WINDSERVE_NATS_URL"] == "nats://nats:4222"
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"
        assert "healthcheck" in svc


def test_gpu_reserved_for_prefill_and_decode_only(spec):
    def wants_gpu(svc: dict) -> bool:
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        return any("gpu" in d.get("capabilities", []) for d in devices)

    assert {n for n, svc in spec["services"].items() if wants_gpu(svc)} == {"prefill", "decode"}


def test_nats_runs_jetstream_from_the_shipped_config(spec):
    nats = spec["services"]["nats"]
    assert nats["command"] == ["-c", "/etc/nats/nats.conf"]
    assert "./nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    assert "jetstream" in (ROOT / "compose" / "nats.conf").read_text()


def test_nats_conf_is_accepted_by_nats_server(tmp_path):
    # `nats-server -t` parses the config and exits: catches typos without starting a server.
    binary = Path(sys.executable).parent / "nats-server"
    conf = (ROOT / "compose" / "nats.conf").read_text().replace("/data", str(tmp_path))
    (tmp_path / "nats.conf").write_text(conf)
    proc = subprocess.run([str(binary), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_installs_cpu_torch_before_the_project():
    lines = (ROOT / "compose" / "Dockerfile").read_text().splitlines()
    torch = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    project = next(i for i, line in enumerate(lines) if line.strip() == "RUN pip install .")
    first = next(line for line in lines if line.strip() and not line.startswith("#"))
    assert first.startswith("FROM python:3.11") and torch < project


def test_kv_transfer_engines_listen_on_the_compose_network(spec):
    # prefill -> decode KV (and GCache values) go container to container; each replica advertises its own IP
    for role in ("prefill", "decode", "cache"):
        assert spec["services"][role]["environment"]["WINDSERVE_TRANSFER_HOST"] == "0.0.0.0"
    assert "WINDSERVE_TRANSFER_HOST" not in spec["services"]["gateway"]["environment"]


def test_every_service_restarts_and_the_gateway_is_healthy_only_when_ready(spec):
    for name, svc in spec["services"].items():
        assert svc.get("restart") == "unless-stopped", name
    assert "http://127.0.0.1:8000/health/ready" in spec["services"]["gateway"]["healthcheck"]["test"][-1]


def test_worker_healthcheck_passes_only_once_the_service_runs(spec):
    """Runs the compose healthcheck of decode against a real metrics endpoint: starting -> unhealthy,
    running -> healthy (the model may load for minutes while the metrics port already answers)."""
    from libs.service.metrics import SERVICE_STATE, MetricsServer
    from tests.fixtures.nats import free_port

    check = spec["services"]["decode"]["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"]
    port = free_port()
    server = MetricsServer("127.0.0.1", port)
    try:
        code = check[3].replace("127.0.0.1:9100", f"127.0.0.1:{port}")
        for state, healthy in (("starting", False), ("running", True)):
            for s in ("starting", "running"):
                SERVICE_STATE.labels(s).set(1 if s == state else 0)
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
            assert (proc.returncode == 0) == healthy, (state, proc.stderr)
    finally:
        server.stop()


CLUSTER = ROOT / "compose" / "docker-compose.cluster.yml"


def test_cluster_override_is_valid_and_gives_every_service_three_nodes_and_r3(spec):
    checker = Path(sys.executable).parent / "check-jsonschema"
    proc = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(CLUSTER)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    override = yaml.safe_load(CLUSTER.read_text())
    nodes = {"nats", "nats-1", "nats-2"}
    assert set(override["services"]) == ROLES | nodes
    names = {override["services"][n]["environment"]["NATS_SERVER_NAME"] for n in nodes}
    assert len(names) == 3  # JetStream clustering needs unique server names
    for role in ROLES:
        env = {**spec["services"][role]["environment"], **override["services"][role]["environment"]}  # compose merges
        assert env["WINDSERVE_NATS_URL"].split(",") == ["nats://nats:4222", "nats://nats-1:4222", "nats://nats-2:4222"]
        assert env["WINDSERVE_NATS_REPLICAS"] == "3"
        assert set(override["services"][role]["depends_on"]) == nodes
    data = {v.split(":")[0] for n in nodes for v in override["services"][n]["volumes"] if v.endswith(":/data")}
    assert len(data) == 3  # one store per node


def test_cluster_nats_conf_is_accepted_by_nats_server(tmp_path):
    binary = Path(sys.executable).parent / "nats-server"
    conf = (ROOT / "compose" / "nats-cluster.conf").read_text().replace("/data", str(tmp_path))
    (tmp_path / "nats.conf").write_text(conf)
    proc = subprocess.run([str(binary), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True,
                          timeout=30, env={**os.environ, "NATS_SERVER_NAME": "nats-0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "routes: [nats://nats:6222, nats://nats-1:6222, nats://nats-2:6222]" in conf


def test_cache_nodes_keep_their_disk_tier_on_a_volume_one_directory_per_replica(spec):
    cache = spec["services"]["cache"]
    mount = next(v for v in cache["volumes"] if v.startswith("cache-data:"))
    assert "cache-data" in spec["volumes"]
    disk_dir = cache["environment"]["WINDSERVE_DISK_DIR"]
    assert disk_dir.startswith(mount.split(":")[1] + "/") and "{hostname}" in disk_dir  # --scale: no two share
    assert int(cache["environment"]["WINDSERVE_DISK_BYTES"].split(":-")[1].rstrip("}")) > 0
