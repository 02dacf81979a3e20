"""KV page transfer between serving processes: UCX (`ucxx`) engine with a plain-TCP fallback.

See docs/transfer.md for the protocol, failure semantics and UCX settings.
"""

from .buffers import Payload
from .config import Backend, TransferConfig, select_backend, ucx_available
from .engine import TcpTransferEngine, TransferEngine, create_engine, parse_address
from .errors import PeerDisconnected, TransferAborted, TransferError, TransferRejected, TransferTimeout
from .protocol import LayerSpec, TransferHeader
from .transfers import Destinations, IncomingTransfer, OutgoingTransfer, TransferState, TransferStats

__all__ = [
    "Backend", "Destinations", "IncomingTransfer", "LayerSpec", "OutgoingTransfer", "Payload",
    "PeerDisconnected", "TcpTransferEngine", "TransferAborted", "TransferConfig", "TransferEngine",
    "TransferError", "TransferHeader", "TransferRejected", "TransferState", "TransferStats",
    "TransferTimeout", "create_engine", "parse_address", "select_backend", "ucx_available",
]
