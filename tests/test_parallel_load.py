"""Loading a parallel rank's shard straight from a safetensors checkpoint (#18): each rank reads only its part
(FP8 and fused-qkv layouts included) and gets exactly the shard libs/engine/parallel/build.py cuts from a full model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.fp8 import quant_fp8_block
from libs.engine.config import EngineConfig
from libs.engine.core import EngineCore
from libs.engine.llm import LLM
from libs.engine.parallel.build import shard_state
from libs.engine.parallel.layout import ParallelLayout
from libs.engine.parallel.load import load_shard
from libs.engine.request import Request
from libs.model import CheckpointError, load_model
from libs.model.loader import _Shards, checkpoint_config
from libs.worker.engine import build_engine
from tests.test_engine import assert_baseline, drain, greedy
from tests.test_model import LAYER_TYPES, _fuse_qkv, _rewrite, _save_sharded, hf_dir  # noqa: F401 (a fixture)

WIDE = 512  # layer 0's dense MLP width: its tp = 2 halves (256) start and end on the 128-wide FP8 quant blocks
FP8 = ["model.layers.0.mlp.gate_proj.weight",  # rows cut on block borders: only the rank's blocks are read
       "model.layers.0.mlp.down_proj.weight",  # columns cut on block borders
       "model.layers.1.self_attn.o_proj.weight",  # columns cut inside a block: read whole, dequantised, cut
       "model.layers.2.mlp.experts.5.gate_proj.weight",
       "model.layers.3.self_attn.qkv_proj.weight"]  # fused and FP8 (packed scales)
def _greedy(core: EngineCore, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        core.add_request(Request(f"r{i}", p, greedy(8)))
    out = drain(core)
    assert_baseline(core)
    return out


LAYOUTS = [ParallelLayout(tp=2), ParallelLayout(ep=2), ParallelLayout(tp=2, ep=2)]


@pytest.fixture(scope="module")
def ckpt(hf_dir, tmp_path_factory):  # noqa: F811
    """The transformers-saved tiny model rewritten into every layout at once: fused qkv on all layers, some
    weights FP8, an index over two files, layer 0's MLP widened to WIDE."""
    def edit(t, dst):
        g = torch.Generator().manual_seed(7)
        for part, shape in (("gate_proj", (WIDE, 64)), ("up_proj", (WIDE, 64)), ("down_proj", (64, WIDE))):
            t[f"model.layers.0.mlp.{part}.weight"] = torch.randn(shape, generator=g) / 8
        for layer, kind in enumerate(LAYER_TYPES):
            t[f"model.layers.{layer}.self_attn.qkv_proj.weight"] = _fuse_qkv(t, layer, 2 if "sliding" in kind else 1)
        for name in FP8:
            t[name], t[name + "_scale_inv"] = quant_fp8_block(t[name])
        _save_sharded(t, dst)
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, "intermediate_size": WIDE}))

    return _rewrite(hf_dir, tmp_path_factory.mktemp("pload") / "ckpt", edit)


@pytest.fixture(scope="module")
def full(ckpt):
    return load_model(str(ckpt), progress=False)[0]


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, tuple | None]]:
    """Every tensor read from the checkpoint files: (name, index; None = whole)."""
    seen: list[tuple[str, tuple | None]] = []
    read = _Shards.read

    def spy(self, name, index=None):
        seen.append((name, index))
        return read(self, name, index)

    monkeypatch.setattr(_Shards, "read", spy)
    return seen


