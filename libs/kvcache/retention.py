"""SWA retention policies: which windows of SWA KV a sequence keeps when they slide out of its window.

A running sequence frees SWA pages as they leave the window, except the pages of the checkpoints its policy
names; at finish it inserts those plus the window at its end into the prefix tree. Everything else becomes a
tombstone (full KV only). Policies are pure functions of the request shape, registered by name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from libs.kvcache.types import RebuildStats


class CheckpointKind(enum.IntFlag):
    """Why a checkpoint was kept. The cache counts, per kind, how many checkpoints it stored and how many later
    ended a hit, and evicts the SWA KV of kinds this workload does not reuse first (see docs/kvcache.md)."""

    END = 1  # the end of the sequence (chat: the next turn extends prompt + output)
    TURN = 2  # the prompt end rounded down to the router's hash block
    PROMPT_END = 4  # the last page boundary a repeat of the same prompt can hit (regenerate, n > 1)
    BRANCH = 8  # where the sequence left the cached tree
    PERIODIC = 16  # every `checkpoint_every_pages` pages
    OTHER = 32  # a custom policy's checkpoint without a kind


_TURN, _PROMPT_END, _BRANCH, _PERIODIC, _OTHER = (int(k) for k in (
    CheckpointKind.TURN, CheckpointKind.PROMPT_END, CheckpointKind.BRANCH, CheckpointKind.PERIODIC,
    CheckpointKind.OTHER))
END = int(CheckpointKind.END)
SPECULATIVE = _PERIODIC  # cold until proven reused: inserted at low priority, they only take SWA memory no warm
# checkpoint needs
_KIND_BITS = tuple(int(k) for k in CheckpointKind)
_ALL_KINDS = sum(_KIND_BITS)
_BITS_OF = tuple(tuple(b for b in _KIND_BITS if m & b) for m in range(_ALL_KINDS + 1))  # kinds -> its bits
_REUSED = 1 << 30  # Node.kinds flag: a hit has ended at this checkpoint
_COLD_EVIDENCE = 32  # checkpoints of a kind stored before its hit ratio can call it cold
_COLD_FRACTION = 0.1  # a kind is cold when its hit ratio is below this fraction of the best kind's
_COLD_RECHECK = 8  # counted checkpoints / reuses between re-evaluations of the cold kinds
_STATS_HALF_LIFE = 1024  # stored checkpoints of a kind after which its counts are halved (follow the workload)


@dataclass(frozen=True, slots=True)
class RetentionContext:
    prompt_tokens: int
    max_tokens: int  # prompt + max_new_tokens
    hit_tokens: int  # valid hit L the sequence starts from
    raw_tokens: int  # page-aligned raw token match (where this sequence branches off the cached tree)
    page_size: int
    window: int
    align: int  # turn-boundary checkpoint granularity (tokens, multiple of page_size)
    every_pages: int  # periodic checkpoints (0 = off)


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    keep_all: bool
    checkpoints: tuple[int, ...]  # page-aligned token positions X; pages covering [X - window, X) are kept
    kinds: tuple[int, ...] = ()  # per checkpoint, CheckpointKind bits (missing: OTHER)

    def kind_of(self, i: int) -> int:
        return self.kinds[i] if i < len(self.kinds) else _OTHER


RetentionPolicy = Callable[[RetentionContext], RetentionPlan]


def retain_none(ctx: RetentionContext) -> RetentionPlan:
    """Only the window the sequence holds when it finishes (a plain tombstone cache)."""
    return RetentionPlan(keep_all=False, checkpoints=())


def retain_all(ctx: RetentionContext) -> RetentionPlan:
    """SWA KV for every token (what a single-pool layout stores)."""
    return RetentionPlan(keep_all=True, checkpoints=())


def retain_checkpoints(ctx: RetentionContext) -> RetentionPlan:
    """Windows where reuse is likely, besides the end of the sequence (which every policy keeps):

    - turn boundary: the prompt end rounded down to `align` (the next turn, or a request that shares this
      prompt's whole blocks, resumes there);
    - prompt end: the last page boundary strictly before the prompt's end (a regenerate of the same prompt);
    - branch point: where this sequence leaves the cached tree, when that point is a tombstone (heals it, so the
      next request sharing the same stem hits there);
    - optionally every `every_pages` pages.
    """
    p = ctx.page_size
    points: dict[int, int] = {}  # position -> CheckpointKind bits (plain ints: enum arithmetic is slow)

    def add(x: int, kind: int) -> None:
        if ctx.hit_tokens < x <= ctx.max_tokens:
            points[x] = points.get(x, 0) | kind

    add(ctx.prompt_tokens // ctx.align * ctx.align, _TURN)
    # A match always leaves one token to compute, so a repeat of this exact prompt resumes at the last page
    # boundary strictly before its end: for a page-aligned prompt that is one page before the end.
    add((ctx.prompt_tokens - 1) // p * p, _PROMPT_END)
    if ctx.raw_tokens > ctx.hit_tokens:
        add(ctx.raw_tokens, _BRANCH)
    if ctx.every_pages:
        step = ctx.every_pages * p
        for x in range(step, ctx.max_tokens + 1, step):
            add(x, _PERIODIC)
    keep = tuple(sorted(points))
    return RetentionPlan(keep_all=False, checkpoints=keep, kinds=tuple(points[x] for x in keep))


POLICIES: dict[str, RetentionPolicy] = {
    "checkpoints": retain_checkpoints,
    "none": retain_none,
    "all": retain_all,
}


def register_policy(name: str, policy: RetentionPolicy) -> None:
    """Make a custom policy selectable by `KVCacheConfig.retention` (validate the name there too)."""
    POLICIES[name] = policy


def plan_from(plan: RetentionPlan, x0: int) -> RetentionPlan:
    """The plan's checkpoints at or past token `x0` (with their kinds)."""
    keep = [i for i, x in enumerate(plan.checkpoints) if x >= x0]
    return RetentionPlan(plan.keep_all, tuple(plan.checkpoints[i] for i in keep),
                         tuple(plan.kind_of(i) for i in keep))


def kept_pages(plan: RetentionPlan, page_size: int, window_pages: int, first_private: int) -> frozenset[int]:
    """Page indices (>= first_private, the pages the sequence owns) that the plan's checkpoints keep."""
    out: set[int] = set()
    for x in plan.checkpoints:
        end = x // page_size
        out.update(range(max(first_private, end - window_pages), end))
    return frozenset(out)


class _Checkpoint(Protocol):
    """What the statistics see of a tree node: the kinds of the checkpoint(s) ending at it."""

    kinds: int


class ReuseStats:
    """Reuse statistics: per checkpoint kind, the checkpoints stored and how many of them later ended a hit (the
    learned SWA value: kinds this workload does not reuse are cold), and the SWA window rebuild counts.

    The only writer of `Node.kinds` (besides a split, which copies them to both halves). `learn` and `reused`
    return True when the cold kinds changed: the SWA eviction order depends on them and must be rebuilt."""

    __slots__ = ("_stored", "_hits", "_cold", "_counted", "_rebuild_matched", "_rebuild_admitted",
                 "_rebuilt_tokens", "_censor", "_reuse_age", "_weight", "censored", "raw_hit_tokens",
                 "valid_hit_tokens")

    def __init__(self, censor: bool = False) -> None:
        """`censor` (the arena): a checkpoint evicted unreused younger than its kind's mean reuse age is taken
        out of the kind's stored count: it had no chance to be reused, so it is no evidence against the kind."""
        self._stored = dict.fromkeys(_KIND_BITS, 0)
        self._hits = dict.fromkeys(_KIND_BITS, 0)
        self._censor = censor
        self._reuse_age = dict.fromkeys(_KIND_BITS, 0.0)  # mean LRU-clock age at first reuse, per kind
        self._weight = dict.fromkeys(_KIND_BITS, 1.0)  # hit ratio relative to the best kind's (arena eviction)
        self._cold = self._cold_mask()  # kinds this workload does not reuse (at first: the speculative kinds)
        self._counted = 0
        self._rebuild_matched = self._rebuild_admitted = self._rebuilt_tokens = 0
        self.censored = 0  # checkpoints taken out of the stored counts (censor)
        self.raw_hit_tokens = self.valid_hit_tokens = 0  # admitted requests: full-KV match, valid hit

    def learn(self, node: _Checkpoint, kinds: int) -> bool:
        """`node` now holds SWA KV of the checkpoint(s) `kinds`: count the kinds it did not carry yet."""
        new = kinds & ~node.kinds
        node.kinds |= kinds
        return self._count(self._stored, new)

    def reused(self, node: _Checkpoint, age: int = 0) -> bool:
        """A hit ends at `node`, `age` LRU ticks after its SWA KV was last used or stored. The hit ratio of a
        kind is the share of its checkpoints ever reused, so each checkpoint counts once."""
        if node.kinds & _REUSED:
            return False
        if self._censor:
            ages = self._reuse_age
            for bit in _BITS_OF[node.kinds & _ALL_KINDS]:
                ages[bit] += (age - ages[bit]) / 16 if ages[bit] else age
        changed = self._count(self._hits, node.kinds)
        node.kinds |= _REUSED
        return changed

    def evicted(self, node: _Checkpoint, age: int) -> None:
        """`node`'s SWA KV is evicted `age` ticks after its last use. Unreused and younger than its kind's mean
        reuse age (censor on): it is taken out of the stored count, so a kind whose checkpoints the cache
        drops early (memory short) is not learned as never reused: that would drop them earlier still."""
        if not self._censor or node.kinds & _REUSED:
            return
        stored, hits, ages = self._stored, self._hits, self._reuse_age
        for bit in _BITS_OF[node.kinds & _ALL_KINDS]:
            if hits[bit] and age < ages[bit] and stored[bit] > hits[bit]:
                stored[bit] -= 1
                self.censored += 1

    def weight(self, kinds: int) -> float:
        """Relative value of a checkpoint of `kinds` (its best kind's hit ratio over the best kind's, in (0, 1];
        1 for no known kind): the arena scales the expected recompute a checkpoint saves by it."""
        kinds &= _ALL_KINDS
        if not kinds:
            return 1.0
        w = self._weight
        return max(w[b] for b in _BITS_OF[kinds])

    def admitted(self, raw: int, valid: int) -> None:
        self.raw_hit_tokens += raw
        self.valid_hit_tokens += valid

    def cold(self, kinds: int) -> bool:
        """Every kind of a checkpoint is cold. No known kind (inside a hit's window, `all` retention) is warm."""
        kinds &= ~_REUSED
        return bool(kinds) and not kinds & ~self._cold

    def rebuild_matched(self) -> None:
        self._rebuild_matched += 1

    def rebuild_admitted(self, rebuilt_tokens: int) -> None:
        self._rebuild_admitted += 1
        self._rebuilt_tokens += rebuilt_tokens

    def rebuild_stats(self) -> RebuildStats:
        return RebuildStats(self._rebuild_matched, self._rebuild_admitted, self._rebuilt_tokens)

    def checkpoint_stats(self) -> dict[str, tuple[int, int, bool]]:
        """Per checkpoint kind: (checkpoints stored, of which reused by a hit, cold)."""
        return {CheckpointKind(b).name.lower(): (self._stored[b], self._hits[b],  # type: ignore[union-attr]
                                                 bool(self._cold & b)) for b in _KIND_BITS}

    def _count(self, counts: dict[int, int], kinds: int) -> bool:
        if not kinds:
            return False
        stored, hits = self._stored, self._hits
        for bit in _BITS_OF[kinds & _ALL_KINDS]:
            counts[bit] += 1
            if stored[bit] >= _STATS_HALF_LIFE:
                stored[bit] //= 2
                hits[bit] //= 2
        self._counted += 1
        if self._counted % _COLD_RECHECK:
            return False
        cold = self._cold_mask()
        if cold == self._cold:
            return False
        self._cold = cold
        return True

    def _cold_mask(self) -> int:
        """Kinds whose checkpoints end hits far less often than the best kind's (Laplace-smoothed ratios);
        before enough evidence, the speculative kinds."""
        hits, stored = self._hits, self._stored
        ratio = [(hits[b] + 1) / (stored[b] + 2) for b in _KIND_BITS]
        best = max(ratio)
        bar = _COLD_FRACTION * best
        for b, r in zip(_KIND_BITS, ratio, strict=True):
            self._weight[b] = r / best
        cold = 0
        for b, r in zip(_KIND_BITS, ratio, strict=True):
            if (r < bar) if stored[b] >= _COLD_EVIDENCE else b & SPECULATIVE:
                cold |= b
        return cold

    def check_invariants(self, rebuild_tokens: int) -> None:
        """Counts in range (halved before a kind's stored count reaches the half-life), the cold mask only known
        kinds, and every admitted rebuild recomputing exactly S = `rebuild_tokens`."""
        for b in _KIND_BITS:
            if not 0 <= self._stored[b] < _STATS_HALF_LIFE or self._hits[b] < 0:
                raise AssertionError(f"checkpoint kind {b}: stored {self._stored[b]} / reused {self._hits[b]} out "
                                     f"of range (stored is halved at {_STATS_HALF_LIFE})")
        if self._cold & ~_ALL_KINDS:
            raise AssertionError(f"cold kinds {self._cold:#x} name unknown checkpoint kinds")
        rb = self.rebuild_stats()
        if rb.admitted > rb.matched or rb.rebuilt_tokens != rb.admitted * rebuild_tokens:
            raise AssertionError(f"rebuild stats {rb}: more admitted than matched, or not S={rebuild_tokens} "
                                 f"tokens recomputed per admitted rebuild")
