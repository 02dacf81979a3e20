"""Turn a full MiMoV2Model into one rank's shard, in place: attention and dense MLPs split over tp (their
outputs summed by an all-reduce), MoE experts split over ep (or their intermediate dim over tp), embeddings,
norms, the router and lm_head replicated. Parameter names stay the checkpoint's, so a shard can also be
loaded directly (libs/engine/parallel/load.py).

The MoE router (sigmoid scores + correction bias, top-k) runs on every rank over the same replicated input, so
every rank picks the same experts; a rank computes its own experts' share and the all-reduce combines them.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import grouped_moe, sigmoid_topk_route
from libs.engine.parallel.comm import Comm
from libs.engine.parallel.layout import ParallelLayout
from libs.model.config import ModelConfig
from libs.model.layers import MLP, Attention, DecoderLayer, Experts, MoE, MoEGate
from libs.model.model import MiMoV2Model


def _rows(t: torch.Tensor, groups: range, size: int) -> torch.Tensor:
    """Rows of `groups` (each `size` rows long) of a [rows, ...] weight, as a new contiguous tensor."""
    return t[groups.start * size: groups.stop * size].clone()


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


class AllReduceOutput:
    """A forward hook summing a module's output over the ranks (row-parallel projections, expert shares)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def __call__(self, _module, _args, out: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(out.contiguous())


def shard_attention(full: Attention, cfg: ModelConfig, layout: ParallelLayout, rank: int) -> Attention:
    local = Attention(layout.local_config(cfg), full.is_swa).to(full.q_proj.weight.dtype)
    q, kv = layout.q_heads(cfg, rank), layout.kv_heads(cfg, rank, full.is_swa)
    with torch.no_grad():
        local.q_proj.weight = _param(_rows(full.q_proj.weight, q, full.qk_dim))
        local.k_proj.weight = _param(_rows(full.k_proj.weight, kv, full.qk_dim))
        local.v_proj.weight = _param(_rows(full.v_proj.weight, kv, full.v_dim))
        o = full.o_proj.weight
        local.o_proj.weight = _param(o[:, q.start * full.v_dim: q.stop * full.v_dim].clone())
        if full.attention_sink_bias is not None:
            local.attention_sink_bias = _param(full.attention_sink_bias[q.start:q.stop].clone())
    return local


def shard_mlp(full: MLP, layout: ParallelLayout, rank: int) -> MLP:
    i = layout.inter(full.gate_proj.weight.shape[0], rank)
    local = MLP(full.gate_proj.weight.shape[1], len(i)).to(full.gate_proj.weight.dtype)
    with torch.no_grad():
        local.gate_proj.weight = _param(full.gate_proj.weight[i.start:i.stop].clone())
        local.up_proj.weight = _param(full.up_proj.weight[i.start:i.stop].clone())
        local.down_proj.weight = _param(full.down_proj.weight[:, i.start:i.stop].clone())
    return local


class ShardedMoE(MoE):
    """A rank's experts (all of them with a split intermediate dim, or its ep share whole). The output is this
    rank's share of the sum; the all-reduce hook adds the others'."""

    def __init__(self, cfg: ModelConfig, experts: range, inter: range) -> None:
        nn.Module.__init__(self)
        self.cfg = cfg
        self.expert_range = experts
        self.split_experts = len(experts) < cfg.num_experts
        self.gate = MoEGate(cfg)
        self.experts = Experts(cfg.with_(num_experts=len(experts), moe_intermediate_size=len(inter),
                                         n_group=1, topk_group=1, num_experts_per_tok=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        logits = nn.functional.linear(x.float(), self.gate.weight.float())
        w, ids = sigmoid_topk_route(logits, self.gate.e_score_correction_bias, c.num_experts_per_tok,
                                    n_group=c.n_group, topk_group=c.topk_group, renormalize=c.norm_topk_prob,
                                    scaling=c.routed_scaling_factor)
        if self.split_experts:  # other ranks' experts get weight 0 (their ids pointed at a local one)
            lo, n = self.expert_range.start, len(self.expert_range)
            mine = (ids >= lo) & (ids < lo + n)
            w = w * mine
            ids = (ids - lo).clamp_(0, n - 1)
        return grouped_moe(x, w, ids, self.experts.gate_up_proj, self.experts.down_proj)


def shard_moe(full: MoE, cfg: ModelConfig, layout: ParallelLayout, rank: int) -> ShardedMoE:
    experts, inter = layout.experts(cfg, rank), layout.moe_inter(cfg, rank)
    local = ShardedMoE(cfg, experts, inter)
    size = cfg.moe_intermediate_size
    with torch.no_grad():
        local.gate = full.gate
        gu = full.experts.gate_up_proj[experts.start:experts.stop]
        rows = torch.cat([gu[:, inter.start:inter.stop], gu[:, size + inter.start: size + inter.stop]], dim=1)
        local.experts.gate_up_proj = _param(rows)
        local.experts.down_proj = _param(full.experts.down_proj[experts.start:experts.stop, :, inter.start:inter.stop]
                                         .clone())
    return local


def shard_model_(model: MiMoV2Model, layout: ParallelLayout, rank: int, comm: Comm | None) -> MiMoV2Model:
    """Make `model` rank `rank`'s shard (in place) and return it. `comm` None: no all-reduce hooks (for shape
    and byte arithmetic only). The MTP blocks are dropped: speculative decoding is not parallel yet."""
    cfg = model.cfg
    layout.validate(cfg)
    hook = AllReduceOutput(comm) if comm is not None else None
    for module in model.model.layers:
        layer: DecoderLayer = module  # type: ignore[assignment]
        if layout.tp > 1:
            layer.self_attn = shard_attention(layer.self_attn, cfg, layout, rank)
            if hook is not None:
                layer.self_attn.register_forward_hook(hook)
        mlp = layer.mlp
        if isinstance(mlp, MoE):
            layer.mlp = shard_moe(mlp, cfg, layout, rank)
            if hook is not None:
                layer.mlp.register_forward_hook(hook)
        elif layout.tp > 1:
            layer.mlp = shard_mlp(mlp, layout, rank)  # type: ignore[arg-type]
            if hook is not None:
                layer.mlp.register_forward_hook(hook)
    model.model.mtp = None
    return model
