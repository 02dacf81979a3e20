"""SWA retention policies: which windows of SWA KV a sequence keeps when they slide out of its window.

A running sequence frees SWA pages as they leave the window, except the pages of the checkpoints its policy
names; at finish it inserts those plus the window at its end into the prefix tree. Everything else becomes a
tombstone (full KV only). Policies are pure functions of the request shape, registered by name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass


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


def kept_pages(plan: RetentionPlan, page_size: int, window_pages: int, first_private: int) -> frozenset[int]:
    """Page indices (>= first_private, the pages the sequence owns) that the plan's checkpoints keep."""
    out: set[int] = set()
    for x in plan.checkpoints:
        end = x // page_size
        out.update(range(max(first_private, end - window_pages), end))
    return frozenset(out)
