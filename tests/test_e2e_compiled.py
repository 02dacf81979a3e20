"""The services on the compiled step (WINDSERVE_COMPILE=1, their default outside the suite) end to end:
aggregated and disaggregated, greedy outputs equal to the offline engine run eager, the compile reported in
health and metrics."""

from __future__ import annotations

import asyncio

import pytest
import torch

from libs.engine import LLM, SamplingParams
from tests.test_e2e_disagg import OFFLINE, complete_ids, prompt, topology

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

COMPILED = {"WINDSERVE_COMPILE": "1"}


@pytest.fixture(scope="module", params=[{"worker": 1}, {"prefill": 1, "decode": 1}], ids=["aggregated", "disagg"])
def compiled(request, nats_server, tmp_path_factory):
    topo = topology(nats_server.url, tmp_path_factory.mktemp("compiled"))
    try:
        for role, n in {"gateway": 1, "router": 1, **request.param}.items():
            for i in range(n):
                topo.start(topo.iid(role, i), role, COMPILED if role in ("worker", "prefill", "decode") else None)
        topo.wait_ready(300)  # (each engine warms its graphs up before it registers; seconds with a warm cache)
        yield topo, [r for r in request.param]
    finally:
        topo.stop()


@pytest.fixture(scope="module")
def offline():
    torch.manual_seed(0)
    return LLM(None, **OFFLINE)


async def test_compiled_services_equal_offline_eager(compiled, offline):
    topo, roles = compiled
    prompts = [prompt(100 + i, n) for i, n in enumerate([3, 17, 40, 9, 26, 60])]
    expected = [list(o.token_ids) for o in offline.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))]
    client = topo.client()
    assert await complete_ids(client, prompts[0], 10) == expected[0]  # alone: one-sequence decode graph
    got = await asyncio.gather(*(complete_ids(client, p, 10) for p in prompts))  # together: the dynamic one
    assert got == expected
    for role in roles:
        instance = topo.iid(role, 0)
        details = await topo.details(instance)
        assert "'enabled': True" in details["compile"], details["compile"]
        samples = topo.metrics(instance)
        assert samples[("windserve_worker_compiled_calls", ())] > 0


def test_every_service_log_line_is_json_through_a_stop(compiled):
    """#40: the compiled step loads triton, whose bindings print plain-text leak reports at interpreter exit;
    a service ends without that teardown, so its log stays JSON to the last line."""
    topo, _ = compiled
    topo.stop()
    for log in sorted(topo.logs.glob("*.log")):
        text = [line for line in log.read_text().splitlines() if line.strip()]
        assert text and [line for line in text if not line.startswith("{")] == [], log.name
