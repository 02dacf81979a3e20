"""Greedy generation for one sequence through the paged path (debug CLI, tests, benchmark).

Pages are assigned identically in both pools (logical page j -> physical page j); the real engine does its
own allocation. This helper exists so the model can be exercised end to end without the engine.
"""

from __future__ import annotations

import torch

from libs.model.model import MiMoV2Model
from libs.model.paged import BatchMeta, KVPools


def greedy_generate(model: MiMoV2Model, prompt_ids: list[int], max_new_tokens: int, page_size: int = 16,
                    eos_token_ids: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
    """Return (generated token ids, their log-probabilities). Stops early at an EOS id."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    cfg = model.cfg
    total = len(prompt_ids) + max_new_tokens
    n_pages = -(-total // page_size)
    device = model.lm_head.weight.device
    kv = KVPools.allocate(cfg, n_pages, n_pages, page_size, model.dtype, device)
    pages = [list(range(n_pages))]
    ids, logps = [], []
    step_ids = torch.tensor(prompt_ids, device=device)
    kv_len = len(prompt_ids)
    for _ in range(max_new_tokens):
        meta = BatchMeta.build([step_ids.numel()], [kv_len], pages, device=device)
        logprobs = torch.log_softmax(model(step_ids, meta, kv)[-1], dim=-1)
        nxt = int(logprobs.argmax())
        ids.append(nxt)
        logps.append(float(logprobs[nxt]))
        if nxt in eos_token_ids:
            break
        step_ids = torch.tensor([nxt], device=device)
        kv_len += 1
    return ids, logps
