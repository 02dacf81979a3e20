"""Tool calling (#15): tools rendered through the chat template, calls parsed from the Qwen / Hermes output format
(`<tool_call>{"name", "arguments"}</tool_call>`), `tool_choice` required / named constrained by a grammar so
that the call always parses and validates against the function's parameter schema."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import jsonschema
import pytest
import torch

from libs.engine import LLM, SamplingParams
from libs.engine.grammar import GrammarCache
from libs.engine.request import GrammarSpec
from libs.model.tokenizer import ByteTokenizer
from protos.messages import WireGrammar
from services.gateway.generation import call_schema, chat_grammar
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.tool_calls import (
    HERMES,
    XML,
    ToolCallStream,
    parse_tool_calls,
    tool_format_for,
)
from tests.fixtures.chat_templates import QWEN_TOOLS_TEMPLATE, XML_TOOLS_TEMPLATE
from tests.test_gateway import MODEL, client_for, make_api
from tests.test_gateway import FakeBackend as GatewayFakeBackend
from tests.test_gateway_strict import assert_error
from tests.test_structured import ENGINE, System, assert_worker_idle, combined_system

TOK = ByteTokenizer()
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"$ref": "#/$defs/small"}},
       "required": ["a", "b"], "additionalProperties": False, "$defs": {"small": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "weather in Paris? and 2+3"}]


def check_calls(calls) -> None:
    """Every call names a declared function and its arguments validate against that function's schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


# --- pure parts ---------------------------------------------------------------------------------------


def test_tool_calls_are_parsed_from_the_output_format():
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n' \
           '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"x\\"}"}</tool_call>'
    rest, calls = parse_tool_calls(text, ["add", "get_weather"])
    assert rest.strip() == "Let me check." and calls == [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "x"}')]
    assert parse_tool_calls(text, ["add"]) is None  # an undeclared function: all of it stays content
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", ["add"]) is None
    assert parse_tool_calls("no calls", ["add"]) is None


@pytest.mark.parametrize("split", [1, 3, 7])
def test_streamed_content_holds_back_only_the_tool_call(split):
    text = 'Sure <b>: <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    s = ToolCallStream(HERMES, {"add": None}, str)
    out = "".join(s.feed(text[i:i + split])[0] for i in range(0, len(text), split))
    tail, calls = s.finish()[0], [(c.name, c.arguments) for c in s.calls]
    assert out == "Sure <b>: " and tail == "" and calls == [("add", '{"a": 1, "b": 2}')]
    plain = ToolCallStream(HERMES, {"add": None}, str)
    assert "".join(plain.feed(c)[0] for c in "a <tool") + plain.finish()[0] == "a <tool"  # not a call: all released


def test_tools_and_tool_results_render_through_chatml_and_a_qwen_style_template():
    conversation = [*USER,
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "call_1", "type": "function",
                         "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    tools = [t for t in TOOLS]
    for tok in (TOK, ByteTokenizer(QWEN_TOOLS_TEMPLATE)):
        text = tok.apply_chat_template(conversation, tools=tools)
        assert '"name": "get_weather"' in text and "<tools>" in text
        assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>' in text
        assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert TOK.apply_chat_template(USER) == ("<|im_start|>user\nweather in Paris? and 2+3<|im_end|>\n"
                                             "<|im_start|>assistant\n")


def test_required_and_named_choices_become_tool_call_grammars():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS,
                                                 "tool_choice": "required"})
    g = chat_grammar(body)
    assert g is not None and g.kind == "tool_calls" and g.parallel
    assert json.loads(g.json_schema)["anyOf"][1]["properties"]["arguments"]["properties"]["b"]["$ref"] == \
        "#/anyOf/1/properties/arguments/$defs/small"  # local refs rebased into the call schema
    named = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS,
                                                  "parallel_tool_calls": False,
                                                  "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert chat_grammar(named) == WireGrammar(kind="tool_calls", parallel=False, json_schema=json.dumps(
        call_schema([named.tools[1]]), separators=(",", ":")))
    auto = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS})
    g = chat_grammar(auto)  # auto is constrained too (#15): free text, or a whole valid call
    assert auto.calls_tools and g is not None and g.kind == "structural_tag"
    assert json.loads(g.json_schema)["format"]["type"] == "triggered_tags"


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.manual_seed(0)
    return LLM(None, **ENGINE)


