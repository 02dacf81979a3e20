"""MTP speculative decoding: draft with the model's MTP layers, verify in one target forward, accept exactly.

MTP block j at position i reads token i+1+j and the previous stage's hidden state at i and predicts token
i+2+j; its K/V lives in SWA-pool layer ``n_swa + j``, so pages, admission, eviction, L2 copies and KV
shipping cover the draft layers unchanged. The last k - 1 target hidden states of every sequence are kept
(`HiddenRing`) because the rows that read drafts are provisional and recomputed next step. The next decode
step verifies the last token and its k drafts in one forward; greedy acceptance (`greedy_accept`) makes
outputs equal to decoding without MTP, token for token. Scheme: docs/mtp.md, "The scheme".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from libs.engine.sampling import History, adjust_logits
from libs.mm.placeholders import model_token_ids
from libs.model.layers import AttnContext
from libs.model.paged import BatchMeta, KVPools


def check_draft_layers(speculative_tokens: int, model_config) -> int:
    """Validate `speculative_tokens` against the model: the draft steps (and draft KV layers) of a pass. Up
    to the model's MTP layers each step has its own block; beyond them the last block is reused, chained
    (`MiMoV2Model.forward_mtp`), each step with its own KV layer. A model without MTP layers cannot draft."""
    have = getattr(model_config, "num_mtp_layers", 0)
    if speculative_tokens > 0 and have == 0:
        raise ValueError(f"speculative_tokens={speculative_tokens} but the model has no MTP layers")
    return speculative_tokens


def draft_view(kv: KVPools, n_swa: int) -> KVPools:
    """The MTP blocks' KV: the SWA pool layers after the model's own (views, no copy; with an arena the same
    buffers, its SWA layers counted from `n_swa`)."""
    return KVPools(kv.page_size, kv.full_k[:0], kv.full_v[:0], kv.swa_k[n_swa:], kv.swa_v[n_swa:], kv.arena,
                   kv.swa_offset + n_swa if kv.arena is not None else 0)


def drafts_for(params) -> bool:
    """Requests that draft: greedy ones (exact acceptance) and sampled ones (rejection sampling over temperature /
    top-k / top-p / min-p), with or without logit bias and presence / frequency / repetition penalties (each
    verified row is processed as if the drafts before it had been emitted: `as_if_emitted`), with or without
    logprobs (each emitted token's entry is the target's raw distribution at its verified row) and with or
    without a grammar (each verified row masked by the grammar's state after the drafts before it; a draft the
    grammar refuses ends acceptance: `GrammarBook.verify_bitmask`)."""
    return True


def as_if_emitted(logits: torch.Tensor, params, token_ids: Sequence[int], num_prompt: int,
                  drafts: Sequence[int]) -> torch.Tensor:
    """One sequence's rows ``[len(drafts) + 1, V]`` (at its last token, then at each draft) after its logit
    processing (logit bias, penalties), row i as the step without speculation would process it after
    ``token_ids + drafts[:i]`` had been emitted one by one: its penalties count the drafts before it."""
    if not params.adjusts_logits:
        return logits
    n = logits.shape[0]
    hist = [History([*token_ids, *drafts[:i]], num_prompt) if params.penalized else None for i in range(n)]
    return adjust_logits(logits, [params] * n, hist)


def rejection_accept(p: torch.Tensor, q: torch.Tensor, drafts: Sequence[int],
                     gen: torch.Generator) -> tuple[tuple[int, ...], int]:
    """Speculative rejection sampling (Leviathan et al. / Chen et al.): target distributions ``p [n + 1, V]`` at
    the last token and each draft, draft distributions ``q [n, V]`` the drafts were drawn from. Draft i is kept
    with probability min(1, p_i(d) / q_i(d)); the first rejected one is replaced by a draw from the residual
    max(0, p_i - q_i) (normalised), and if all are kept a bonus token is drawn from p_n. Every emitted token is
    then distributed exactly as the target's (CPU tensors; draws from `gen`)."""
    for i, d in enumerate(drafts):
        u = float(torch.rand((), generator=gen))
        if u * float(q[i, d]) < float(p[i, d]):
            continue
        resid = (p[i] - q[i]).clamp_min_(0.0)
        total = float(resid.sum())
        row = resid / total if total > 0 else p[i]
        return tuple(drafts[:i]), int(torch.multinomial(row, 1, generator=gen))
    return tuple(drafts), int(torch.multinomial(p[len(drafts)], 1, generator=gen))


