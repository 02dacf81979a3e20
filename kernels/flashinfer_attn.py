"""flashinfer path for paged attention (CUDA only; imported lazily).

flashinfer's paged prefill kernel handles ragged q, paged K/V, asymmetric q/k vs v head dims and
``window_left``. Sinks are applied afterwards from the returned log-sum-exp: with a sink logit ``s`` per head,
softmax over ``[scores, s]`` rescales the sink-free output by ``exp(lse) / (exp(lse) + exp(s))``, i.e.
``sigmoid(lse - s)``. flashinfer reports lse in base 2, hence the ``ln 2`` factor.

Not exercised on CPU; ``tests/test_kernels.py`` has GPU-marked tests comparing it with the torch reference.
"""

from __future__ import annotations

import math

import torch

from kernels.attn_plan import AttnPlan

_WORKSPACE: dict[torch.device, torch.Tensor] = {}


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACE:
        _WORKSPACE[device] = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    return _WORKSPACE[device]


def _csr_pages(plan: AttnPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer CSR page lists. Pages left of the window are dropped from the list; flashinfer then sees
    a shorter sequence, so positions are re-based — that is why the caller passes window_left and the kernel
    counts the window from the end of the (shortened) key list, which stays correct."""
    ps = plan.page_size
    indptr, indices, last_len = [0], [], []
    for b, kv_len in enumerate(plan.kv_lens):
        n_pages = -(-kv_len // ps)
        first = 0
        if plan.window_left >= 0:
            first_q = kv_len - plan.q_lens[b]
            first = max(0, first_q - plan.window_left) // ps
        row = plan.page_table[b, first:n_pages]
        indices.append(row)
        indptr.append(indptr[-1] + row.numel())
        last_len.append(kv_len - (n_pages - 1) * ps)
    dev = plan.page_table.device
    return (torch.tensor(indptr, dtype=torch.int32, device=dev), torch.cat(indices).to(torch.int32),
            torch.tensor(last_len, dtype=torch.int32, device=dev))


def paged_attention_flashinfer(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: AttnPlan,
                               scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    import flashinfer

    qo_indptr = torch.tensor([0, *torch.tensor(plan.q_lens).cumsum(0).tolist()], dtype=torch.int32,
                             device=q.device)
    kv_indptr, kv_indices, last_len = _csr_pages(plan)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(q.device), "NHD")
    wrapper.plan(
        qo_indptr, kv_indptr, kv_indices, last_len,
        num_qo_heads=q.shape[1], num_kv_heads=k_pool.shape[2], head_dim_qk=q.shape[2],
        page_size=plan.page_size, head_dim_vo=v_pool.shape[-1], causal=True,
        window_left=plan.window_left, sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_pool.dtype,
    )
    out, lse = wrapper.run(q, (k_pool, v_pool), return_lse=True)
    if sinks is not None:
        gate = torch.sigmoid(lse.float() * math.log(2.0) - sinks.float()[None, :])
        out = (out.float() * gate[..., None]).to(q.dtype)
    return out
