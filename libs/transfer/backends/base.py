"""The data-plane seam: one ``DataPlane`` per engine, one ``Link`` per control connection."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch

from ..config import TransferBackend, TransferConfig


class Link(Protocol):
    """Moves one connection's payloads; the control stream has already announced each of them."""

    async def send(self, seq: int, position: int, data: torch.Tensor) -> None:
        """Write the LAYER frame and its bytes; returns (bounded) when ``data`` may be reused."""

    async def receive(self, seq: int, position: int, nbytes: int, landing: torch.Tensor | None) -> asyncio.Future:
        """Take the announced payload into ``landing`` (None: consume and drop). The future is done
        when the bytes have landed."""

    async def close(self) -> None:
        """After this returns no buffer is read or written by this link any more."""


class DataPlane(ABC):
    """One engine's side of a backend: started with the engine, opens a ``Link`` per connection."""

    backend: ClassVar[TransferBackend]

    def __init__(self, config: TransferConfig) -> None:
        self.config = config

    async def start(self) -> None:  # noqa: B027  (optional hook: the TCP backend has nothing to start)
        """Called inside the running event loop by ``engine.start()``."""

    async def stop(self) -> None:  # noqa: B027
        """Release what ``start`` acquired (connections' links are closed already)."""

    def local_address(self) -> str | None:
        """This engine's data-plane address, sent in HELLO / HELLO_ACK (None: the control stream)."""
        return None

    @abstractmethod
    async def open_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nonce: int,
                        peer_address: str | None) -> Link:
        """The link for a connection whose handshake just gave the peer's data-plane address."""


def done_future() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut
