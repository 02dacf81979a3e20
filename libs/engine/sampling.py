"""Token sampling over a batch of logits rows, one SamplingParams per row.

Rows that ask for it first get their logits processed (logit_bias, presence / frequency / repetition
penalties: `adjust_logits`, vectorised over those rows only) and a grammar's token bitmask (the rows of
constrained sequences only); every other row is left untouched, so a batch without them costs what it did.
Greedy rows then take the argmax. Other rows apply temperature, then min-p, top-k and top-p (nucleus)
filtering in one vectorised pass, and draw with the row's own `torch.Generator` so a seeded
request is reproducible whatever else shares its batch. Logprobs are those of the model's raw
distribution (before processing, masks, temperature / filtering), as OpenAI-style APIs report them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

from libs.engine.request import SamplingParams, TokenLogprob


@dataclass(frozen=True)
class History:
    """A row's tokens, for penalties: token_ids = prompt (the first num_prompt) + output."""

    token_ids: Sequence[int]
    num_prompt: int


@dataclass(frozen=True)
class TokenMask:
    """A grammar's token bitmask (xgrammar layout: int32 words, bit i of a row = token i allowed) and the
    logits rows it applies to (other rows of the mask are ignored)."""

    bitmask: torch.Tensor
    rows: list[int]


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded deterministically (draws happen on CPU so results match across devices)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return gen


# what a seeded request's draw is for (draw_seed's salt): the token itself, an MTP draft, an MTP verification
DRAW_TOKEN, DRAW_DRAFT, DRAW_VERIFY = 0, 1, 2
DRAW_HASH_SEED = 0x5EED  # draw_seed's xxhash seed (fixed: seeded outputs are reproducible across processes)


def draw_seed(seed: int, position: int, salt: int = DRAW_TOKEN) -> int:
    """The seed of a seeded request's draw for the token at `position` (its index in prompt + output): the draw
    depends on (seed, position, logits) only, so a request that resumes elsewhere (a migrated stream, a
    disaggregated decode) or after a preemption draws what it would have drawn in one run (xxhash, fixed)."""
    return xxhash.xxh64_intdigest(f"{int(seed)}:{position}:{salt}".encode(), seed=DRAW_HASH_SEED)


def _padded(seqs: Sequence[Sequence[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max((len(t) for t in seqs), default=0))
    flat: list[int] = []
    for t in seqs:
        flat += t
        flat += [pad] * (width - len(t))
    return torch.tensor(flat, dtype=torch.int64, device=device).view(len(seqs), width)


def token_counts(seqs: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """[len(seqs), vocab] float: how often each token occurs in each sequence (one scatter_add)."""
    idx = _padded(seqs, vocab, device)  # padding counts into an extra column, dropped below
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    return counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=counts.dtype))[:, :vocab]


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  histories: Sequence[History | None]) -> torch.Tensor:
    """Logits after logit_bias and presence / frequency / repetition penalties of the rows that ask for them
    (see SamplingParams for the formulas); the same tensor, unchanged, when no row does, else a copy."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not rows:
        return logits
    out = logits.clone()
    vocab, dev = logits.shape[1], logits.device
    for i in rows:
        if params[i].logit_bias:
            ids, bias = zip(*params[i].logit_bias, strict=True)
            out[i, list(ids)] += torch.tensor(bias, device=dev)
    _penalize(out, [i for i in rows if params[i].penalized], params, histories, vocab)
    return out


def _penalize(out: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
              histories: Sequence[History | None], vocab: int) -> None:
    if not rows:
        return
    dev = out.device
    hist = [histories[i] for i in rows]
    if any(h is None for h in hist):
        raise ValueError("penalties need each penalized row's History")
    idx = torch.tensor(rows, device=dev)
    sub = out[idx]
    outputs = [h.token_ids[h.num_prompt:] for h in hist]  # type: ignore[union-attr]
    counts = token_counts(outputs, vocab, dev)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=dev).unsqueeze(1)
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=dev).unsqueeze(1)
    sub -= freq * counts + pres * (counts > 0)
    rep_rows = [j for j, i in enumerate(rows) if params[i].repetition_penalty != 1.0]
    if rep_rows:
        seen = token_counts([hist[j].token_ids for j in rep_rows], vocab, dev) > 0  # type: ignore[union-attr]
        rp = torch.tensor([params[rows[j]].repetition_penalty for j in rep_rows], device=dev).unsqueeze(1)
        part = sub[rep_rows]
        sub[rep_rows] = torch.where(seen, torch.where(part > 0, part / rp, part * rp), part)
    out[idx] = sub


def apply_mask(logits: torch.Tensor, mask: TokenMask) -> None:
    """Set the disallowed tokens of mask.rows to -inf, in place (xgrammar's kernel; other rows untouched)."""
    if mask.rows:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, mask.bitmask, indices=mask.rows)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Return temperature-scaled logits with everything outside min-p / top-k / top-p set to -inf.

    logits [B, V] float32; temperature [B] (> 0); top_k [B] int (0 = off); top_p [B] in (0, 1];
    min_p [B] in [0, 1] (0 = off): tokens whose probability is below min_p x the top token's are dropped.
    """
    scaled = logits / temperature.unsqueeze(1)
    if min_p is not None and bool((min_p > 0).any()):
        probs = scaled.softmax(dim=-1)
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
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


def token_logprobs(logits: torch.Tensor, chosen: Sequence[int],
                   params: Sequence[SamplingParams]) -> list[TokenLogprob | None]:
    """Each row's logprob entry for its chosen token (None where the row's params ask for none): the logprob
    and the top-k of the raw distribution of `logits` (before processing, masks, temperature / filtering)."""
    if all(p.logprobs is None for p in params):
        return [None] * len(params)
    return _logprob_entries(logits.float().log_softmax(dim=-1), chosen, params)


def _logprob_entries(logprobs: torch.Tensor, chosen: Sequence[int],
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


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
           histories: Sequence[History | None] | None = None, mask: TokenMask | None = None) -> SampleResult:
    """Sample one token per row. logits [B, V] float32; one params and one generator per row; `histories`
    (one per row, None where unused) for rows with penalties; `mask` for grammar-constrained rows."""
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"sample(): {logits.shape[0]} logits rows, {len(params)} params, "
                         f"{len(generators)} generators; all three must match")
    raw = logits = logits.float()
    logits = adjust_logits(logits, params, histories or [None] * len(params))
    if mask is not None and mask.rows:
        logits = logits.clone() if logits is raw else logits
        apply_mask(logits, mask)
    chosen = logits.argmax(dim=-1).tolist()  # all-greedy batches stop here: one argmax, one transfer
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        idx = torch.tensor(random_rows, device=logits.device)
        sub = [params[i] for i in random_rows]
        temp = torch.tensor([p.temperature for p in sub], device=logits.device)
        top_k = torch.tensor([p.top_k for p in sub], device=logits.device)
        top_p = torch.tensor([p.top_p for p in sub], device=logits.device)
        min_p = torch.tensor([p.min_p for p in sub], device=logits.device)
        probs = filter_logits(logits[idx], temp, top_k, top_p, min_p).softmax(dim=-1).cpu()
        for j, row in enumerate(random_rows):
            chosen[row] = int(torch.multinomial(probs[j], 1, generator=generators[row]))
    return SampleResult(chosen, token_logprobs(raw, chosen, params))
