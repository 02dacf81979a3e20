"""Gateway: HTTP API over a fake backend (pure-logic fake: no NATS, no model), SSE framing,
incremental detokenization with stop strings, logprob rendering, errors, auth and backpressure."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest

from libs.model.tokenizer import ByteTokenizer
from protos.messages import (
    RegistryEntry,
    Role,
    TokenChunk,
    Usage,
    WireFinishReason,
    WireSamplingParams,
    WireTokenLogprob,
)
from services.gateway.admission import Admission, AdmissionConfig
from services.gateway.backend import BackendError
from services.gateway.generation import Limits, Plan, Renderer, plan_completion, stream_events
from services.gateway.handlers import Api, bearer_ok, build_app
from services.gateway.protocol import CompletionRequest
from services.gateway.render import (
    SSE_DONE,
    TextAssembler,
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    held_back,
    parse_sse,
    sse_event,
    text_offsets,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

TOK = ByteTokenizer()
MODEL = "tiny-test"


def fake_tokens(prompt: list[int], seed: int | None, n: int) -> list[int]:
    """The fake worker's output: lowercase ASCII letters determined by prompt, seed and position."""
    base = sum(prompt) + (seed or 0) * 5
    return [97 + (base + 7 * i) % 26 for i in range(n)]


class FakeBackend:
    """Streams `fake_tokens` one chunk per token; records requests and streams closed before the end."""

    def __init__(self, gate: asyncio.Event | None = None, error: BackendError | None = None,
                 fail_after: int | None = None) -> None:
        self.gate = gate
        self.error = error
        self.fail_after = fail_after
        self.requests: list[tuple[str, list[int], WireSamplingParams]] = []
        self.closed_early: list[str] = []

    async def generate(self, request_id: str, token_ids: list[int], sampling: WireSamplingParams):
        self.requests.append((request_id, token_ids, sampling))
        if self.error is not None and self.fail_after is None:
            raise self.error
        finished = False
        try:
            if self.gate is not None:
                await self.gate.wait()
            toks = fake_tokens(token_ids, sampling.seed, sampling.max_tokens)
            for i, tok in enumerate(toks):
                if self.fail_after is not None and i == self.fail_after:
                    assert self.error is not None
                    raise self.error
                last = i == len(toks) - 1
                lps = [WireTokenLogprob(token_id=tok, logprob=-0.25, top={tok: -0.25, tok + 1: -1.5, tok + 2: -2.5})]
                yield TokenChunk(
                    request_id=request_id, token_ids=[tok], logprobs=lps if sampling.wants_logprobs else [],
                    finish_reason=WireFinishReason.LENGTH if last else None,
                    usage=Usage(prompt_tokens=len(token_ids), completion_tokens=len(toks), cached_tokens=3)
                    if last else None,
                )
                await asyncio.sleep(0)
            finished = True
        finally:
            if not finished:
                self.closed_early.append(request_id)


def make_api(backend, keys: frozenset[str] = frozenset(), in_flight: int = 8, queued: int = 8) -> Api:
    limits = Limits(max_model_len=64, default_max_tokens=6, max_n=4, max_batch=4)
    return Api(backend, TOK, MODEL, limits, Admission(AdmissionConfig(in_flight, queued, 5.0)), keys, retry_after_s=3)


async def no_services():
    return []


async def ready_services():
    """A registry holding a complete serving path (one combined worker): /health answers 200."""
    return [RegistryEntry(role=Role.WORKER, instance_id="w1")]


def client_for(api: Api) -> httpx.AsyncClient:
    app = build_app(ready_services, "gw-test", api)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def text_of(prompt: str, seed: int | None, n: int) -> str:
    return bytes(fake_tokens(list(prompt.encode()), seed, n)).decode()


# --- SSE, detokenization, logprobs (pure) -------------------------------------------------------


def test_sse_framing_round_trips_and_ends_with_done():
    raw = sse_event({"a": 1, "text": "x\ny"}) + sse_event({"b": [1, 2]}) + SSE_DONE
    assert raw.startswith(b"data: {") and raw.count(b"\n\n") == 3
    assert parse_sse(raw) == [{"a": 1, "text": "x\ny"}, {"b": [1, 2]}, "[DONE]"]
    with pytest.raises(ValueError, match="not an SSE data event"):
        parse_sse(b"event: x\n\n")


