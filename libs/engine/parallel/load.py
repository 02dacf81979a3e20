"""Loading one rank's shard straight from a checkpoint directory: the rank's sharded skeleton (build.skeleton)
filled by the model loader (libs/model/loader.py) with a selection that keeps only the rank's part.

`load_shard` reads exactly the slices libs/engine/parallel/shard.py cuts out of a full model (the tests
check they agree): its heads' attention rows / columns and its intermediate slice through safetensors
``get_slice``, its own experts only, replicated tensors whole, no MTP blocks. FP8 weights are read by quant
block where the slice is block-aligned, else whole, dequantised, then sliced. Details: docs/parallel.md,
"Loading".
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from libs.engine.parallel.build import skeleton
from libs.engine.parallel.comm import Comm
from libs.engine.parallel.layout import ParallelLayout
from libs.model.config import ModelConfig
from libs.model.loader import Cut, Selection, load_weights
from libs.model.model import MiMoV2Model

_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
_EXPERT_PART = re.compile(r"^mlp\.experts\.\d+\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


class ShardSelection(Selection):
    """Rank `rank`'s part of the checkpoint under `layout`."""

    def __init__(self, cfg: ModelConfig, layout: ParallelLayout, rank: int) -> None:
        layout.validate(cfg)
        self.cfg, self.layout, self.rank = cfg, layout, rank
        self.experts = layout.experts(cfg, rank)

    def keeps(self, name: str) -> bool:
        return not name.startswith("model.mtp.")  # (a shard has no MTP blocks)

    def cuts(self, name: str) -> tuple[Cut, ...]:
        m = _LAYER.match(name)
        if m is None:
            return ()
        cuts = self._layer_cuts(int(m["layer"]), m["rest"])
        return tuple(c for c in cuts if c.keep != range(c.full))  # (tp = 1: attention whole)

    def _layer_cuts(self, layer: int, rest: str) -> tuple[Cut, ...]:
        cfg, lay, r = self.cfg, self.layout, self.rank
        if rest.startswith("self_attn."):
            q = lay.q_heads(cfg, r)
            kv = lay.kv_heads(cfg, r, cfg.layer_is_swa[layer])
            n_kv = cfg.kv_heads_swa if cfg.layer_is_swa[layer] else cfg.kv_heads_full
            return {
                "self_attn.q_proj.weight": (_heads(0, q, cfg.qk_head_dim, cfg.num_heads),),
                "self_attn.k_proj.weight": (_heads(0, kv, cfg.qk_head_dim, n_kv),),
                "self_attn.v_proj.weight": (_heads(0, kv, cfg.v_head_dim, n_kv),),
                "self_attn.o_proj.weight": (_heads(1, q, cfg.v_head_dim, cfg.num_heads),),
                "self_attn.attention_sink_bias": (_heads(0, q, 1, cfg.num_heads),),
            }.get(rest, ())
        if m := _EXPERT_PART.match(rest):
            return (_width(m["part"], lay.moe_inter(cfg, r), cfg.moe_intermediate_size),)
        if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
            return (_width(rest.split(".")[1], lay.inter(cfg.intermediate_size, r), cfg.intermediate_size),)
        return ()


def _heads(dim: int, heads: range, size: int, total: int) -> Cut:
    return Cut(dim, range(heads.start * size, heads.stop * size), total * size)


def _width(part: str, keep: range, full: int) -> Cut:
    """An MLP's intermediate slice: gate / up rows, down columns."""
    return Cut(1 if part == "down_proj" else 0, keep, full)


def load_shard(path: str | Path, cfg: ModelConfig, layout: ParallelLayout, rank: int, comm: Comm | None,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               progress: bool = True) -> MiMoV2Model:
    """Rank `rank`'s shard of the checkpoint at `path` (config `cfg`: loader.checkpoint_config(path)), reading
    only its part; the progress bar shows on rank 0 only."""
    model = skeleton(cfg, layout, rank, comm, dtype, device)
    load_weights(model, path, ShardSelection(cfg, layout, rank), progress=progress and rank == 0)
    return model