def generate(llm: LLM, spec: GrammarSpec, seeds: int, max_tokens: int, tok: ByteTokenizer = TOK):
    """(output, its text) of `seeds` seeded samples at temperature 1 of the USER prompt with TOOLS, under `spec`."""
    prompt = tok.encode(tok.apply_chat_template(USER, tools=TOOLS))
    outs = llm.generate([prompt] * seeds, [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=s, grammar=spec)
                                           for s in range(seeds)])
    return [(o, TOK.decode(list(o.token_ids), skip_special_tokens=True)) for o in outs]


def test_forced_calls_always_parse_and_validate_over_seeds_in_the_engine(llm):
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS,
                                                 "tool_choice": "required", "parallel_tool_calls": False})
    g = chat_grammar(body)
    assert g is not None
    spec = GrammarSpec(g.kind, g.json_schema, g.parallel)
    names = set()
    for o, text in generate(llm, spec, 8, 100):
        assert o.finish_reason == "stop", text
        _, calls = parse_tool_calls(text, list(PARAMS))
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0][1]), PARAMS[calls[0][0]])
        names.add(calls[0][0])
    assert names <= set(PARAMS)


def body_of(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, "tools": TOOLS, **fields})


def spec_of(body: ChatCompletionRequest, fmt: str = HERMES) -> GrammarSpec:
    g = chat_grammar(body, fmt)
    assert g is not None
    return GrammarSpec(g.kind, g.json_schema, g.parallel)


def stream_all(fmt: str, text: str, pieces: list[str]) -> tuple[str, list[dict], list[dict]]:
    """Feed `pieces` (which join to `text`) to a ToolCallStream: (content, its calls, the deltas it sent)."""
    assert "".join(pieces) == text
    s = ToolCallStream(fmt, PARAMS, lambda i: f"call_{i}")
    content, deltas = "", []
    for piece in pieces:
        c, d = s.feed(piece)
        content, deltas = content + c, deltas + d
    c, d = s.finish()
    return content + c, s.openai_calls(), deltas + d


