"""EncoderClient: the EncoderAPI over NATS (control) and the transfer engine (embedding rows).

CONTRACT STUB — the encoder work implements it. Construction and lifecycle, as gateway and workers use it:

    client = EncoderClient(bus, namespace, view, engine=None)   # engine: a started KVTransferEngine (workers)
    await client.start(); ...; await client.close()

`encode` picks the encoder by consistent hashing of the content hash over the live encoders in `view` (so the
same image meets the same cache), bounded by the config's timeouts; `fetch` needs `engine`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from libs.mm.api import Encoded, EncoderUnavailable
from protos.messages import MMKind, WireMMItem


class EncoderClient:
    def __init__(self, bus: Any, namespace: str, view: Any, engine: Any = None, config: Any = None) -> None:
        self.bus, self.namespace, self.view, self.engine, self.config = bus, namespace, view, engine, config

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def encode(self, request_id: str, kind: MMKind, data: bytes) -> Encoded:
        raise EncoderUnavailable("no encoder client in this build (contract stub)")

    async def fetch(self, items: Sequence[WireMMItem], dtype: torch.dtype) -> list[torch.Tensor]:
        raise EncoderUnavailable("no encoder client in this build (contract stub)")
