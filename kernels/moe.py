"""Sigmoid-routed top-k MoE (DeepSeek-V3 / MiMo-V2 style) with a grouped expert pass.

Routing: ``scores = sigmoid(x @ Wg^T)``; experts are *chosen* on ``scores + correction_bias`` (optionally
restricted to the best ``topk_group`` of ``n_group`` groups), but *weighted* by the plain scores,
renormalised over the chosen k and multiplied by ``routed_scaling_factor``.

Expert pass: token-expert pairs are sorted by expert so each expert runs one matmul over a contiguous slice
(a loop over experts, never over tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid_topk_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(weights [T, k] float32, expert ids [T, k] int64)``."""
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def grouped_moe(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """SwiGLU experts. x ``[T, H]``; gate_up ``[E, 2I, H]`` (gate rows first); down ``[E, H, I]``."""
    t, k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // k
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    xs = x.index_select(0, token_of)
    out_sorted = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        seg = xs[start:start + n]
        gate, up = F.linear(seg, gate_up[e]).chunk(2, dim=-1)
        out_sorted[start:start + n] = F.linear(F.silu(gate) * up, down[e])
        start += n
    w = weights.reshape(-1)[order].to(x.dtype)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, out_sorted * w[:, None])
    return out