def accumulate(deltas: list[dict]) -> list[dict]:
    """What an OpenAI client builds from delta.tool_calls entries (by index; name and arguments appended)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": d.get("id"), "type": "function",
                                             "function": {"name": "", "arguments": ""}})
        call["function"]["name"] += d["function"].get("name", "")
        call["function"]["arguments"] += d["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]


# literal outputs in each format (hermes: what Qwen2.5 / Qwen3 write; xml: MiMo-V2.6's format as its chat template and
# xgrammar's `mimo` builtin give it; string values raw, others JSON)
OUTPUTS = {
    HERMES: ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
             '\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'),
    XML: ('Checking.\n<tool_call><function=get_weather><parameter=city>Paris</parameter><parameter=unit>c</parameter>'
          '</function></tool_call><tool_call><function=add><parameter=a>2</parameter><parameter=b>3</parameter>'
          '</function></tool_call>'),
}
EXPECTED = [("get_weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 2, "b": 3}')]


@pytest.mark.parametrize("fmt", [HERMES, XML])
def test_streamed_calls_accumulate_to_the_whole_parse_for_any_split(fmt):
    text = OUTPUTS[fmt]
    content, calls = parse_tool_calls(text, list(PARAMS), fmt, PARAMS)
    assert content.strip() == "Checking." and calls == EXPECTED
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        streamed, whole, deltas = stream_all(fmt, text, pieces)
        assert accumulate(deltas) == whole and [(c["function"]["name"], c["function"]["arguments"]) for c in whole] \
            == EXPECTED
        assert streamed == "Checking.\n" and "<" not in streamed  # the markup never leaks into content
        firsts = [d for d in deltas if "id" in d]  # each call announced once: index, id, type, name, arguments ""
        assert [(d["index"], d["type"], d["function"]) for d in firsts] == [
            (0, "function", {"name": "get_weather", "arguments": ""}),
            (1, "function", {"name": "add", "arguments": ""})]
    per_char = stream_all(fmt, text, list(text))[2]
    assert sum(1 for d in per_char if d["function"].get("arguments") and d["index"] == 0) > 2  # fragments, not whole


def test_the_chat_template_selects_the_tool_call_format():
    assert tool_format_for(None) == HERMES and tool_format_for(QWEN_TOOLS_TEMPLATE) == HERMES
    assert tool_format_for(XML_TOOLS_TEMPLATE) == XML
    tok = ByteTokenizer(XML_TOOLS_TEMPLATE)  # and the xml template renders earlier calls the same way
    history = [*USER, {"role": "assistant", "content": "Checking.\n", "tool_calls": [
        {"id": "c0", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}},
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]
    assert OUTPUTS[XML] + "<|im_end|>" in tok.apply_chat_template(history, add_generation_prompt=False, tools=TOOLS)


def walk(cache: GrammarCache, spec: GrammarSpec, prefix: bytes, seed: int, eos: int, steps: int = 300) -> str:
    """Drive a real matcher with uniformly random allowed tokens after forcing `prefix` (a weak model's worst
    case: anything the grammar lets through happens): the text, up to the end of the first call."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(cache.compile(spec))
    rng = random.Random(seed)
    out = list(prefix)
    assert all(m.accept_token(b) for b in prefix)
    mask = xgr.allocate_token_bitmask(1, cache.vocab_size)
    while len(out) < steps and not m.is_terminated() and not bytes(out).endswith(b"</tool_call>"):
        m.fill_next_token_bitmask(mask, 0)
        words = mask[0].tolist()
        allowed = [t for t in range(cache.vocab_size) if (words[t // 32] >> (t % 32)) & 1]
        t = rng.choice(allowed)
        if t == eos:
            break
        assert m.accept_token(t)
        out.append(t)
    return bytes(out).decode("utf-8", errors="replace")  # (free text may stop inside a character)


@pytest.mark.parametrize("fmt", [HERMES, XML])
def test_auto_calls_are_complete_and_valid_once_the_model_starts_one(llm, fmt):
    """tool_choice auto (#15): free text until the model writes `<tool_call>`; from there the grammar allows only a
    whole call of a declared tool with valid arguments. A random walk over the allowed tokens, 40 seeds."""
    core = llm.core
    cache = GrammarCache(TOK, core.model_config.vocab_size, core.scheduler.eos_token_ids)
    spec = spec_of(body_of(tool_choice="auto", parallel_tool_calls=False), fmt)
    eos = core.scheduler.eos_token_ids[0]
    names = set()
    for seed in range(40):
        text = walk(cache, spec, b"Let me see. <tool_call>", seed, eos)
        parsed = parse_tool_calls(text, list(PARAMS), fmt, PARAMS)
        assert parsed is not None, text
        (name, arguments), = parsed[1]
        jsonschema.validate(json.loads(arguments), PARAMS[name])
        names.add(name)
    assert names == set(PARAMS)
    free = walk(cache, spec, b"", 0, eos, steps=40)  # before a call: free text (the walk rarely opens one)
    assert "<tool_call>" not in free and len(free) > 20


def test_auto_with_response_format_answers_with_calls_or_the_json_over_seeds(llm):
    """tools + response_format (#15): the text answer follows the schema, a call follows its tool's schema."""
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer"], "additionalProperties": False}
    body = body_of(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    kinds = set()
    for o, text in generate(llm, spec_of(body), 16, 120):
        assert o.finish_reason == "stop", text
        parsed = parse_tool_calls(text, list(PARAMS), HERMES, PARAMS)
        if parsed is None:
            jsonschema.validate(json.loads(text), schema)
            kinds.add("json")
        else:
            assert parsed[0].strip() == ""
            for name, arguments in parsed[1]:
                jsonschema.validate(json.loads(arguments), PARAMS[name])
            kinds.add("calls")
    assert kinds == {"json", "calls"}  # both branches are open to the model
    required = chat_grammar(body_of(tool_choice="required", response_format={"type": "json_object"}))
    assert required is not None and required.kind == "tool_calls"  # a forced call: the tool schema constrains it


def test_forced_xml_calls_parse_and_validate_over_seeds_in_the_engine(llm):
    """The xml format end to end in the engine: forced calls under its grammar, parsed by its parser."""
    spec = spec_of(body_of(tool_choice="required"), XML)
    for o, text in generate(llm, spec, 8, 150, ByteTokenizer(XML_TOOLS_TEMPLATE)):
        assert o.finish_reason == "stop" and text.startswith("<tool_call><function="), text
        content, calls = parse_tool_calls(text, list(PARAMS), XML, PARAMS)
        assert content == "" and calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMS[name])


@pytest.mark.parametrize(("fields", "needle"), [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among tools"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}],
      "tool_choice": "required"}, "tools.0.function.parameters: unsupported JSON schema feature(s): not"),
    ({"tools": TOOLS, "ignore_eos": True}, "ignore_eos cannot be combined with response_format or tools"),
])
async def test_bad_tool_requests_get_400(fields, needle):
    async with client_for(make_api(GatewayFakeBackend())) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, **fields})
    assert_error(r, 400, needle)


