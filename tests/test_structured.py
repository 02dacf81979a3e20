"""Structured outputs (#15): grammar-constrained decoding with xgrammar and the sampling extras.

The tiny model is random: without the grammar its output is never JSON, so every schema-valid output here is
the constraint's doing. Engine level (offline LLM), disaggregated prefill -> decode in one process (real UCX),
and the official `openai` client against a real gateway + router + combined worker.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import jsonschema
import openai
import pytest
import torch

from libs.engine import LLM, EngineConfig, EngineCore, SamplingParams
from libs.engine.grammar import GrammarCache, GrammarError, spec_key, unsupported_keywords, validate_spec
from libs.engine.request import GrammarSpec
from libs.engine.sampling import History, adjust_logits, filter_logits, sample
from libs.model.tokenizer import ByteTokenizer
from protos import subjects
from protos.messages import GenerateRequest, WireGrammar, WireSamplingParams
from tests.fixtures.services import ServiceGroup
from tests.test_disagg import OPTS, Pipeline, tiny, tokens_of, ucx_config  # noqa: F401 (tiny: a fixture)
from tests.test_gateway import MODEL, client_for, make_api
from tests.test_gateway import FakeBackend as GatewayFakeBackend
from tests.test_gateway_strict import assert_error

TOK = ByteTokenizer()
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
ENGINE = {"page_size": 16, "num_full_pages": 256, "num_swa_pages": 128}


def chat_prompt(text: str) -> list[int]:
    return TOK.encode(TOK.apply_chat_template([{"role": "user", "content": text}]))


def text_of(ids) -> str:
    return TOK.decode(list(ids), skip_special_tokens=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.manual_seed(0)
    return LLM(None, **ENGINE)


# --- the engine ---------------------------------------------------------------------------------------


def test_json_schema_outputs_always_validate_over_many_seeds(llm):
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=SPEC) for s in range(16)]
    outs = llm.generate([chat_prompt("who?")] * len(params), params)
    texts = [text_of(o.token_ids) for o in outs]
    for o, text in zip(outs, texts, strict=True):
        assert o.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)  # json.loads is strict: no raw control characters
    assert len(set(texts)) > 8  # seeds still sample: the grammar narrows the choice, it does not fix it
    free = llm.generate([chat_prompt("who?")], SamplingParams(max_tokens=40, temperature=1.0, seed=0))[0]
    with pytest.raises(ValueError):  # the same model, unconstrained: not JSON
        json.loads(text_of(free.token_ids))
    assert len(llm.core.grammars) == 0  # every finished sequence released its matcher


def test_json_object_outputs_parse_as_objects(llm):
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=GrammarSpec("json_object"))
              for s in range(8)]
    for o in llm.generate([chat_prompt("json please")] * 8, params):
        assert o.finish_reason == "stop" and isinstance(json.loads(text_of(o.token_ids)), dict)


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm):
    prompts = [chat_prompt("a"), chat_prompt("bb"), chat_prompt("ccc")]
    free = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, temperature=0.9, seed=7),
            SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)]
    alone = llm.generate(prompts, free)
    constrained = [SamplingParams(max_tokens=24, temperature=t, seed=s, grammar=SPEC) for s, t in ((1, 1.0), (2, 0.0))]
    mixed = llm.generate([prompts[0], chat_prompt("x"), prompts[1], chat_prompt("y"), prompts[2]],
                         [free[0], constrained[0], free[1], constrained[1], free[2]])
    got = [mixed[0], mixed[2], mixed[4]]
    assert [o.token_ids for o in got] == [o.token_ids for o in alone]
    # logprobs: the same tokens and alternatives; values up to float noise (a batch of another size sums differently)
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got[2].logprobs] == [
        (lp.token_id, [t for t, _ in lp.top]) for lp in alone[2].logprobs]
    assert [lp.logprob for lp in got[2].logprobs] == pytest.approx([lp.logprob for lp in alone[2].logprobs], abs=1e-4)
    assert not any(text_of(o.token_ids).startswith("{") for o in got)  # still free text


def test_prefix_cached_prompt_gives_the_same_constrained_output_and_frees_kv(llm):
    before = llm.core.usage()
    prompt = chat_prompt("cache me " * 8)  # several full pages
    params = SamplingParams(max_tokens=120, temperature=0.0, grammar=SPEC)
    first, second = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    assert second.num_cached_tokens > 0 and first.num_cached_tokens == 0
    assert second.token_ids == first.token_ids
    jsonschema.validate(json.loads(text_of(first.token_ids)), SCHEMA)
    after = llm.core.usage()
    assert (after.full.in_use, after.swa.in_use) == (before.full.in_use, before.swa.in_use) == (0, 0)


def test_grammar_cache_is_keyed_by_the_canonical_schema():
    a = GrammarSpec("json_schema", json.dumps(SCHEMA))
    b = GrammarSpec("json_schema", json.dumps(SCHEMA, indent=2))  # same schema, other whitespace
    assert spec_key(a) == spec_key(b) == spec_key(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    assert spec_key(a) != spec_key(GrammarSpec("json_schema", json.dumps({**SCHEMA, "maxProperties": 5})))
    cache = GrammarCache(TOK, 512, TOK.eos_token_ids)
    first = cache.compile(a)
    assert cache.compile(b) is first and cache.hits == 1 and len(cache.compile_seconds) == 1


def test_unsupported_or_invalid_schemas_are_refused_naming_the_problem():
    assert unsupported_keywords({"type": "object", "properties": {"not": {"not": {}}, "x": {"uniqueItems": True}},
                                 "if": {}}) == ["properties.not.not", "properties.x.uniqueItems", "if"]
    with pytest.raises(GrammarError, match="unsupported JSON schema feature.*format=bogus"):
        validate_spec(GrammarSpec("json_schema", json.dumps({"type": "string", "format": "bogus"})))
    with pytest.raises(GrammarError, match="invalid JSON schema"):
        validate_spec(GrammarSpec("json_schema", json.dumps({"type": "strin"})))
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=SPEC, ignore_eos=True)


# --- the sampling extras against direct computations --------------------------------------------------


def test_penalties_and_logit_bias_equal_a_direct_computation():
    torch.manual_seed(3)
    logits = torch.randn(3, 10)
    hist = History([1, 2, 2, 5, 5, 5, 7], num_prompt=2)  # output: 2, 5, 5, 5, 7 (prompt 1, 2)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5,
                             logit_bias={3: 2.0, 9: -100.0}),
              SamplingParams(), SamplingParams(repetition_penalty=0.8)]
    got = adjust_logits(logits, params, [hist, None, hist])
    want = logits.clone()
    counts = {2: 1, 5: 3, 7: 1}
    for t in range(10):
        x = want[0, t].item() + {3: 2.0, 9: -100.0}.get(t, 0.0)
        x -= 0.25 * counts.get(t, 0) + 0.5 * (t in counts)
        if t in (1, 2, 5, 7):
            x = x / 1.5 if x > 0 else x * 1.5
        want[0, t] = x
        y = logits[2, t].item()
        want[2, t] = (y / 0.8 if y > 0 else y * 0.8) if t in (1, 2, 5, 7) else y
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1], logits[1])  # untouched row
    assert adjust_logits(logits, [SamplingParams()] * 3, [None] * 3) is logits  # nothing to do: no copy


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    one = torch.ones(1)
    out = filter_logits(logits, one, torch.zeros(1, dtype=torch.long), one, torch.tensor([0.2]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]  # 0.08 < 0.2 x 0.5
    gens = [torch.Generator().manual_seed(i) for i in range(200)]
    params = [SamplingParams(temperature=1.0, min_p=0.5)] * 200
    drawn = set(sample(logits.expand(200, 4).contiguous(), params, gens).token_ids)
    assert drawn == {0, 1}  # 0.12 and 0.08 are below 0.5 x 0.5


def test_logit_bias_steers_greedy_and_ignore_eos_runs_to_max_tokens(llm):
    prompt = chat_prompt("hi")
    out = llm.generate([prompt], SamplingParams(max_tokens=4, logit_bias={ord("z"): 100.0}))[0]
    assert out.token_ids == (ord("z"),) * 4
    eos = TOK.eos_token_ids[0]
    stops = llm.generate([prompt], SamplingParams(max_tokens=6, logit_bias={eos: 100.0}))[0]
    assert stops.token_ids == (eos,) and stops.finish_reason == "stop"
    runs = llm.generate([prompt], SamplingParams(max_tokens=6, logit_bias={eos: 100.0}, ignore_eos=True))[0]
    assert runs.token_ids == (eos,) * 6 and runs.finish_reason == "length"


# --- disaggregated prefill -> decode -------------------------------------------------------------------


async def test_disaggregated_constrained_output_equals_the_combined_engine(tiny):  # noqa: F811
    model, cfg, tok = tiny
    prompts = [chat_prompt("disagg one"), chat_prompt("disagg two, longer " * 3)]
    combined = LLM.from_core(EngineCore(EngineConfig(**OPTS), model, cfg, tok)).generate(
        prompts, SamplingParams(max_tokens=100, temperature=0.0, grammar=SPEC))
    wire = WireSamplingParams(max_tokens=100, temperature=0.0,
                              grammar=WireGrammar(kind="json_schema", json_schema=SPEC.schema))
    async with Pipeline(tiny, ucx_config()) as pipe:
        async def run(i: int, ids: list[int]) -> list[int]:
            rid = f"g{i}"
            await pipe.prefill.submit(GenerateRequest(request_id=rid, token_ids=ids, sampling=wire,
                                                      stream_subject=subjects.stream("t", rid), decode_instance="d0"))
            return tokens_of(await pipe.stream.result(rid))
        got = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
        await pipe.assert_no_kv_in_use()
        # the decode engine rebuilt each matcher from the wire and advanced it by the first token
        assert len(pipe.decode_engine.core.grammars) == 0 and len(pipe.prefill_engine.core.grammars) == 0
    assert got == [list(o.token_ids) for o in combined]
    for ids in got:
        jsonschema.validate(json.loads(text_of(ids)), SCHEMA)


# --- the gateway -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "needle"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}},
     "unsupported JSON schema feature(s): not"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integr"}}}, "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema is required"),
])
async def test_gateway_refuses_bad_schemas_with_400(fmt, needle):
    async with client_for(make_api(GatewayFakeBackend())) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                       "response_format": fmt})
    err = assert_error(r, 400, needle)
    assert err["param"].startswith("response_format")


class System(ServiceGroup):
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)


def combined_system(nats_url: str, logs, prefix: str) -> Iterator[System]:
    """A gateway and one combined worker (tiny model; no router: the gateway picks from the registry)."""
    sys_ = System(nats_url, logs, env={"WINDSERVE_LOG_LEVEL": "WARNING"}, namespace=prefix)
    try:
        sys_.start(f"{prefix}-gw", "gateway", {})
        sys_.start(f"{prefix}-w1", "worker", {f"WINDSERVE_{k.upper()}": str(v) for k, v in ENGINE.items()})
        sys_.wait_ready(timeout=90)
        yield sys_
    finally:
        sys_.stop()


@pytest.fixture(scope="module")
def system(nats_server, tmp_path_factory) -> Iterator[System]:
    yield from combined_system(nats_server.url, tmp_path_factory.mktemp("structured"), "st")


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_openai_client_json_schema_and_json_object_through_gateway_and_worker(system):
    c = system.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    resp = c.chat.completions.create(model="windserve-tiny", messages=[{"role": "user", "content": "a person"}],
                                     response_format=fmt, n=8, seed=11, temperature=1.0, max_tokens=160)
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = c.chat.completions.create(model="windserve-tiny", messages=[{"role": "user", "content": "a person"}],
                                       response_format=fmt, temperature=0, max_tokens=160, stream=True)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(streamed), SCHEMA)
    obj = c.chat.completions.create(model="windserve-tiny", messages=[{"role": "user", "content": "json"}],
                                    response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    # repeated: the prefix cache serves the prompt and the grammar still holds
    again = c.chat.completions.create(model="windserve-tiny", messages=[{"role": "user", "content": "a person"}],
                                      response_format=fmt, temperature=0, max_tokens=160)
    assert again.choices[0].message.content == streamed
    assert_worker_idle(system, "st-w1")


def assert_worker_idle(system: ServiceGroup, instance: str) -> None:
    """The worker's KV pools back to baseline: nothing running, no page in use (its load snapshot refreshes every
    LOAD_INTERVAL_S, so wait a bounded while)."""
    deadline = time.monotonic() + 15
    while True:
        details = asyncio.run(system.details(instance))
        state = (details["running"], details["waiting"], details["kv_full_used"], details["kv_swa_used"])
        if state == ("0", "0", "0", "0") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert state == ("0", "0", "0", "0")


def test_json_schema_numbers_never_run_past_what_parses(llm):
    """#37: unbounded integers and floats in a schema, 50 seeds at temperature 1 of a random-weights model: every
    output ends (stop, not length), parses and validates; integers fit 64 bits."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"},
                                               "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 3}},
              "required": ["n", "x", "xs"]}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=s, grammar=spec) for s in range(50)]
    for o in llm.generate([chat_prompt("numbers please")] * 50, params):
        value = json.loads(text_of(o.token_ids))
        assert o.finish_reason == "stop", text_of(o.token_ids)
        jsonschema.validate(value, schema)
        assert abs(value["n"]) < 2**63


