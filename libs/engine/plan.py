"""The scheduler's output: what one step computes (pure data, no tensors)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class ScheduledSeq(NamedTuple):
    """One sequence's share of a step.

    token_ids are the `num_new` tokens whose KV this step writes, at positions
    [start, start + num_new). `sample` is True when this chunk completes the sequence, so the
    step produces its next token. Page tables are the cache's, after reserve() for this step.
    (A NamedTuple: immutable like a frozen dataclass, and ~5x cheaper to build, once per sequence per step.)
    """

    req_id: str
    start: int
    token_ids: tuple[int, ...]
    is_prefill: bool
    sample: bool
    full_pages: Sequence[int]  # (lists straight from the cache: never mutated after scheduling)
    swa_pages: Sequence[int]
    # SWA window rebuild (0, 0 = none): full-attention K/V below full_from is cached, not written, and
    # SWA layers read no key left of swa_from (see docs/engine.md)
    full_from: int = 0
    swa_from: int = 0
    # MTP speculative decoding: the last `num_draft` of token_ids are draft tokens to verify (their KV is
    # written at the positions after the sequence's last token; the rejected ones are rolled back by update)
    num_draft: int = 0

    @property
    def num_new(self) -> int:
        return len(self.token_ids)

    @property
    def kv_len(self) -> int:
        return self.start + self.num_new


@dataclass(frozen=True)
class BatchPlan:
    """Ordered work for one step.

    The runner executes `backup_copies` (device -> host) first, then `load_copies` (host ->
    device, layer by layer, overlapped with the forward), then the forward over `seqs`.
    The order matters: a page backed up in this plan may be reused as a load destination or
    for new KV in the same plan. PageCopy objects come from libs.kvcache.
    """

    seqs: tuple[ScheduledSeq, ...] = ()
    load_copies: tuple[Any, ...] = ()
    backup_copies: tuple[Any, ...] = ()
    preempted: tuple[str, ...] = field(default=())
    num_tokens: int = -1  # new tokens over `seqs` (filled in when omitted)
    attn_pairs: int = 0  # sum of num_new * kv_len over `seqs` (the step cost model's input)
    num_prefill_seqs: int = 0  # chunks of more than one token among `seqs` (the step cost model's input)
    interruptible: bool = False  # carries longer-bucket prefill: may stop at a layer boundary (see EngineCore)

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            object.__setattr__(self, "num_tokens", sum(s.num_new for s in self.seqs))

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.backup_copies and not self.load_copies
