"""Control-stream frames: one frozen dataclass per frame type, coded once at the boundary. Pure (no IO).

On the stream a frame is a 9-byte prefix (``!BQ``: type, body length) and a body: a JSON object for
control frames, a fixed ``!IIQ`` struct for LAYER (whose payload, on the TCP backend, follows inline).
``encode_frame`` and ``decode_frame`` are the only places bytes become frames and back; the connection
dispatches on the frame classes. A malformed frame raises ``FrameError`` naming the frame type and the
field; for a HEADER whose ``seq`` was readable the error carries it, so the receiver can REJECT that
one transfer instead of dropping the whole connection.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
import types
from dataclasses import dataclass
from typing import Any, ClassVar, get_type_hints

import orjson

from .protocol import TransferHeader

FRAME_PREFIX = struct.Struct("!BQ")  # frame type, body length
LAYER_BODY = struct.Struct("!IIQ")  # transfer seq, layer position, payload bytes
MESSAGE_ID = struct.Struct("!Q")  # a MESSAGE frame's id; its opaque body follows


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
    MESSAGE = 11


class FrameError(ValueError):
    """A frame that does not follow the protocol (corrupt stream, version skew or a buggy peer)."""

    def __init__(self, message: str, *, ftype: FrameType | None = None, seq: int | None = None) -> None:
        super().__init__(message)
        self.ftype = ftype
        self.seq = seq


@dataclass(frozen=True)
class Hello:
    """Sender -> receiver, first frame of a connection: who is dialling and its data-plane address."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO
    version: int
    backend: str
    engine: str
    nonce: int  # per-connection salt of the UCX payload tags
    data: str | None = None  # the sender's data-plane address (UCX worker address, base64); TCP: None


