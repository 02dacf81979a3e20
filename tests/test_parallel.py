"""Model parallelism (#18): tp / ep shards of the tiny model in real rank processes (gloo), against one process.

Rank processes take seconds to start on a busy machine, so each layout's engine is built once per module."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from libs.engine import AsyncEngine, EngineConfig, EngineCore, Request
from libs.engine.async_engine import EngineDeadError
from libs.engine.parallel.build import shard_state
from libs.engine.parallel.layout import LayoutError, ParallelLayout
from libs.engine.parallel.runner import ParallelRunner, RankDied
from libs.engine.runner import one_shot_logits
from libs.model.config import ModelConfig
from libs.model.loader import TINY_SEED, init_random_, load_model
from libs.model.model import MiMoV2Model
from libs.model.paged import BatchMeta, KVPools
from tests.test_engine import (
    PAGE,
    assert_baseline,
    conversations,
    drain,
    greedy,
    make_core,
    run_round,
    tokens,
)

LAYOUTS = [(2, 1), (1, 2), (2, 2)]
PRESSURED = dict(page_size=PAGE, bucket_edges=(), max_num_seqs=16, num_full_pages=72, num_swa_pages=36,
                 num_host_full_pages=256, num_host_swa_pages=128, max_num_batched_tokens=64,
                 l2_backup_watermark=0.3, l2_backup_pages=16, admission_decode_tokens=2)


@pytest.fixture(scope="module")
def tiny():
    return (*load_model(None, progress=False), None)


@pytest.fixture(scope="module")
def reference(tiny):
    """One process, no prefix cache: the independent reference for every parallel run."""
    core = make_core(tiny, enable_prefix_cache=False)
    yield core
    core.close()


def even_heads_model() -> tuple[MiMoV2Model, ModelConfig]:
    """The tiny model with 2 full / 4 SWA KV heads (random weights, fixed seed): at tp = 2 each rank holds half
    of both groups, so its arena units are the model's at half the bytes (the tiny model's 1 / 2 heads at
    tp = 2: the full head replicated, the SWA heads split, so a rank pads its SWA plane slots)."""
    cfg = ModelConfig.tiny().with_(kv_heads_full=2, kv_heads_swa=4)
    return init_random_(MiMoV2Model(cfg), TINY_SEED), cfg


@pytest.fixture(scope="module")
def even():
    return (*even_heads_model(), None)


@pytest.fixture(scope="module")
def even_reference(even):
    core = make_core(even, enable_prefix_cache=False)
    yield core
    core.close()


@pytest.mark.parametrize("tp,ep", LAYOUTS)
def test_multi_turn_under_pressure_equals_one_process(tiny, reference, tp, ep):
    """Prefix hits (device and host tier), chunked prefill, preemption and L2 copies on every rank: the greedy
    tokens equal a cache-disabled single-process run, and the pools come back to baseline. One KV arena per
    rank (tp = 2 on this model: padded SWA plane slots, `KVArena.stride`); `kv_arena=False`: the static pools."""
    # a rank's arena: the model's bytes (ep: the whole KV replicated; tp 2: the padded SWA slots cost what the
    # split saved, where the static pools take 2/3 of one process's bytes per rank)
    _multi_turn(make_core(tiny, **PRESSURED, tp=tp, ep=ep), reference, tp, ep, arena_share=1)


def _arena_bytes(core: EngineCore) -> int:
    """One process's arena bytes at `core`'s config (K and V)."""
    from libs.engine.core import arena_plan

    plan = arena_plan(core.config, core.runner.full_config)
    assert plan is not None
    return plan.units * plan.unit_bytes


def test_static_pools_under_pressure_equal_one_process(tiny, reference):
    _multi_turn(make_core(tiny, **PRESSURED, tp=2, ep=2, kv_arena=False), reference, 2, 2, arena_share=None)


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2)])
def test_tp_over_one_kv_arena_equals_one_process(even, even_reference, tp, ep):
    """As above with tp splitting both groups' KV heads alike: every rank holds one arena of the same units
    (its own heads in each), addressed by rank 0's cache; the ranks hold no unit tables (page rows come with
    each step, a load's units with the copy, stale loads are dropped by rank 0 before it sends them)."""
    _multi_turn(make_core(even, **PRESSURED, tp=tp, ep=ep), even_reference, tp, ep, arena_share=2)  # half each


