"""Images and videos in chat requests (#16): content parts, limits, loading, encoding, prompt assembly.

A user message's content parts `{"type": "image_url", "image_url": {"url": ...}}` / `{"type": "video_url",
"video_url": {"url": ...}}` become, in the prompt, `<|vision_start|><|image_pad|>×N<|vision_end|>` (video:
`<|video_pad|>`), N = the item's merged-patch count from the encoder. The order of work, each step's failures:

1. `MediaCollector` (pure, while the messages are turned into template dicts): the part's shape, the source
   (`data:` URI decoded here; http(s) only to allow-listed hosts; local paths only under the configured root),
   the count and byte limits, and that no text carries a vision special token (nobody may forge pad positions) —
   all 400 before anything is queued;
2. `load_all` (IO, bounded): http(s) fetches with byte, time and redirect limits (each hop's host allow-listed),
   local file reads; a slow, unreachable or failing URL is a 400 naming it;
3. `encode_all`: every item through the EncoderAPI at once (EncodeError -> 400 with its message, EncoderUnavailable
   -> 503 `encoder_unavailable`);
4. `expand` (pure): the tokenized prompt's single pad per item grows to N pads, then the hash view
   (libs/mm/placeholders.py: pad k of an item becomes `mm_token(mm_hash, k)`) and one WireMMItem per item whose offset
   indexes the final token ids. Any vision special the template produced beyond ours is a 400.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from libs.mm.api import Encoded, EncodeError, EncoderAPI, EncoderMissing, EncoderUnavailable
from libs.mm.placeholders import hash_view
from protos.messages import MMKind, WireMMItem
from services.gateway.config import MediaConfig
from services.gateway.protocol import ApiError

_PART_FIELD = {"image_url": MMKind.IMAGE, "video_url": MMKind.VIDEO}


@dataclass(frozen=True)
class VisionTokens:
    """The model's vision special tokens: ids, and their text (what user text must not contain)."""

    start_id: int
    end_id: int
    image_id: int
    video_id: int
    texts: tuple[str, str, str, str]  # start, end, image pad, video pad

    def placeholder(self, kind: MMKind) -> str:
        start, end, image, video = self.texts
        return start + (image if kind is MMKind.IMAGE else video) + end

    def pad_id(self, kind: MMKind) -> int:
        return self.image_id if kind is MMKind.IMAGE else self.video_id

    @classmethod
    def of(cls, model_config: Any, decode: Any) -> VisionTokens | None:
        """From a ModelConfig with a vision tower (None without one) and the tokenizer's decode."""
        ids = (model_config.vision_start_token_id, model_config.vision_end_token_id, model_config.image_token_id,
               model_config.video_token_id)
        if model_config.vision is None or any(i is None for i in ids):
            return None
        texts = tuple(decode([i], skip_special_tokens=False) for i in ids)
        return cls(*ids, texts=texts)  # type: ignore[arg-type]


@dataclass(frozen=True)
class MediaPart:
    kind: MMKind
    param: str  # where in the request (messages.i.content.j), for the error's `param`
    url: str
    data: bytes | None = None  # data: URIs are decoded while collecting
    path: str = ""  # local files: the resolved path under the root
    size: int = 0  # known bytes (data URI, local file); URLs: 0 until fetched


@dataclass
class MediaCollector:
    """Collects a chat request's media parts while its messages become template dicts (step 1 above)."""

    vision: VisionTokens
    config: MediaConfig
    parts: list[MediaPart] = field(default_factory=list)
    known_bytes: int = 0

    def check_text(self, text: str, param: str) -> None:
        for special in self.vision.texts:
            if special in text:
                raise ApiError(400, f"{param}: text may not contain the vision token {special!r} (images go in "
                                    "image_url / video_url content parts)", param=param, code="invalid_content")

    def add(self, part: dict[str, Any], param: str, role: str) -> str:
        """The placeholder text of one image_url / video_url part (400 for anything wrong with it)."""
        kind = _PART_FIELD[part["type"]]
        if role != "user":
            raise ApiError(400, f"{param}: only user messages may carry images or videos", param=param)
        url = _part_url(part, param)
        if len(self.parts) >= self.config.mm_max_items:
            raise ApiError(400, f"more than {self.config.mm_max_items} images / videos in one request (the limit)",
                           param=param, code="too_many_items")
        item = self._source(kind, url, param)
        self.known_bytes += item.size
        if self.known_bytes > self.config.mm_max_total_bytes:
            raise ApiError(400, f"images / videos of more than {self.config.mm_max_total_bytes} bytes in one request "
                                "(the limit)", param=param, code="media_too_large")
        self.parts.append(item)
        return self.vision.placeholder(kind)

    def _source(self, kind: MMKind, url: str, param: str) -> MediaPart:
        scheme = urlsplit(url).scheme.lower() if not url.startswith("/") else ""
        if scheme == "data":
            data = decode_data_uri(url, self.config.mm_max_item_bytes, param)
            return MediaPart(kind, param, url[:32], data=data, size=len(data))
        if scheme in ("http", "https"):
            check_host(url, self.config.url_hosts, param)
            return MediaPart(kind, param, url)
        if scheme in ("file", ""):
            path = local_path(url, self.config.mm_local_root, param)
            size = path.stat().st_size
            if size > self.config.mm_max_item_bytes:
                raise _too_large(param, size, self.config.mm_max_item_bytes)
            return MediaPart(kind, param, url, path=str(path), size=size)
        raise ApiError(400, f"{param}: URL scheme {scheme!r} is not supported (data:, http(s) to allowed hosts, or a "
                            "local path under the configured root)", param=param, code="invalid_url")