async def test_tool_messages_are_checked():
    bad = [[*USER, {"role": "tool", "content": "5"}],  # no tool_call_id
           [*USER, {"role": "user", "content": "x", "tool_call_id": "c"}],
           [*USER, {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}]}]]
    async with client_for(make_api(GatewayFakeBackend())) as c:
        for messages, needle in zip(bad, ["tool_call_id", "tool_call_id", "not valid JSON"], strict=True):
            assert_error(await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400, needle)


# --- the openai client against gateway + worker --------------------------------------------------------


@pytest.fixture(scope="module")
def system(nats_server, tmp_path_factory) -> Iterator[System]:
    """Its own gateway + worker in namespace "tl" (the structured-output tests' system is gone by now)."""
    logs = tmp_path_factory.mktemp("tools")
    yield from combined_system(nats_server.url, logs, "tl")


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_required_and_named_tool_choice_always_parse_and_validate(system):
    """Seeded sampling at temperature 1 over several choices: every call is valid, whatever the draw."""
    c = system.client()
    required = c.chat.completions.create(model="windserve-tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                         n=6, seed=5, temperature=1.0, max_tokens=200)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls)
    named = c.chat.completions.create(model="windserve-tiny", messages=USER, tools=TOOLS, n=4, seed=9,
                                      temperature=1.0, max_tokens=100, parallel_tool_calls=False,
                                      tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert choice.message.tool_calls[0].function.name == "get_weather"
        check_calls(choice.message.tool_calls)


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(system, stream):
    c = system.client()
    kwargs = dict(model="windserve-tiny", tools=TOOLS, temperature=0, max_tokens=100)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in c.chat.completions.create(messages=USER, tool_choice="required", stream=True, **kwargs):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for d in choice.delta.tool_calls or ():
                    call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls" and calls
        first = [{"id": v["id"], "type": "function", "function": {"name": v["name"], "arguments": v["arguments"]}}
                 for _, v in sorted(calls.items())]
    else:
        resp = c.chat.completions.create(messages=USER, tool_choice="required", **kwargs)
        check_calls(resp.choices[0].message.tool_calls)
        first = [t.model_dump() for t in resp.choices[0].message.tool_calls]
    for call in first:
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": first},
               *({"role": "tool", "tool_call_id": call["id"], "content": "42"} for call in first)]
    answer = c.chat.completions.create(messages=history, tool_choice="none", max_tokens=8,
                                       **{k: v for k, v in kwargs.items() if k != "max_tokens"})
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens > len(TOK.encode(TOK.apply_chat_template(USER)))  # the calls and results
    assert_worker_idle(system, "tl-w1")


NOTE = {"type": "function", "function": {"name": "write_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 30, "maxLength": 40}},
    "required": ["text"], "additionalProperties": False}}}


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_streamed_tool_calls_accumulate_to_the_non_streamed_response(system):
    """Streaming (#15): calls arrive as OpenAI clients expect them — announced once (index, id, type, name), then
    argument fragments as the model writes them — and the `openai` client's own accumulation of the stream equals
    the non-streamed response of the same seed."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    c = system.client()
    tools = [*TOOLS, NOTE]
    params = {**PARAMS, "write_note": NOTE["function"]["parameters"]}
    # a bias on "\n" (byte 10: after a call, the grammar's choice between another call and the end) makes
    # parallel calls common for this random model
    kwargs = dict(model="windserve-tiny", messages=USER, tools=tools, tool_choice="required", n=4, seed=3,
                  temperature=1.0, max_tokens=300, logit_bias={"10": 4})
    whole = c.chat.completions.create(**kwargs)
    states = {i: ChatCompletionStreamState() for i in range(4)}
    fragments: dict[tuple[int, int], int] = {}
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:  # one state per choice: the client's accumulator handles one choice index 0
            states[choice.index].handle_chunk(chunk.model_copy(update={"choices": [choice.model_copy(
                update={"index": 0})]}))
            for d in choice.delta.tool_calls or ():
                if d.function and d.function.arguments:
                    fragments[choice.index, d.index] = fragments.get((choice.index, d.index), 0) + 1
    calls_seen = 0
    for choice in whole.choices:
        streamed = states[choice.index].get_final_completion().choices[0]
        assert streamed.finish_reason == choice.finish_reason == "tool_calls"
        assert [(t.type, t.function.name, t.function.arguments) for t in streamed.message.tool_calls] == \
            [(t.type, t.function.name, t.function.arguments) for t in choice.message.tool_calls]
        ids = [t.id for t in streamed.message.tool_calls]  # (ids name the request's calls: they differ per request)
        assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)
        assert [t.index for t in streamed.message.tool_calls] == list(range(len(choice.message.tool_calls)))
        assert not streamed.message.content and choice.message.content is None
        for t in choice.message.tool_calls:
            jsonschema.validate(json.loads(t.function.arguments), params[t.function.name])
            calls_seen += 1
    assert calls_seen > 4  # parallel calls happen (indices 0..n-1 checked above)
    assert max(fragments.values()) > 10  # a long argument streams in many chunks, not in one piece
    assert_worker_idle(system, "tl-w1")


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_auto_with_response_format_through_gateway_and_worker(system):
    """The structural-tag grammar on the wire: auto + json_schema answers with valid calls or the schema's JSON."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    resp = system.client().chat.completions.create(
        model="windserve-tiny", messages=USER, tools=TOOLS, n=6, seed=1, temperature=1.0, max_tokens=150,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}})
    kinds = set()
    for choice in resp.choices:
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            check_calls(choice.message.tool_calls)
            kinds.add("calls")
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)
            kinds.add("json")
    assert kinds == {"calls", "json"}


def test_numbers_the_schema_leaves_unbounded_stay_short_enough_to_parse(llm):
    """#37: an integer or number field without bounds could run to max_tokens inside one number (a weak model
    wrote 150 digits). A random walk over the allowed bytes now always ends in JSON that parses, with integers
    inside int64 and floats that round-trip; a schema's own bounds still hold."""
    core = llm.core
    cache = GrammarCache(TOK, core.model_config.vocab_size, core.scheduler.eos_token_ids)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                               "small": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n", "x", "small"]}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, cache.vocab_size)
    for seed in range(30):
        m, rng, out = xgr.GrammarMatcher(cache.compile(spec)), random.Random(seed), []
        while len(out) < 400 and not m.is_terminated():
            m.fill_next_token_bitmask(mask, 0)
            words = mask[0].tolist()
            t = rng.choice([t for t in range(cache.vocab_size) if (words[t // 32] >> (t % 32)) & 1])
            assert m.accept_token(t)
            if t < 256:  # (a stop token ends the walk)
                out.append(t)
        text = bytes(out).decode()
        value = json.loads(text)
        assert abs(value["n"]) < 2**63 and 0 <= value["small"] <= 9, text
        assert len(text) < 120, text