def _reference(ids: list[int], bounds: list[int], stops: list[str]) -> str:
    """Oracle: after each chunk decode everything received; the first time a stop string is present,
    the answer is the text before its earliest occurrence; otherwise the whole text."""
    for end in bounds:
        text = TOK.decode(ids[:end])
        cuts = [text.find(s) for s in stops if s in text]
        if cuts:
            return text[: min(cuts)]
    return TOK.decode(ids)


@pytest.mark.parametrize("seed", range(40))
def test_text_assembler_matches_whole_text_reference(seed):
    """Deltas concatenated == the whole output decoded then cut at the first stop string, for random
    token splits, multi-byte characters split across tokens, and stops spanning chunk boundaries."""
    rng = random.Random(seed)
    alphabet = ["a", "b", "c", "é", "ü", "→", " "]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
    ids = list(text.encode())
    stops = [text[i: i + rng.randint(1, 4)] for i in rng.sample(range(len(text)), k=min(2, len(text)))]
    stops = [s for s in stops if s] if rng.random() < 0.7 else ["zz"]
    bounds = []
    while not bounds or bounds[-1] < len(ids):
        bounds.append(min(len(ids), (bounds[-1] if bounds else 0) + rng.randint(1, 3)))
    asm = TextAssembler(TOK.decode, stops)
    out, pos = [], 0
    for end in bounds:
        delta = asm.add(ids[pos:end])
        assert "\ufffd" not in delta  # never half a character
        out.append(delta)
        pos = end
    out.append(asm.finish())
    assert "".join(out) == _reference(ids, bounds, stops)
    assert asm.stopped == any(s in text for s in stops)


def test_held_back_keeps_possible_stop_prefix_and_partial_utf8():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["xyz"]) == 0
    assert held_back("ab\ufffd", []) == 1


def test_logprob_rendering_completion_and_chat():
    lps = [WireTokenLogprob(token_id=104, logprob=-0.5, top={104: -0.5, 105: -1.0}),
           WireTokenLogprob(token_id=33, logprob=-2.0, top={105: -0.1, 106: -0.7})]
    before = list(b"0123456789")  # 10 characters of text before these two tokens
    comp = completion_logprobs(lps, TokenNames(TOK.decode), text_offsets(TOK.decode, before + [104, 33], 10))
    assert comp["tokens"] == ["h", "!"] and comp["token_logprobs"] == [-0.5, -2.0]
    assert comp["top_logprobs"][1] == {"i": -0.1, "j": -0.7, "!": -2.0}  # alternatives + the sampled token
    assert comp["text_offset"] == [10, 11]
    as_ids = completion_logprobs(lps, TokenNames(TOK.decode, as_ids=True), [0, 1])
    assert as_ids["tokens"] == ["token_id:104", "token_id:33"]
    assert as_ids["top_logprobs"][0] == {"token_id:104": -0.5, "token_id:105": -1.0}
    chat = chat_logprobs(lps, TokenNames(TOK.decode), top_k=1)
    assert chat["content"][1]["token"] == "!" and chat["content"][1]["bytes"] == [33]
    assert chat["content"][1]["top_logprobs"] == [{"token": "i", "logprob": -0.1, "bytes": [105]}]


def test_bearer_check():
    keys = frozenset({"k1", "k2"})
    assert bearer_ok("Bearer k2", keys) and bearer_ok("bearer k1", keys)
    assert not bearer_ok("Bearer k3", keys) and not bearer_ok("k1", keys) and not bearer_ok("", keys)


# --- HTTP API -----------------------------------------------------------------------------------


async def test_completion_text_usage_token_ids_and_choice_order():
    backend = FakeBackend()
    async with client_for(make_api(backend)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["ab", "xyz"], "max_tokens": 5, "n": 2,
                                                  "seed": 7, "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    texts = [ch["text"] for ch in body["choices"]]
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
    assert texts == [text_of("ab", 7, 5), text_of("ab", 8, 5), text_of("xyz", 7, 5), text_of("xyz", 8, 5)]
    assert body["choices"][2]["prompt_token_ids"] == list(b"xyz")
    assert body["choices"][2]["token_ids"] == list(text_of("xyz", 7, 5).encode())
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25,
                             "prompt_tokens_details": {"cached_tokens": 6}}
    seeds = sorted(s.seed for _, _, s in backend.requests)
    assert seeds == [7, 7, 8, 8]


