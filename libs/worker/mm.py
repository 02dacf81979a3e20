"""Image / video embeddings of a request, fetched from the encoder tier before the request enters the engine (#16).

Every engine role gets them the same way: `EmbeddingFetcher.fetch(items)` -> `MMEmbeddings` (one bounded
`EncoderAPI.fetch`, rows checked against the items), attached to the engine `Request`. A fetch that fails or runs
past its bound raises `EncoderUnavailable`; the role turns that into an error chunk (the client's 503), so a request
never waits on a dead encoder and never holds KV while it waits (the fetch comes before admission).

Also here (pure): `mm_refusal`, why a GenerateRequest's `mm_items` cannot be served by this model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import torch

from libs.engine.mm import MMEmbeddings
from libs.mm.api import Encoded, EncoderAPI, EncoderUnavailable
from libs.mm.placeholders import MM_TOKEN_FLAG, mm_token
from protos.messages import MMKind, WireMMItem


def mm_refusal(token_ids: Sequence[int], items: Sequence[WireMMItem], has_vision: bool) -> str | None:
    """Why `items` do not fit `token_ids` (positions outside the prompt, overlapping, pseudo tokens that are not the
    items' own, a model without a vision tower), or None. Pseudo tokens are the only ids allowed beyond the
    vocabulary, and only where an item says its rows go."""
    if not items:
        return None
    if not has_vision:
        return "this model has no vision tower: it cannot take images or videos"
    covered: set[int] = set()
    for i, item in enumerate(items):
        end = item.offset + item.num_tokens
        if end > len(token_ids):
            return f"mm_items.{i} at [{item.offset}, {end}) lies outside a prompt of {len(token_ids)} tokens"
        span = range(item.offset, end)
        if covered.intersection(span):
            return f"mm_items.{i} overlaps an earlier item"
        covered.update(span)
        if any(token_ids[item.offset + k] != mm_token(item.mm_hash, k) for k in range(item.num_tokens)):
            return f"mm_items.{i}: the prompt does not carry its pseudo tokens at [{item.offset}, {end})"
    stray = next((p for p, t in enumerate(token_ids) if t >= MM_TOKEN_FLAG and p not in covered), None)
    if stray is not None:
        return f"prompt position {stray} holds a multimodal pseudo token that no mm_item covers"
    return None


class LazyEncoder:
    """An EncoderAPI built on first use by `make` (one build at a time; a failed build is tried again by the next
    call). Callers bound the wait (EmbeddingFetcher's timeout covers the build)."""

    def __init__(self, make: Callable[[], Awaitable[EncoderAPI]]) -> None:
        self._make = make
        self._encoder: EncoderAPI | None = None
        self._lock = asyncio.Lock()

    async def _get(self) -> EncoderAPI:
        async with self._lock:
            if self._encoder is None:
                try:
                    self._encoder = await self._make()
                except (EncoderUnavailable, asyncio.CancelledError):
                    raise
                except Exception as exc:  # e.g. the registry could not be listed
                    raise EncoderUnavailable(f"the encoder client could not start: {exc!r}") from exc
            return self._encoder

    async def encode(self, request_id: str, kind: MMKind, data: bytes) -> Encoded:
        return await (await self._get()).encode(request_id, kind, data)

    async def fetch(self, items: Sequence[WireMMItem], dtype: torch.dtype) -> list[torch.Tensor]:
        return await (await self._get()).fetch(items, dtype)


class EmbeddingFetcher:
    """Bounded fetch of a request's embedding rows through an EncoderAPI (the real EncoderClient, or a test's)."""

    def __init__(self, encoder: EncoderAPI, dtype: torch.dtype = torch.float32, timeout_s: float = 10.0) -> None:
        self.encoder = encoder
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.fetched = 0  # items fetched
        self.failures = 0

    async def fetch(self, items: Sequence[WireMMItem]) -> MMEmbeddings | None:
        """The rows of `items` (None when there are none); EncoderUnavailable when the encoder tier cannot give
        them within `timeout_s` or gives rows of the wrong shape."""
        if not items:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                rows = await self.encoder.fetch(items, self.dtype)
        except TimeoutError:
            self.failures += 1
            raise EncoderUnavailable(f"the embeddings of {len(items)} item(s) did not arrive within "
                                     f"{self.timeout_s}s") from None
        except EncoderUnavailable:
            self.failures += 1
            raise
        if len(rows) != len(items) or any(r.shape[0] != i.num_tokens for r, i in zip(rows, items, strict=False)):
            self.failures += 1
            raise EncoderUnavailable(f"the encoder returned {[tuple(r.shape) for r in rows]} rows for items of "
                                     f"{[i.num_tokens for i in items]} tokens")
        self.fetched += len(items)
        return MMEmbeddings(tuple(i.offset for i in items), tuple(rows))

    def counts(self) -> dict[str, int]:
        return {"mm_items_fetched": self.fetched, "mm_fetch_failures": self.failures}


async def fetch_embeddings(fetcher: EmbeddingFetcher | None, items: Sequence[WireMMItem]) -> MMEmbeddings | None:
    """The embeddings of a request's `items` (None without any); EncoderUnavailable also when this worker has no
    encoder client (a model without a vision tower refuses such requests earlier, in `mm_refusal`)."""
    if not items:
        return None
    if fetcher is None:
        raise EncoderUnavailable("this worker has no encoder client to fetch image embeddings with")
    return await fetcher.fetch(items)
