"""What gateway and workers need from the encoder tier (#16), typed so that both sides can be built and unit
tested against it: the real client (`libs/mm/client.py`, NATS + transfer engine) and an in-process one
(`libs/mm/local.py`, unit tests only) implement it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from protos.messages import MMKind, WireMMItem


class EncodeError(ValueError):
    """The input itself is bad or over a limit (the client gets a 400 with this message)."""


class EncoderUnavailable(RuntimeError):
    """No encoder answered within its bound, or the embedding was gone (the client gets a 503, or a retry)."""


class EncoderMissing(EncoderUnavailable):
    """The deployment runs no encoder: none has registered since the client started, past its start-up grace.
    Permanent until one is started, so the client gets a 400 that says so, not a 503 to retry."""


@dataclass(frozen=True)
class Encoded:
    mm_hash: int
    kind: MMKind
    num_tokens: int
    grid_thw: tuple[int, int, int]
    encoder_instance: str
    cached: bool = False


class EncoderAPI(Protocol):
    async def encode(self, request_id: str, kind: MMKind, data: bytes) -> Encoded:
        """Embed `data` (file bytes) on the encoder its content hash maps to and keep it there; raises EncodeError
        for bad input, EncoderUnavailable when no encoder serves it in time."""
        ...

    async def fetch(self, items: Sequence[WireMMItem], dtype: torch.dtype) -> list[torch.Tensor]:
        """The embedding rows ``[num_tokens, hidden]`` of each item, in order (over the transfer engine);
        raises EncoderUnavailable when an encoder is gone or no longer holds one."""
        ...
