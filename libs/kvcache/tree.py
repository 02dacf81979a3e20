"""Radix-tree nodes over page-aligned token blocks, and the pure structural helpers (walk, split).

Nodes are keyed by block hash (the chained xxhash64 of a page identifies the page and its whole prefix), so a
node stores one 8-byte hash per page, not its tokens, and a child is found by its first page's hash. A node
holds a run of whole pages: block hashes, full-pool page ids (None when it lives only in the host tier), SWA
page ids (-1: a tombstone page) and host copies. `lock` counts the hits / running sequences whose prefix
passes through the node (every ancestor of a locked node is locked too); `swa_lock` counts those whose last
window covers it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from itertools import count

from libs.kvcache.hashing import chain_hashes

_ids = count(1)


def ids(xs: Iterable[int]) -> array:
    """Page ids / tokens / hashes as a flat int64 array: compact, and invisible to the garbage collector (a
    long-lived tree of Python lists made every GC pass walk millions of ints)."""
    return array("q", xs)


def hash_ids(xs: Iterable[int]) -> tuple[int, ...]:
    """Block hashes as a tuple: its ints drop out of GC tracking after one pass, and events share the tuple
    instead of converting a copy per event."""
    return xs if type(xs) is tuple else tuple(xs)


def no_pages(n: int) -> array:
    """n page slots holding -1 (no page)."""
    return _NONE * n


_NONE = array("q", [-1])


def live(pages: array, n_live: int) -> array:
    """The page ids (>= 0) of a page array holding `n_live` of them. Retention leaves SWA pages at the end of a
    node (nodes are cut at checkpoint ends), so the common case is one C-level slice, not a Python loop."""
    if n_live == 0:
        return array("q")
    tail = pages[len(pages) - n_live:]
    return tail if tail.count(-1) == 0 else array("q", [p for p in pages if p >= 0])


class Node:
    __slots__ = ("nid", "start", "parent", "children", "full", "swa", "n_swa", "host_full", "host_swa",
                 "hashes", "lock", "swa_lock", "access", "swa_access", "alive", "kinds")

    def __init__(self, start: int, parent: Node | None, full: Sequence[int] | None,
                 swa: Sequence[int] | None, hashes: Sequence[int], access: int) -> None:
        """`full` / `swa` int64 arrays become the node's own (pass fresh slices); other sequences are copied."""
        self.nid = next(_ids)
        self.start = start  # global index of the node's first page
        self.parent = parent
        self.children: dict[int, Node] = {}  # first page's block hash -> child
        # Arrays are taken over, not copied: every caller passes a fresh slice (one copy per node, not two).
        self.full = None if full is None else full if type(full) is array else ids(full)
        self.swa = None if swa is None else swa if type(swa) is array else ids(swa)
        self.n_swa = 0 if self.swa is None else len(self.swa) - self.swa.count(-1)
        self.host_full: array | None = None
        self.host_swa: array | None = None
        self.hashes = hash_ids(hashes)  # the key: one chained block hash per page
        self.lock = 0
        self.swa_lock = 0
        self.access = access
        self.swa_access = access
        self.alive = True
        self.kinds = 0  # CheckpointKind bits of the checkpoint(s) ending at this node (0: none known)

    @property
    def npages(self) -> int:
        return len(self.hashes)

    @property
    def end(self) -> int:
        return self.start + len(self.hashes)

    def on_device(self) -> bool:
        return self.full is not None

    def host_swa_count(self) -> int:
        return 0 if self.host_swa is None else sum(1 for s in self.host_swa if s >= 0)

    def is_tombstone(self) -> bool:
        """No SWA KV anywhere (device or host): no valid hit can end inside this node."""
        return self.n_swa == 0 and self.host_swa_count() == 0

    def has_device_child(self) -> bool:
        return any(c.full is not None for c in self.children.values())

    def swa_at(self, i: int) -> bool:
        if self.full is not None:
            return self.swa[i] >= 0  # type: ignore[index]
        return self.host_swa is not None and self.host_swa[i] >= 0


def make_root() -> Node:
    return Node(0, None, [], [], [], 0)


