"""Test helper (no tests here): a fake engine for KV-cache tests. It writes "KV" (the token prefix each position depends on) into page ids
and checks, before every read, that the pages it reads hold the KV of this sequence's tokens.

This is the brute-force oracle: per device/host page it tracks what each position's KV was computed from, so
a hit, a page table or a host copy that points at the wrong (freed, reused, evicted) page is caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.kvcache import KVCache, PageCopy, PrefixHit


@dataclass
class Running:
    tokens: list[int]
    prompt_len: int
    max_new: int
    new: int = 0


@dataclass
class Oracle:
    cache: KVCache
    # page id -> the token prefix (up to and including the last written position of that page)
    dev: dict[str, dict[int, tuple[int, ...]]] = field(default_factory=lambda: {"full": {}, "swa": {}})
    host: dict[str, dict[int, tuple[int, ...]]] = field(default_factory=lambda: {"full": {}, "swa": {}})
    running: dict[str, Running] = field(default_factory=dict)

    @property
    def P(self) -> int:
        return self.cache.cfg.page_size

    @property
    def W(self) -> int:
        return self.cache.cfg.window

    def holds(self, group: str, page: int, tokens: list[int], pos: int) -> bool:
        """Does device page `page` hold the KV of position `pos` computed from `tokens`?"""
        got = self.dev[group].get(page)
        if got is None or not pos < len(got) <= (pos // self.P + 1) * self.P:
            return False
        return list(got) == tokens[:len(got)]

    def check_hit(self, tokens: list[int], hit: PrefixHit) -> None:
        L = hit.tokens
        assert L % self.P == 0 and 0 <= L < max(len(tokens), 1), (L, len(tokens))
        assert hit.raw_tokens >= L and 0 <= hit.host_tokens <= L
        self.run_copies(hit.load_copies)
        if L == 0:
            return
        assert len(hit.full_pages) == len(hit.swa_pages) == L // self.P
        for p in range(L):
            assert self.holds("full", hit.full_pages[p // self.P], tokens, p), f"full KV missing at {p} of hit {L}"
        for p in range(max(0, L - self.W), L):
            assert self.holds("swa", hit.swa_pages[p // self.P], tokens, p), f"SWA KV missing at {p} of hit {L}"

    def run_copies(self, copies: list[PageCopy] | tuple[PageCopy, ...]) -> None:
        for c in copies:
            src, dst = (self.dev, self.host) if c.direction == "d2h" else (self.host, self.dev)
            assert c.src in src[c.group], f"copy from a page that holds nothing: {c}"
            dst[c.group][c.dst] = src[c.group][c.src]

    def step(self, seq_id: str, k: int) -> bool:
        """One engine step: reserve, check what the forward reads, write, commit. False if reserve refused."""
        run = self.running[seq_id]
        c0 = self.cache.num_computed(seq_id)
        before = (self.cache.page_tables(seq_id), self.cache.usage())
        if not self.cache.reserve(seq_id, k):
            assert (self.cache.page_tables(seq_id), self.cache.usage()) == before, "refused reserve changed state"
            return False
        full, swa = self.cache.page_tables(seq_id)
        toks = run.tokens
        for p in range(c0):  # the forward reads full KV of the whole prefix and SWA KV of the last window
            assert self.holds("full", full[p // self.P], toks, p), f"{seq_id}: full KV lost at {p}"
        for p in range(max(0, c0 - self.W), c0):
            assert self.holds("swa", swa[p // self.P], toks, p), f"{seq_id}: SWA KV lost at {p} (window)"
        for p in range(c0, c0 + k):
            j = p // self.P
            assert swa[j] >= 0, f"{seq_id}: no SWA page to write position {p}"
            self.dev["full"][full[j]] = self.dev["swa"][swa[j]] = tuple(toks[:p + 1])
        new: list[int] = []
        if c0 + k == len(toks) and run.new < run.max_new:
            new = [10_000_000 + 7919 * len(toks) % 9973 + hash_free_token(seq_id, len(toks))]
            run.new += 1
        run.tokens = toks + new
        self.cache.commit(seq_id, k, new)
        return True


def hash_free_token(seq_id: str, n: int) -> int:
    """A deterministic 'sampled' token (no Python hash()): depends on the sequence id and position."""
    return sum(map(ord, seq_id)) * 131 + n
