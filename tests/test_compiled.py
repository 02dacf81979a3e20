"""The compiled step (libs/model/compiled.py) against the eager engine on the same requests.

Reference: the same model weights run eager (a separate model instance, so nothing compiled reaches it). Greedy
tokens must be identical and logprobs close, across the compiled graphs' boundaries (decode at 1, 2..16 and more
sequences; prefill chunks of 2..16 and more tokens), prefix hits, chunked prefill, preemption and MTP.
"""

import pytest
import torch

from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
from libs.model import BatchMeta, KVPools, load_model, load_tokenizer
from libs.model.compiled import CompiledStep
from tests.test_engine import assert_baseline

pytestmark = pytest.mark.integration

OPTS = dict(page_size=4, num_full_pages=512, num_swa_pages=256, max_num_batched_tokens=48, bucket_edges=(),
            max_num_seqs=24, checkpoint_every_pages=2)  # (SWA checkpoints every 8 tokens: mid-prompt prefix hits)


def core_of(compile: bool, **overrides) -> EngineCore:
    model, cfg = load_model(None)  # a model instance of its own: compiling one never reaches another
    return EngineCore(EngineConfig(**{**OPTS, **overrides, "compile": compile}), model, cfg, load_tokenizer(None))


def run(core: EngineCore, waves: list[list[list[int]]], max_tokens: int = 10) -> dict[str, tuple[list, list]]:
    """Each wave's prompts together, wave after wave: {req id: (tokens, logprobs of the chosen tokens)}."""
    got: dict[str, tuple[list, list]] = {}
    for w, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            core.add_request(Request(f"w{w}-{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                    ignore_eos=True, logprobs=0)))
        for _ in range(2000):
            if not core.has_work():
                break
            for out in core.step():
                toks, lps = got.setdefault(out.req_id, ([], []))
                toks += out.new_token_ids
                lps += [lp.logprob for lp in out.logprobs or ()]
        assert not core.has_work()
    return got


def assert_same(eager: dict, compiled: dict) -> None:
    assert eager.keys() == compiled.keys()
    for rid, (toks, lps) in eager.items():
        assert compiled[rid][0] == toks, f"{rid}: greedy tokens differ"
        torch.testing.assert_close(torch.tensor(compiled[rid][1]), torch.tensor(lps), atol=1e-3, rtol=1e-3)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (length + i % 5,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def shared_prefix_waves():
    base = prompts(1, 40, seed=1)[0]
    return [prompts(1, 3, 2),  # decode at one sequence, a prefill chunk of a few tokens
            prompts(5, 9, 3),  # decode at 2..16 sequences
            prompts(18, 2, 4),  # decode past 16 sequences (the MoE's grouped form inside the graph)
            [base + prompts(1, 30, 5)[0]],  # chunked prefill (48-token budget) of 70 tokens
            [base + p for p in prompts(3, 6, 6)]]  # prefix hits on the shared 40


def test_compiled_engine_equals_eager(shared_prefix_waves):
    compiled = core_of(True)
    assert compiled.compile_stats["enabled"], compiled.compile_stats
    assert compiled.compile_stats["warmup_s"] is not None
    assert_baseline(compiled)  # the warm-up kept no page
    assert not compiled.drain_kv_events()  # and published nothing
    got = run(compiled, shared_prefix_waves)
    assert_same(run(core_of(False), shared_prefix_waves), got)
    load = compiled.load()
    assert load.compiled_calls > 0 and not load.eager_fallbacks
    assert load.hit_tokens >= 3 * 32  # the last wave hit the cached prefix
    assert_baseline(compiled)


def test_compiled_preemption_equals_eager():
    waves = [prompts(10, 12, 7)]
    small = dict(num_full_pages=48, num_swa_pages=40, admission_decode_tokens=1)
    compiled = core_of(True, **small)
    got = run(compiled, waves, max_tokens=16)
    assert compiled.scheduler.stats.preemptions > 0
    assert_same(run(core_of(False, **small), waves, max_tokens=16), got)
    assert_baseline(compiled)


def test_compiled_mtp_equals_eager_without_mtp():
    waves = [prompts(1, 8, 8), prompts(4, 8, 9)]
    compiled = core_of(True, speculative_tokens=2)
    got = run(compiled, waves)
    assert compiled.scheduler.stats.drafted_tokens > 0
    ref = run(core_of(False), waves)
    assert {r: t for r, (t, _) in got.items()} == {r: t for r, (t, _) in ref.items()}


def test_steps_beyond_the_compiled_sizes_run_eager_and_are_counted():
    core = core_of(False)
    step = CompiledStep(max_tokens=4)  # the compiled sizes stop at 4 tokens
    core.runner.model.set_compiled(step)
    waves = [prompts(2, 1, 12), prompts(8, 3, 10)]  # two sequences: compiled; eight: eager
    got = run(core, waves)
    assert step.fallbacks["tokens_over_max"] > 0 and step.compiled_calls > 0
    assert core.load().eager_fallbacks["tokens_over_max"] == step.fallbacks["tokens_over_max"]
    assert_same(run(core_of(False), waves), got)


def test_a_failed_warm_up_bound_leaves_the_engine_eager():
    core = core_of(True, compile_warmup_s=1e-9)  # passed before the second stage
    assert not core.compile_stats["enabled"] and "bound" in core.compile_stats["reason"]
    assert core.runner.model.compiled is None
    ref = run(core_of(False), [prompts(2, 5, 11)])
    assert_same(ref, run(core, [prompts(2, 5, 11)]))


def test_the_decode_graph_refuses_an_unmapped_page_like_the_plan():
    model, cfg = load_model(None)
    model.set_compiled(CompiledStep(max_tokens=8))
    kv = KVPools.allocate(cfg, 8, 8, page_size=4)
    meta = BatchMeta.build([1], [9], [[0, -1, 2]], [[0, 1, 2]])  # position 4..7's full page is unmapped
    with pytest.raises(ValueError, match="logical page 1 is unmapped"):
        model(torch.tensor([5]), meta, kv)
