"""The KV-transfer wire protocol: its vocabulary (layer specs, headers, addresses, tags). Pure: no IO, no torch.

One control connection (a TCP stream) per (sender engine, receiver engine) pair carries length-prefixed
frames; payload bytes travel inline (TCP engine) or as UCX tagged messages (`payload_tag`: connection nonce,
transfer seq, layer position). A transfer is HEADER → ACCEPT | REJECT, one LAYER per layer in header order,
END → DONE; ABORT (sender) and CANCEL (receiver) end it at any time. The frames and their codecs are in
``frames.py``; the sequence in docs/transfer.md, "Protocol".
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import xxhash

PROTOCOL_VERSION = 1
TAG_SEED = 0x57_49_4E_44  # fixed seed: tags must agree between processes ("WIND")

# Bytes per element of the dtypes a KV page may carry (torch dtype names).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


@dataclass(frozen=True)
class LayerSpec:
    """One layer's payload in a transfer: the gathered pages of one layer.

    ``shape`` is the shape of the whole layer payload (usually ``(page_count, *page_shape)``);
    ``group`` names the KV pool the pages belong to ("full" or "swa" for MiMo-V2).
    """

    group: str
    layer_index: int
    page_count: int
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.group:
            raise ValueError("LayerSpec.group must be a non-empty string")
        if self.layer_index < 0 or self.page_count < 0:
            raise ValueError(f"LayerSpec indices must be >= 0, got {self.layer_index=} {self.page_count=}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"LayerSpec.dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"LayerSpec.shape has a negative dim: {self.shape}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    def to_wire(self) -> list[Any]:
        return [self.group, self.layer_index, self.page_count, self.dtype, list(self.shape)]

    @classmethod
    def from_wire(cls, item: list[Any]) -> LayerSpec:
        group, index, pages, dtype, shape = item
        return cls(str(group), int(index), int(pages), str(dtype), tuple(shape))


@dataclass(frozen=True)
class TransferHeader:
    """What the receiver learns before any payload: the request and its layers, in send order."""

    request_id: str
    layers: tuple[LayerSpec, ...]

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("TransferHeader.request_id must be non-empty")
        object.__setattr__(self, "layers", tuple(self.layers))

    @property
    def total_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.layers)

    def to_wire(self, seq: int) -> dict[str, Any]:
        return {"seq": seq, "request_id": self.request_id, "layers": [s.to_wire() for s in self.layers]}

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> TransferHeader:
        return cls(str(body["request_id"]), tuple(LayerSpec.from_wire(x) for x in body["layers"]))


def payload_tag(nonce: int, seq: int, position: int) -> int:
    """64-bit UCX tag of one layer payload; unique per connection, transfer and layer."""
    return xxhash.xxh64_intdigest(struct.pack("!QII", nonce, seq, position), seed=TAG_SEED)


MESSAGE_TAG_DOMAIN = 0x4D  # keeps message payload tags apart from transfer payload tags (docs/transfer.md, "Messages")


def message_tag(nonce: int, msg_id: int, index: int) -> int:
    """64-bit UCX tag of payload ``index`` of message ``msg_id`` on a connection (the direct path)."""
    return xxhash.xxh64_intdigest(struct.pack("!QQIB", nonce, msg_id, index, MESSAGE_TAG_DOMAIN), seed=TAG_SEED)


def parse_address(address: str) -> tuple[str, str, int]:
    """'ucx://host:port' -> ('ucx', host, port), with an error naming the bad address."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if not sep or not colon or not host or not port.isdigit():
        raise ValueError(f"transfer address must look like 'ucx://host:port' or 'tcp://host:port', got {address!r}")
    return scheme, host, int(port)
