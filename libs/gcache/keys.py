"""GCache keys and value checksums.

A key names one page-aligned block of one model's KV: `<namespace>:F:<block hash>` holds the block's
full-attention pages (every full layer, K and V), `<namespace>:S:<block hash>` the SWA checkpoint ending at that
block (the SWA layers' pages of the window that ends there). The block hash is the chained xxhash64 of
`libs.kvcache.hashing` (the same as KV events and routing). The namespace folds in everything that makes two
models' bytes incompatible (model name, KV layout, page size, dtype, hash seed), so they never mix.
"""

from __future__ import annotations

import re

import xxhash

GCACHE_CHECKSUM_SEED = 0x6763616368650002  # "gcache" + version: value checksums (xxh3-64; version 1 was xxh64)
_NS_SEED = 0x6763616368656E73

_SLUG_RE = re.compile(r"[^A-Za-z0-9_\-]+")


def model_namespace(model: str, layout: str, page_size: int, dtype: str, hash_seed: int) -> str:
    """`<readable model slug>-<xxh64 of every identity field>`; `layout` is a canonical string of the KV layout
    (layer kinds, KV heads, head dims, window)."""
    slug = _SLUG_RE.sub("_", model.rstrip("/").rsplit("/", 1)[-1])[:40] or "model"
    ident = "\x1f".join((model, layout, str(page_size), dtype, str(hash_seed))).encode()
    return f"{slug}-{xxhash.xxh64_hexdigest(ident, seed=_NS_SEED)}"


def full_key(namespace: str, block_hash: int) -> str:
    return f"{namespace}:F:{block_hash:016x}"


def swa_key(namespace: str, block_hash: int) -> str:
    return f"{namespace}:S:{block_hash:016x}"


def value_checksum(data: bytes | bytearray | memoryview) -> int:
    """A value's checksum: xxh3-64 with a fixed seed (far faster than xxh64, and every put and every memory get
    hashes each byte at least once; docs/gcache.md "Checksums")."""
    return xxhash.xxh3_64_intdigest(data, seed=GCACHE_CHECKSUM_SEED)
