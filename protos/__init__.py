"""The wire contract: typed messages, their encoding, and the NATS subject names."""

from protos.base import ProtocolError, WireModel, decode, encode

__all__ = ["ProtocolError", "WireModel", "decode", "encode"]
