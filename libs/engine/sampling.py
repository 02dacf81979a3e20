"""Token sampling over a batch of logits rows, one SamplingParams per row.

Greedy rows take the argmax. Other rows apply temperature, then top-k, then top-p (nucleus)
filtering in one vectorised pass, and draw with the row's own `torch.Generator` so a seeded
request is reproducible whatever else shares its batch. Logprobs are those of the model's raw
distribution (before temperature / filtering), as OpenAI-style APIs report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from libs.engine.request import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded deterministically (draws happen on CPU so results match across devices)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor) -> torch.Tensor:
    """Return temperature-scaled logits with everything outside top-k / top-p set to -inf.

    logits [B, V] float32; temperature [B] (> 0); top_k [B] int (0 = off); top_p [B] in (0, 1].
    """
    scaled = logits / temperature.unsqueeze(1)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    ranks = torch.arange(vocab, device=scaled.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token when the mass strictly before it is < top_p: the top token always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)


def _logprob_entries(logprobs: torch.Tensor, chosen: list[int],
                     params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return [None] * len(params)
    kmax = max(w or 0 for w in want)
    top_vals, top_ids = logprobs.topk(kmax, dim=-1) if kmax > 0 else (None, None)
    out: list[TokenLogprob | None] = []
    for row, (tok, k) in enumerate(zip(chosen, want, strict=True)):
        if k is None:
            out.append(None)
            continue
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            assert top_vals is not None and top_ids is not None
            top = tuple(zip(top_ids[row, :k].tolist(), top_vals[row, :k].tolist(), strict=True))
        out.append(TokenLogprob(tok, float(logprobs[row, tok]), top))
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator]) -> SampleResult:
    """Sample one token per row. logits [B, V] float32; one params and one generator per row."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"sample(): {logits.shape[0]} logits rows, {len(params)} params, "
                         f"{len(generators)} generators; all three must match")
    logits = logits.float()
    chosen = logits.argmax(dim=-1).tolist()  # all-greedy batches stop here: one argmax, one transfer
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        sub = [params[i] for i in random_rows]
        temp = torch.tensor([p.temperature for p in sub], device=logits.device)
        top_k = torch.tensor([p.top_k for p in sub], device=logits.device)
        top_p = torch.tensor([p.top_p for p in sub], device=logits.device)
        probs = filter_logits(logits[idx], temp, top_k, top_p).softmax(dim=-1).cpu()
        for j, row in enumerate(random_rows):
            chosen[row] = int(torch.multinomial(probs[j], 1, generator=generators[row]))
    if all(p.logprobs is None for p in params):
        return SampleResult(chosen, [None] * len(params))
    return SampleResult(chosen, _logprob_entries(logits.log_softmax(dim=-1), chosen, params))
