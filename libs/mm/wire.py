"""How embeddings travel from an encoder to a worker as transfer-engine layers (pure; shared by both sides).

One `EmbedFetchRequest` is one transfer; each item found is one layer, ``[num_tokens, hidden]`` rows in the
requested dtype, named by its position in the request (`layer_index`); `page_count` carries the row count so
the receiver lays out its buffers from the header alone. Items not found have no layer; a fetch where every
item missed has no transfer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from libs.transfer import LayerSpec
from libs.transfer.protocol import DTYPE_SIZES

GROUP = "mm"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a float dtype the rows may be sent in; ValueError for any other."""
    name = str(dtype).removeprefix("torch.")
    if name not in FLOAT_DTYPES:
        raise ValueError(f"embeddings are sent as {', '.join(FLOAT_DTYPES)}, not {name}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    if name not in FLOAT_DTYPES:
        raise ValueError(f"embeddings are sent as {', '.join(FLOAT_DTYPES)}, not {name!r}")
    return getattr(torch, name)


def layer_spec(position: int, rows: int, hidden: int, dtype: str) -> LayerSpec:
    return LayerSpec(GROUP, position, rows, dtype, (rows, hidden))


def nbytes(rows: int, hidden: int, dtype: str) -> int:
    return rows * hidden * DTYPE_SIZES[dtype]


def check_layers(specs: Sequence[LayerSpec], sizes: Sequence[int], hidden: int, dtype: str) -> None:
    """ValueError unless the header's layers are exactly the found items (sizes >= 0), in order, as announced."""
    want = [(i, s) for i, s in enumerate(sizes) if s >= 0]
    got = [(s.layer_index, s.nbytes) for s in specs]
    if got != want or any(s.group != GROUP or s.dtype != dtype or s.shape[1:] != (hidden,) for s in specs):
        raise ValueError(f"embedding transfer layers {got} do not match the announced items {want}")
