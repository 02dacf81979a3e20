"""UCX backend on ``ucxx``: payloads are tagged messages between the two engines' UCX workers.

The control stream still carries each LAYER announcement, so a receiver only ever posts receives
for payloads the sender committed to, and closing the UCX endpoint cancels them. ``ucxx`` is
imported only when an engine starts, so this module loads on hosts without it.
"""

from __future__ import annotations

import asyncio
import base64
import os
from typing import Any

import numpy as np
import torch

from ..buffers import ucx_buffer
from ..config import TransferBackend, TransferConfig
from ..errors import TransferError, TransferTimeout
from ..frames import Layer, encode_frame
from ..protocol import payload_tag
from .base import DataPlane, done_future


class UcxLink:
    """Payload bytes as UCX tagged messages on an endpoint between the two engines' workers."""

    def __init__(self, endpoint: Any, nonce: int, writer: asyncio.StreamWriter, layer_timeout_s: float) -> None:
        self._ep = endpoint
        self._writer = writer
        self._nonce = nonce
        self._timeout = layer_timeout_s

    async def send(self, seq: int, position: int, data: torch.Tensor) -> None:
        self._writer.write(encode_frame(Layer(seq, position, data.numel())))
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
            return done_future()
        # A payload nobody wants still has to be received, or it would sit in UCX's
        # unexpected-message queue (and keep the sender's send pending) forever.
        buf = landing if landing is not None else torch.empty(nbytes, dtype=torch.uint8)
        tag = payload_tag(self._nonce, seq, position)
        return asyncio.ensure_future(self._ep.recv(ucx_buffer(buf), tag=tag, force_tag=True))

    # -- tagged payloads outside transfers (the direct path, docs/transfer.md "Messages") ------------
    @property
    def nonce(self) -> int:
        return self._nonce

    def post_recv(self, tag: int, data: torch.Tensor | np.ndarray) -> asyncio.Future:
        """Post a tagged receive into ``data`` now (before this returns, so a message sent after it cannot miss
        it); the future is done when the bytes landed. The request keeps ``data`` alive until then; closing
        the link cancels it."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMaskFull

        ep = self._live_endpoint()
        req = ep._ep.tag_recv(Array(_host_or_device(data)), Tag(tag), TagMaskFull)
        return _hold(asyncio.ensure_future(req.wait()), data)

    def post_send(self, tag: int, data: torch.Tensor | np.ndarray) -> asyncio.Future:
        """Issue a tagged send of ``data`` now; the future is done when ``data`` may be reused."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        ep = self._live_endpoint()
        req = ep._ep.tag_send(Array(_host_or_device(data)), Tag(tag))
        return _hold(asyncio.ensure_future(req.wait()), data)

    def _live_endpoint(self) -> Any:
        ep = self._ep
        if ep is None or ep.closed:
            raise TransferError("UCX endpoint closed")
        ep._ep.raise_on_error()
        return ep

    async def close(self) -> None:
        # Closing the endpoint cancels every request still posted on it, so no buffer is
        # written after this returns. The period bounds how long UCX may block the loop.
        ep, self._ep = self._ep, None
        if ep is not None:
            ep.abort(period=10**8, max_attempts=1)


def _host_or_device(data: torch.Tensor | np.ndarray) -> object:
    return data if isinstance(data, np.ndarray) else ucx_buffer(data)


# windserve's UCX defaults, each unless the environment (UCX_<NAME>) or TransferConfig.ucx_options sets it:
# the tcp transport's segments at 256 KiB instead of UCX's 8 KiB: a 64 MiB message over loopback moved at
# 1.1 GB/s with 8 KiB segments and 3.2-3.7 GB/s with 256 KiB-4 MiB ones (bench.gcache's raw baseline, 2-core
# VM), for 256 KiB of buffer per segment in flight; other transports ignore them
UCX_DEFAULTS = (("TCP_TX_SEG_SIZE", "256k"), ("TCP_RX_SEG_SIZE", "256k"))


def ucx_context_options(options: tuple[tuple[str, str], ...]) -> dict[str, str]:
    """The options a UCX context is created with: `UCX_DEFAULTS` the environment leaves unset, then `options`."""
    out = {k: v for k, v in UCX_DEFAULTS if f"UCX_{k}" not in os.environ}
    out.update(dict(options))
    return out


def _hold(fut: asyncio.Future, data: object) -> asyncio.Future:
    """Keep ``data`` referenced until the request is over (its memory must not be reused before)."""
    def release(_fut: asyncio.Future, _keep: object = data) -> None:
        pass  # (the closure is the reference; dropped once the callback ran)

    fut.add_done_callback(release)
    return fut


class UcxDataPlane(DataPlane):
    """Each engine owns its UCX context + worker (progress thread, Python-future notifier),
    created in ``start()`` inside the running event loop; UCX settings come from
    ``config.ucx_options`` and then the ``UCX_*`` environment (e.g. ``UCX_TLS=sm,self``)."""

    backend = TransferBackend.UCX

    def __init__(self, config: TransferConfig) -> None:
        super().__init__(config)
        self._ctx: Any = None
        self._progress: Any = None

    async def start(self) -> None:
        from ucxx._lib_async import ApplicationContext
        from ucxx._lib_async.application_context import ProgressTasks
        from ucxx._lib_async.continuous_ucx_progress import ThreadMode

        loop = asyncio.get_running_loop()
        previous = ProgressTasks.get(loop)
        self._ctx = ApplicationContext(ucx_context_options(self.config.ucx_options), progress_mode="thread",
                                       enable_python_future=True)
        # ucxx keeps one progress task per event loop in a module-level dict, so a second
        # context on the same loop would never be progressed; each engine owns its thread.
        task = ProgressTasks.get(loop)
        if task is not previous and task is not None and task.worker is self._ctx.worker:
            self._progress = ProgressTasks.pop(loop)
            if previous is not None:
                ProgressTasks[loop] = previous
        else:
            self._progress = ThreadMode(self._ctx.worker, loop)

    async def stop(self) -> None:
        if self._ctx is None:
            return
        # Wake the notifier first: otherwise its 1 s wait blocks stop_notifier_thread().
        self._ctx.worker.stop_request_notifier_thread()
        self._ctx.stop_notifier_thread()
        self._ctx.worker.stop_progress_thread()
        self._ctx, self._progress = None, None

    @property
    def context(self) -> Any:
        """The ``ucxx`` ApplicationContext (None until started)."""
        return self._ctx

    def local_address(self) -> str | None:
        return base64.b64encode(bytes(self._ctx.worker_address)).decode() if self._ctx else None

    async def open_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, nonce: int,
                        peer_address: str | None) -> UcxLink:
        import ucxx

        if not peer_address:
            raise TransferError("peer sent no UCX worker address")
        address = ucxx.get_ucx_address_from_buffer(base64.b64decode(peer_address))
        try:
            ep = await self._ctx.create_endpoint_from_worker_address(
                address, endpoint_error_handling=self.config.endpoint_error_handling())
        except Exception as exc:
            raise TransferError(f"UCX cannot reach the peer worker (UCX_TLS={self.config.ucx_tls()}): "
                                f"{exc!r}") from exc
        return UcxLink(ep, nonce, writer, self.config.layer_timeout_s)