class PromptHashes:
    """The block-hash chain of a token list, computed lazily page by page as a walk needs it (a prompt that
    matches nothing costs one page hash), or taken from the caller."""

    __slots__ = ("tokens", "page_size", "seed", "h")

    def __init__(self, tokens: Sequence[int], page_size: int, seed: int, given: Sequence[int] | None = None) -> None:
        self.tokens = tokens
        self.page_size = page_size
        self.seed = seed
        self.h: Sequence[int] = given if given is not None else []  # never mutated: the caller's list

    def upto(self, n: int) -> Sequence[int]:
        """The hashes of the first n pages (n <= full pages of the tokens); may hold more."""
        h = self.h
        if len(h) < n:
            h = self.h = [*h, *chain_hashes(self.tokens, self.page_size, h[-1] if h else self.seed, len(h),
                                            n - len(h))]
        return h


def common_pages(node: Node, hashes: PromptHashes, first: int, limit: int) -> int:
    """Pages of `node` (at most `limit`) equal to the prompt's pages from `first` on; the first is known equal."""
    n = min(node.npages, limit)
    h = hashes.upto(first + n)
    if n == 1 or node.hashes[:n] == tuple(h[first:first + n]):
        return n
    m = 1
    while m < n and node.hashes[m] == h[first + m]:
        m += 1
    return m


def walk(root: Node, hashes: PromptHashes, max_pages: int) -> list[tuple[Node, int]]:
    """The path of (node, pages matched in it) along the prompt; only the last node may be partly matched."""
    path: list[tuple[Node, int]] = []
    node, pos = root, 0
    while pos < max_pages and node.children:
        child = node.children.get(hashes.upto(pos + 1)[pos])
        if child is None:
            break
        m = common_pages(child, hashes, pos, max_pages - pos)
        path.append((child, m))
        pos += m
        if m < child.npages:
            break
        node = child
    return path


def split(node: Node, k: int) -> Node:
    """Split `node` after its first k pages (0 < k < npages); returns the new prefix node (the parent half).

    Both halves keep the lock counts: every holder's prefix ends at a node boundary at or below `node`, and
    SWA locks only ever cover whole nodes inside a window, so each holder covers both halves. Copies in a lower
    tier are split by that tier (`LowerTier.split`).
    """
    assert 0 < k < node.npages, (k, node.npages)
    parent = node.parent
    assert parent is not None
    head = Node(node.start, parent, None if node.full is None else node.full[:k],
                None if node.swa is None else node.swa[:k], node.hashes[:k], node.access)
    head.swa_access = node.swa_access
    head.lock, head.swa_lock = node.lock, node.swa_lock
    head.kinds = node.kinds  # a window split in two: both halves are worth what the checkpoint is
    parent.children[head.hashes[0]] = head
    node.start += k
    if node.full is not None:
        node.full = node.full[k:]
        node.swa = node.swa[k:]  # type: ignore[index]
    node.n_swa -= head.n_swa
    node.hashes = node.hashes[k:]
    node.parent = head
    head.children[node.hashes[0]] = node
    return head


def held_blocks(root: Node) -> tuple[tuple[int, ...], bytes]:
    """Every block of the tree (depth first) and what is held of it, as `BlockHeld` bits: DEVICE (1) and
    DEVICE_SWA (2) from the device arrays, HOST (4) and HOST_SWA (8) from the host copies."""
    hashes: list[int] = []
    states = bytearray()
    stack = [root]
    while stack:
        for node in stack.pop().children.values():
            stack.append(node)
            hashes.extend(node.hashes)
            full, swa, host_full, host_swa = node.full, node.swa, node.host_full, node.host_swa
            for i in range(node.npages):
                st = 0
                if full is not None:
                    st = 1 | (2 if swa[i] >= 0 else 0)  # type: ignore[index]
                if host_full is not None:
                    st |= 4 | (8 if host_swa[i] >= 0 else 0)  # type: ignore[index]
                states.append(st)
    return tuple(hashes), bytes(states)


def path_to_root(node: Node) -> list[Node]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out