def _multi_turn(core: EngineCore, reference: EngineCore, tp: int, ep: int, arena_share: int | None) -> None:
    """Two turns of 6 conversations on `core` (closed after) against `reference`. `arena_share`: each rank's
    arena holds 1 / arena_share of one process's arena bytes (None: the static pools)."""
    try:
        assert isinstance(core.runner, ParallelRunner)
        if arena_share is None:
            assert core.runner.kv.arena is None
        else:
            assert core.runner.rank_pool_bytes() == [{"arena": _arena_bytes(core) // arena_share}] * 2
        systems, users = conversations()
        history = {c: list(systems[c % 2]) for c in range(6)}
        for turn in range(2):  # (2 turns of 20 tokens, > the window of 16: preempts and loads back from L2 here)
            prompts = {f"c{c}t{turn}": history[c] + users[(c, turn)] for c in range(6)}
            got = run_round(core, prompts, n_out=20)
            assert got == run_round(reference, prompts, n_out=20), f"tp={tp} ep={ep} turn {turn}"
            for c in range(6):
                history[c] = prompts[f"c{c}t{turn}"] + got[f"c{c}t{turn}"]
        stats = core.scheduler.stats
        assert stats.hit_tokens > 0 and stats.preemptions > 0 and stats.loaded_pages > 0, stats
        assert_baseline(core)
        core.runner.check_alive()
    finally:
        core.close()


def test_kv_pools_hold_the_rank_heads(tiny):
    """tp=2 on the tiny model (4 query heads, 1 full / 2 SWA KV heads): a rank's SWA pool holds one KV head, its
    full pool the one KV head (replicated: fewer KV heads than ranks); shapes otherwise as one process."""
    _, cfg, _ = tiny
    lay = ParallelLayout(tp=2)
    local = lay.local_config(cfg)
    assert (local.num_heads, local.kv_heads_full, local.kv_heads_swa) == (2, 1, 1)
    assert [lay.kv_heads(cfg, r, swa=True) for r in (0, 1)] == [range(0, 1), range(1, 2)]
    assert [lay.kv_heads(cfg, r, swa=False) for r in (0, 1)] == [range(0, 1), range(0, 1)]
    assert lay.kv_bytes_ratio(cfg, swa=True) == 0.5 and lay.kv_bytes_ratio(cfg, swa=False) == 1.0


def test_shards_sum_to_the_full_logits(tiny):
    """Without any process group: run every rank's shard by hand and sum the partial outputs the all-reduce would
    sum — logits equal one process within fp32 tolerance (an independent check of the slicing arithmetic)."""
    model, cfg, _ = tiny
    ids = tokens(5, 37)
    want = one_shot_logits(model, cfg, ids)
    for tp, ep in LAYOUTS:
        lay = ParallelLayout(tp, ep)
        shards = [shard_state(model, lay, r) for r in range(lay.world)]
        # a Comm stand-in that sums the same module output over all ranks' shards (pure arithmetic)
        got = _summed_forward(tiny, lay, shards, ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"tp={tp} ep={ep}")


def _summed_forward(tiny, lay: ParallelLayout, shards, ids) -> torch.Tensor:
    from libs.engine.parallel.build import build_shard

    model, cfg, _ = tiny
    models = [build_shard(s, cfg, lay, r, None, torch.float32, "cpu") for r, s in enumerate(shards)]
    # replace each rank-0 module's output by the sum over the ranks' modules on the same input
    for name, mod in models[0].named_modules():
        if name.endswith("self_attn") and lay.tp > 1 or name.endswith(".mlp") and (
                lay.tp > 1 or type(mod).__name__ == "ShardedMoE"):
            others = [m.get_submodule(name) for m in models[1:]]
            mod.register_forward_hook(lambda _m, args, out, others=others: out + sum(o(*args) for o in others))
    # (the ranks share rank 0's pools here: each layer writes its K/V and reads it back before the next rank's
    # module overwrites them, within the one forward)
    pages = -(-len(ids) // 16)
    kv = KVPools.allocate(lay.local_config(cfg), pages, pages, 16)
    table = torch.arange(pages).unsqueeze(0)
    return models[0](torch.tensor(ids), BatchMeta([len(ids)], [len(ids)], table, table.clone()), kv)[-1]


def test_layout_validation(tiny):
    _, cfg, _ = tiny
    with pytest.raises(LayoutError, match="num_experts=8 is not divisible by ep=3"):
        ParallelLayout(ep=3).validate(cfg)
    with pytest.raises(LayoutError, match="num_heads=4 is not divisible by tp=3"):
        ParallelLayout(tp=3).validate(cfg)
    with pytest.raises(LayoutError, match="must be equal"):
        ParallelLayout(tp=2, ep=4)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(tp=2, speculative_tokens=1)
    with pytest.raises(LayoutError, match="kv_heads_swa=2 neither divides"):
        ParallelLayout(tp=3).validate(cfg.with_(num_heads=6, kv_heads_full=1, kv_heads_swa=2))


@pytest.mark.timeout(180)
async def test_killed_rank_fails_the_engine_explicitly(tiny):
    """SIGKILL of a worker rank mid-generation: the request fails with an explicit error within a bound (no hang),
    the engine reports itself dead, and a fresh engine's load() names the dead rank while idle."""
    core = EngineCore(EngineConfig(tp=2, ep=2, parallel_timeout_s=20), *tiny)
    engine = AsyncEngine(core, output_timeout_s=60)
    async with engine:
        got: list[int] = []

        async def consume():
            async for out in engine.generate(Request("victim", tokens(3, 20), greedy(2000))):
                got.extend(out.new_token_ids)

        task = asyncio.ensure_future(consume())
        deadline = time.monotonic() + 60
        while len(got) < 5:
            assert time.monotonic() < deadline and not task.done(), "no tokens before the kill"
            await asyncio.sleep(0.01)
        os.kill(core.runner.rank_pids[0], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises((EngineDeadError, RankDied, RuntimeError)):
            await asyncio.wait_for(task, 60)
        assert time.monotonic() - killed < 30
        assert not engine.is_running
    core.close()

    idle = EngineCore(EngineConfig(tp=2), *tiny)
    try:
        idle.load()
        os.kill(idle.runner.rank_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        with pytest.raises(RankDied, match="exited"):
            while time.monotonic() < deadline:
                idle.load()
                time.sleep(0.05)
    finally:
        idle.close()


def test_close_stops_every_rank(tiny):
    core = EngineCore(EngineConfig(tp=2), *tiny)
    pids = core.runner.rank_pids
    drain_out = (core.add_request(Request("a", tokens(1, 9), greedy(3))), drain(core))[1]
    assert len(drain_out["a"]) == 3
    core.close()
    for pid in pids:
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"rank pid {pid} still running after close()"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
