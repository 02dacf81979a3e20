"""Pure rendering: SSE framing, incremental detokenization with stop strings, OpenAI logprob objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from protos.messages import WireTokenLogprob

SSE_DONE = b"data: [DONE]\n\n"
_REPLACEMENT = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence

Decode = Callable[[list[int]], str]


def sse_event(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying a JSON object (`data: {...}` and a blank line)."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def parse_sse(raw: bytes) -> list[Any]:
    """Inverse of the framing above (for tests and tools): the JSON payloads, '[DONE]' kept as a string."""
    out: list[Any] = []
    for event in raw.split(b"\n\n"):
        event = event.strip()
        if not event:
            continue
        if not event.startswith(b"data: "):
            raise ValueError(f"not an SSE data event: {event[:40]!r}")
        payload = event[len(b"data: "):]
        out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def first_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index where the earliest stop string begins in text[start:] (absolute), or None."""
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that must not be emitted yet: an incomplete UTF-8 sequence, or
    the longest suffix that could still grow into a stop string."""
    complete = text.rstrip(_REPLACEMENT)
    partial = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(complete)), partial, -1):
            if complete.endswith(s[:k]):
                partial = k
                break
    # The half character may complete a stop string that begins in the complete text before it.
    return len(text) - len(complete) + partial


class TextAssembler:
    """Turns one choice's token ids into text deltas that are never retracted.

    Each `add()` decodes all ids so far (byte-level and BPE decoders are prefix-stable once complete
    characters are out) and emits only what is safe: text after a stop string is cut, and text that
    might be the start of a stop string (or half a UTF-8 character) waits for the next tokens.
    """

    def __init__(self, decode: Decode, stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self._stops = tuple(stops)
        self._ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found: the choice is complete

    def add(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(ids)
        full = self.decode(self._ids)
        # A stop that ends inside held-back text starts at most max(len(stop)) chars before it.
        start = max(0, len(self.text) - max((len(s) for s in self._stops), default=0))
        cut = first_stop(full, self._stops, start)
        if cut is not None:
            self.stopped = True
            return self._emit(full, max(cut, len(self.text)))
        return self._emit(full, len(full) - held_back(full, self._stops))

    def finish(self) -> str:
        """The stream ended without a stop string: release what was held back."""
        if self.stopped:
            return ""
        return self._emit(self.decode(self._ids), None)

    def _emit(self, full: str, end: int | None) -> str:
        end = len(full) if end is None else end
        if end <= len(self.text):
            return ""
        delta = full[len(self.text):end]
        self.text += delta
        return delta


# --- logprobs ---------------------------------------------------------------------------------


def text_offsets(decode: Decode, ids: Sequence[int], start: int, limit: int | None = None) -> list[int]:
    """Completions `text_offset` of ids[start:]: where each token's text begins in the returned text,
    i.e. the length of the decoded text before it (without a trailing half character; at most `limit`,
    the length of a text cut at a stop string)."""
    out = []
    for i in range(start, len(ids)):
        offset = len(decode(list(ids[:i])).rstrip(_REPLACEMENT))
        out.append(offset if limit is None else min(offset, limit))
    return out


def bytes_name(raw: bytes) -> str:
    """OpenAI's name of a token that is not valid UTF-8 on its own, e.g. `bytes:\\xe2\\x80`."""
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


@dataclass(frozen=True)
class TokenNames:
    """How tokens are named in logprobs. A token whose bytes are valid UTF-8 is named by its text;
    otherwise (half a character, a lone byte 128-255) `bytes:\\x..` of its raw bytes, as OpenAI does;
    `token_id:N` with vLLM's return_tokens_as_token_ids. `bytes` is always the token's raw bytes."""

    decode: Decode
    as_ids: bool = False
    token_bytes: Callable[[int], bytes] | None = None

    def raw(self, token_id: int) -> bytes:
        if self.token_bytes is not None:
            return self.token_bytes(token_id)
        return self.decode([token_id]).encode("utf-8", errors="surrogatepass")

    def name(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        raw = self.raw(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return bytes_name(raw)

    def unique(self, token_ids: Sequence[int]) -> dict[int, str]:
        """Names of distinct tokens that never collide (a `top_logprobs` dict keeps every entry): the
        first token to claim a name keeps it, a later one with the same text is named `token_id:N`."""
        names: dict[int, str] = {}
        taken: set[str] = set()
        for t in token_ids:
            if t in names:
                continue
            name = self.name(t)
            names[t] = name if name not in taken else f"token_id:{t}"
            taken.add(names[t])
        return names


def _ranked(lp: WireTokenLogprob) -> list[tuple[int, float]]:
    return sorted(lp.top.items(), key=lambda kv: (-kv[1], kv[0]))


def completion_logprobs(lps: Sequence[WireTokenLogprob], names: TokenNames, offsets: Sequence[int]) -> dict[str, Any]:
    """Legacy completions format. top_logprobs holds the requested alternatives plus the sampled
    token (as OpenAI documents: up to logprobs + 1 entries), keyed without collisions (the sampled
    token keeps its name). `offsets`: each token's text_offset (see `text_offsets`)."""
    tokens, token_logprobs, tops = [], [], []
    for lp in lps:
        ranked = _ranked(lp)
        unique = names.unique([lp.token_id] + [t for t, _ in ranked])
        top = {unique[t]: v for t, v in ranked}
        top[unique[lp.token_id]] = lp.logprob
        tokens.append(unique[lp.token_id])
        token_logprobs.append(lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": list(offsets)}


def _chat_entry(names: TokenNames, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": names.name(token_id), "logprob": logprob, "bytes": list(names.raw(token_id))}


def chat_logprobs(lps: Sequence[WireTokenLogprob], names: TokenNames, top_k: int) -> dict[str, Any]:
    """Chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for lp in lps:
        entry = _chat_entry(names, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_chat_entry(names, t, v) for t, v in _ranked(lp)[:top_k]]
        content.append(entry)
    return {"content": content}


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