@dataclass(frozen=True)
class HelloAck:
    """Receiver -> sender: the handshake result; a non-empty ``error`` refuses the connection."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO_ACK
    engine: str = ""
    data: str | None = None
    error: str = ""


@dataclass(frozen=True)
class Header:
    """Sender -> receiver: a new transfer ``seq`` on this connection and what it will carry."""

    TYPE: ClassVar[FrameType] = FrameType.HEADER
    seq: int
    header: TransferHeader


@dataclass(frozen=True)
class Accept:
    TYPE: ClassVar[FrameType] = FrameType.ACCEPT
    seq: int


@dataclass(frozen=True)
class Reject:
    TYPE: ClassVar[FrameType] = FrameType.REJECT
    seq: int
    reason: str


@dataclass(frozen=True)
class Layer:
    """Sender -> receiver: layer ``position`` of transfer ``seq`` follows (``nbytes`` payload bytes)."""

    TYPE: ClassVar[FrameType] = FrameType.LAYER
    seq: int
    position: int
    nbytes: int


@dataclass(frozen=True)
class End:
    TYPE: ClassVar[FrameType] = FrameType.END
    seq: int


@dataclass(frozen=True)
class Done:
    """Receiver -> sender: every layer of ``seq`` landed (``nbytes`` in all)."""

    TYPE: ClassVar[FrameType] = FrameType.DONE
    seq: int
    nbytes: int


@dataclass(frozen=True)
class Abort:
    TYPE: ClassVar[FrameType] = FrameType.ABORT
    seq: int
    reason: str


@dataclass(frozen=True)
class Cancel:
    TYPE: ClassVar[FrameType] = FrameType.CANCEL
    seq: int
    reason: str


@dataclass(frozen=True)
class Message:
    """Either direction, outside any transfer: an opaque ``body`` for the engine's message handler (what the
    direct path of GCache speaks, docs/transfer.md "Messages"). Binary: ``!Q`` id, then the body bytes."""

    TYPE: ClassVar[FrameType] = FrameType.MESSAGE
    msg_id: int
    body: bytes


Frame = Hello | HelloAck | Header | Accept | Reject | Layer | End | Done | Abort | Cancel | Message
_CLASSES: dict[FrameType, type[Any]] = {
    cls.TYPE: cls for cls in (Hello, HelloAck, Header, Accept, Reject, Layer, End, Done, Abort, Cancel)}
_HINTS = {cls: get_type_hints(cls) for cls in _CLASSES.values()}  # field -> declared type, for decoding
# Field names that differ on the wire (kept so protocol version 1 is unchanged).
_WIRE_NAMES = {"nbytes": "bytes"}


def encode_frame(frame: Frame) -> bytes:
    if isinstance(frame, Layer):
        # On the TCP backend ``nbytes`` payload bytes follow this frame on the stream.
        return FRAME_PREFIX.pack(FrameType.LAYER, LAYER_BODY.size) + LAYER_BODY.pack(
            frame.seq, frame.position, frame.nbytes)
    if isinstance(frame, Message):
        return FRAME_PREFIX.pack(FrameType.MESSAGE, MESSAGE_ID.size + len(frame.body)) + MESSAGE_ID.pack(
            frame.msg_id) + frame.body
    if isinstance(frame, Header):
        body = frame.header.to_wire(frame.seq)
    else:
        body = {_WIRE_NAMES.get(f.name, f.name): getattr(frame, f.name) for f in dataclasses.fields(frame)}
    payload = orjson.dumps(body)
    return FRAME_PREFIX.pack(frame.TYPE, len(payload)) + payload


def decode_prefix(prefix: bytes, max_body: int) -> tuple[FrameType, int]:
    raw_type, length = FRAME_PREFIX.unpack(prefix)
    try:
        ftype = FrameType(raw_type)
    except ValueError as exc:
        raise FrameError(f"unknown frame type {raw_type}") from exc
    if length > max_body:
        raise FrameError(f"{ftype.name} frame of {length} bytes exceeds the {max_body}-byte limit", ftype=ftype)
    return ftype, length


def decode_frame(ftype: FrameType, body: bytes) -> Frame:
    """The frame of type ``ftype`` in ``body``; FrameError names what is wrong with it."""
    if ftype is FrameType.LAYER:
        if len(body) != LAYER_BODY.size:
            raise FrameError(f"LAYER frame body must be {LAYER_BODY.size} bytes, got {len(body)}", ftype=ftype)
        return Layer(*LAYER_BODY.unpack(body))
    if ftype is FrameType.MESSAGE:
        if len(body) < MESSAGE_ID.size:
            raise FrameError(f"MESSAGE frame body must hold at least {MESSAGE_ID.size} bytes, got {len(body)}",
                             ftype=ftype)
        return Message(MESSAGE_ID.unpack_from(body)[0], bytes(body[MESSAGE_ID.size:]))
    obj = _json_object(ftype, body)
    if ftype is FrameType.HEADER:
        return _decode_header(obj)
    frame: Frame = _decode_fields(_CLASSES[ftype], ftype, obj)
    return frame


def _json_object(ftype: FrameType, body: bytes) -> dict[str, Any]:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"{ftype.name} frame body is not JSON: {exc}", ftype=ftype) from exc
    if not isinstance(obj, dict):
        raise FrameError(f"{ftype.name} frame body must be an object, got {type(obj).__name__}", ftype=ftype)
    return obj


def _decode_header(obj: dict[str, Any]) -> Header:
    seq = _field(obj, "seq", int, FrameType.HEADER)
    try:
        header = TransferHeader.from_wire(obj)
    except (KeyError, ValueError, TypeError) as exc:
        raise FrameError(f"HEADER frame of transfer {seq}: {type(exc).__name__}: {exc}",
                         ftype=FrameType.HEADER, seq=seq) from exc
    return Header(seq, header)


def _decode_fields(cls: type[Any], ftype: FrameType, obj: dict[str, Any]) -> Any:
    """Build ``cls`` from the JSON object: every field present (or defaulted) and of its declared type."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = _WIRE_NAMES.get(f.name, f.name)
        if key in obj or f.default is dataclasses.MISSING:
            kwargs[f.name] = _field(obj, key, _HINTS[cls][f.name], ftype)
    return cls(**kwargs)


def _field(obj: dict[str, Any], key: str, kind: type | types.UnionType, ftype: FrameType) -> Any:
    if key not in obj:
        raise FrameError(f"{ftype.name} frame has no {key!r} field", ftype=ftype)
    value = obj[key]
    # bool is an int subclass in Python but not a number on this wire.
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise FrameError(f"{ftype.name} frame field {key!r} must be {_kind_name(kind)}, got {value!r}",
                         ftype=ftype)
    return value


def _kind_name(kind: type | types.UnionType) -> str:
    return kind.__name__ if isinstance(kind, type) else str(kind)
