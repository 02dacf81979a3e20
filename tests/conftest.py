"""Shared test configuration: marker handling."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Real nats-server fixtures (nats_server, nats_url, bus) for integration tests.
from tests.fixtures.nats import bus, nats_server, nats_url  # noqa: E402, F401
