"""From a validated OpenAI request to worker requests (a pure `Plan`), and from token chunks back to
OpenAI responses: whole (`collect`) or as server-sent events (`stream_events`).

One HTTP request becomes one sub-request per (prompt, choice): choice index = prompt index × n + i,
as OpenAI numbers batch completions. With a seed, choice i samples with seed + i, so the n choices
differ yet the whole response is reproducible.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, cast

import xxhash

from libs.engine.grammar import GrammarError, canonical_json, parse_schema, schema_ebnf, validate_spec
from libs.engine.request import GrammarSpec
from libs.mm.api import Encoded
from protos.messages import (
    TokenChunk,
    WireFinishReason,
    WireGrammar,
    WireMMItem,
    WireSamplingParams,
    WireTokenLogprob,
)
from services.gateway import metrics
from services.gateway.backend import Backend, BackendError
from services.gateway.media import MediaCollector, MediaPart, VisionTokens, expand, model_view
from services.gateway.protocol import (
    UINT64_MAX,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    Tool,
    error_body,
)
from services.gateway.reasoning import ReasoningSplit, grammar_reasoning, reasoning_mode
from services.gateway.render import (
    SSE_DONE,
    TextAssembler,
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    sse_event,
    text_offsets,
    usage_dict,
)
from services.gateway.tool_calls import (
    HERMES,
    ToolCallStream,
    auto_format,
    call_tags,
    calls_format,
    structural_tag,
    tool_format_for,
)


class Kind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"


@dataclass(frozen=True)
class Limits:
    """Per-request limits (each answered with 400, as OpenAI does; the context with code context_length_exceeded)."""

    max_model_len: int = 32768
    default_max_tokens: int = 256  # max_tokens null or omitted: up to the context, capped here (0 = no cap)
    max_n: int = 16
    max_batch: int = 64
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters of one stop string (the gateway holds back up to this many)
    max_messages: int = 1024
    max_fanout: int = 32  # sub-requests of one HTTP request running downstream at once (the rest wait)


@dataclass(frozen=True)
class SubRequest:
    index: int  # choice index in the response
    prompt_index: int
    request_id: str
    sampling: WireSamplingParams


@dataclass(frozen=True)
class Plan:
    kind: Kind
    id: str
    created: int
    model: str
    prompts: list[list[int]]
    subs: list[SubRequest]
    stops: tuple[str, ...] = ()
    logprobs: int | None = None  # None = off; else alternatives per token
    return_token_ids: bool = False
    as_token_ids: bool = False
    include_usage: bool = False
    stream: bool = False
    skip_special_tokens: bool = True
    max_fanout: int = 32  # sub-requests running downstream at once
    # chat with tools: calls of these functions (name -> parameter schema) are parsed from the output, in this format
    tool_params: dict[str, Any] | None = None
    tool_format: str = HERMES
    mm_items: tuple[WireMMItem, ...] = ()  # chat with images: where their rows go in prompts[0] (the hash view)
    shown_prompts: list[list[int]] | None = None  # return_token_ids: the prompts as the model's ids (None: prompts)
    reasoning: str | None = None  # chat of a reasoning model: reasoning.reasoning_mode (None = no split)


class TextCodec(Protocol):
    """What the gateway needs from a tokenizer (libs.model.tokenizer satisfies it)."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str: ...


# --- planning (pure) --------------------------------------------------------------------------


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], tok: TextCodec) -> list[list[int]]:
    """Normalise the four OpenAI prompt shapes to token id lists."""
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = [tok.encode(p) if isinstance(p, str) else list(cast(list[int], p)) for p in prompt]
    if not prompts:
        raise ApiError(400, "prompt is empty", param="prompt")
    for i, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, f"prompt {i} has no tokens", param="prompt")
        if any(t < 0 for t in ids):
            raise ApiError(400, f"prompt {i} contains a negative token id", param="prompt")
    return prompts


