"""OpenAI's Responses API (`POST /v1/responses`), the one OpenAI's newer agents call.

A Responses request is translated into a chat completion request (`instructions`, `input` as text or items:
messages with `input_text` / `input_image` parts, `function_call` and `function_call_output` items; function
tools, `tool_choice`, `text.format` as the response format) and runs through the chat pipeline unchanged. Its
answer is rendered back as a Response (`reasoning`, `message` and `function_call` output items, status, usage),
whole or as the Responses SSE events (`response.created` … `response.completed`). Nothing is stored: `store` is
`previous_response_id` continues a conversation the gateway kept (`ResponseStore`: in memory, bounded in count and
age; `store: false` keeps nothing); an unknown or expired id is a 404. The continuation re-sends the whole
conversation, whose prefix the workers' caches hold.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.protocol import ApiError, ChatCompletionRequest, chat_request


class ResponsesRequest(BaseModel):
    """The Responses API request body (fields this server serves; any other is a 400)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = Field(default=None, description="accepted; nothing is stored")
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = Field(default=None, description="accepted; the model's template decides")
    previous_response_id: str | None = None
    service_tier: str | None = None
    truncation: str | None = None


class ResponseStore:
    """Conversations of recent responses, for `previous_response_id`: at most `entries`, each for `ttl_s`."""

    def __init__(self, entries: int = 1024, ttl_s: float = 3600.0) -> None:
        self.entries, self.ttl_s = entries, ttl_s
        self._kept: OrderedDict[str, tuple[float, list[dict[str, Any]]]] = OrderedDict()

    def put(self, response_id: str, conversation: list[dict[str, Any]], now: float | None = None) -> None:
        self._kept[response_id] = ((time.monotonic() if now is None else now) + self.ttl_s, conversation)
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.entries:
            self._kept.popitem(last=False)

    def get(self, response_id: str, now: float | None = None) -> list[dict[str, Any]]:
        kept = self._kept.get(response_id)
        if kept is None or kept[0] < (time.monotonic() if now is None else now):
            self._kept.pop(response_id, None)
            raise ApiError(404, f"previous_response_id {response_id!r}: no such response here (unknown, expired "
                                "after the store's ttl, or stored with store: false)", type_="not_found_error",
                           param="previous_response_id", code="previous_response_not_found")
        return list(kept[1])


# --- request: Responses -> chat -----------------------------------------------------------------------------------


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}: a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise ApiError(400, f"{where}.{j}: a content part of type {kind!r} is not supported (input_text, "
                                "input_image with image_url)", param=f"{where}.{j}")
    return parts


def _items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: function calls join the assistant turn before them."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where, kind = f"input.{i}", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError(400, f"{where}.role: user, assistant, system or developer", param=f"{where}.role")
            messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("content"):
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # earlier reasoning is not shown to the model again
        else:
            raise ApiError(400, f"{where}: an input item of type {kind!r} is not supported", param=where)
    return messages


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ApiError(400, "tool_choice: auto, required, none or a function", param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ApiError(400, f"text.format.type {fmt.get('type')!r}: text, json_object or json_schema",
                   param="text.format")


def to_chat(body: ResponsesRequest, store: ResponseStore | None = None) -> ChatCompletionRequest:
    """The chat completion request that serves `body` (streaming asks for the usage chunk too); a
    `previous_response_id` continues the conversation `store` kept."""
    messages: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        if store is None:
            raise ApiError(400, "previous_response_id: this server keeps no responses", param="previous_response_id")
        messages = [m for m in store.get(body.previous_response_id) if m["role"] != "system"]
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    messages += ([{"role": "user", "content": body.input}] if isinstance(body.input, str) else _items(body.input))
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("user", body.user), ("response_format", _format(body.text)),
                        ("parallel_tool_calls", body.parallel_tool_calls)):
        if value is not None:
            chat[name] = value
    if body.tools:
        for t in body.tools:
            if t.get("type") != "function":
                raise ApiError(400, f"tools: a tool of type {t.get('type')!r} is not served (function tools only)",
                               param="tools")
        chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                           if t.get(k) is not None}} for t in body.tools]
        if body.tool_choice is not None:
            chat["tool_choice"] = _tool_choice(body.tool_choice)
    return chat_request(chat, "Responses")


# --- response: chat -> Response -----------------------------------------------------------------------------------


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, output = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
            "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens",
                                                                                                    0)},
            "output_tokens_details": {"reasoning_tokens": 0}}


