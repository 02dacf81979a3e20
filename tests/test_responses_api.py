"""OpenAI's Responses API (`/v1/responses`, #37) through the openai client: text, streaming events, reasoning,
function calls and their outputs, structured output, and what a server that stores nothing refuses."""

from __future__ import annotations

import json

import openai
import pytest

from libs.model.tokenizer import ByteTokenizer
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


@pytest.mark.parametrize("kwargs, words", [
    (dict(previous_response_id="resp_1"), "stores no responses"),
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