def _max_tokens(requested: int | None, prompt_len: int, limits: Limits, index: int) -> int:
    if prompt_len >= limits.max_model_len:
        raise ApiError(400, f"prompt {index} has {prompt_len} tokens; this model's context is "
                            f"{limits.max_model_len} tokens", param="prompt", code="context_length_exceeded")
    if requested is None:  # OpenAI: "up to the context"; the server's default cap keeps answers bounded
        left = limits.max_model_len - prompt_len
        return min(limits.default_max_tokens, left) if limits.default_max_tokens else left
    if prompt_len + requested > limits.max_model_len:
        raise ApiError(400, f"prompt {index} ({prompt_len} tokens) + max_tokens ({requested}) exceeds this "
                            f"model's context of {limits.max_model_len} tokens", param="max_tokens",
                       code="context_length_exceeded")
    return requested


def _common_checks(body: CompletionRequest | ChatCompletionRequest, num_prompts: int,
                   limits: Limits) -> tuple[str, ...]:
    body.check_unsupported()
    if body.n > limits.max_n:
        raise ApiError(400, f"n={body.n} is above this server's limit of {limits.max_n}", param="n")
    if num_prompts > limits.max_batch:
        raise ApiError(400, f"{num_prompts} prompts in one request; the limit is {limits.max_batch}", param="prompt")
    return _checked_stops(body.stop_list(), limits)


def _checked_stops(stops: list[str], limits: Limits) -> tuple[str, ...]:
    if len(stops) > limits.max_stop_strings:
        raise ApiError(400, f"{len(stops)} stop strings; the limit is {limits.max_stop_strings}", param="stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop strings must not be empty", param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_length:
        raise ApiError(400, f"a stop string of {longest} characters; the limit is {limits.max_stop_length}",
                       param="stop")
    return tuple(stops)


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i samples with seed + i, wrapped to the 64 bits the engine's generator takes."""
    return None if seed is None else (seed + i) & UINT64_MAX


def _processing(body: CompletionRequest | ChatCompletionRequest, tok: TextCodec,
                grammar: WireGrammar | None = None) -> dict[str, Any]:
    """The sampling fields beyond the basic ones (penalties, logit_bias, min_p, grammar)."""
    if grammar is not None and body.ignore_eos:
        raise ApiError(400, "ignore_eos cannot be combined with response_format or tools (their grammar ends the "
                            "output with the end-of-sequence token)", param="ignore_eos")
    return {"presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty, "min_p": body.min_p,
            "logit_bias": body.logit_bias_ids(getattr(tok, "vocab_size", None)), "grammar": grammar}


def _subs(body: CompletionRequest | ChatCompletionRequest, request_id: str, prompts: list[list[int]],
          max_tokens: int | None, limits: Limits, stops: tuple[str, ...], logprobs: int | None,
          processing: dict[str, Any]) -> list[SubRequest]:
    subs = []
    for p, ids in enumerate(prompts):
        budget = _max_tokens(max_tokens, len(ids), limits, p)
        for i in range(body.n):
            sampling = WireSamplingParams(
                max_tokens=budget, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                seed=choice_seed(body.seed, i), stop_token_ids=list(body.stop_token_ids),
                logprobs=logprobs or 0, sampled_logprob=logprobs is not None, stop=list(stops),
                ignore_eos=body.ignore_eos, **processing,
            )
            index = p * body.n + i
            subs.append(SubRequest(index, p, f"{request_id}-{index}", sampling))
    return subs


def plan_completion(body: CompletionRequest, tok: TextCodec, limits: Limits, request_id: str, model: str) -> Plan:
    prompts = completion_prompts(body.prompt, tok)
    stops = _common_checks(body, len(prompts), limits)
    subs = _subs(body, request_id, prompts, body.max_tokens, limits, stops, body.logprobs, _processing(body, tok))
    return Plan(Kind.COMPLETION, request_id, int(time.time()), model, prompts, subs, stops, body.logprobs,
                body.return_token_ids, body.return_tokens_as_token_ids, body.include_usage, body.stream,
                body.skip_special_tokens, limits.max_fanout)


def chat_messages(body: ChatCompletionRequest, limits: Limits, media: MediaCollector | None = None
                  ) -> list[dict[str, Any]]:
    """The messages as template dicts (400s for what is wrong with them); with `media`, image / video parts are
    collected there and stand as placeholders in the text."""
    if len(body.messages) > limits.max_messages:
        raise ApiError(400, f"{len(body.messages)} messages; the limit is {limits.max_messages}", param="messages")
    return [m.template_dict(i, media) for i, m in enumerate(body.messages)]


@dataclass(frozen=True)
class ChatMedia:
    """A chat request's encoded images: its template dicts (with placeholders) and what `media.expand` needs."""

    messages: list[dict[str, Any]]
    vision: VisionTokens
    parts: Sequence[MediaPart]
    encoded: Sequence[Encoded]


def plan_chat(body: ChatCompletionRequest, tok: TextCodec, limits: Limits, request_id: str, model: str,
              media: ChatMedia | None = None, messages: list[dict[str, Any]] | None = None) -> Plan:
    """`messages`: the template dicts when the caller made them already (`chat_messages`; with `media`, its)."""
    if media is not None:
        messages = media.messages
    if messages is None:
        messages = chat_messages(body, limits)
    stops = _common_checks(body, 1, limits)
    # tool_choice none: the tools are not shown to the model (it could only answer in text anyway)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or ()] if body.calls_tools else None
    extra = {**(body.chat_template_kwargs or {}), **({"tools": tools} if tools or any(
        m.tool_calls or m.role == "tool" for m in body.messages) else {})}
    prompt = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **extra)
    ids = tok.encode(prompt)
    if not ids:
        raise ApiError(400, "the chat template produced an empty prompt", param="messages")
    mm_items: list[WireMMItem] = []
    shown = None
    if media is not None:  # one pad per item -> N pads each, in the hash view
        ids, mm_items = expand(ids, media.vision, media.parts, media.encoded)
        shown = [model_view(ids, mm_items, media.vision)]  # (return_token_ids shows pads, not pseudo tokens)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    fmt = tool_format_for(getattr(tok, "template", None))  # the checkpoint's chat template decides
    reasoning = reasoning_mode(getattr(tok, "template", None), prompt)
    grammar = chat_grammar(body, fmt)
    if grammar is not None:  # the constraint applies to the answer, after the reasoning
        grammar = grammar.model_copy(update={"reasoning": grammar_reasoning(reasoning, prompt)})
    processing = _processing(body, tok, grammar)
    subs = _subs(body, request_id, [ids], body.max_completion_tokens or body.max_tokens, limits, stops, logprobs,
                 processing)
    params = {t.function.name: t.function.parameters for t in body.tools or ()} if body.calls_tools else None
    return Plan(Kind.CHAT, request_id, int(time.time()), model, [ids], subs, stops, logprobs,
                body.return_token_ids, body.return_tokens_as_token_ids, body.include_usage, body.stream,
                body.skip_special_tokens, limits.max_fanout, params, fmt, tuple(mm_items), shown, reasoning)


