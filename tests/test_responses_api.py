"""OpenAI's Responses API (`/v1/responses`, #37) through the openai client: text, streaming events, reasoning,
function calls and their outputs, structured output, and what a server that stores nothing refuses."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from libs.model.tokenizer import ByteTokenizer
from services.gateway.protocol import ApiError
from services.gateway.responses_api import ResponseStore
from tests.test_gateway import MODEL, TOK, FakeBackend, fake_tokens, sdk_for
from tests.test_messages_api import WEATHER, CallingBackend, make_api
from tests.test_reasoning import THINK_TEMPLATE, ThinkingBackend

pytestmark = pytest.mark.unit
FUNCTION = {"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}


async def test_a_response_is_the_chat_answer_with_its_usage():
    backend = FakeBackend()
    response = await sdk_for(make_api(backend)).responses.create(model=MODEL, input="hi", instructions="Be brief.",
                                                                 max_output_tokens=5)
    [prompt] = [ids for _, ids, _ in backend.requests]
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == bytes(fake_tokens(prompt, None, 5)).decode()
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (len(prompt), 5)
    assert "Be brief." in TOK.decode(prompt)


async def test_streamed_events_build_the_same_response():
    client = sdk_for(make_api(FakeBackend()))
    kinds, text = [], ""
    async for event in await client.responses.create(model=MODEL, input="hi", max_output_tokens=5, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    whole = await client.responses.create(model=MODEL, input="hi", max_output_tokens=5)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert text == whole.output_text == final.output_text and final.usage.output_tokens == 5


async def test_reasoning_is_a_reasoning_item():
    api = make_api(ThinkingBackend())
    api.tokenizer = ByteTokenizer(THINK_TEMPLATE)
    response = await sdk_for(api).responses.create(model=MODEL, input="hi")
    assert [o.type for o in response.output] == ["reasoning", "message"]
    assert response.output[0].summary[0].text == "The user says hi." and response.output_text == "Hello there!"
    assert response.status == "completed"


async def test_function_call_and_its_output_round_trip():
    backend = CallingBackend()
    client = sdk_for(make_api(backend))
    response = await client.responses.create(model=MODEL, input="Weather in Paris?", tools=[FUNCTION],
                                             max_output_tokens=200)
    [call] = [o for o in response.output if o.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    follow = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sun"}]
    await client.responses.create(model=MODEL, input=follow, tools=[FUNCTION], max_output_tokens=200)
    assert "18 C, sun" in backend.prompt
    args = ""
    async for event in await client.responses.create(model=MODEL, input="Weather?", tools=[FUNCTION],
                                                     max_output_tokens=200, stream=True):
        if event.type == "response.function_call_arguments.delta":
            args += event.delta
        if event.type == "response.completed":
            assert [o.type for o in event.response.output] == ["function_call"]
    assert json.loads(args) == {"city": "Paris"}


async def test_previous_response_id_continues_the_kept_conversation():
    backend = FakeBackend()
    client = sdk_for(make_api(backend))
    first = await client.responses.create(model=MODEL, input="first question", max_output_tokens=4)
    second = await client.responses.create(model=MODEL, input="second question", max_output_tokens=4,
                                           previous_response_id=first.id)
    prompt = TOK.decode(backend.requests[-1][1])
    assert prompt.index("first question") < prompt.index(first.output_text) < prompt.index("second question")
    third = await client.responses.create(model=MODEL, input="third", previous_response_id=second.id,
                                          max_output_tokens=2)
    assert "first question" in TOK.decode(backend.requests[-1][1]) and third.status == "incomplete"


async def test_an_unknown_expired_or_unstored_response_is_a_404():
    api = make_api(FakeBackend())
    api.responses = ResponseStore(entries=8, ttl_s=0.2)
    client = sdk_for(api)
    with pytest.raises(openai.NotFoundError, match="no such response"):
        await client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")
    unkept = await client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    kept = await client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL, input="y", previous_response_id=unkept.id)
    await asyncio.sleep(0.3)
    with pytest.raises(openai.NotFoundError, match="expired"):
        await client.responses.create(model=MODEL, input="y", previous_response_id=kept.id)


def test_the_store_is_bounded_oldest_first():
    store = ResponseStore(entries=2, ttl_s=10)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}], now=0.0)
    assert store.get("r2", now=1.0)[0]["content"] == "2"
    with pytest.raises(ApiError):
        store.get("r0", now=1.0)
    with pytest.raises(ApiError):
        store.get("r1", now=11.0)


async def test_text_format_json_schema_reaches_the_grammar():
    backend = FakeBackend()
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    await sdk_for(make_api(backend)).responses.create(model=MODEL, input="x", max_output_tokens=4, text={
        "format": {"type": "json_schema", "name": "thing", "schema": schema}})
    grammar = backend.requests[-1][2].grammar
    assert grammar.kind == "json_schema" and json.loads(grammar.json_schema) == schema


@pytest.mark.parametrize("kwargs, words", [
    (dict(tools=[{"type": "web_search"}]), "function tools only"),
    (dict(extra_body={"no_such_field": 1}), "no_such_field"),
])
async def test_what_this_server_does_not_serve_is_a_400(kwargs, words):
    with pytest.raises(openai.BadRequestError, match=words):
        await sdk_for(make_api(FakeBackend())).responses.create(model=MODEL, input="hi", **kwargs)


async def test_store_and_metadata_are_accepted():
    response = await sdk_for(make_api(FakeBackend())).responses.create(
        model=MODEL, input="hi", max_output_tokens=3, store=False, metadata={"k": "v"}, user="u")
    assert len(response.output_text) == 3