@pytest.mark.integration
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"tp{lay.tp}-ep{lay.ep}")
def test_each_rank_loads_exactly_its_shard(ckpt, full, reads, layout):
    cfg = full.cfg
    for rank in range(layout.world):
        reads.clear()
        got = load_shard(ckpt, cfg, layout, rank, None, progress=False).state_dict()
        want = shard_state(full, layout, rank)
        assert got.keys() == want.keys()
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, atol=0, rtol=0, msg=name)
        names = {n for n, _ in reads}
        mine = {f"experts.{e}." for e in layout.experts(cfg, rank)}
        others = [n for n in names if ".experts." in n and not any(e in n for e in mine)]
        assert not others, f"rank {rank} read other ranks' experts: {sorted(others)[:3]}"
        assert any(".experts." in n for n in names)
        index = dict(reads)
        if layout.tp > 1:  # plain tensors and FP8 blocks read by slice, not whole
            half = slice(rank * WIDE // 2, (rank + 1) * WIDE // 2)
            assert index["model.layers.0.mlp.gate_proj.weight"] == (half, slice(None))
            assert index["model.layers.0.mlp.gate_proj.weight_scale_inv"] == (slice(2 * rank, 2 * rank + 2),
                                                                              slice(None))
            assert index["model.layers.0.mlp.down_proj.weight"] == (slice(None), half)
            assert index["model.layers.1.self_attn.o_proj.weight"] is None  # (cut inside a quant block)
        if layout.tp > 1 and layout.ep == 1:  # the experts' width split
            assert index["model.layers.4.mlp.experts.0.down_proj.weight"] == (slice(None), slice(12 * rank,
                                                                                               12 * rank + 12))


def _one_file(ckpt: Path, dst: Path, edit) -> Path:
    """A copy of `ckpt` as one safetensors file, its tensors changed by `edit`."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(f))
    edit(tensors)
    dst.mkdir()
    shutil.copy(ckpt / "config.json", dst)
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.mark.integration
def test_a_rank_needs_only_its_tensors_and_names_a_bad_one(ckpt, full, tmp_path):
    cfg, ep = full.cfg, ParallelLayout(ep=2)
    sinks = "model.layers.4.self_attn.sinks"
    bad = _one_file(ckpt, tmp_path / "shape", lambda t: t.update({sinks: torch.zeros(3)}))
    with pytest.raises(CheckpointError, match=re.escape(f"{sinks}: checkpoint shape (3,) != expected (4,)")):
        load_shard(bad, cfg, ParallelLayout(tp=2), 1, None, progress=False)
    scale = "model.layers.0.mlp.gate_proj.weight_scale_inv"  # (read by rows on block borders: 2 of 4 -> of 5)
    bad = _one_file(ckpt, tmp_path / "scale", lambda t: t.update({scale: torch.ones(5, 1)}))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.0\.mlp\.gate_proj\.weight: block scales"):
        load_shard(bad, cfg, ParallelLayout(tp=2), 0, None, progress=False)
    victim = "model.layers.2.mlp.experts.6.up_proj.weight"
    missing = _one_file(ckpt, tmp_path / "missing", lambda t: t.pop(victim))
    load_shard(missing, cfg, ep, 0, None, progress=False)  # experts 0-3: the missing one is rank 1's
    with pytest.raises(CheckpointError, match=re.escape(f"{victim} is missing")):
        load_shard(missing, cfg, ep, 1, None, progress=False)


@pytest.mark.integration
def test_engine_from_checkpoint_path_equals_one_process(ckpt, full, monkeypatch):
    """build_engine with tp = 2 loads no full model: both ranks read their shards from the path."""
    prompts = [[(5 * i + j) % 290 + 3 for j in range(30 + 11 * i)] for i in range(3)]
    engine = dict(num_full_pages=128, num_swa_pages=64)
    base = EngineCore(EngineConfig(**engine), full, full.cfg)
    want = _greedy(base, prompts)
    base.close()

    def no_full_model(*args, **kwargs):
        raise AssertionError("a parallel engine over a checkpoint loaded the full model")

    monkeypatch.setattr("libs.model.load_model", no_full_model)
    assert checkpoint_config(ckpt) == full.cfg
    core = build_engine(str(ckpt), EngineConfig(**engine, tp=2))
    try:
        assert core.runner.model.model.layers[0].mlp.gate_proj.weight.shape == (WIDE // 2, 64)
        assert _greedy(core, prompts) == want
    finally:
        core.close()


@pytest.mark.integration
@pytest.mark.parametrize("entry", ["build_engine", "LLM"])
def test_engine_names_the_tensor_a_worker_rank_lacks(ckpt, tmp_path, entry):
    """Rank 1 (its own process) fails on a tensor only it needs: the engine raises CheckpointError naming it. The
    offline LLM loads the same way (it used to load the whole model, and sent the ranks their shards)."""
    victim = "model.layers.3.mlp.experts.7.down_proj.weight"
    missing = _one_file(ckpt, tmp_path / "missing", lambda t: t.pop(victim))
    with pytest.raises(CheckpointError, match=r"parallel rank 1: tensor " + re.escape(victim) + " is missing"):
        if entry == "LLM":
            LLM(str(missing), num_full_pages=64, num_swa_pages=32, ep=2)
        else:
            build_engine(str(missing), EngineConfig(num_full_pages=64, num_swa_pages=32, ep=2))
