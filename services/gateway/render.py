"""Pure rendering: SSE framing, incremental detokenization with stop strings, OpenAI logprob objects."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import orjson

from protos.messages import TokenLogprob

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
        self._decode = decode
        self._stops = tuple(stops)
        self._ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found: the choice is complete

    def add(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(ids)
        full = self._decode(self._ids)
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
        return self._emit(self._decode(self._ids), None)

    def _emit(self, full: str, end: int | None) -> str:
        end = len(full) if end is None else end
        if end <= len(self.text):
            return ""
        delta = full[len(self.text):end]
        self.text += delta
        return delta


# --- logprobs ---------------------------------------------------------------------------------


def token_text(token_id: int, decode: Decode, as_ids: bool) -> str:
    """How a token is named in logprobs: its text, or `token_id:N` (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}" if as_ids else decode([token_id])


def completion_logprobs(lps: Sequence[TokenLogprob], decode: Decode, as_ids: bool, offset: int) -> dict[str, Any]:
    """Legacy completions format. top_logprobs holds the requested alternatives plus the sampled
    token (as OpenAI documents: up to logprobs + 1 entries). `offset`: text length before these tokens."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp in lps:
        name = token_text(lp.token_id, decode, as_ids)
        top = {token_text(t, decode, as_ids): v for t, v in lp.top.items()}
        top.setdefault(name, lp.logprob)
        tokens.append(name)
        token_logprobs.append(lp.logprob)
        tops.append(top)
        offsets.append(offset)
        offset += len(name)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _chat_entry(name: str, logprob: float) -> dict[str, Any]:
    return {"token": name, "logprob": logprob, "bytes": list(name.encode("utf-8"))}


def chat_logprobs(lps: Sequence[TokenLogprob], decode: Decode, as_ids: bool, top_k: int) -> dict[str, Any]:
    """Chat format: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    content = []
    for lp in lps:
        entry = _chat_entry(token_text(lp.token_id, decode, as_ids), lp.logprob)
        ranked = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_k]
        entry["top_logprobs"] = [_chat_entry(token_text(t, decode, as_ids), v) for t, v in ranked]
        content.append(entry)
    return {"content": content}


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
