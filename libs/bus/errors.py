"""Errors raised by the bus. ProtocolError (bad message) lives in protos.base."""

from __future__ import annotations

from protos.messages import ErrorCode


class BusError(Exception):
    """Base of bus failures."""


class BusTimeout(BusError):
    """No reply (or payload transfer) within the timeout."""


class NoResponders(BusError):
    """Nobody listens on the subject (fails fast instead of waiting for the timeout)."""


class Unavailable(Exception):
    """Raised by a handler that cannot take this request now (full, draining) although another instance of its
    role might: the caller gets ErrorCode.UNAVAILABLE and may try elsewhere."""


class RemoteError(BusError):
    """The remote side answered with an ErrorReply."""

    def __init__(self, subject: str, code: ErrorCode, message: str) -> None:
        super().__init__(f"{subject}: remote error {code.value}: {message}")
        self.subject = subject
        self.code = code
        self.message = message
