"""``KVTransferEngine``: the interface services and tests type a transfer engine against.

``create_engine()`` returns one (UCX or the plain-TCP fallback); a test double only needs the
methods its caller uses, since this is a structural ``Protocol``.

Contract: every wait is bounded by ``TransferConfig``; every failure of a transfer reaches its
caller as a ``TransferError`` (see ``errors.py``), after which the engine touches neither the
sender's nor the receiver's buffers of that transfer again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .buffers import Payload
from .config import TransferBackend, TransferConfig
from .protocol import LayerSpec
from .transfers import Destinations, IncomingTransfer, OutgoingTransfer, TransferStats


class KVTransferEngine(Protocol):
    config: TransferConfig

    @property
    def backend(self) -> TransferBackend: ...

    @property
    def address(self) -> str:
        """``'ucx://host:port'`` / ``'tcp://host:port'`` once started ("" before): goes into the registry."""
        ...

    @property
    def bytes_sent(self) -> int:
        """Bytes of completed outgoing transfers."""
        ...

    @property
    def bytes_received(self) -> int:
        """Bytes of completed incoming transfers."""
        ...

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on ``host`` (a free port by default); returns ``address``."""
        ...

    async def close(self) -> None:
        """Fail everything in flight, close connections and the listener, release the data plane."""
        ...

    # -- receiver ------------------------------------------------------------------------------
    def expect(self, request_id: str, destinations: Destinations) -> IncomingTransfer:
        """Register an incoming transfer before telling the sender to send; headers for ids nobody
        expects are rejected. ``destinations``: one payload per layer in header order, or a callback
        header -> payloads that allocates them when the header arrives."""
        ...

    async def cancel(self, request_id: str, reason: str = "cancelled by receiver") -> bool:
        """Cancel an expected / incoming transfer (the sender's next call raises); False if unknown."""
        ...

    # -- sender --------------------------------------------------------------------------------
    async def begin_send(self, address: str, request_id: str, layers: Sequence[LayerSpec]) -> OutgoingTransfer:
        """Send the header and wait (bounded) for the receiver's ACCEPT. The transfer then stays open,
        with no idle timeout, until ``finish()`` or ``abort()``: layers may follow one by one as they
        are computed."""
        ...

    async def send(self, address: str, request_id: str, layers: Sequence[LayerSpec],
                   payloads: Sequence[Payload]) -> TransferStats:
        """``begin_send`` + every layer + ``finish``; aborts the transfer on any local error."""
        ...

    async def abort(self, request_id: str, reason: str = "aborted by sender") -> bool:
        """Abort an outgoing transfer (the receiver fails promptly); False if unknown."""
        ...
