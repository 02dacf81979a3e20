"""The vision tower against independent references.

- transformers' Qwen2.5-VL vision modules, weights copied in: patch embedding, 2-D rotary, merger, and the whole
  tower where the architectures agree (MHA, Qwen2.5-VL window partitions, full blocks);
- a dense masked attention written here from patch coordinates (an explicit [S, S] mask per item / frame /
  window / band, sinks in the softmax denominator, KV heads repeated) for what transformers has not: GQA, MiMo's
  sliding band in row and column order, sinks;
- batched == unbatched, deterministic init, checkpoint loading.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import xxhash
from safetensors.torch import save_file

from libs.model import vision as vision_mod
from libs.model.loader import CheckpointError
from libs.model.vision import VisionAttention, VisionTower, block_kind, build_plan, rotary_positions
from libs.model.vision_config import VisionConfig
from libs.model.vision_loader import load_vision_tower

pytestmark = pytest.mark.unit

tf_vl = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
tf_cfg = pytest.importorskip("transformers.models.qwen2_5_vl.configuration_qwen2_5_vl")

TINY = VisionConfig.tiny()
MHA = replace(TINY, num_kv_heads=TINY.num_heads)  # what Qwen2.5-VL can express
# MiMo-style: GQA, head dim != hidden / heads, sliding band with sinks, one column-order block, full block 0
MIMO = replace(TINY, head_dim=16, sliding_window=6, use_sink=True, full_attention_blocks=(0,),
               window_attn_types=(-1, 1, -1, 1))
# merged grids 3x5 (partial windows), 4x4 (a video of 2 temporal patches), 2x3
GRIDS = [(1, 6, 10), (2, 8, 8), (1, 4, 6)]


def hf_config(vc: VisionConfig):
    cfg = tf_cfg.Qwen2_5_VLVisionConfig(
        depth=vc.depth, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
        num_heads=vc.num_heads, patch_size=vc.patch_size, window_size=vc.window_size,
        fullatt_block_indexes=list(vc.full_attention_blocks), out_hidden_size=vc.out_hidden_size,
        spatial_merge_size=vc.spatial_merge_size, temporal_patch_size=vc.temporal_patch_size,
        in_channels=vc.in_channels, hidden_act="silu")
    cfg._attn_implementation = "eager"
    return cfg


def patches_for(grids, vc, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, vc.patch_dim, generator=torch.Generator().manual_seed(seed))


def test_whole_tower_matches_transformers_qwen25_vl():
    hf = tf_vl.Qwen2_5_VisionTransformerPretrainedModel(hf_config(MHA)).eval()
    ours = VisionTower(MHA)
    ours.load_state_dict(hf.state_dict(), strict=True)
    x, grid = patches_for(GRIDS, MHA), torch.tensor(GRIDS)
    with torch.no_grad():
        ref = hf(x, grid_thw=grid).pooler_output
    got = ours(x, grid)
    assert got.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, MHA.out_hidden_size)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_patch_embed_and_merger_match_transformers():
    ours = VisionTower(TINY)
    pe = tf_vl.Qwen2_5_VisionPatchEmbed(TINY.patch_size, TINY.temporal_patch_size, TINY.in_channels,
                                        TINY.hidden_size)
    pe.load_state_dict(ours.patch_embed.state_dict())
    merger = tf_vl.Qwen2_5_VLPatchMerger(TINY.out_hidden_size, TINY.hidden_size, TINY.spatial_merge_size)
    merger.load_state_dict(ours.merger.state_dict())
    x = patches_for(GRIDS, TINY)
    with torch.no_grad():
        torch.testing.assert_close(ours.patch_embed(x), pe(x), atol=1e-5, rtol=1e-5)
        h = torch.randn(64, TINY.hidden_size)
        torch.testing.assert_close(ours.merger(h), merger(h), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vc", [MHA, MIMO], ids=["qwen25-head-dim", "mimo-head-dim"])
def test_rotary_matches_transformers(vc):
    from transformers.vision_utils import get_vision_position_ids

    hc = hf_config(MHA)
    hc.head_dim = vc.attn_head_dim
    rope = tf_vl.Qwen2_5_VLVisionRotaryEmbedding(hc)
    grid = torch.tensor(GRIDS)
    pos = get_vision_position_ids(grid, vc.spatial_merge_size)
    ref_cos, ref_sin = rope(torch.zeros(1), pos)
    assert torch.equal(rotary_positions(GRIDS, vc.spatial_merge_size), pos.to(torch.int64))
    cos, sin = VisionTower(vc).rotary(GRIDS, torch.device("cpu"))
    torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=1e-6)


def dense_mask(grids, vc: VisionConfig, kind: str) -> torch.Tensor:
    """[S, S] bool, built from coordinates only: same item and frame, and the kind's window / band rule."""
    m = vc.spatial_merge_size
    rows = []  # per patch: (item, frame, merged row, merged col, patch row, patch col)
    for item, (t, h, w) in enumerate(grids):
        for f in range(t):
            for a in range(h // m):
                for b in range(w // m):
                    rows += [(item, f, a, b, a * m + i, b * m + j) for i in range(m) for j in range(m)]
    c = torch.tensor(rows)
    same = (c[:, None, 0] == c[None, :, 0]) & (c[:, None, 1] == c[None, :, 1])
    if kind == "full":
        return same
    if kind == "window":
        ws = vc.window_tokens
        return (same & ((c[:, None, 2] // ws) == (c[None, :, 2] // ws))
                & ((c[:, None, 3] // ws) == (c[None, :, 3] // ws)))
    # band: rank of each patch in the frame's row- or column-major merged order (units of m*m patches)
    wm = torch.tensor([grids[int(i)][2] // m for i in c[:, 0]])
    hm = torch.tensor([grids[int(i)][1] // m for i in c[:, 0]])
    unit = c[:, 2] * wm + c[:, 3] if kind == "row" else c[:, 3] * hm + c[:, 2]
    rank = unit * m * m + (c[:, 4] % m) * m + (c[:, 5] % m)
    return same & ((rank[:, None] - rank[None, :]).abs() <= vc.sliding_window)


def dense_attention(attn: VisionAttention, x, cos, sin, mask):
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.qkv(x).split([h * d, kv * d, kv * d], dim=-1)

    def rope(t):
        t = t.view(len(x), -1, d)
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return t * cos[:, None] + torch.cat([-t2, t1], -1) * sin[:, None]

    q, k, v = rope(q), rope(k), v.view(len(x), kv, d)
    k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if attn.sinks is not None:
        sink = attn.sinks.view(h, 1, 1).expand(h, len(x), 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return attn.proj(torch.einsum("hqk,khd->qhd", probs, v).reshape(len(x), h * d))


@pytest.mark.parametrize("budget", [None, 1], ids=["one-chunk", "row-chunks"])
@pytest.mark.parametrize("vc,block", [(TINY, 0), (TINY, 3), (MIMO, 0), (MIMO, 1), (MIMO, 2)],
                         ids=["gqa-window", "gqa-full", "mimo-full", "mimo-band-col-sinks", "mimo-band-row-sinks"])
def test_attention_matches_dense_masked_reference(vc, block, budget, monkeypatch):
    if budget is not None:  # one query row per chunk: the band's key slices and chunk edges are exercised
        monkeypatch.setattr(vision_mod, "_SCORE_BUDGET", budget)
    tower = VisionTower(vc)
    attn = tower.blocks[block].attn
    kind = block_kind(vc, block)
    assert kind == {0: "window", 3: "full"}[block] if vc is TINY else kind == ["full", "col", "row"][block]
    with torch.no_grad():
        attn.sinks is not None and attn.sinks.copy_(torch.tensor([1.5, -1.0, 0.5, 3.0]))  # sinks that matter
        x = torch.randn(sum(t * h * w for t, h, w in GRIDS), vc.hidden_size)
        cos, sin = tower.rotary(GRIDS, torch.device("cpu"))
        got = attn(x, cos, sin, build_plan(GRIDS, vc, kind, torch.device("cpu")))
        ref = dense_attention(attn, x, cos, sin, dense_mask(GRIDS, vc, kind))
    assert (attn.sinks is not None) == (vc is MIMO and block != 0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("vc", [TINY, MIMO], ids=["tiny", "mimo-style"])
def test_batched_equals_unbatched(vc):
    tower = VisionTower(vc)
    xs = [patches_for([g], vc, seed=i) for i, g in enumerate(GRIDS)]
    alone = [tower(x, torch.tensor([g])) for x, g in zip(xs, GRIDS, strict=True)]
    together = tower(torch.cat(xs), torch.tensor(GRIDS))
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)
    # and the items do interact with nothing: changing one item changes only its own rows
    xs[1] = xs[1] + 1.0
    changed = tower(torch.cat(xs), torch.tensor(GRIDS))
    n0, n1 = (g[0] * g[1] * g[2] // 4 for g in GRIDS[:2])
    torch.testing.assert_close(changed[:n0], together[:n0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(changed[n0 + n1:], together[n0 + n1:], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed[n0:n0 + n1], together[n0:n0 + n1])


def test_wrong_patch_count_is_refused():
    with pytest.raises(ValueError, match="do not match grid_thw"):
        VisionTower(TINY)(torch.zeros(10, TINY.patch_dim), torch.tensor([[1, 4, 4]]))


def _digest(tower: VisionTower) -> str:
    h = xxhash.xxh64()
    for _, p in sorted(tower.named_parameters()):
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


_DIGEST = ("from libs.model.vision import VisionTower; from libs.model.vision_config import VisionConfig; "
           "from tests.test_vision import _digest; print(_digest(VisionTower(VisionConfig.tiny())))")


def test_seeded_init_is_the_same_in_every_process():
    there = subprocess.run([sys.executable, "-c", _DIGEST], capture_output=True, text=True, timeout=180,
                           check=True, env={"PYTHONHASHSEED": "7", "PATH": ""})
    assert there.stdout.strip() == _digest(VisionTower(TINY))
    assert _digest(VisionTower(TINY, seed=99)) != _digest(VisionTower(TINY))


def _save(tower: VisionTower, path, prefix="visual.", drop=()):
    tensors = {prefix + k: v.contiguous() for k, v in tower.state_dict().items() if k not in drop}
    save_file(tensors, str(path / "model.safetensors"))


def test_loader_reads_visual_tensors(tmp_path):
    src = VisionTower(MIMO, seed=5)
    with torch.no_grad():
        src.merger.mlp[0].bias.zero_()
        src.merger.mlp[2].bias.zero_()
    _save(src, tmp_path, prefix="model.visual.", drop=("merger.mlp.0.bias", "merger.mlp.2.bias"))
    loaded = load_vision_tower(tmp_path, MIMO)
    x, grid = patches_for(GRIDS, MIMO), torch.tensor(GRIDS)
    torch.testing.assert_close(loaded(x, grid), src(x, grid), atol=0, rtol=0)
    assert load_vision_tower(tmp_path, MIMO, dtype=torch.bfloat16)(x, grid).dtype == torch.bfloat16


def test_loader_names_missing_and_misshaped_tensors(tmp_path):
    src = VisionTower(MIMO)
    (tmp_path / "a").mkdir()
    _save(src, tmp_path / "a", drop=("blocks.2.attn.sinks",))
    with pytest.raises(CheckpointError, match="blocks.2.attn.sinks is missing"):
        load_vision_tower(tmp_path / "a", MIMO)
    (tmp_path / "b").mkdir()
    _save(src, tmp_path / "b")
    with pytest.raises(CheckpointError,
                       match=r"visual.blocks.0.attn.proj.weight: checkpoint shape \(32, 64\) != expected \(32, 32\)"):
        load_vision_tower(tmp_path / "b", replace(MIMO, head_dim=8))
    with pytest.raises(CheckpointError, match="unexpected vision tensor visual.blocks.1.attn.sinks"):
        load_vision_tower(tmp_path / "b", replace(MIMO, use_sink=False))


def test_hf_vision_config_mimo_and_qwen25_fields():
    mimo = VisionConfig.from_hf_dict({"depth": 28, "hidden_size": 1280, "num_heads": 32, "num_key_value_heads": 8,
                                      "qk_channels": 64, "kv_channels": 64, "fullatt_block_indexes": [0, 9, 18, 27],
                                      "visual_token_window_size": 64, "use_sink": True, "patch_size": 16,
                                      "vit_window_attn_types": [-1] * 28, "out_hidden_size": 4096}, 4096)
    assert (mimo.attn_head_dim, mimo.num_kv_heads, mimo.sliding_window, mimo.use_sink) == (64, 8, 64, True)
    assert [block_kind(mimo, i) for i in (0, 1, 9, 27)] == ["full", "row", "full", "full"]
    qwen = VisionConfig.from_hf_dict({"depth": 32, "hidden_size": 1280, "num_heads": 16, "patch_size": 14,
                                      "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                                      "out_hidden_size": 3584}, 3584)
    assert (qwen.attn_head_dim, qwen.num_kv_heads, qwen.sliding_window, qwen.use_sink) == (80, 16, 0, False)
    assert qwen.window_tokens == 4 and block_kind(qwen, 0) == "window"
