"""One home per setting: every WINDSERVE_* variable is declared by one config class, read flat wherever that class
is a part, and listed in the generated docs/settings.md."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import pytest

from libs.nesting import parts
from libs.service.config import ConfigError, ServiceConfig, load_config
from libs.service.settings import DOC, ROLES, all_settings, markdown, role_config, settings_of, unknown_variables

pytestmark = pytest.mark.unit


def _classes(cls: type) -> set[type]:
    """`cls`, the config classes it inherits from and, recursively, its parts."""
    found = {base for base in inspect.getmro(cls) if base.__dict__.get("__annotations__") and base is not object}
    for part in parts(cls).values():
        found |= _classes(part)
    return found


def test_docs_settings_is_current():
    assert DOC.read_text() == markdown(), "run: python -m libs.service.settings --write"


def test_no_setting_is_declared_twice():
    classes = set().union(*(_classes(role_config(r)) for r in ROLES))
    declared: dict[str, list[str]] = {}
    for cls in classes:
        for name in cls.__dict__.get("__annotations__", {}):
            if name.startswith("_") or name == "model_config" or name in parts(cls):
                continue
            declared.setdefault(name, []).append(cls.__name__)
    assert {n: sorted(c) for n, c in declared.items() if len(c) > 1} == {}


def test_every_setting_is_described():
    assert [s.name for s in all_settings() if not s.description] == []


def test_a_part_setting_is_read_flat_from_the_environment():
    env = {"WINDSERVE_MAX_NUM_SEQS": "7", "WINDSERVE_BUCKET_EDGES": "[100, 200]", "WINDSERVE_PAGE_SIZE": "32",
           "WINDSERVE_ACK_TIMEOUT_S": "5", "WINDSERVE_MM_URL_HOSTS": "a.example"}
    prefill = load_config(role_config("prefill"), env)
    assert prefill.engine.page_size == 32
    assert prefill.engine.scheduler.max_num_seqs == 7
    router, gateway = load_config(role_config("router"), env), load_config(role_config("gateway"), env)
    assert prefill.engine.scheduler.buckets == router.buckets == gateway.backend.buckets
    assert router.buckets.bucket_edges == (100, 200)
    assert gateway.backend.ack_timeout_s == 5.0 and gateway.media.url_hosts == {"a.example"}


def test_flat_keywords_and_defaults_of_parts():
    worker = role_config("worker")(max_num_seqs=3, page_size=8)
    assert (worker.engine.scheduler.max_num_seqs, worker.engine.page_size) == (3, 8)
    default = role_config("worker")().engine.scheduler
    assert worker.engine.scheduler.max_num_batched_tokens == default.max_num_batched_tokens


@pytest.mark.parametrize("env, names", [
    ({"WINDSERVE_MAX_NUM_SEQS": "many"}, "WINDSERVE_MAX_NUM_SEQS"),
    ({"WINDSERVE_BUCKET_EDGES": "[200, 100]"}, "strictly increasing"),
    ({"WINDSERVE_SERVED_BUCKETS": "[7]"}, "served_buckets"),
])
def test_a_bad_part_setting_is_a_config_error(env, names):
    with pytest.raises(ConfigError, match=names):
        load_config(role_config("decode"), env)


def test_every_role_config_is_a_service_config():
    assert all(issubclass(role_config(r), ServiceConfig) for r in ROLES)


HELP_PROBE = """
import runpy, sys
sys.argv = ["x", "--help"]
try:
    runpy.run_module(sys.argv_module, run_name="__main__")
except SystemExit as exc:
    assert exc.code == 0, exc.code
print("TORCH" if "torch" in sys.modules else "NO_TORCH")
"""


@pytest.mark.parametrize("role", list(ROLES))
def test_help_lists_the_role_settings_without_starting_anything(role):
    """`python -m services.<role> --help` prints the role's settings and exits 0 without importing the service
    (torch, the model) or connecting: the NATS URL points at a closed port and nothing waits for it."""
    module = f"services.{'gcache' if role == 'cache' else role}"
    env = {**os.environ, "WINDSERVE_NATS_URL": "nats://127.0.0.1:1"}
    probe = HELP_PROBE.replace("sys.argv_module", repr(module))
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"usage: python -m {module}" in proc.stdout and "WINDSERVE_NATS_URL" in proc.stdout
    assert {s.name for s in settings_of(role_config(role))} <= set(re.findall(r"WINDSERVE_\w+", proc.stdout))
    assert proc.stdout.rstrip().endswith("NO_TORCH")


def test_a_service_refuses_arguments_other_than_help():
    proc = subprocess.run([sys.executable, "-m", "services.router", "--port", "1"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--help" in proc.stderr


def test_a_misspelled_setting_is_named_with_the_closest_one():
    warnings = unknown_variables({"WINDSERVE_MAX_NUM_SEQ": "3", "WINDSERVE_PAGE_SIZE": "16", "HOME": "/",
                                  "WINDSERVE_BASE_IMAGE": "x", "WINDSERVE_ZZZ": "1"})
    assert len(warnings) == 2
    assert "WINDSERVE_MAX_NUM_SEQ " in warnings[0] and "did you mean WINDSERVE_MAX_NUM_SEQS?" in warnings[0]
    assert "WINDSERVE_ZZZ" in warnings[1] and "did you mean" not in warnings[1]


def test_make_run_warns_of_a_misspelled_setting():
    env = {**os.environ, "WINDSERVE_NUM_FULL_PAGE": "64"}
    proc = subprocess.run([sys.executable, "-m", "scripts.run", "--services", "nosuch"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 2
    assert "WINDSERVE_NUM_FULL_PAGE is not a windserve setting" in proc.stderr
    assert "did you mean WINDSERVE_NUM_FULL_PAGES?" in proc.stderr
