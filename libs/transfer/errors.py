"""Errors raised by the transfer engine.

Contract: when any ``TransferError`` reaches a caller for a transfer, that transfer is
finished for good and the engine no longer reads from the sender's buffers nor writes
into the receiver's destination buffers, so both sides may free their KV pages.
"""


class TransferError(RuntimeError):
    """A KV transfer failed; the message names the request, the peer and the cause."""


class TransferRejected(TransferError):
    """The receiver refused the transfer (unknown request id, shape mismatch, ...)."""


class TransferAborted(TransferError):
    """The other side aborted or cancelled the transfer explicitly."""


class PeerDisconnected(TransferError):
    """The control connection to the peer closed or broke mid-transfer."""


class TransferTimeout(TransferError):
    """A bounded wait of the transfer protocol expired."""