def greedy_accept(argmax: Sequence[int], drafts: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """argmax of the target at the sequence's last token and each draft (len(drafts) + 1 rows) -> (accepted
    drafts, the token after them). Exact: every emitted token is the target's argmax given the ones before."""
    m = 0
    while m < len(drafts) and drafts[m] == argmax[m]:
        m += 1
    return tuple(drafts[:m]), int(argmax[m])


@dataclass(frozen=True)
class DraftSpan:
    """One sequence's share of a drafting pass (pure data, for the chain below)."""

    req_id: str
    lo: int  # first position the blocks (re)compute
    hi: int  # last committed position (its target hidden is the newest)
    tokens: Sequence[int]  # the sequence's tokens (verified)
    swa_pages: Sequence[int]  # its SWA page table after the commit
    kv_start: int  # first position whose SWA page is still held (keys left of it are not read)
    drafting: bool  # produce drafts (a decoding sequence); else only fill the blocks' KV (prefill chunk)

    def block_end(self, j: int) -> int:
        """Last position block j can compute: it needs token i+1+j, a draft past the verified tokens."""
        return self.hi if self.drafting else min(self.hi, len(self.tokens) - 2 - j)


def block_inputs(span: DraftSpan, j: int, drafts: Sequence[int]) -> list[int]:
    """Token ids block j reads at positions [lo, block_end(j)]: token i+1+j, from the drafts past the end."""
    n = len(span.tokens)
    return [span.tokens[x] if x < n else drafts[x - n] for x in range(span.lo + 1 + j, span.block_end(j) + 2 + j)]


class HiddenRing:
    """The newest target hidden states of each sequence (the last `keep` committed positions): block j > 0
    recomputes the positions whose inputs were drafts, which needs the target hidden there."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._rows: dict[str, tuple[int, torch.Tensor]] = {}  # req id -> (first position, rows)

    def span(self, req_id: str, start: int, rows: torch.Tensor, floor: int) -> tuple[int, torch.Tensor]:
        """Hidden states of positions [lo, start + len(rows)) with lo as far back as the ring allows (>= floor,
        >= start - keep); stores the newest `keep` of them. Positions are of verified tokens, so a ring left
        from an earlier admission of the same request is still right where it is contiguous."""
        lo, h = start, rows
        old = self._rows.get(req_id)
        if old is not None and old[0] + old[1].shape[0] == start:
            back = max(floor, start - self.keep, old[0])
            if back < start:
                lo, h = back, torch.cat([old[1][back - old[0]:], rows])
        end = lo + h.shape[0]
        if self.keep:
            first = max(lo, end - self.keep)
            self._rows[req_id] = (first, h[first - lo:])
        if lo < floor:  # e.g. a long prefill chunk whose first pages already left the window
            lo, h = min(floor, end), h[min(floor, end) - lo:]
        return lo, h

    def get(self, req_id: str) -> tuple[int, torch.Tensor] | None:
        """(first position, rows) kept for `req_id`, if any."""
        return self._rows.get(req_id)

    def put(self, req_id: str, first: int, rows: torch.Tensor) -> None:
        """Keep `rows` (positions [first, first + len(rows)), at most `keep`) as `req_id`'s newest hidden
        states: another engine's (a prefill worker's, shipped with its first drafts)."""
        if not 0 < rows.shape[0] <= self.keep:
            raise ValueError(f"{rows.shape[0]} hidden rows for a ring that keeps {self.keep}")
        self._rows[req_id] = (first, rows)

    def forget(self, req_id: str) -> None:
        self._rows.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._rows)


@dataclass(frozen=True)
class FirstDrafts:
    """MTP in prefill across a disaggregated hand-off: a prefill-only request's drafts after its first token,
    and the target hidden states of its last prompt positions (`HiddenRing`) that the decode engine's first
    drafting pass recomputes the provisional rows from. With both, the decode engine's first step verifies
    the drafts and its drafting passes equal a colocated engine's."""

    drafts: tuple[int, ...]
    hidden_from: int  # position of hidden's first row (hidden ends at the prompt's last position)
    hidden: torch.Tensor | None  # [rows, hidden_size] on the CPU; None when k = 1 (the ring keeps nothing)