# --- constrained decoding (pure) ----------------------------------------------------------------


def _rebase_refs(schema: Any, base: str) -> Any:
    """The schema with its local `$ref`s ("#/$defs/x", "#") pointing into `base` (a JSON pointer), so it can be
    nested in a larger schema."""
    if isinstance(schema, list):
        return [_rebase_refs(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _rebase_refs(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = "#" + base + ref[1:]
    return out


def call_schema(tools: list[Tool]) -> dict[str, Any]:
    """JSON schema of one tool call object {"name", "arguments"} of any of `tools` (each arguments schema its
    function's parameters; an object of any shape when it has none)."""
    def one(t: Tool, base: str) -> dict[str, Any]:
        params = _rebase_refs(t.function.parameters, base + "/properties/arguments") \
            if t.function.parameters is not None else {"type": "object"}
        return {"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}

    if len(tools) == 1:
        return one(tools[0], "")
    return {"anyOf": [one(t, f"/anyOf/{i}") for i, t in enumerate(tools)]}


def _checked(grammar: WireGrammar, param: str) -> WireGrammar:
    try:
        validate_spec(GrammarSpec(grammar.kind, grammar.json_schema, grammar.parallel, grammar.reasoning))
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_json_schema") from exc
    return grammar


def chat_grammar(body: ChatCompletionRequest, fmt: str = HERMES) -> WireGrammar | None:
    """The grammar a chat request's output must follow (400 for a schema that is invalid or uses features this
    server cannot enforce), in the tool-call format `fmt`:

    - tool_choice required / a named function: only calls (of that function), arguments valid;
    - tool_choice auto: free text, and once the model opens a call, a complete valid call; with a
      response_format json_object / json_schema, the text answer is that JSON instead (so: calls or the JSON);
    - no tools (or tool_choice none): the response_format, if any; None when unconstrained."""
    text = _response_format_grammar(body)
    if not body.calls_tools:
        return text
    choice = body.effective_tool_choice
    tools = list(body.tools or ())
    for i, t in enumerate(tools):
        if t.function.parameters is not None:
            _check_schema(t.function.parameters, f"tools.{i}.function.parameters")
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    parallel = body.parallel_tool_calls
    if choice != "auto" and fmt == HERMES:
        grammar = WireGrammar(kind="tool_calls", json_schema=canonical_json(call_schema(tools)), parallel=parallel)
        return _checked(grammar, "tools")
    tags = call_tags(fmt, [(t.function.name, t.function.parameters) for t in tools], schema_ebnf)
    if choice != "auto":
        shape = calls_format(fmt, tags, parallel)
    elif text is not None:
        answer = {"type": "grammar", "grammar": schema_ebnf(json.loads(text.json_schema) if text.json_schema
                                                            else {"type": "object"})}
        shape = {"type": "or", "elements": [calls_format(fmt, tags, parallel), answer]}
    else:
        shape = auto_format(fmt, tags, parallel)
    return _checked(WireGrammar(kind="structural_tag", json_schema=canonical_json(structural_tag(shape))), "tools")


def _response_format_grammar(body: ChatCompletionRequest) -> WireGrammar | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return WireGrammar(kind="json_object")
    assert fmt.json_schema is not None  # the model validator makes sure
    param = "response_format.json_schema.schema"
    if fmt.json_schema.schema_ is None:
        raise ApiError(400, f"{param} is required", param=param)
    _check_schema(fmt.json_schema.schema_, param)
    return _checked(WireGrammar(kind="json_schema", json_schema=canonical_json(fmt.json_schema.schema_)), param)


def _check_schema(schema: dict[str, Any], param: str) -> None:
    try:
        parse_schema(canonical_json(schema))
    except GrammarError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param, code="invalid_json_schema") from exc


# --- per-choice state -------------------------------------------------------------------------


_FINISH_NAMES = {WireFinishReason.STOP: "stop", WireFinishReason.LENGTH: "length", WireFinishReason.ABORT: "abort"}


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[WireTokenLogprob]
    finish_reason: str | None  # set on the delta that completes the choice
    offsets: list[int] = field(default_factory=list)  # completions text_offset of each token (when tracked)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chat with tools: delta.tool_calls entries
    reasoning: str = ""  # chat of a reasoning model: delta.reasoning_content

    def after(self, held: Delta | None) -> Delta:
        """This delta carrying the tokens of an earlier one that was held back (it had no text)."""
        if held is None:
            return self
        return Delta(held.text + self.text, held.token_ids + self.token_ids, held.logprobs + self.logprobs,
                     self.finish_reason, held.offsets + self.offsets, held.tool_calls + self.tool_calls,
                     held.reasoning + self.reasoning)


@dataclass
class ChoiceState:
    sub: SubRequest
    assembler: TextAssembler
    track_offsets: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[WireTokenLogprob] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    held: Delta | None = None  # streaming: tokens whose text is still empty wait here for the next delta
    tools: ToolCallStream | None = None  # chat with tools: splits tool calls from the content
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # the message's calls, once finished
    thinking: ReasoningSplit | None = None  # a reasoning model's chat: splits the reasoning from the answer

    @property
    def content(self) -> str | None:
        """The message content: the text, less its reasoning and its tool calls (None when only calls remain)."""
        if self.tools is None:
            return self.thinking.content if self.thinking is not None else self.assembler.text
        if self.tool_calls:
            return self.tools.content.strip() or None
        return self.tools.content

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def apply(self, chunk: TokenChunk) -> Delta:
        if self.done:
            return Delta("", [], [], None)
        if chunk.token_ids:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            elif self.last_token_at is not None:
                metrics.ITL.observe((now - self.last_token_at) / len(chunk.token_ids))
            self.last_token_at = now
        start = len(self.token_ids)
        text = self.assembler.add(chunk.token_ids)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.usage is not None:
            self.cached_tokens = chunk.usage.cached_tokens
        if chunk.finish_reason is not None:
            text += self.assembler.finish()
            self.finish_reason = "stop" if self.assembler.stopped else _FINISH_NAMES.get(chunk.finish_reason, "stop")
        elif self.assembler.stopped:  # the gateway saw the stop string first; the caller aborts the rest
            self.finish_reason = "stop"
        calls: list[dict[str, Any]] = []
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text)
            if self.finish_reason is not None:
                more_reasoning, more = self.thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if self.finish_reason is not None:
                tail, more = self._finish_tools()
                text, calls = text + tail, calls + more
        offsets = self._offsets(start)
        return Delta(text, list(chunk.token_ids), list(chunk.logprobs), self.finish_reason, offsets, calls,
                     reasoning)

    def _finish_tools(self) -> tuple[str, list[dict[str, Any]]]:
        assert self.tools is not None
        tail, calls = self.tools.finish()
        self.tool_calls = self.tools.openai_calls()
        if self.tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return tail, calls

    def _offsets(self, start: int) -> list[int]:
        if not self.track_offsets:
            return []
        limit = len(self.assembler.text) if self.assembler.stopped else None  # text cut at a stop string
        new = text_offsets(self.assembler.decode, self.token_ids, start, limit)
        self.offsets.extend(new)
        return new


def new_states(plan: Plan, decode_text: Callable[[list[int]], str]) -> dict[int, ChoiceState]:
    track = plan.kind == Kind.COMPLETION and plan.logprobs is not None
    return {s.index: ChoiceState(s, TextAssembler(decode_text, plan.stops), track, tools=_tool_stream(plan, s),
                                 thinking=ReasoningSplit(plan.reasoning) if plan.reasoning else None)
            for s in plan.subs}


def _tool_stream(plan: Plan, sub: SubRequest) -> ToolCallStream | None:
    if plan.tool_params is None:
        return None
    return ToolCallStream(plan.tool_format, plan.tool_params,
                          lambda i: "call_" + xxhash.xxh64_hexdigest(f"{sub.request_id}:{i}".encode()))


def usage_of(plan: Plan, states: dict[int, ChoiceState]) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per choice); cached tokens are those of each prompt's
    first choice, so cached <= prompt always holds."""
    first: dict[int, ChoiceState] = {}
    for index in sorted(states):
        first.setdefault(states[index].sub.prompt_index, states[index])
    prompt = sum(len(p) for p in plan.prompts)
    completion = sum(len(s.token_ids) for s in states.values())
    cached = sum(s.cached_tokens for s in first.values())
    return usage_dict(prompt, completion, cached)


# --- fan-out over sub-requests ------------------------------------------------------------------


_END = object()


class Streams:
    """The gateway's requests in flight (their fan-outs), so a shutdown can end each with an error the client
    reads, instead of a dropped connection."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[Fanout] = weakref.WeakSet()

    def add(self, fanout: Fanout) -> None:
        self._live.add(fanout)

    def __len__(self) -> int:
        return len(self._live)

    def cut(self, message: str) -> int:
        """End every request in flight with a 503 `server_shutdown` carrying `message`; how many were cut."""
        live = list(self._live)
        for fanout in live:
            fanout.cut(BackendError(503, message, code="server_shutdown"))
        return len(live)


class Fanout:
    """Runs every sub-request's stream as a task and merges their chunks in arrival order.

    Cancelling a pump task closes its backend stream, which aborts that request downstream;
    `close()` does this for all that are still running (no await: safe in a cancelled finally).
    """

    def __init__(self, backend: Backend, plan: Plan, live: Streams | None = None) -> None:
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        if live is not None:
            live.add(self)
        # A large fan-out (up to max_n x max_batch choices) runs max_fanout at a time, in choice order:
        # all at once it would fill every decode worker (503 server_busy on an idle server) or flood the
        # router past its timeout. Semaphore waiters wake FIFO, so lower choice indexes start first.
        self._active = asyncio.Semaphore(plan.max_fanout)
        self._tasks = {s.index: asyncio.ensure_future(self._pump(backend, s, plan.prompts[s.prompt_index],
                                                                 plan.mm_items))
                       for s in plan.subs}

    async def _pump(self, backend: Backend, sub: SubRequest, prompt: list[int],
                    mm_items: tuple[WireMMItem, ...]) -> None:
        # (mm_items only when there are some: a text-only request calls any Backend the same way as before)
        extra = {"mm_items": mm_items} if mm_items else {}
        try:
            async with self._active:
                async for chunk in backend.generate(sub.request_id, prompt, sub.sampling, **extra):
                    self._queue.put_nowait((sub.index, chunk))
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            self._queue.put_nowait((sub.index, exc))
        finally:
            self._queue.put_nowait((sub.index, _END))

    async def events(self) -> AsyncIterator[tuple[int, TokenChunk]]:
        """(choice index, chunk) until every stream ended; the first failure is raised."""
        open_streams = len(self._tasks)
        while open_streams:
            index, item = await self._queue.get()
            if item is _END:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item

    def cancel(self, index: int) -> None:
        self._tasks[index].cancel()

    def cut(self, error: BackendError) -> None:
        """End the merged stream now with `error` (the sub-requests are closed by the consumer's `close()`)."""
        self._queue.put_nowait((-1, error))

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()


def _error_to_api(exc: BackendError) -> ApiError:
    type_ = "invalid_request_error" if exc.status < 500 else "server_error"
    headers = {} if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return ApiError(exc.status, exc.message, type_=type_, code=exc.code, headers=headers)


def _record(plan: Plan, states: dict[int, ChoiceState], started: float, usage: dict[str, Any]) -> None:
    metrics.PROMPT_TOKENS.inc(usage["prompt_tokens"])
    metrics.OUTPUT_TOKENS.inc(usage["completion_tokens"])
    metrics.CACHED_TOKENS.inc(usage["prompt_tokens_details"]["cached_tokens"])
    for st in states.values():
        if st.first_token_at is not None:
            metrics.TTFT.observe(st.first_token_at - started)
    metrics.LATENCY.observe(time.monotonic() - started)


# --- rendering of choices -----------------------------------------------------------------------


@dataclass(frozen=True)
class Renderer:
    plan: Plan
    decode_token: Callable[[list[int]], str]  # keeps special tokens (logprob names)
    token_bytes: Callable[[int], bytes] | None = None  # raw bytes of one token; None: its decoded text's

    @property
    def names(self) -> TokenNames:
        return TokenNames(self.decode_token, self.plan.as_token_ids, self.token_bytes)

    def logprobs(self, lps: Sequence[WireTokenLogprob], offsets: list[int]) -> dict[str, Any] | None:
        if self.plan.logprobs is None:
            return None
        if self.plan.kind == Kind.CHAT:
            return chat_logprobs(lps, self.names, self.plan.logprobs)
        return completion_logprobs(lps, self.names, offsets)

    def header(self) -> dict[str, Any]:
        obj = {Kind.COMPLETION: "text_completion", Kind.CHAT: "chat.completion"}[self.plan.kind]
        if self.plan.stream and self.plan.kind == Kind.CHAT:
            obj = "chat.completion.chunk"
        return {"id": self.plan.id, "object": obj, "created": self.plan.created, "model": self.plan.model}

    def _ids(self, choice: dict[str, Any], st: ChoiceState, token_ids: list[int], first: bool) -> dict[str, Any]:
        if self.plan.return_token_ids:
            if first:
                choice["prompt_token_ids"] = (self.plan.shown_prompts or self.plan.prompts)[st.sub.prompt_index]
            choice["token_ids"] = token_ids
        return choice

    def full_choice(self, st: ChoiceState) -> dict[str, Any]:
        lps = self.logprobs(st.logprobs, st.offsets)
        if self.plan.kind == Kind.CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": st.content}
            if st.thinking is not None:
                message["reasoning_content"] = st.thinking.reasoning or None
            if st.tool_calls:
                message["tool_calls"] = st.tool_calls
            choice = {"index": st.sub.index, "message": message, "logprobs": lps, "finish_reason": st.finish_reason}
        else:
            choice = {"index": st.sub.index, "text": st.assembler.text, "logprobs": lps,
                      "finish_reason": st.finish_reason}
        return self._ids(choice, st, st.token_ids, first=True)

    def delta_choice(self, st: ChoiceState, d: Delta, first: bool) -> dict[str, Any]:
        lps = self.logprobs(d.logprobs, d.offsets) if d.logprobs else None
        if self.plan.kind == Kind.CHAT:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.text or first:
                delta["content"] = d.text
            if d.tool_calls:
                delta["tool_calls"] = d.tool_calls
            choice = {"index": st.sub.index, "delta": delta, "logprobs": lps, "finish_reason": d.finish_reason}
        else:
            choice = {"index": st.sub.index, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason}
        return self._ids(choice, st, d.token_ids, first)


# --- running a plan -----------------------------------------------------------------------------


async def collect(plan: Plan, backend: Backend, renderer: Renderer, decode_text: Callable[[list[int]], str],
                  live: Streams | None = None) -> dict[str, Any]:
    """Run every sub-request to the end and build the whole (non-streaming) response body."""
    started = time.monotonic()
    states = new_states(plan, decode_text)
    fanout = Fanout(backend, plan, live)
    try:
        async for index, chunk in fanout.events():
            st = states[index]
            st.apply(chunk)
            if st.done and chunk.finish_reason is None:
                fanout.cancel(index)  # stop string seen here first: abort the rest downstream
    except BackendError as exc:
        raise _error_to_api(exc) from exc
    finally:
        fanout.close()
    usage = usage_of(plan, states)
    _record(plan, states, started, usage)
    choices = [renderer.full_choice(states[i]) for i in sorted(states)]
    return {**renderer.header(), "choices": choices, "usage": usage}


async def stream_events(plan: Plan, backend: Backend, renderer: Renderer,
                        decode_text: Callable[[list[int]], str], on_close: Callable[[], None],
                        live: Streams | None = None) -> AsyncIterator[bytes]:
    """Server-sent events of a streaming response; errors after the headers went out (a shutdown's included)
    become an error event followed by [DONE]. Leaving early (client gone) closes every sub-request (abort)."""
    started = time.monotonic()
    states = new_states(plan, decode_text)
    seen: set[int] = set()
    fanout = Fanout(backend, plan, live)
    finished = False
    try:
        async for index, chunk in fanout.events():
            st = states[index]
            delta = st.apply(chunk)
            if st.done and chunk.finish_reason is None:
                fanout.cancel(index)
            first = index not in seen
            # a delta with tokens is not empty when the client asked for their ids or logprobs (held back, they
            # would reach it late: its second token's time would be the third's)
            carries = bool(delta.token_ids) and (plan.return_token_ids or plan.logprobs is not None)
            if not (delta.text or delta.reasoning or delta.tool_calls or carries or delta.finish_reason
                    or (first and plan.kind == Kind.CHAT)):
                st.held = delta.after(st.held)  # no text: its tokens go out with the next delta (no empty chunk)
                continue
            delta, st.held = delta.after(st.held), None
            seen.add(index)
            yield sse_event({**renderer.header(), "choices": [renderer.delta_choice(st, delta, first)]})
        usage = usage_of(plan, states)
        _record(plan, states, started, usage)
        if plan.include_usage:
            yield sse_event({**renderer.header(), "choices": [], "usage": usage})
        finished = True
        yield SSE_DONE
    except BackendError as exc:
        api = _error_to_api(exc)
        finished = True
        yield sse_event(error_body(api.message, api.type, api.param, api.code))
        yield SSE_DONE
    finally:
        fanout.close()
        if not finished:
            metrics.DISCONNECTS.inc()
        on_close()
