"""The KV-transfer wire protocol: pure data types and frame codecs (no IO, no torch).

One control connection (a TCP stream) per (sender engine, receiver engine) pair carries
length-prefixed frames. Payload bytes travel either inline on that stream (TCP engine) or
as UCX tagged messages whose tag is derived from (connection nonce, transfer seq, layer
position) (UCX engine). Sequence of one transfer::

    sender                                   receiver
    HEADER {seq, request_id, layers} ──────▶  look up expect(request_id), allocate dests
                                      ◀──────  ACCEPT {seq}  |  REJECT {seq, reason}
    LAYER (seq, pos, nbytes) [+bytes] ──────▶  post recv of layer pos into its destination
    ... one LAYER per layer, in header order ...
    END {seq}                         ──────▶  all layers landed?
                                      ◀──────  DONE {seq, bytes}
    ABORT {seq, reason} (any time)    ──────▶  fail transfer (after in-flight payloads land)
                                      ◀──────  CANCEL {seq, reason} (receiver gives up)
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

PROTOCOL_VERSION = 1
TAG_SEED = 0x57_49_4E_44  # fixed seed: tags must agree between processes ("WIND")

# Bytes per element of the dtypes a KV page may carry (torch dtype names).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}

FRAME_PREFIX = struct.Struct("!BQ")  # frame type, body length
LAYER_BODY = struct.Struct("!IIQ")  # transfer seq, layer position, payload bytes


class FrameType(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    HEADER = 3
    ACCEPT = 4
    REJECT = 5
    LAYER = 6
    END = 7
    DONE = 8
    ABORT = 9
    CANCEL = 10


class ProtocolError(ValueError):
    """A frame that does not follow the protocol (corrupt stream or version skew)."""


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


def encode_control(ftype: FrameType, body: dict[str, Any]) -> bytes:
    payload = orjson.dumps(body)
    return FRAME_PREFIX.pack(ftype, len(payload)) + payload


def decode_control(ftype: FrameType, body: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"{ftype.name} frame body is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"{ftype.name} frame body must be an object, got {type(obj).__name__}")
    return obj


def encode_layer(seq: int, position: int, nbytes: int) -> bytes:
    """LAYER frame prefix; on the TCP engine ``nbytes`` payload bytes follow it on the stream."""
    return FRAME_PREFIX.pack(FrameType.LAYER, LAYER_BODY.size) + LAYER_BODY.pack(seq, position, nbytes)


def decode_layer(body: bytes) -> tuple[int, int, int]:
    if len(body) != LAYER_BODY.size:
        raise ProtocolError(f"LAYER frame body must be {LAYER_BODY.size} bytes, got {len(body)}")
    seq, position, nbytes = LAYER_BODY.unpack(body)
    return seq, position, nbytes


def decode_prefix(prefix: bytes, max_body: int) -> tuple[FrameType, int]:
    raw_type, length = FRAME_PREFIX.unpack(prefix)
    try:
        ftype = FrameType(raw_type)
    except ValueError as exc:
        raise ProtocolError(f"unknown frame type {raw_type}") from exc
    if length > max_body:
        raise ProtocolError(f"{ftype.name} frame of {length} bytes exceeds the {max_body}-byte limit")
    return ftype, length


def payload_tag(nonce: int, seq: int, position: int) -> int:
    """64-bit UCX tag of one layer payload; unique per connection, transfer and layer."""
    return xxhash.xxh64_intdigest(struct.pack("!QII", nonce, seq, position), seed=TAG_SEED)