def _part_url(part: dict[str, Any], param: str) -> str:
    field_name = part["type"]
    inner = part.get(field_name)
    if set(part) != {"type", field_name} or not isinstance(inner, dict) or not isinstance(inner.get("url"), str) \
            or not set(inner) <= {"url", "detail"} or not inner["url"]:
        raise ApiError(400, f"{param}: a {field_name} part is {{\"type\": \"{field_name}\", \"{field_name}\": "
                            "{\"url\": \"...\"}}", param=param)
    return str(inner["url"])


def _too_large(param: str, size: int, limit: int) -> ApiError:
    return ApiError(400, f"{param}: {size} bytes; one image / video may have at most {limit}", param=param,
                    code="media_too_large")


def decode_data_uri(url: str, max_bytes: int, param: str) -> bytes:
    """The bytes of a base64 `data:` URI (400 when it is not one, or too large)."""
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise ApiError(400, f"{param}: a data URI must be data:<type>;base64,<data>", param=param, code="invalid_url")
    if len(payload) * 3 // 4 > max_bytes + 2:
        raise _too_large(param, len(payload) * 3 // 4, max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{param}: the data URI is not valid base64", param=param, code="invalid_url") from None
    if not data:
        raise ApiError(400, f"{param}: the data URI is empty", param=param, code="invalid_url")
    if len(data) > max_bytes:
        raise _too_large(param, len(data), max_bytes)
    return data


def check_host(url: str, hosts: frozenset[str], param: str) -> None:
    if not hosts:
        raise ApiError(400, f"{param}: fetching http(s) URLs is off on this server (send a data: URI; "
                       "the operator allows hosts with WINDSERVE_MM_URL_HOSTS)",
                       param=param, code="url_not_allowed")
    host = (urlsplit(url).hostname or "").lower()
    if host not in hosts:
        raise ApiError(400, f"{param}: host {host!r} is not on this server's allow-list (WINDSERVE_MM_URL_HOSTS)",
                       param=param,
                       code="url_not_allowed")


def local_path(url: str, root: str, param: str) -> Path:
    """The resolved file a `file://` URL or absolute path names, which must lie under `root`."""
    if not root:
        raise ApiError(400, f"{param}: local paths are off on this server (WINDSERVE_MM_LOCAL_ROOT is empty)",
                       param=param, code="url_not_allowed")
    raw = urlsplit(url).path if url.startswith("file:") else url
    path = Path(os.path.realpath(raw))
    base = Path(os.path.realpath(root))
    if not path.is_relative_to(base) or not path.is_file():
        raise ApiError(400, f"{param}: {raw!r} is not a file under this server's media root", param=param,
                       code="url_not_allowed")
    return path


# --- IO: loading and encoding ------------------------------------------------------------------------------


async def load_all(parts: Sequence[MediaPart], config: MediaConfig) -> list[bytes]:
    """Every part's bytes (URLs fetched concurrently); a 400 names the first part that failed."""
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        datas = await asyncio.gather(*(_load(p, config, client) for p in parts))
    total = sum(len(d) for d in datas)
    if total > config.mm_max_total_bytes:
        raise ApiError(400, f"images / videos of {total} bytes in one request; "
                            f"the limit is {config.mm_max_total_bytes}",
                       code="media_too_large")
    return list(datas)


async def _load(part: MediaPart, config: MediaConfig, client: httpx.AsyncClient) -> bytes:
    if part.data is not None:
        return part.data
    if part.path:
        return await asyncio.to_thread(Path(part.path).read_bytes)
    try:
        async with asyncio.timeout(config.mm_url_timeout_s):
            return await fetch_url(client, part.url, config, part.param)
    except TimeoutError:
        raise ApiError(400, f"{part.param}: {part.url} did not answer within {config.mm_url_timeout_s}s",
                       param=part.param, code="url_fetch_failed") from None
    except httpx.HTTPError as exc:
        raise ApiError(400, f"{part.param}: {part.url} could not be fetched: {exc!r}", param=part.param,
                       code="url_fetch_failed") from None


async def fetch_url(client: httpx.AsyncClient, url: str, config: MediaConfig, param: str) -> bytes:
    """GET `url`, following at most `url_max_redirects` redirects (each to an allowed host), reading at most
    `max_item_bytes` (the caller bounds the time)."""
    for _ in range(config.mm_url_max_redirects + 1):
        check_host(url, config.url_hosts, param)
        async with client.stream("GET", url) as resp:
            if resp.is_redirect:
                url = urljoin(url, resp.headers.get("location", ""))
                continue
            if resp.status_code != 200:
                raise ApiError(400, f"{param}: {url} answered HTTP {resp.status_code}", param=param,
                               code="url_fetch_failed")
            return await _read_capped(resp, config.mm_max_item_bytes, param)
    raise ApiError(400, f"{param}: more than {config.mm_url_max_redirects} redirects", param=param,
                   code="url_fetch_failed")


async def _read_capped(resp: httpx.Response, limit: int, param: str) -> bytes:
    length = resp.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(param, int(length), limit)
    chunks, size = [], 0
    async for chunk in resp.aiter_bytes():
        size += len(chunk)
        if size > limit:
            raise _too_large(param, size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def encode_all(encoder: EncoderAPI | None, request_id: str, parts: Sequence[MediaPart],
                     datas: Sequence[bytes], retry_after_s: int = 1) -> list[Encoded]:
    """Every item through the encoder tier at once: EncodeError -> 400, EncoderUnavailable -> 503."""
    if encoder is None:
        raise ApiError(503, "no encoder client on this gateway", type_="server_error", code="encoder_unavailable",
                       headers={"Retry-After": str(retry_after_s)})
    results = await asyncio.gather(*(encoder.encode(request_id, p.kind, d) for p, d in zip(parts, datas, strict=True)),
                                   return_exceptions=True)
    for part, result in zip(parts, results, strict=True):
        if isinstance(result, EncodeError):
            raise ApiError(400, f"{part.param}: {result}", param=part.param, code="invalid_image")
    for part, result in zip(parts, results, strict=True):
        if isinstance(result, EncoderMissing):
            raise ApiError(400, f"{part.param}: images and videos need an encoder and this deployment runs none: "
                           "start one (make run ARGS=\"--services ...,encoder\", or the compose service encoder)",
                           param=part.param, code="encoder_missing")
    for result in results:
        if isinstance(result, EncoderUnavailable):
            raise ApiError(503, f"the encoder tier is unavailable: {result}", type_="server_error",
                           code="encoder_unavailable", headers={"Retry-After": str(retry_after_s)})
        if isinstance(result, BaseException):
            raise result
    return list(results)  # type: ignore[arg-type]


# --- prompt assembly (pure) ------------------------------------------------------------------------------------


def expand(ids: Sequence[int], vision: VisionTokens, parts: Sequence[MediaPart],
           encoded: Sequence[Encoded]) -> tuple[list[int], list[WireMMItem]]:
    """The tokenized prompt (one pad per item) with item i's pad grown to its N tokens, in the hash view, and the
    items' WireMMItems. 400 when the prompt's vision tokens are not exactly ours (one start / pad / end per item)."""
    pads = [i for i, t in enumerate(ids) if t in (vision.image_id, vision.video_id)]
    starts = sum(1 for t in ids if t == vision.start_id)
    ends = sum(1 for t in ids if t == vision.end_id)
    if len(pads) != len(parts) or starts != len(parts) or ends != len(parts) or any(
            ids[p] != vision.pad_id(part.kind) for p, part in zip(pads, parts, strict=False)):
        raise ApiError(400, "the prompt carries vision tokens that are not this request's images (a chat template or "
                            "tool text produced them)", param="messages", code="invalid_content")
    out: list[int] = []
    items: list[WireMMItem] = []
    prev = 0
    for p, enc in zip(pads, encoded, strict=True):
        out.extend(ids[prev:p])
        items.append(WireMMItem(mm_hash=enc.mm_hash, kind=enc.kind, offset=len(out), num_tokens=enc.num_tokens,
                                grid_thw=list(enc.grid_thw), encoder_instance=enc.encoder_instance))
        out.extend([ids[p]] * enc.num_tokens)
        prev = p + 1
    out.extend(ids[prev:])
    return hash_view(out, [(i.mm_hash, i.offset, i.num_tokens) for i in items]), items


def model_view(ids: Sequence[int], items: Sequence[WireMMItem], vision: VisionTokens) -> list[int]:
    """The expanded prompt as the model's token ids: each item's pseudo tokens back to its pad id (what a client
    asking for `return_token_ids` should see; the pseudo tokens are internal, never vocabulary ids)."""
    out = list(ids)
    for item in items:
        out[item.offset:item.offset + item.num_tokens] = [vision.pad_id(item.kind)] * item.num_tokens
    return out
