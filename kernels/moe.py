"""Sigmoid-routed top-k MoE (DeepSeek-V3 / MiMo-V2 style) with a grouped expert pass.

Routing: ``scores = sigmoid(x @ Wg^T)``; experts are *chosen* on ``scores + correction_bias`` (optionally
restricted to the best ``topk_group`` of ``n_group`` groups), but *weighted* by the plain scores,
renormalised over the chosen k and multiplied by ``routed_scaling_factor``.

Expert pass, three shapes with the same result (up to fp32 rounding): dense (every expert on every token, a
few ops whatever ``E`` is: for small batches), grouped (pairs sorted by expert, one ``grouped_mm`` per
projection, only the chosen experts' weights read) and segmented (a loop over active experts, for dtypes
``grouped_mm`` has no CPU kernel for). :func:`grouped_moe` picks dense only under
:data:`DENSE_MOE_MAX_WEIGHT_BYTES` and :data:`DENSE_MOE_MAX_MACS`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Dense expert pass while T * E * 3 * I * H (its multiply-adds) stays below this: ~1 ms of matmul on one CPU
# core, about what the segmented pass spends in per-expert op overhead for a handful of experts.
DENSE_MOE_MAX_MACS = 1 << 22
# ... and while every expert's weights together stay this small: past it the dense pass is bound by reading all
# E experts where the grouped pass reads the chosen ones (measured: E=16, H=256, I=128, one token: 213 us dense
# vs 138 us grouped; E=8, H=64, I=32: 37 us dense vs 92 us grouped).
DENSE_MOE_MAX_WEIGHT_BYTES = 1 << 20
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    """SwiGLU experts. x ``[T, H]``; gate_up ``[E, 2I, H]`` (gate rows first); down ``[E, H, I]``;
    weights/ids ``[T, k]`` from :func:`sigmoid_topk_route`. Returns ``[T, H]`` in x's dtype."""
    e, two_i, h = gate_up.shape
    small = (gate_up.numel() + down.numel()) * gate_up.element_size() <= DENSE_MOE_MAX_WEIGHT_BYTES
    if small and x.shape[0] * e * h * two_i * 3 // 2 <= DENSE_MOE_MAX_MACS:
        return dense_moe(x, weights, ids, gate_up, down)
    if x.dtype in _GROUPED_DTYPES and x.dtype == gate_up.dtype == down.dtype:
        return grouped_mm_moe(x, weights, ids, gate_up, down)
    return segmented_moe(x, weights, ids, gate_up, down)


def _sorted_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order of the token-expert pairs sorted by expert, the token of each sorted pair, pairs per expert)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, order // ids.shape[1], torch.bincount(flat, minlength=num_experts)


def grouped_mm_moe(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Token-expert pairs sorted by expert, each projection one grouped matmul (see module docstring)."""
    order, token_of, counts = _sorted_pairs(ids, gate_up.shape[0])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x.index_select(0, token_of)
    gate, up = F.grouped_mm(xs, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(gate).mul_(up), down.transpose(1, 2), offs=offs)
    y.mul_(weights.reshape(-1)[order].to(x.dtype)[:, None])
    return torch.zeros_like(x).index_add_(0, token_of, y)


def dense_moe(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Every expert on every token, weighted by a dense routing matrix (see module docstring)."""
    dense_w = torch.zeros(x.shape[0], gate_up.shape[0], dtype=x.dtype, device=x.device)
    dense_w.scatter_add_(1, ids, weights.to(x.dtype))  # add: a rank's ep share may repeat a (zero-weight) id
    gate, up = torch.matmul(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, T, I] each
    y = torch.matmul(F.silu(gate).mul_(up), down.transpose(1, 2))  # [E, T, H]
    return y.mul_(dense_w.t().unsqueeze(-1)).sum(0)


def segmented_moe(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Token-expert pairs sorted by expert, one matmul pair per active expert, one index_add_."""
    order, token_of, counts_t = _sorted_pairs(ids, gate_up.shape[0])
    counts = counts_t.tolist()
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
