"""KV page transfer between serving processes: UCX (`ucxx`) engine with a plain-TCP fallback.

Type an engine as `KVTransferEngine`; `create_engine()` builds one. See docs/transfer.md for the
module layout, the protocol, failure semantics and UCX settings.
"""

from .api import KVTransferEngine
from .buffers import Payload
from .config import TransferBackend, TransferConfig, select_backend, ucx_available
from .engine import TcpTransferEngine, UcxTransferEngine, advertised_address, create_engine
from .errors import PeerDisconnected, TransferAborted, TransferError, TransferRejected, TransferTimeout
from .protocol import LayerSpec, TransferHeader, parse_address
from .transfers import Destinations, IncomingTransfer, OutgoingTransfer, TransferState, TransferStats

__all__ = [
    "Destinations", "IncomingTransfer", "KVTransferEngine", "LayerSpec", "OutgoingTransfer", "Payload",
    "PeerDisconnected", "TcpTransferEngine", "TransferAborted", "TransferBackend", "TransferConfig", "TransferError",
    "TransferHeader", "TransferRejected", "TransferState", "TransferStats", "TransferTimeout", "UcxTransferEngine",
    "advertised_address", "create_engine", "parse_address", "select_backend", "ucx_available",
]
