"""One home per setting: every WINDSERVE_* variable is declared by one config class, read flat wherever that class
is a part, and listed in the generated docs/settings.md."""

from __future__ import annotations

import inspect

import pytest

from libs.nesting import parts
from libs.service.config import ConfigError, ServiceConfig, load_config
from libs.service.settings import DOC, ROLES, all_settings, markdown, role_config

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
