"""Anthropic's Messages API (`/v1/messages`, #37) through Anthropic's own client: text, streaming events,
thinking, tool use and tool results, stop reasons, usage, and errors in Anthropic's format."""

from __future__ import annotations

import json

import anthropic
import httpx2
import pytest

from libs.model.tokenizer import ByteTokenizer
from services.gateway.generation import Limits
from services.gateway.handlers import build_app
from tests.test_gateway import MODEL, TOK, FakeBackend, fake_tokens, ready_services
from tests.test_gateway import make_api as small_api
from tests.test_reasoning import THINK_TEMPLATE, ScriptedBackend, ThinkingBackend

pytestmark = pytest.mark.unit


def make_api(backend, **kw):
    """The gateway tests' Api with room for a tool call's prompt and answer."""
    api = small_api(backend, **kw)
    api.limits = Limits(max_model_len=4096, default_max_tokens=64, max_n=4, max_batch=4)
    return api


def client_for(api, key: str = "k") -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_app(ready_services, "gw-test", api)),
                             base_url="http://gw")
    return anthropic.AsyncAnthropic(base_url="http://gw", api_key=key, max_retries=0, http_client=http)


async def test_a_message_is_the_chat_answer_with_its_usage_and_stop_reason():
    backend = FakeBackend()
    message = await client_for(make_api(backend)).messages.create(
        model=MODEL, max_tokens=5, system="Be brief.", messages=[{"role": "user", "content": "hi"}])
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [prompt] = [ids for _, ids, _ in backend.requests]
    assert message.content[0].type == "text" and message.content[0].text == bytes(fake_tokens(prompt, None, 5)).decode()
    assert message.stop_reason == "max_tokens"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (len(prompt), 5)
    assert "Be brief." in TOK.decode(prompt)  # the system prompt went into the template


async def test_streamed_events_carry_the_same_text_in_order():
    client = client_for(make_api(FakeBackend()))
    kinds, text = [], ""
    async with client.messages.stream(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}]) as s:
        async for event in s:
            kinds.append(event.type)
        final = await s.get_final_message()
    text = final.content[0].text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    whole = await client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert text == whole.content[0].text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 5


async def test_thinking_comes_back_as_a_thinking_block():
    api = make_api(ThinkingBackend())
    api.tokenizer = ByteTokenizer(THINK_TEMPLATE)
    message = await client_for(api).messages.create(model=MODEL, max_tokens=64,
                                                    messages=[{"role": "user", "content": "hi"}])
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[1].text) == ("The user says hi.", "Hello there!")
    assert message.stop_reason == "end_turn"
    async with client_for(api).messages.stream(model=MODEL, max_tokens=64,
                                               messages=[{"role": "user", "content": "hi"}]) as s:
        final = await s.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", "The user says hi."), ("text", "Hello there!")]


class CallingBackend(ScriptedBackend):
    """A worker whose model calls get_weather (Hermes format), then stops."""

    OUTPUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def test_tool_use_and_its_result_round_trip():
    backend = CallingBackend()
    client = client_for(make_api(backend))
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    message = await client.messages.create(model=MODEL, max_tokens=200, messages=ask, tools=[WEATHER])
    [call] = [b for b in message.content if b.type == "tool_use"]
    assert (call.name, call.input, message.stop_reason) == ("get_weather", {"city": "Paris"}, "tool_use")
    follow = [*ask, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sun"}]}]
    await client.messages.create(model=MODEL, max_tokens=200, messages=follow, tools=[WEATHER])
    assert "18 C, sun" in backend.prompt and "get_weather" in backend.prompt  # the result reached the template
    async with client.messages.stream(model=MODEL, max_tokens=200, messages=ask, tools=[WEATHER]) as s:
        final = await s.get_final_message()
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("tool_use", {"city": "Paris"})]


@pytest.mark.parametrize("kwargs, exc, status", [
    (dict(model="nope"), anthropic.NotFoundError, 404),
    (dict(extra_body={"temperature": 5}), anthropic.BadRequestError, 400),
    (dict(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
     anthropic.BadRequestError, 400),
])
async def test_errors_use_anthropic_s_format(kwargs, exc, status):
    call = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(exc) as caught:
        await client_for(make_api(FakeBackend())).messages.create(**call)
    assert caught.value.status_code == status
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] in ("not_found_error", "invalid_request_error")


async def test_the_key_may_come_as_x_api_key():
    api = make_api(FakeBackend(), keys=frozenset({"right"}))
    with pytest.raises(anthropic.AuthenticationError):
        await client_for(api, key="wrong").messages.create(model=MODEL, max_tokens=2,
                                                          messages=[{"role": "user", "content": "hi"}])
    ok = await client_for(api, key="right").messages.create(model=MODEL, max_tokens=2,
                                                            messages=[{"role": "user", "content": "hi"}])
    assert json.loads(ok.model_dump_json())["content"][0]["type"] == "text"


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}])
async def test_tool_choice_reaches_the_grammar(choice):
    backend = FakeBackend()
    await client_for(make_api(backend)).messages.create(
        model=MODEL, max_tokens=5, tools=[WEATHER], tool_choice=choice,
        messages=[{"role": "user", "content": "Weather?"}])
    [(_, _, sampling)] = backend.requests
    forced = choice["type"] != "auto"  # a forced call: only calls; auto: free text until a call opens
    assert sampling.grammar is not None and (sampling.grammar.kind == "tool_calls") == forced, sampling.grammar


async def test_count_tokens_counts_what_the_message_would_bring():
    backend = FakeBackend()
    client = client_for(make_api(backend))
    call = {"model": MODEL, "system": "Be brief.", "tools": [WEATHER],
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    counted = await client.messages.count_tokens(**call)
    message = await client.messages.create(max_tokens=3, **call)
    assert counted.input_tokens == message.usage.input_tokens > 0
    assert len(backend.requests) == 1  # counting sent nothing downstream


async def test_a_tool_result_without_its_tool_use_is_a_400():
    with pytest.raises(anthropic.BadRequestError, match="no tool_use") as caught:
        await client_for(make_api(FakeBackend())).messages.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "18 C"}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):  # required, as in the API
        await client_for(make_api(FakeBackend())).post("/v1/messages", cast_to=object, body={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]})


def test_thinking_disabled_turns_the_template_s_thinking_off():
    from services.gateway.messages_api import MessagesRequest, to_chat

    ask = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert to_chat(MessagesRequest(**ask, thinking={"type": "disabled"})).chat_template_kwargs == {
        "enable_thinking": False}
    assert to_chat(MessagesRequest(**ask, thinking={"type": "enabled", "budget_tokens": 64})).chat_template_kwargs \
        is None
