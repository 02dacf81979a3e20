"""How GCache values travel as transfer-engine layers (docs/gcache.md, "Chunking").

One batch is one transfer; each value of it is sliced into chunks of at most `chunk_bytes`, and each chunk is
one uint8 layer, in value order. A chunk's `LayerSpec` names its value (`layer_index` = the value's position
in the request's keys / items) and its place in it (`page_count` = chunk number), so a receiver can lay out
its buffers from the header alone. Values of 0 bytes have no layer; a batch with no bytes has no transfer.

`chunk_sizes` and `layer_specs` are pure; `chunk_views` wraps buffers as tensors without a copy (the transfer
engine moves torch tensors).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from libs.transfer import LayerSpec

from .api import Buffer

GROUP = "gcache"


def chunk_sizes(size: int, chunk_bytes: int) -> list[int]:
    """Sizes of the chunks of a `size`-byte value: full chunks, then the remainder (none for 0 bytes)."""
    if size < 0 or chunk_bytes <= 0:
        raise ValueError(f"chunk_sizes needs size >= 0 and chunk_bytes > 0, got {size}, {chunk_bytes}")
    full, rest = divmod(size, chunk_bytes)
    return [chunk_bytes] * full + ([rest] if rest else [])


def layer_specs(sizes: Sequence[int], chunk_bytes: int, positions: Sequence[int] | None = None) -> list[LayerSpec]:
    """The layers of a batch of values of `sizes` (value `i` is named `positions[i]`, default `i`)."""
    names = range(len(sizes)) if positions is None else positions
    return [LayerSpec(GROUP, pos, chunk, "uint8", (n,))
            for pos, size in zip(names, sizes, strict=True) for chunk, n in enumerate(chunk_sizes(size, chunk_bytes))]


def value_sizes(specs: Sequence[LayerSpec]) -> dict[int, int]:
    """Value position -> total bytes, from a header's layers; ValueError when they are not this module's shape
    (a foreign group, chunks out of order)."""
    sizes: dict[int, int] = {}
    chunks: dict[int, int] = {}
    for spec in specs:
        if spec.group != GROUP or spec.dtype != "uint8" or len(spec.shape) != 1:
            raise ValueError(f"not a GCache layer: {spec}")
        if spec.page_count != chunks.get(spec.layer_index, 0):
            raise ValueError(f"value {spec.layer_index}: chunk {spec.page_count} out of order")
        chunks[spec.layer_index] = spec.page_count + 1
        sizes[spec.layer_index] = sizes.get(spec.layer_index, 0) + spec.shape[0]
    return sizes


def chunk_views(buffer: Buffer, chunk_bytes: int) -> list[torch.Tensor]:
    """Zero-copy uint8 tensors over `buffer`'s chunks (writable buffers can be received into)."""
    view = memoryview(buffer).cast("B") if not isinstance(buffer, bytearray) else buffer
    out: list[torch.Tensor] = []
    offset = 0
    with warnings.catch_warnings():  # a read-only buffer (bytes) is fine to send from; torch warns anyway
        warnings.simplefilter("ignore", UserWarning)
        for n in chunk_sizes(len(view), chunk_bytes):
            out.append(torch.frombuffer(view, dtype=torch.uint8, count=n, offset=offset))
            offset += n
    return out


def chunk_arrays(buffer: Buffer, chunk_bytes: int) -> list[np.ndarray]:
    """Zero-copy flat uint8 numpy views of `buffer`'s chunks (what ucxx takes as is: the direct path's tagged
    messages); read-only when `buffer` is."""
    whole = np.frombuffer(buffer, dtype=np.uint8) if len(memoryview(buffer)) else np.empty(0, dtype=np.uint8)
    return [whole[i:i + chunk_bytes] for i in range(0, len(whole), chunk_bytes)]
