"""OpenAI-compatible request bodies and the OpenAI error format.

Bodies are validated strictly (pydantic strict mode on the raw JSON): no bool-as-int, no
string-as-bool, no bool-as-token. Errors map to statuses as follows (see `validation_status`):
- 400, as OpenAI answers: the body is not valid JSON (also a lone surrogate such as "\\ud800": not valid
  UTF-8), an integer outside the 64-bit range the workers can carry, a field this server does not implement
  (every unknown field is refused: nothing is silently ignored, and a field of the other endpoint gets a hint),
  or a schema mismatch (wrong type, missing field, out-of-range number).
Requests that are well-formed but cannot be served as asked raise `ApiError` (400 and others) from
the planning code.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

import orjson
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

MAX_LOGPROBS = 20
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1
OUT_OF_RANGE = "int_out_of_range"  # pydantic error type of an integer beyond 64 bits
# A body that fits the other endpoint: the field that gives it away, and where to send it.
OTHER_ENDPOINT = {
    "messages": "; `messages` belongs to /v1/chat/completions (this is /v1/completions)",
    "prompt": "; `prompt` belongs to /v1/completions (this is /v1/chat/completions)",
}


class ApiError(Exception):
    """An error answered to the client: HTTP status plus the OpenAI error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error the gateway answers (OpenAI's error object)."""

    error: ErrorDetail


def _seed_in_range(v: int) -> int:
    if not 0 <= v <= UINT64_MAX:
        raise PydanticCustomError(OUT_OF_RANGE, "integer out of range: a seed is in [0, 2**64 - 1]")
    return v


# Every integer goes to the workers as msgpack (64 bits at most): the int64 bounds of these types are
# answered with code integer_out_of_range (see validation_status), any tighter bound with invalid_value. Seeds take
# the uint64 range.
Int = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegativeInt = Annotated[int, Field(ge=0, le=INT64_MAX)]
PositiveInt = Annotated[int, Field(ge=1, le=INT64_MAX)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Seed = Annotated[int, AfterValidator(_seed_in_range), Field(json_schema_extra={"minimum": 0, "maximum": UINT64_MAX})]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


MAX_LOGIT_BIAS = 300  # entries of one logit_bias (OpenAI's limit)


class _Common(_Strict):
    """Fields shared by completions and chat completions (OpenAI names, vLLM extensions marked)."""

    model: str = Field(min_length=1)
    max_tokens: PositiveInt | None = Field(default=None, description="None or omitted: up to the context, "
                                   "capped by the server's default_max_tokens")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: NonNegativeInt = Field(default=0, description="vLLM extension; 0 = off")
    n: PositiveInt = Field(default=1)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] = Field(default_factory=list, description="vLLM extension")
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(default=False, description="vLLM extension")
    return_token_ids: bool = Field(default=False, description="vLLM extension: prompt and output token ids")
    return_tokens_as_token_ids: bool = Field(
        default=False, description="vLLM extension: logprob tokens rendered as 'token_id:N'"
    )
    skip_special_tokens: bool = Field(default=True, description="vLLM extension: drop special tokens from the text")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                    description="subtracted from the logit of every token the output contains")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                     description="times each token's count in the output, subtracted from its logit")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="vLLM extension: drop tokens whose probability "
                                                                    "is below min_p times the top token's; 0 = off")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, description="vLLM extension: logits of tokens "
                                      "in prompt or output divided (positive) / multiplied (negative) by it; 1 = off")
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, description="token id (as a string) -> bias added to its logit")
    user: str | None = None
    # Accepted and ignored, as they change nothing here (SDKs send them): no stored completions, no service tiers.
    store: bool | None = Field(default=None, description="accepted; nothing is stored")
    metadata: dict[str, str] | None = Field(default=None, description="accepted; kept nowhere")
    service_tier: str | None = Field(default=None, description="accepted; one tier")

    @model_validator(mode="after")
    def _token_ids_non_negative(self) -> _Common:
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: token ids must be >= 0")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_unsupported(self) -> None:
        """Well-formed requests this server cannot serve as asked: 400 (subclasses add theirs)."""

    def logit_bias_ids(self, vocab_size: int | None) -> dict[int, float]:
        """logit_bias with integer token ids; 400 for a key that is not a token id of this model."""
        bias = self.logit_bias or {}
        if len(bias) > MAX_LOGIT_BIAS:
            raise ApiError(400, f"logit_bias has {len(bias)} entries; the limit is {MAX_LOGIT_BIAS}",
                           param="logit_bias")
        out = {}
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit() or (vocab_size is not None and int(key) >= vocab_size):
                limit = f" [0, {vocab_size})" if vocab_size is not None else ""
                raise ApiError(400, f"logit_bias: {key!r} is not a token id of this model{limit}", param="logit_bias")
            out[int(key)] = value
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptType = str | list[str] | list[Int] | list[list[Int]]


