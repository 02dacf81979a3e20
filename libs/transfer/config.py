"""Transfer engine settings and backend selection."""

from __future__ import annotations

import enum
import importlib.util
import os
from dataclasses import dataclass

# Transports without a UCX peer-failure handler: endpoints must be created without
# error handling or UCX reports the peer unreachable. Failure detection then rests on
# the control connection, which is why the protocol never relies on UCX errors alone.
_SHARED_MEMORY_TLS = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "self"}


class TransferBackend(enum.Enum):
    UCX = "ucx"
    TCP = "tcp"


@dataclass(frozen=True)
class TransferConfig:
    connect_timeout_s: float = 5.0
    """Dial + handshake with a peer engine."""
    accept_timeout_s: float = 5.0
    """Sender waits this long for the receiver's ACCEPT/REJECT of a header."""
    layer_timeout_s: float = 30.0
    """One layer: the sender's send completion, or a receiver's wait for the next layer."""
    header_timeout_s: float = 60.0
    """A registered (expected) transfer fails if no header arrives within this time."""
    register_grace_s: float = 0.5
    """A header for an unregistered request id waits this long for ``expect()`` before REJECT."""
    drain_timeout_s: float = 2.0
    """After an abort, in-flight payloads get this long to land before the connection is dropped."""
    max_control_bytes: int = 16 << 20
    """Largest control frame accepted (guards against a corrupt stream)."""
    ucx_options: tuple[tuple[str, str], ...] = ()
    """UCX settings without the ``UCX_`` prefix, e.g. (("TLS", "tcp,self"),); they override env."""
    ucx_error_handling: bool | None = None
    """UCX endpoint error handling; None = on unless the transports are shared-memory only."""

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "accept_timeout_s", "layer_timeout_s", "header_timeout_s",
                     "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.register_grace_s < 0:
            raise ValueError(f"TransferConfig.register_grace_s must be >= 0, got {self.register_grace_s}")
        if self.max_control_bytes < 1024:
            raise ValueError("TransferConfig.max_control_bytes must be >= 1024")
        for item in self.ucx_options:
            if len(item) != 2 or str(item[0]).startswith("UCX_"):
                raise ValueError(f"ucx_options entries are (NAME, value) without the UCX_ prefix: {item}")

    def ucx_tls(self) -> str:
        """The UCX transport list in effect (config, then env, then UCX's default 'all')."""
        return dict(self.ucx_options).get("TLS", os.environ.get("UCX_TLS", "all"))

    def endpoint_error_handling(self) -> bool:
        if self.ucx_error_handling is not None:
            return self.ucx_error_handling
        tls = {t.strip().lstrip("^") for t in self.ucx_tls().split(",") if t.strip()}
        return not tls or not tls <= _SHARED_MEMORY_TLS


def ucx_available() -> bool:
    return importlib.util.find_spec("ucxx") is not None


def select_backend(env: str | None = None) -> TransferBackend:
    """``WINDSERVE_TRANSFER`` = ucx | tcp picks the engine; unset means UCX when ucxx is installed."""
    choice = (env if env is not None else os.environ.get("WINDSERVE_TRANSFER", "")).strip().lower()
    if choice == "tcp":
        return TransferBackend.TCP
    if choice == "ucx":
        if not ucx_available():
            raise RuntimeError("WINDSERVE_TRANSFER=ucx but the ucxx package is not installed")
        return TransferBackend.UCX
    if choice:
        raise ValueError(f"WINDSERVE_TRANSFER must be 'ucx' or 'tcp', got {choice!r}")
    return TransferBackend.UCX if ucx_available() else TransferBackend.TCP