def _response_id(chat_id: str) -> str:
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def _envelope(rid: str, model: str, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
              finish: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": []}


def _reasoning_item(rid: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{rid}", "summary": [{"type": "summary_text", "text": text}]}


def _message_item(rid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{rid}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def answer_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A Response's output as the chat message it continues from."""
    text = "".join(c["text"] for o in output if o["type"] == "message" for c in o["content"])
    calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
             for o in output if o["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


def remembering(store: ResponseStore, request: ChatCompletionRequest, keep: bool) -> Callable[[dict[str, Any]], None]:
    """What to do with a finished Response: keep its conversation for `previous_response_id` (unless `keep` is
    off)."""
    asked = [m.model_dump(exclude_none=True) for m in request.messages]

    def remember(response: dict[str, Any]) -> None:
        if keep and response["status"] in ("completed", "incomplete"):
            store.put(response["id"], [*asked, answer_message(response["output"])])
    return remember


def to_response(chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as a Response."""
    choice = chat["choices"][0]
    msg, rid = choice["message"], _response_id(chat["id"])
    output = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(rid, msg["reasoning_content"]))
    if msg.get("content"):
        output.append(_message_item(rid, msg["content"]))
    output += [_call_item(c) for c in msg.get("tool_calls") or ()]
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    return _envelope(rid, chat["model"], status, output, _usage(chat.get("usage")), choice["finish_reason"])


class _Events:
    """The Responses SSE events, numbered in order."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, kind: str, data: dict[str, Any]) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def to_events(chunks: AsyncIterator[bytes], model: str,
                    done: Callable[[dict[str, Any]], None] | None = None) -> AsyncIterator[bytes]:
    """The chat completion's SSE stream as the Responses SSE events; `done` gets the finished Response."""
    event, rid = _Events(), ""
    output: list[dict[str, Any]] = []
    text = reasoning = ""
    calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> function_call item
    open_item: str | None = None  # "reasoning", "message" or "call:<index>"
    usage, finish = None, None

    def close() -> list[bytes]:
        nonlocal open_item
        out: list[bytes] = []
        index = len(output)
        if open_item == "reasoning":
            item = _reasoning_item(rid, reasoning)
            out.append(event("response.reasoning_summary_text.done", {"item_id": item["id"], "output_index": index,
                                                                       "summary_index": 0, "text": reasoning}))
        elif open_item == "message":
            item = _message_item(rid, text)
            out += [event("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                        "content_index": 0, "text": text}),
                    event("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                         "content_index": 0, "part": item["content"][0]})]
        elif open_item is not None:
            item = calls[int(open_item.split(":")[1])]
            out.append(event("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                         "arguments": item["arguments"]}))
        else:
            return out
        out.append(event("response.output_item.done", {"output_index": index, "item": item}))
        output.append(item)
        open_item = None
        return out

    def switch(kind: str, item: dict[str, Any]) -> list[bytes]:
        nonlocal open_item
        if kind == open_item:
            return []
        out = close()
        open_item = kind
        out.append(event("response.output_item.added", {"output_index": len(output), "item": item}))
        if kind == "message":
            out.append(event("response.content_part.added", {"item_id": item["id"], "output_index": len(output),
                                                             "content_index": 0, "part": item["content"][0]}))
        return out

    async for raw in chunks:
        for line in raw.decode().splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                yield event("error", {"code": chunk["error"].get("code"), "message": chunk["error"]["message"],
                                      "param": None})
                return
            if not rid:
                rid = _response_id(chunk["id"])
                started = _envelope(rid, model, "in_progress", [], None, None)
                yield event("response.created", {"response": started})
                yield event("response.in_progress", {"response": started})
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    for out in switch("reasoning", {**_reasoning_item(rid, ""), "summary": []}):
                        yield out
                    reasoning += delta["reasoning_content"]
                    yield event("response.reasoning_summary_text.delta", {
                        "item_id": f"rs_{rid}", "output_index": len(output), "summary_index": 0,
                        "delta": delta["reasoning_content"]})
                if delta.get("content"):
                    for out in switch("message", _message_item(rid, "", "in_progress")):
                        yield out
                    text += delta["content"]
                    yield event("response.output_text.delta", {"item_id": f"msg_{rid}", "output_index": len(output),
                                                               "content_index": 0, "delta": delta["content"]})
                for call in delta.get("tool_calls") or ():
                    fn = call.get("function") or {}
                    if "id" in call:
                        calls[call["index"]] = _call_item({"id": call["id"], "function": {
                            "name": fn.get("name"), "arguments": ""}})
                        for out in switch(f"call:{call['index']}", {**calls[call["index"]], "status": "in_progress"}):
                            yield out
                    if fn.get("arguments"):
                        item = calls[call["index"]]
                        item["arguments"] += fn["arguments"]
                        yield event("response.function_call_arguments.delta", {
                            "item_id": item["id"], "output_index": len(output), "delta": fn["arguments"]})
                finish = choice.get("finish_reason") or finish
    for out in close():
        yield out
    status = "incomplete" if finish == "length" else "completed"
    response = _envelope(rid, model, status, output, _usage(usage), finish)
    if done is not None:
        done(response)
    yield event(f"response.{status}", {"response": response})