class CompletionRequest(_Common):
    prompt: PromptType
    logprobs: LogprobCount | None = None
    echo: bool = Field(default=False, description="only false is supported")
    best_of: Int | None = Field(default=None, description="only equal to n is supported")
    suffix: str | None = Field(default=None, description="only empty is supported")

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of other than n is not supported by this server", param="best_of")


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1)
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(_Strict):
    """A tool call of an earlier assistant message (as this server or OpenAI returned it)."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: ToolCallFunction


class MediaParts(Protocol):
    """What a chat message hands its image / video parts and text to (services/gateway/media.MediaCollector)."""

    def check_text(self, text: str, param: str) -> None: ...
    def add(self, part: dict[str, Any], param: str, role: str) -> str: ...


class ChatMessage(_Strict):
    """A message with text content (a string or text parts). Every message needs `content` (400 when
    missing or null) except an assistant message with `tool_calls`; a `tool` message (a tool's result)
    needs `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def check(self, index: int) -> None:
        where = f"messages.{index}"
        if self.tool_calls is not None:
            if self.role != "assistant":
                raise ApiError(400, f"{where}.tool_calls: only assistant messages carry tool calls",
                               param=f"{where}.tool_calls")
            if not self.tool_calls:
                raise ApiError(400, f"{where}.tool_calls must not be empty (omit it)", param=f"{where}.tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ApiError(400, f"{where}.tool_call_id: a tool message needs one, other roles have none",
                           param=f"{where}.tool_call_id")

    def template_dict(self, index: int, media: MediaParts | None = None) -> dict[str, Any]:
        """The message as chat templates take it (HF convention: tool-call arguments as an object). With `media`
        (a model with a vision tower), image / video parts become its placeholders and text is checked for
        vision tokens."""
        self.check(index)
        out: dict[str, Any] = {"role": self.role}
        if self.tool_calls:
            out["content"] = "" if self.content is None else self.text(index, media)
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments, index)}}
                for c in self.tool_calls]
        else:
            out["content"] = self.text(index, media)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self, index: int, media: MediaParts | None = None) -> str:
        """Message content as text. Content parts are text, or (with `media`) image_url / video_url parts, which
        become the collector's placeholders (services/gateway/media.py)."""
        param = f"messages.{index}.content"
        if self.content is None:
            raise ApiError(400, f"{param}: a {self.role} message needs content", param=param)
        if isinstance(self.content, str):
            if media is not None:
                media.check_text(self.content, param)
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind in ("image_url", "video_url"):
                if media is None:
                    raise ApiError(400, f"{param}: content part of type {kind!r}: this model takes no images or "
                                        "videos (it has no vision tower)", param=param, code="unsupported_content")
                parts.append(media.add(part, f"{param}.{j}", self.role))
                continue
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise ApiError(400, f"{param}: content part of type {kind!r} is not supported "
                                    "(text, image_url and video_url parts only)", param=param)
            if media is not None:
                media.check_text(part["text"], f"{param}.{j}")
            parts.append(part["text"])
        return "".join(parts)


def _arguments(text: str, index: int) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"messages.{index}.tool_calls: arguments are not valid JSON ({exc})",
                       param=f"messages.{index}.tool_calls") from exc


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="JSON schema of the arguments")
    strict: bool | None = Field(default=None, description="accepted; forced calls always follow the schema")


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="the JSON schema")
    strict: bool | None = Field(default=None, description="accepted; the output always follows the schema")


class ResponseFormat(_Strict):
    """`text` (no constraint), `json_object` (any JSON object) or `json_schema` (the given schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema and allowed only there")
        return self


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    max_completion_tokens: PositiveInt | None = None
    add_generation_prompt: bool = Field(default=True, description="vLLM extension")
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None, description="vLLM extension: the chat template's own variables, e.g. enable_thinking")
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        default=None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = True

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ApiError(400, "tools: function names must be unique", param="tools")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ApiError(400, f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                "among tools", param="tool_choice")

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.effective_tool_choice != "none"


def _loc(error: Any) -> list[str]:
    return [str(x) for x in error.get("loc", ()) if x != "body"]


def _beyond_64_bits(error: Any) -> bool:
    if error.get("type") == OUT_OF_RANGE:
        return True
    bound = (error.get("ctx") or {}).get(
        {"less_than_equal": "le", "greater_than_equal": "ge"}.get(error.get("type"), ""))
    return bound in (INT64_MAX, INT64_MIN)


def validation_status(errors: list[Any]) -> tuple[int, str, str | None, str | None]:
    """(status, message, param, code) of a body that failed validation, every problem listed as
    `field: reason`; always 400, as OpenAI answers (the code tells the cases apart)."""
    invalid_json = [e for e in errors if e.get("type") == "json_invalid"]
    if invalid_json:
        return 400, f"request body is not valid JSON: {invalid_json[0].get('msg')}", None, None
    unsupported = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unsupported:
        names = sorted({".".join(_loc(e)) for e in unsupported})
        hint = next((h for field, h in OTHER_ENDPOINT.items() if field in names), "")
        return (400, f"unsupported parameter(s), not implemented by this server: {', '.join(names)}{hint}",
                names[0], "unsupported_parameter")
    first_param = next((loc[0] for loc in map(_loc, errors) if loc), None)
    message = "; ".join(f"{'.'.join(_loc(e)) or 'body'}: {e.get('msg')}" for e in errors)
    too_big = [e for e in errors if _beyond_64_bits(e)]
    if too_big:
        where = ".".join(_loc(too_big[0])) or "body"
        return 400, f"{where}: integer out of range (beyond 64 bits); {message}", first_param, "integer_out_of_range"
    return 400, message, first_param, "invalid_value"


def chat_request(chat: dict[str, Any], api: str) -> ChatCompletionRequest:
    """The chat request another API's request (`api`: Messages, Responses) was translated into; a field that does
    not validate is a 400 naming the chat field it became."""
    try:
        return ChatCompletionRequest.model_validate(chat, strict=False)
    except ValidationError as exc:
        status, message, param, code = validation_status(list(exc.errors()))
        raise ApiError(status, f"{message} (in the chat request this {api} request becomes)", param=param,
                       code=code) from None
