"""Model parallelism (#18): tp / ep shards of the tiny model in real rank processes (gloo), against one process."""

from __future__ import annotations

import pytest

from libs.engine.config import EngineConfig
from libs.engine.core import EngineCore
from libs.engine.request import Request, SamplingParams
from libs.model.loader import load_model
from libs.parallel.layout import LayoutError, ParallelLayout


@pytest.fixture(scope="module")
def tiny():
    return load_model(None, progress=False)


def _greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int = 10) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    out: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not core.has_work():
            break
        for o in core.step():
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return out


PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(40 + 13 * i)] for i in range(4)]


@pytest.mark.parametrize("tp,ep", [(2, 1), (1, 2), (2, 2)])
def test_greedy_equals_one_process(tiny, tp, ep):
    model, cfg = tiny
    base = EngineCore(EngineConfig(num_full_pages=256, num_swa_pages=128), model, cfg)
    want = _greedy(base, PROMPTS)
    base.close()
    core = EngineCore(EngineConfig(num_full_pages=256, num_swa_pages=128, tp=tp, ep=ep), model, cfg)
    try:
        assert _greedy(core, PROMPTS) == want
    finally:
        core.close()


def test_layout_validation(tiny):
    _, cfg = tiny
    with pytest.raises(LayoutError, match="num_experts=8 is not divisible by ep=3"):
        ParallelLayout(ep=3).validate(cfg)
    with pytest.raises(LayoutError, match="must be equal"):
        ParallelLayout(tp=2, ep=4)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(tp=2, speculative_tokens=1)