# --- a reasoning model: the constraint applies to the answer, after `</think>` -------------------------


def allowed_bytes(spec: GrammarSpec, output: str) -> set[int]:
    """The tokens the engine's grammar book allows after `output` (prompt first, as the engine passes rows)."""
    from libs.engine.grammar import ConstrainedRow, GrammarBook

    book = GrammarBook(GrammarCache(TOK, TOK.vocab_size, TOK.eos_token_ids))
    prompt = chat_prompt("hi")
    mask, rows = book.bitmask([ConstrainedRow(0, "r", spec, prompt + TOK.encode(output), len(prompt))], 1, "cpu")
    assert rows == [0]
    return {t for t in range(TOK.vocab_size) if (int(mask[0, t // 32]) >> (t % 32)) & 1}


def test_the_grammar_of_a_reasoning_chat_starts_after_the_reasoning():
    opened = GrammarSpec("json_schema", json.dumps(SCHEMA), reasoning="open")
    free = allowed_bytes(opened, "I think {not json <b")
    assert {ord("x"), ord("<"), ord("}")} <= free and not free & set(TOK.eos_token_ids)  # reasoning: any text
    assert allowed_bytes(opened, "I think {not json</think>\n") == {ord("{"), ord(" "), ord("\n")}
    assert allowed_bytes(opened, "done</think>\n{") == {ord('"')}  # then the schema, as without reasoning
    detect = GrammarSpec("json_schema", json.dumps(SCHEMA), reasoning="detect")
    assert allowed_bytes(detect, "") == {ord("<"), ord("{")}  # a reasoning, or the answer straight away
    assert allowed_bytes(GrammarSpec("json_schema", json.dumps(SCHEMA)), "") == {ord("{")}
    assert spec_key(opened) != spec_key(detect) != spec_key(SPEC)


def test_a_reasoning_engine_row_thinks_freely_under_its_grammar(llm):
    """The same biased random model: with the reasoning open its text is free (the grammar leaves it alone);
    without it, the grammar shapes the output from the first token."""
    x = {ord("x"): 100.0}
    opened = GrammarSpec("json_schema", json.dumps(SCHEMA), reasoning="open")
    think, plain = llm.generate([chat_prompt("who?")] * 2, [
        SamplingParams(max_tokens=20, temperature=1.0, seed=3, logit_bias=tuple(x.items()), grammar=g)
        for g in (opened, SPEC)])
    assert text_of(think.token_ids) == "x" * 20 and think.finish_reason == "length"
    assert text_of(plain.token_ids).startswith('{"name": "')
    assert len(llm.core.grammars) == 0
