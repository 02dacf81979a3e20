"""Plain-TCP backend: payload bytes inline on the control stream (asyncio streams)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from ..buffers import host_bytes
from ..config import TransferBackend
from ..errors import TransferError, TransferTimeout
from ..frames import Layer, encode_frame
from .base import DataPlane, done_future


class StreamLink:
    """Payload bytes inline on the control TCP stream."""

    def __init__(self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader, layer_timeout_s: float) -> None:
        self._writer = writer
        self._reader = reader
        self._timeout = layer_timeout_s

    async def send(self, seq: int, position: int, data: torch.Tensor) -> None:
        # Both writes happen without an await between them, so no other frame can interleave.
        self._writer.write(encode_frame(Layer(seq, position, data.numel())))
        if data.numel():
            self._writer.write(host_bytes(data.cpu()))
        try:
            async with asyncio.timeout(self._timeout):
                await self._writer.drain()
        except TimeoutError:
            raise TransferTimeout(f"layer {position} of transfer {seq}: socket did not drain in "
                                  f"{self._timeout:.3g}s") from None
        except ConnectionError as exc:
            raise TransferError(f"layer {position} of transfer {seq}: connection broke: {exc}") from exc

    async def receive(self, seq: int, position: int, nbytes: int, landing: torch.Tensor | None) -> asyncio.Future:
        # Runs inside the reader loop: the payload follows the LAYER frame on the stream.
        data = await self._reader.readexactly(nbytes) if nbytes else b""
        if landing is not None and nbytes:
            src = np.frombuffer(data, dtype=np.uint8)
            if landing.is_cuda:
                landing.copy_(torch.from_numpy(src.copy()))
            else:
                landing.numpy()[:] = src
        return done_future()

    async def close(self) -> None:
        return None


class TcpDataPlane(DataPlane):
    backend = TransferBackend.TCP

    async def open_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nonce: int,
                        peer_address: str | None) -> StreamLink:
        return StreamLink(writer, reader, self.config.layer_timeout_s)
