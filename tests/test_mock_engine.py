"""The timing-model engine (#38, libs/engine/mock.py): deterministic tokens per (prompt, position), the KV
accounting of the real engine on the same request sequence (same hits, same pool usage), modelled step time,
grammars, and migration (a resumed request continues the uninterrupted output)."""

from __future__ import annotations

import json

import pytest

from libs.engine import LLM, EngineConfig, Request, SamplingParams
from libs.engine.core import load_core
from libs.engine.mock import MockRunner, mock_token
from libs.engine.mock_profile import MockProfile
from libs.engine.request import GrammarSpec
from libs.engine.runner import StepInterrupted

pytestmark = pytest.mark.unit

ENGINE = dict(page_size=4, num_full_pages=96, num_swa_pages=48, max_num_batched_tokens=32, max_num_seqs=4,
              bucket_edges=())


def mock(**kw) -> LLM:
    return LLM(None, engine_mode="mock", mock_profile=kw.pop("mock_profile", ""), **{**ENGINE, **kw})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_tokens_depend_only_on_the_previous_token_and_position_and_avoid_eos() -> None:
    assert mock_token(5, 9, 100) == mock_token(5, 9, 100)
    assert len({mock_token(5, p, 1000) for p in range(50)}) > 40
    avoid = frozenset(range(0, 99))
    assert mock_token(5, 9, 100, avoid) == 99


def test_profiles_load_by_name_or_path_and_refuse_bad_values(tmp_path) -> None:
    p = MockProfile.load()
    assert p.fixed_s > 0 and p.source
    path = tmp_path / "mine.json"
    MockProfile(0.001, 1e-5, 1e-8, 0.0005, "test").save(path)
    assert MockProfile.load(str(path)).per_pair_s == 1e-8
    with pytest.raises(ValueError, match="no mock profile 'nope'"):
        MockProfile.load("nope")
    with pytest.raises(ValueError, match="must be >= 0"):
        MockProfile(-1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="mock engine runs without MTP"):
        EngineConfig(engine_mode="mock", speculative_tokens=1)
    with pytest.raises(ValueError, match="real or mock"):
        EngineConfig(engine_mode="fake")


def test_a_mock_engine_loads_no_weights_and_sleeps_the_modelled_step_time(tmp_path) -> None:
    path = tmp_path / "p.json"
    MockProfile(0.002, 0.0001, 0.0, 0.0, "test").save(path)
    llm = mock(mock_profile=str(path))
    runner = llm.core.runner
    assert isinstance(runner, MockRunner) and runner.model is None
    out = llm.generate([list(range(3, 23))], greedy(5))[0]
    assert len(out.token_ids) == 5
    # 20 prompt tokens in one step, then 4 decode steps of one token: 5 x 2 ms + 24 x 0.1 ms
    assert runner.slept_s == pytest.approx(5 * 0.002 + 24 * 0.0001)


def test_outputs_are_a_function_of_the_prompt_on_every_engine_and_after_a_migration() -> None:
    prompts = [list(range(3, 40)), list(range(50, 61))]
    a = [o.token_ids for o in mock().generate(prompts, greedy(20))]
    b = mock(max_num_seqs=1)  # another engine, other batching
    assert [o.token_ids for o in b.generate(prompts, greedy(20))] == a
    core = b.core
    core.add_request(Request("moved", prompts[0], greedy(20), resumed=list(a[0][:7])))
    got = []
    while core.has_work():
        got += [t for o in core.step() for t in o.new_token_ids]
    assert list(a[0][:7]) + got == list(a[0])


def test_kv_accounting_equals_the_real_engine_on_the_same_requests() -> None:
    """Shared prefixes, served one at a time: every request's prefix hit and the pools after it are the real
    engine's (outputs differ, so no prompt contains an output)."""
    real, fake = LLM(None, **ENGINE), mock()
    stem = list(range(3, 40))
    prompts = [stem + [100 + i] * (3 + 5 * i) for i in range(5)] + [stem[:21] + [7] * 9, stem + [100] * 3]
    for i, p in enumerate(prompts):
        outs = [llm.generate([p], greedy(6 + i))[0] for llm in (real, fake)]
        assert outs[0].num_cached_tokens == outs[1].num_cached_tokens, i
        assert real.core.usage() == fake.core.usage(), i


def test_a_grammar_shapes_the_mock_output() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    llm = LLM(None, engine_mode="mock", **ENGINE)
    tok = llm.core.tokenizer
    params = SamplingParams(max_tokens=40, grammar=GrammarSpec(kind="json_schema", schema=json.dumps(schema)))
    out = llm.generate([tok.encode("give me json")], params)[0]
    ids = [t for t in out.token_ids if t not in tok.eos_token_ids]  # (the grammar ends it with EOS)
    assert isinstance(json.loads(tok.decode(ids))["n"], int)


def test_an_interrupt_stops_a_sleeping_step() -> None:
    core = load_core(None, EngineConfig(engine_mode="mock", **ENGINE))
    runner = core.runner
    core.add_request(Request("r", list(range(3, 30)), greedy(2)))
    plan = core.scheduler.schedule()
    with pytest.raises(StepInterrupted):
        runner.forward(plan, interrupt=lambda: True)