async def test_token_id_prompts_and_logprobs_as_token_ids():
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1,
                                                  "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    toks = fake_tokens([5, 6, 7], None, 3)
    assert lp["tokens"] == [f"token_id:{t}" for t in toks]
    assert lp["top_logprobs"][0][f"token_id:{toks[0] + 1}"] == -1.5


async def test_stop_string_cuts_text_and_aborts_the_rest():
    backend = FakeBackend()
    full = text_of("ab", None, 20)
    stop = full[6:8]
    async with client_for(make_api(backend)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 20, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["text"] == full[: full.find(stop)] and choice["finish_reason"] == "stop"
    assert backend.requests[0][2].stop == [stop]  # the worker gets the stop strings too
    await asyncio.sleep(0.05)
    assert len(backend.closed_early) == 1  # the gateway stopped first: the downstream request was closed


async def test_chat_non_stream_and_stream_agree():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    prompt_ids = TOK.encode(TOK.apply_chat_template(messages))
    async with client_for(make_api(FakeBackend())) as c:
        whole = (await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                            "logprobs": True, "top_logprobs": 2})).json()
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    expected = bytes(fake_tokens(prompt_ids, None, 6)).decode()  # default_max_tokens=6
    assert whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert len(whole["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.content)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(e["object"] == "chat.completion.chunk" for e in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks if e["choices"]) == expected
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


async def test_completion_stream_carries_token_ids_per_chunk():
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "q", "max_tokens": 4, "stream": True,
                                                  "return_token_ids": True})
    chunks = parse_sse(r.content)[:-1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [ord("q")]
    ids = [t for e in chunks for t in e["choices"][0]["token_ids"]]
    assert ids == fake_tokens([ord("q")], None, 4)
    assert "".join(e["choices"][0]["text"] for e in chunks) == text_of("q", None, 4)


@pytest.mark.parametrize(("payload", "status", "needle"), [
    ({"prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "logit_bias": {"abc": 1.0}}, 400, "logit_bias"),
    ({"prompt": "x", "n": 9}, 400, "limit of 4"),
    ({"prompt": "x", "stop": [""]}, 400, "stop strings"),
    ({"prompt": []}, 400, "prompt is empty"),
    ({"prompt": [1, -2]}, 400, "negative token id"),
    ({"prompt": "x" * 70}, 400, "context"),
    ({"prompt": "x" * 40, "max_tokens": 30}, 400, "max_tokens (30)"),
])
async def test_bad_requests_get_openai_errors(payload, status, needle):
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, **payload})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


async def test_malformed_json_is_400_and_chat_option_mismatch_is_400():
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                       "top_logprobs": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


async def test_unknown_model_is_404_and_models_lists_the_served_one():
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert (await c.get("/v1/models/nope")).status_code == 404


async def test_api_keys():
    async with client_for(make_api(FakeBackend(), keys=frozenset({"sk-good"}))) as c:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-bad"})
        assert r.status_code == 401
        assert (await c.get("/v1/models")).status_code == 401
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-good"})
        assert r.status_code == 200
        assert (await c.get("/health")).status_code == 200  # health and metrics stay open


async def test_backpressure_429_with_retry_after():
    gate = asyncio.Event()
    api = make_api(FakeBackend(gate=gate), in_flight=1, queued=0)
    async with client_for(api) as c:
        first = asyncio.create_task(c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}))
        async with asyncio.timeout(5):
            while api.admission.in_flight < 1:
                await asyncio.sleep(0.01)
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "y", "max_tokens": 2})
        assert r.status_code == 429 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        gate.set()
        assert (await first).status_code == 200
        assert api.admission.in_flight == 0  # the slot was released
        metrics = (await c.get("/metrics")).text
    assert "windserve_gateway_rejected_total" in metrics and 'status="429"' in metrics


async def test_backend_errors_map_to_statuses_and_stream_errors_become_events():
    refused = FakeBackend(error=BackendError(400, "prompt too long for worker w1", code="context_length_exceeded"))
    gone = FakeBackend(error=BackendError(503, "worker w1 is gone"), fail_after=2)
    async with client_for(make_api(refused)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 400 and "too long" in r.json()["error"]["message"]
    async with client_for(make_api(gone)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True})
    events = parse_sse(r.content)
    assert events[-1] == "[DONE]" and "worker w1 is gone" in events[-2]["error"]["message"]
    assert [e["choices"][0]["text"] for e in events[:-2]] == list(text_of("x", None, 2))


