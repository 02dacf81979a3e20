"""Shared test configuration: marker handling, and the engine services run eager unless a test asks otherwise.

The services compile their step by default (WINDSERVE_COMPILE); the suite starts hundreds of engine processes,
and each would pay the compile warm-up (seconds with a warm cache). The compiled path has tests of its own
(tests/test_compiled.py), which set it explicitly."""

import os

import pytest
import torch

os.environ.setdefault("WINDSERVE_COMPILE", "0")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Real nats-server fixtures (nats_server, nats_url, bus) for integration tests.
from tests.fixtures.nats import bus, nats_server, nats_url  # noqa: E402, F401