# (drafting req ids, their logits rows, each one's drafts so far) -> the next draft token of each
Choose = Callable[[list[str], torch.Tensor, list[list[int]]], list[int]]


def argmax_choose(_req_ids: list[str], logits: torch.Tensor, _drafts: list[list[int]]) -> list[int]:
    return logits.argmax(dim=-1).tolist()


@torch.inference_mode()
def run_chain(model, spans: Sequence[DraftSpan], hidden: Sequence[torch.Tensor], kv_mtp: KVPools,
              num_blocks: int, pad_id: int, device, choose: Choose = argmax_choose) -> dict[str, list[int]]:
    """Run MTP blocks 0..num_blocks-1 over the spans (one batched forward per block): writes each block's KV
    and returns the drafts of the drafting spans, picked by `choose` from each block's logits at their last
    position (greedy: argmax). `hidden[b]`: target hidden of span b's [lo, hi].

    Blocks over the same rows (every block of a decode step: a drafting span's rows do not shrink) share one
    batch description and one attention plan, and each takes the one before's hidden states as they are."""
    drafts: dict[str, list[int]] = {s.req_id: [] for s in spans if s.drafting}
    prev = list(hidden)
    live = list(range(len(spans)))
    shape: tuple[list[int], list[int]] = ([], [])  # (live spans, rows of each) that `meta` describes
    meta: BatchMeta | None = None
    contexts: dict[int, AttnContext] = {}  # attention plans of `meta`, by page-table row
    h = torch.empty(0)
    for j in range(num_blocks):
        live = [b for b in live if spans[b].block_end(j) >= spans[b].lo]
        if not live:
            break
        q_lens = [spans[b].block_end(j) - spans[b].lo + 1 for b in live]
        if meta is None or (live, q_lens) != shape:
            meta = _chain_meta(spans, live, q_lens, kv_mtp, device)
            contexts = model.mtp_contexts(meta, kv_mtp, range(j, num_blocks))  # one plan, each block's row
            h_in = torch.cat([prev[b][:n] for b, n in zip(live, q_lens, strict=True)])
        else:  # same rows as the block before: its output is this block's input as is
            h_in = h
        shape = (live, q_lens)
        ids = [x for b in live for x in block_inputs(spans[b], j, drafts.get(spans[b].req_id, ()))]
        tok = model_token_ids(torch.tensor(ids, dtype=torch.int64, device=device), pad_id)
        logits, h = model.forward_mtp(j, tok, h_in, meta, kv_mtp, contexts)
        offs = 0
        for b, n in zip(live, q_lens, strict=True):
            prev[b] = h[offs:offs + n]
            offs += n
        drafting = [spans[b].req_id for b in live if spans[b].drafting]
        chosen = choose(drafting, logits, [drafts[r] for r in drafting]) if drafting else ()
        for req_id, d in zip(drafting, chosen, strict=True):
            drafts[req_id].append(int(d))
    return drafts


def _chain_meta(spans: Sequence[DraftSpan], live: list[int], q_lens: list[int], kv_mtp: KVPools,
                device) -> BatchMeta:
    """The batch of one block over spans `live` (rows [lo, lo + q_len) each), logits only at the last row of
    the drafting spans (the others fill KV; their logits would be thrown away)."""
    kv_lens = [spans[b].lo + n for b, n in zip(live, q_lens, strict=True)]
    meta = BatchMeta.build(q_lens, kv_lens, [list(spans[b].swa_pages) for b in live], device=device, kv=kv_mtp)
    meta.swa_kv_start = [spans[b].kv_start for b in live]
    last, ends = 0, []
    for b, n in zip(live, q_lens, strict=True):
        last += n
        if spans[b].drafting:
            ends.append(last - 1)
    meta.logits_indices = torch.tensor(ends, dtype=torch.int64, device=device)
    return meta


def kv_start_of(swa_pages: Sequence[int], hi: int, page_size: int) -> int:
    """First position of the run of held SWA pages that ends at position hi's page."""
    j = hi // page_size
    while j > 0 and swa_pages[j - 1] >= 0:
        j -= 1
    return j * page_size
