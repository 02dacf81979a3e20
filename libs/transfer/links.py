"""Data planes: how payload bytes move once the control connection announced a LAYER.

``StreamLink`` writes payloads inline on the control stream (plain-TCP fallback).
``UcxLink`` sends each payload as one UCX tagged message between the two engines' workers;
the control stream still carries the LAYER announcement, so a receiver only ever posts
receives for payloads the sender committed to, and closing the UCX endpoint cancels them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from .buffers import host_bytes, ucx_buffer
from .errors import TransferError, TransferTimeout
from .protocol import encode_layer, payload_tag


def _done_future() -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(None)
    return fut


class StreamLink:
    """Payload bytes inline on the control TCP stream."""

    def __init__(self, writer: asyncio.StreamWriter, reader: asyncio.StreamReader, layer_timeout_s: float) -> None:
        self._writer = writer
        self._reader = reader
        self._timeout = layer_timeout_s

    async def send(self, seq: int, position: int, data: torch.Tensor) -> None:
        # Both writes happen without an await between them, so no other frame can interleave.
        self._writer.write(encode_layer(seq, position, data.numel()))
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
        return _done_future()

    async def close(self) -> None:
        return None


class UcxLink:
    """Payload bytes as UCX tagged messages on an endpoint between the two engines' workers."""

    def __init__(self, endpoint: Any, nonce: int, writer: asyncio.StreamWriter, layer_timeout_s: float) -> None:
        self._ep = endpoint
        self._writer = writer
        self._nonce = nonce
        self._timeout = layer_timeout_s

    async def send(self, seq: int, position: int, data: torch.Tensor) -> None:
        self._writer.write(encode_layer(seq, position, data.numel()))
        if not data.numel():
            return
        tag = payload_tag(self._nonce, seq, position)
        try:
            async with asyncio.timeout(self._timeout):
                await self._ep.send(ucx_buffer(data), tag=tag, force_tag=True)
        except TimeoutError:
            raise TransferTimeout(f"layer {position} of transfer {seq}: UCX send did not complete in "
                                  f"{self._timeout:.3g}s") from None
        except Exception as exc:  # ucxx raises its own error types (canceled, peer failure, ...)
            raise TransferError(f"layer {position} of transfer {seq}: UCX send failed: {exc!r}") from exc

    async def receive(self, seq: int, position: int, nbytes: int, landing: torch.Tensor | None) -> asyncio.Future:
        if not nbytes:
            return _done_future()
        # A payload nobody wants still has to be received, or it would sit in UCX's
        # unexpected-message queue (and keep the sender's send pending) forever.
        buf = landing if landing is not None else torch.empty(nbytes, dtype=torch.uint8)
        tag = payload_tag(self._nonce, seq, position)
        return asyncio.ensure_future(self._ep.recv(ucx_buffer(buf), tag=tag, force_tag=True))

    async def close(self) -> None:
        # Closing the endpoint cancels every request still posted on it, so no buffer is
        # written after this returns. The period bounds how long UCX may block the loop.
        ep, self._ep = self._ep, None
        if ep is not None:
            ep.abort(period=10**8, max_attempts=1)
