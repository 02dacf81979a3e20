"""The Anthropic Messages API (`POST /v1/messages`), the one coding agents of the Claude Code family call.

A Messages request is translated into a chat completion request (system prompt, text / image blocks, `tool_use`
and `tool_result` blocks, tools with `input_schema`, `tool_choice`, stop sequences) and runs through the chat
pipeline unchanged: the same validation, template, grammar-constrained tool calls, reasoning split, admission,
routing and failover. Its answer is rendered back as a Message (content blocks `thinking`, `text`, `tool_use`;
`stop_reason`; usage), whole or as the Messages SSE events (`message_start` … `message_stop`). Errors on this
path use Anthropic's error body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.protocol import ApiError, ChatCompletionRequest, chat_request

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class MessagesRequest(BaseModel):
    """The Messages API request body (fields this server serves; any other is a 400)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = Field(default=None, description="accepted; the model's template decides")
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class MessagesErrorDetail(BaseModel):
    type: str
    message: str


class MessagesErrorResponse(BaseModel):
    """Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`."""

    type: Literal["error"]
    error: MessagesErrorDetail


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    max_tokens: int = Field(default=1, ge=1)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


# --- request: Messages -> chat ------------------------------------------------------------------------------------


def _text(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise ApiError(400, f"{where}: a string or a list of text blocks", param=where)
    texts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ApiError(400, f"{where}.{i}: a {block.get('type')!r} block is not allowed here (text only)",
                           param=f"{where}.{i}")
        texts.append(block["text"])
    return "".join(texts)


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
    elif source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise ApiError(400, f"{where}: an image source is base64 (media_type, data) or url", param=where)
    return {"type": "image_url", "image_url": {"url": url}}


def _message(message: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user turn's `tool_result` blocks become `tool` messages."""
    where = f"messages.{index}"
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant") or set(message) - {"role", "content"}:
        raise ApiError(400, f"{where}: a message has a role (user or assistant) and content", param=where)
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: a string or a list of blocks", param=f"{where}.content")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.content.{j}"
        if not isinstance(block, dict):
            raise ApiError(400, f"{at}: a block is an object with a type", param=at)
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text([block], at)})
        elif kind == "image" and role == "user":
            parts.append(_image(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": block.get("id") or f"toolu_{index}_{j}", "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            body = block.get("content", "")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(body, f"{at}.content") if body else ""})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise ApiError(400, f"{at}: a {kind!r} block is not supported in a {role} message", param=at)
    out = list(results)
    if parts or not (calls or results):
        out.append({"role": role, "content": parts})
    if calls:
        if out and out[-1]["role"] == "assistant":
            out[-1]["tool_calls"] = calls
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": calls})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """(chat tool_choice, parallel tool calls) of a Messages tool_choice."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise ApiError(400, f"tool_choice.type {kind!r}: auto, any, tool or none", param="tool_choice")
    return mapped, parallel


def to_chat(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that serves `body` (streaming asks for the usage chunk too)."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": _text(body.system, "system")})
    calls: set[str] = set()  # the tool_use ids of the assistant turn before: what a tool_result may answer
    for i, message in enumerate(body.messages):
        turn = _message(message, i)
        for m in turn:
            if m["role"] == "tool" and m["tool_call_id"] not in calls:
                raise ApiError(400, f"messages.{i}: a tool_result for {m['tool_call_id']!r}, which no tool_use of "
                                    "the assistant turn before it has", param=f"messages.{i}")
        calls = {c["id"] for m in turn for c in m.get("tool_calls") or ()}
        messages += turn
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_tokens,
                            "stream": body.stream}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for name, value in (("stop", body.stop_sequences), ("temperature", body.temperature), ("top_p", body.top_p),
                        ("top_k", body.top_k)):
        if value is not None:
            chat[name] = value
    if body.thinking and body.thinking.get("type") == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}  # the templates that can think take this
    if body.metadata and isinstance(body.metadata.get("user_id"), str):
        chat["user"] = body.metadata["user_id"]
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"), "parameters": t.get("input_schema")}}
            for t in body.tools]
        choice, parallel = _tool_choice(body.tool_choice)
        if choice is not None:
            chat["tool_choice"] = choice
        chat["parallel_tool_calls"] = parallel
    return chat_request(chat, "Messages")


# --- response: chat -> Message ------------------------------------------------------------------------------------


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    return {"input_tokens": usage.get("prompt_tokens", 0), "output_tokens": usage.get("completion_tokens", 0),
            "cache_read_input_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def _message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def to_message(chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as a Message."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for call in msg.get("tool_calls") or ():
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    return {"id": _message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"),
            "stop_sequence": None, "usage": _usage(chat.get("usage"))}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n".encode()


class _Blocks:
    """The content blocks of a streamed Message: a new block whenever the kind of delta changes."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # "thinking", "text" or "tool_use:<call index>"

    def switch(self, kind: str, start: dict[str, Any]) -> list[bytes]:
        if kind == self.kind:
            return []
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return [*out, _event("content_block_start", {"index": self.index, "content_block": start})]

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self.index, "delta": delta})


async def to_events(chunks: AsyncIterator[bytes], model: str) -> AsyncIterator[bytes]:
    """The chat completion's SSE stream as the Messages SSE events."""
    blocks, stop_reason, usage, started = _Blocks(), "end_turn", None, False
    async for raw in chunks:
        for line in raw.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                yield _event("error", {"error": error_body(503, chunk["error"]["message"])["error"]})
                return
            if not started:
                started = True
                yield _event("message_start", {"message": {
                    "id": _message_id(chunk["id"]), "type": "message", "role": "assistant", "model": model,
                    "content": [], "stop_reason": None, "stop_sequence": None, "usage": _usage(None)}})
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    for out in blocks.switch("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield out
                    yield blocks.delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]})
                if delta.get("content"):
                    for out in blocks.switch("text", {"type": "text", "text": ""}):
                        yield out
                    yield blocks.delta({"type": "text_delta", "text": delta["content"]})
                for call in delta.get("tool_calls") or ():
                    fn = call.get("function") or {}
                    if "id" in call:
                        start = {"type": "tool_use", "id": call["id"], "name": fn.get("name"), "input": {}}
                        for out in blocks.switch(f"tool_use:{call['index']}", start):
                            yield out
                    if fn.get("arguments"):
                        yield blocks.delta({"type": "input_json_delta", "partial_json": fn["arguments"]})
                if choice.get("finish_reason"):
                    stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
    for out in blocks.close():
        yield out
    yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                   "usage": {"output_tokens": _usage(usage)["output_tokens"]}})
    yield _event("message_stop", {})