async def test_leaving_a_stream_early_closes_every_downstream_request():
    backend = FakeBackend()
    body = CompletionRequest(model=MODEL, prompt="abc", max_tokens=50, n=3, stream=True)
    plan: Plan = plan_completion(body, TOK, Limits(max_model_len=64), "cmpl-t", MODEL)
    released = []
    events = stream_events(plan, backend, Renderer(plan, TOK.decode), TOK.decode, lambda: released.append(1))
    first = await anext(events)
    assert first.startswith(b"data: ")
    await events.aclose()  # what a client disconnect does to the response body
    await asyncio.sleep(0.05)
    assert sorted(backend.closed_early) == ["cmpl-t-0", "cmpl-t-1", "cmpl-t-2"] and released == [1]


# --- OpenAI's status codes, as its own SDK sees them ------------------------------------------------------------


def sdk_for(api: Api, key: str = "k") -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(ready_services, "gw-test", api)),
                             base_url="http://gw")
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, max_retries=0, http_client=http)


SDK_ERRORS = [  # (backend error, keys, call kwargs, the exception class OpenAI's API would raise, in its message)
    (None, False, dict(prompt="x", temperature=9), openai.BadRequestError, "temperature"),
    (None, False, dict(prompt=None), openai.BadRequestError, "prompt"),
    (None, False, dict(prompt="x" * 70), openai.BadRequestError, "context"),
    (None, False, dict(prompt="x", extra_body={"messages": [{"role": "user", "content": "hi"}]}),
     openai.BadRequestError, "/v1/chat/completions"),
    (None, False, dict(prompt="x", model="gpt-nope"), openai.NotFoundError, "gpt-nope"),
    (None, True, dict(prompt="x"), openai.AuthenticationError, "API key"),
    (BackendError(400, "too long for every worker", code="context_length_exceeded"), False, dict(prompt="x"),
     openai.BadRequestError, "every worker"),
    (BackendError(503, "worker w1 is gone", code="worker_gone", retry_after_s=1), False, dict(prompt="x"),
     openai.InternalServerError, "gone"),
    (BackendError(500, "worker failed", code="worker_error"), False, dict(prompt="x"), openai.InternalServerError,
     "failed"),
]


@pytest.mark.parametrize("error, keyed, kwargs, exc, words", SDK_ERRORS,
                         ids=lambda v: v.__name__ if isinstance(v, type) else None)
async def test_each_error_raises_the_exception_class_openai_would(error, keyed, kwargs, exc, words):
    backend = FakeBackend(error=error)
    client = sdk_for(make_api(backend, keys=frozenset({"right"}) if keyed else frozenset()), key="wrong")
    with pytest.raises(exc, match=words) as caught:
        await client.completions.create(**{"model": MODEL, "max_tokens": 2, **kwargs})
    if error is None:
        assert backend.requests == []  # refused before anything was sent
    assert caught.value.status_code < 500 or error is not None


async def test_a_full_queue_raises_rate_limit_error():
    gate = asyncio.Event()
    client = sdk_for(make_api(FakeBackend(gate=gate), in_flight=1, queued=0))
    first = asyncio.create_task(client.completions.create(model=MODEL, prompt="x", max_tokens=2))
    await asyncio.sleep(0.2)
    with pytest.raises(openai.RateLimitError):
        await client.completions.create(model=MODEL, prompt="y", max_tokens=2)
    gate.set()
    assert (await first).choices[0].text == text_of("x", None, 2)


async def test_fields_sdks_send_are_accepted_and_change_nothing():
    client = sdk_for(make_api(FakeBackend()))
    plain = await client.completions.create(model=MODEL, prompt="x", max_tokens=3, seed=1)
    sdk = await client.completions.create(model=MODEL, prompt="x", max_tokens=3, seed=1, user="u", extra_body={
        "store": False, "metadata": {"team": "a"}, "service_tier": "auto"})
    assert sdk.choices[0].text == plain.choices[0].text
    chat = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                                store=False, metadata={"k": "v"}, user="u")
    assert chat.choices[0].message.content
