"""Building one rank's shard: from a full in-memory model (the shards' state dicts) on rank 0's side, and the
model itself on the rank's side (a meta-device skeleton sharded, then filled from the state dict)."""

from __future__ import annotations

import torch

from libs.engine.parallel.comm import Comm
from libs.engine.parallel.layout import ParallelLayout
from libs.engine.parallel.shard import shard_model_
from libs.model.config import ModelConfig
from libs.model.layers import rope_inv_freq
from libs.model.loader import set_dtype
from libs.model.model import MiMoV2Model


def skeleton(cfg: ModelConfig, layout: ParallelLayout, rank: int, comm: Comm | None, dtype: torch.dtype,
             device: str | torch.device) -> MiMoV2Model:
    """Rank `rank`'s shard of `cfg` with uninitialised weights on `device` (all-reduce hooks bound to `comm`)."""
    with torch.device("meta"):
        model = shard_model_(MiMoV2Model(cfg), layout, rank, comm)
    model.to_empty(device=device)
    model.inv_freq_full = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta_full).to(device)
    model.inv_freq_swa = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta_swa).to(device)
    return set_dtype(model, dtype).eval()


def shard_state(model: MiMoV2Model, layout: ParallelLayout, rank: int) -> dict[str, torch.Tensor]:
    """The state dict of rank `rank`'s shard of a full model (the model itself is left untouched)."""
    cfg = model.cfg
    with torch.device("meta"):
        shape_of = MiMoV2Model(cfg)
    shape_of.load_state_dict(model.state_dict(), assign=True)  # shares the full model's tensors, no copy
    return {k: v.detach().clone() for k, v in shard_model_(shape_of, layout, rank, None).state_dict().items()}


def build_shard(state: dict[str, torch.Tensor], cfg: ModelConfig, layout: ParallelLayout, rank: int,
                comm: Comm | None, dtype: torch.dtype, device: str | torch.device) -> MiMoV2Model:
    model = skeleton(cfg, layout, rank, comm, dtype, device)
    model.load_state_dict(state, strict=True)
    return model
