"""Deterministic block hashes: an xxhash64 chain over page-sized token blocks, seeded by a fixed constant.

The same function runs in gateway, router, workers and GCache, so equal prefixes give equal hashes in every
process (never Python's `hash()`). Tokens are encoded as little-endian uint32.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import xxhash

from libs.kvcache.config import DEFAULT_HASH_SEED

_xxh64 = xxhash.xxh64_intdigest


def _token_bytes(tokens: Sequence[int]) -> bytes:
    arr = array("I", tokens)
    if sys.byteorder == "big":
        arr.byteswap()
    return arr.tobytes()


def chain_hashes(tokens: Sequence[int], page_size: int, parent: int, first_page: int, num_pages: int) -> list[int]:
    """Hashes of pages [first_page, first_page + num_pages) of `tokens`, chained from `parent`'s hash."""
    data = memoryview(_token_bytes(tokens[first_page * page_size:(first_page + num_pages) * page_size]))
    step = 4 * page_size
    out = []
    h = parent
    for i in range(num_pages):
        h = _xxh64(data[i * step:(i + 1) * step], h)
        out.append(h)
    return out


def block_hashes(tokens: Sequence[int], page_size: int, seed: int = DEFAULT_HASH_SEED) -> list[int]:
    """xxhash64 chain over the full pages of `tokens`: h_i = xxh64(bytes(page_i), seed=h_{i-1}), h_{-1} = seed."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    return chain_hashes(tokens, page_size, seed, 0, len(tokens) // page_size)
