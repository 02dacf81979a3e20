"""Gateway hardening (issue 15): strict validation and limits, auth before the body, large fan-outs,
raw-byte logprobs without key collisions, text offsets, max_tokens defaults, special tokens, no empty
stream deltas, the context length from the checkpoint, and the OpenAPI document.

Every HTTP-level test here uses only the public API (and names that exist before the change are
imported at module level), so the file also runs against the previous gateway and shows each failure."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from protos.messages import TokenChunk, Usage, WireFinishReason, WireSamplingParams, WireTokenLogprob
from services.gateway.admission import Admission, AdmissionConfig
from services.gateway.backend import BackendError
from services.gateway.generation import Limits
from services.gateway.handlers import Api, build_app
from services.gateway.render import parse_sse
from tests.fixtures.tokenizers import write_byte_level_tokenizer
from tests.test_gateway import MODEL, TOK, FakeBackend, client_for, make_api

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

IM_START = TOK.special_tokens["<|im_start|>"]
CHAT = [{"role": "user", "content": "hi"}]


class ScriptBackend:
    """Streams a fixed token list, one chunk per token, with the given top alternatives per token."""

    def __init__(self, tokens: list[int], top: dict[int, float] | None = None, logprob: float = -0.5) -> None:
        self.tokens = tokens
        self.top = top or {}
        self.logprob = logprob

    async def generate(self, request_id: str, token_ids: list[int], sampling: WireSamplingParams):
        for i, tok in enumerate(self.tokens):
            last = i == len(self.tokens) - 1
            lps = [WireTokenLogprob(token_id=tok, logprob=self.logprob, top=dict(self.top))]
            yield TokenChunk(request_id=request_id, token_ids=[tok], logprobs=lps if sampling.wants_logprobs else [],
                             finish_reason=WireFinishReason.LENGTH if last else None,
                             usage=Usage(prompt_tokens=len(token_ids), completion_tokens=len(self.tokens))
                             if last else None)
            await asyncio.sleep(0)


class CapacityBackend(FakeBackend):
    """A fake decode tier with room for `capacity` requests at once: one more is refused the way the
    prefill worker refuses when every decode worker is full (retryable 503 server_busy)."""

    def __init__(self, capacity: int = 64) -> None:
        super().__init__()
        self.capacity = capacity
        self.active = 0
        self.peak = 0

    async def generate(self, request_id: str, token_ids: list[int], sampling: WireSamplingParams):
        if self.active >= self.capacity:
            raise BackendError(503, "server is at capacity: every decode worker is full", code="server_busy",
                               retry_after_s=1)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            async for chunk in super().generate(request_id, token_ids, sampling):
                yield chunk
        finally:
            self.active -= 1


async def post_raw(c: httpx.AsyncClient, path: str, body: bytes, headers: dict[str, str] | None = None):
    return await c.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})


def assert_error(r: httpx.Response, status: int, needle: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}
    return err


# --- lone surrogates and integers out of range: 400, never 500 -------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "\\ud800"}'),
    ("/v1/completions", b'{"model": "tiny-test", "prompt": ["ok", "\\udc80x"]}'),
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "x", "stop": ["\\ud800"]}'),
    ("/v1/completions", b'{"model": "tiny-test", "prompt": "x", "user": "\\udfff"}'),
    ("/v1/chat/completions", b'{"model": "tiny-test", "messages": [{"role": "user", "content": "\\udc80"}]}'),
    ("/v1/chat/completions",
     b'{"model": "tiny-test", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
])
async def test_lone_surrogates_are_400(path, body):
    async with client_for(make_api(FakeBackend())) as c:
        assert_error(await post_raw(c, path, body), 400, "not valid JSON")


@pytest.mark.parametrize("fields", [
    {"seed": 2**64}, {"seed": -1}, {"max_tokens": 10**30}, {"stop_token_ids": [2**64]}, {"prompt": [[2**70]]},
    {"top_k": 2**63}, {"n": 2**64},
])
async def test_integers_out_of_range_are_400(fields):
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **fields})
    assert_error(r, 400, "out of range")


async def test_seed_at_the_top_of_the_64_bit_range_wraps_per_choice():
    backend = FakeBackend()
    async with client_for(make_api(backend)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "n": 2,
                                                  "seed": 2**64 - 1})
    assert r.status_code == 200, r.text
    assert sorted(s.seed for _, _, s in backend.requests) == [0, 2**64 - 1]


async def test_keep_alive_connection_survives_bad_requests_and_big_headers_get_a_json_error():
    """Over a real uvicorn (the gateway's protocol class): 400s for a surrogate and a huge seed, then a
    good request, all on one keep-alive connection; a 64 KB header gets OpenAI's error body."""
    from services.gateway.service import _EmbeddedServer, http_config

    app = build_app(_no_services, "gw", make_api(FakeBackend()), 16384)
    server = _EmbeddedServer(http_config(app, "127.0.0.1", 0, 16384))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        bodies = [b'{"model": "tiny-test", "prompt": "\\ud800"}',
                  b'{"model": "tiny-test", "prompt": "x", "seed": 18446744073709551616}',
                  b'{"model": "tiny-test", "prompt": "x", "max_tokens": 2}']
        statuses = []
        for body in bodies:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            statuses.append(await _read_response(reader))
        assert [s for s, _ in statuses] == [400, 400, 200]
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 65536 + b"\r\n\r\n")
        await writer.drain()
        status, body = await _read_response(reader)
        assert status == 431 and "the limit is 16384 bytes" in json.loads(body)["error"]["message"]
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # beyond what h11 buffers
        writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: ")
        for _ in range(17):  # just past h11's 128 KB buffer, then wait (writing on would hit a closed socket)
            writer.write(b"a" * 8192)
            await writer.drain()
            await asyncio.sleep(0.005)
        status, body = await _read_response(reader)
        assert status == 400 and "invalid HTTP request" in json.loads(body)["error"]["message"]
        writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait({task}, timeout=5)


async def _no_services():
    return []


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    async with asyncio.timeout(10):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), body


# --- large fan-outs --------------------------------------------------------------------------------


def _fanout_api(backend, max_fanout: int = 32) -> Api:
    limits = Limits(max_model_len=64, default_max_tokens=2, max_n=16, max_batch=64)
    api = Api(backend, TOK, MODEL, limits, Admission(AdmissionConfig(8, 8, 5.0)))
    if hasattr(limits, "max_fanout"):
        api.limits = Limits(max_model_len=64, default_max_tokens=2, max_n=16, max_batch=64, max_fanout=max_fanout)
    return api


@pytest.mark.parametrize(("n", "prompts"), [(13, 5), (16, 64)])
async def test_large_fan_out_within_the_limits_is_served_on_an_idle_server(n, prompts):
    """n x prompts beyond one decode tier's room (64 here) is served, not answered 503 server_busy."""
    backend = CapacityBackend(capacity=64)
    async with client_for(_fanout_api(backend)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": [f"p{i}" for i in range(prompts)],
                                                  "n": n, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == list(range(n * prompts))
    assert backend.peak <= 32  # max_fanout


async def test_fan_out_streams_every_choice_too():
    backend = CapacityBackend(capacity=64)
    async with client_for(_fanout_api(backend, max_fanout=8)) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b", "c", "d", "e"], "n": 13,
                                                  "max_tokens": 2, "stream": True})
    events = parse_sse(r.content)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert {e["choices"][0]["index"] for e in events[:-1]} == set(range(65)) and backend.peak <= 8


# --- logprobs ------------------------------------------------------------------------------------


async def test_chat_logprob_bytes_are_the_raw_token_bytes():
    async with client_for(make_api(ScriptBackend([0xC3, 0xA9, 200, 104], top={200: -1.0, 201: -2.0}))) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                       "logprobs": True, "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [[0xC3], [0xA9], [200], [104]]
    assert [e["token"] for e in content] == ["bytes:\\xc3", "bytes:\\xa9", "bytes:\\xc8", "h"]
    assert [t["bytes"] for t in content[0]["top_logprobs"]] == [[200], [201]]
    assert r.json()["choices"][0]["message"]["content"] == "é\ufffdh"


async def test_completion_top_logprobs_keys_do_not_collide():
    """Bytes 128..130 all decode to U+FFFD: each keeps its own key and value; the sampled one (130,
    at -0.995) is not overwritten by an alternative that decodes to the same text."""
    top = {128: -2.885, 129: -3.5, 130: -0.995}
    async with client_for(make_api(ScriptBackend([130], top=top, logprob=-0.995))) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "logprobs": 3})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["bytes:\\x82"] and lp["token_logprobs"] == [-0.995]
    assert lp["top_logprobs"][0] == {"bytes:\\x82": -0.995, "bytes:\\x80": -2.885, "bytes:\\x81": -3.5}


def test_same_text_tokens_get_token_id_keys():
    from services.gateway.render import TokenNames, completion_logprobs

    names = TokenNames(lambda ids: "same", token_bytes=lambda t: b"same")
    lps = [WireTokenLogprob(token_id=7, logprob=-0.1, top={5: -0.2, 7: -0.1, 9: -3.0})]
    out = completion_logprobs(lps, names, [0])
    assert out["tokens"] == ["same"]
    assert out["top_logprobs"][0] == {"same": -0.1, "token_id:5": -0.2, "token_id:9": -3.0}


@pytest.mark.parametrize("as_ids", [False, True])
async def test_text_offset_counts_the_returned_text(as_ids):
    tokens = [104, 0xC3, 0xA9, 33, IM_START, 120]  # "h", "é" in two bytes, "!", a special (skipped), "x"
    async with client_for(make_api(ScriptBackend(tokens))) as c:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 6, "logprobs": 0, "return_tokens_as_token_ids": as_ids}
        whole = (await c.post("/v1/completions", json=body)).json()["choices"][0]
        stream = parse_sse((await c.post("/v1/completions", json={**body, "stream": True})).content)[:-1]
    assert whole["text"] == "hé!x"
    assert whole["logprobs"]["text_offset"] == [0, 1, 1, 2, 3, 3]
    assert [o for e in stream for o in (e["choices"][0]["logprobs"] or {}).get("text_offset", [])] == [0, 1, 1, 2, 3, 3]


# --- strict types, unsupported fields, limits --------------------------------------------------------


@pytest.mark.parametrize(("payload", "status", "needle"), [
    ({"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"prompt": [[False]]}, 400, "prompt"),
    ({"prompt": [1, True]}, 400, "prompt"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "echo": 0}, 400, "echo"),
    ({"prompt": "x", "temperature": "0.5"}, 400, "temperature"),
    ({"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"prompt": "x", "response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ({"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "x", "logit_bias": {"999999": 1.0}}, 400, "logit_bias"),
    ({"prompt": "x", "reasoning_effort": "low"}, 400, "reasoning_effort"),
    ({"prompt": "x", "stream_options": {"include_usage": True, "continuous_usage_stats": True}}, 400,
     "stream_options.continuous_usage_stats"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(17)]}, 400, "17 stop strings"),
    ({"prompt": "x", "stop": "y" * 257}, 400, "257 characters"),
])
async def test_strict_types_and_unsupported_fields(payload, status, needle):
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, **payload})
    assert_error(r, status, needle)


@pytest.mark.parametrize(("messages", "status", "needle"), [
    ([{"role": "user"}], 400, "needs content"),
    ([{"role": "assistant", "content": None}], 400, "needs content"),
    ([{"role": "user", "content": "x", "name": "bob"}], 400, "messages.0.name"),
    ([{"role": "assistant", "content": "", "tool_calls": []}], 400, "tool_calls"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], 400, "image_url"),
    ([{"role": "user", "content": "x"}] * 1025, 400, "1025 messages"),
])
async def test_chat_messages_are_checked(messages, status, needle):
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
    assert_error(r, status, needle)


@pytest.mark.parametrize("fields", [{"functions": []}, {"function_call": "auto"}, {"modalities": ["text"]}])
async def test_chat_fields_without_an_implementation_are_refused(fields):
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **fields})
    err = assert_error(r, 400, "not implemented")
    assert err["param"] == next(iter(fields)) and err["code"] == "unsupported_parameter"


async def test_body_size_is_checked_before_parsing():
    api = make_api(FakeBackend())
    api.max_body_bytes = 4096
    big = json.dumps({"model": MODEL, "prompt": [[1] * 3000]}).encode()

    async def chunked():
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    async with client_for(api) as c:
        assert_error(await post_raw(c, "/v1/completions", big), 413, "limit is 4096")
        r = await c.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert_error(r, 413, "limit is 4096")
        # Not even parsed: invalid JSON that is too large is a 413, not a 400.
        assert_error(await post_raw(c, "/v1/completions", b"{" * 5000), 413, "limit is 4096")


# --- max_tokens, special tokens, empty deltas ---------------------------------------------------------


async def test_completion_max_tokens_null_and_omitted_agree():
    backend = FakeBackend()
    async with client_for(make_api(backend)) as c:
        omitted = (await c.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 60})).json()
        null = (await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": None})).json()
        chat = (await c.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT})).json()
    # make_api: context 64, default cap 6 -> "up to the context" = min(6, 64 - prompt)
    assert [s.max_tokens for _, _, s in backend.requests] == [4, 6, 6]
    assert omitted["usage"]["completion_tokens"] == 4 and null["usage"]["completion_tokens"] == 6
    assert chat["usage"]["completion_tokens"] == 6


def test_no_default_cap_means_up_to_the_context():
    from services.gateway.generation import plan_completion
    from services.gateway.protocol import CompletionRequest

    plan = plan_completion(CompletionRequest(model=MODEL, prompt="abc"), TOK,
                           Limits(max_model_len=64, default_max_tokens=0), "r", MODEL)
    assert plan.subs[0].sampling.max_tokens == 61


async def test_special_tokens_are_skipped_in_text_unless_asked():
    tokens = [104, IM_START, 105]
    async with client_for(make_api(ScriptBackend(tokens))) as c:
        default = (await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3})).json()
        kept = (await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3,
                                                      "skip_special_tokens": False})).json()
    assert default["choices"][0]["text"] == "hi"
    assert kept["choices"][0]["text"] == "h<|im_start|>i"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_streams_carry_no_empty_deltas_but_always_the_finish(path):
    tokens = [104, IM_START, 0xC3, 0xA9, IM_START]  # special (no text), half a character, special at the end
    body = {"model": MODEL, "max_tokens": 5, "stream": True}
    body |= {"prompt": "x"} if "chat" not in path else {"messages": CHAT}
    async with client_for(make_api(ScriptBackend(tokens))) as c:
        chunks = parse_sse((await c.post(path, json=body)).content)[:-1]
    choices = [e["choices"][0] for e in chunks]
    texts = [ch["text"] if "text" in ch else ch["delta"].get("content") for ch in choices]
    if "chat" in path:
        assert choices[0]["delta"]["role"] == "assistant"
    assert texts[:-1] == ["h", "é"] and all(texts[:-1])  # no chunk without text before the finish chunk
    assert choices[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_streams_with_token_ids_send_each_token_at_once(path):
    """A chunk that carries the token ids the client asked for is not empty: it goes out when the token comes
    (held back, a token with no text would reach the client with the next one), and no token is lost."""
    tokens = [104, IM_START, 0xC3, 0xA9, IM_START]
    body = {"model": MODEL, "max_tokens": 5, "stream": True, "return_token_ids": True}
    body |= {"prompt": "x"} if "chat" not in path else {"messages": CHAT}
    async with client_for(make_api(ScriptBackend(tokens))) as c:
        chunks = parse_sse((await c.post(path, json=body)).content)[:-1]
    choices = [e["choices"][0] for e in chunks]
    texts = [ch["text"] if "text" in ch else ch["delta"].get("content") for ch in choices]
    assert all(ch["token_ids"] for ch in choices[:-1] if ch.get("finish_reason") is None)
    assert [t for ch in choices for t in ch["token_ids"]] == tokens  # no token is lost or merged away
    assert "".join(t or "" for t in texts) == "hé"
    assert choices[-1]["finish_reason"] == "length"


# --- auth, docs, 405 -----------------------------------------------------------------------------------


async def test_auth_comes_before_the_body_and_says_how():
    async with client_for(make_api(FakeBackend(), keys=frozenset({"sk-good"}))) as c:
        r = await post_raw(c, "/v1/completions", b"{not json")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = await post_raw(c, "/v1/chat/completions", b"{" * 100)
        assert r.status_code == 401
        assert (await c.get("/openapi.json")).status_code == 401
        assert (await c.get("/docs")).status_code == 401
        good = {"Authorization": "Bearer sk-good"}
        assert (await c.get("/openapi.json", headers=good)).status_code == 200
        assert (await c.get("/docs", headers=good)).status_code == 200
        r = await post_raw(c, "/v1/completions", b"{not json", good)
        assert_error(r, 400, "not valid JSON")


async def test_a_browser_reaches_the_docs_with_the_key_in_the_query():
    async with client_for(make_api(FakeBackend(), keys=frozenset({"sk-good"}))) as c:
        page = await c.get("/docs", params={"api_key": "sk-good"})
        assert page.status_code == 200 and "/openapi.json?api_key=sk-good" in page.text  # the page's own fetch
        assert (await c.get("/openapi.json", params={"api_key": "sk-good"})).status_code == 200
        assert (await c.get("/docs", params={"api_key": "wrong"})).status_code == 401
        assert (await c.post("/v1/completions", params={"api_key": "sk-good"}, json={})).status_code == 401


async def test_docs_can_stay_open_with_keys():
    api = make_api(FakeBackend(), keys=frozenset({"k"}))
    api.docs_auth = False
    async with client_for(api) as c:
        assert (await c.get("/openapi.json")).status_code == 200


async def test_405_carries_allow():
    async with client_for(make_api(FakeBackend())) as c:
        r = await c.get("/v1/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and "error" in r.json()
        r = await c.delete("/v1/models")
        assert r.status_code == 405 and r.headers["allow"] == "GET"


# --- OpenAPI ---------------------------------------------------------------------------------------


async def test_openapi_documents_every_status_with_the_body_sent():
    async with client_for(make_api(FakeBackend())) as c:
        doc = (await c.get("/openapi.json")).json()
        sent_400 = (await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})).json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = doc["paths"][path]["post"]
        statuses = {int(s) for s in op["responses"]} - {200}
        assert statuses >= {400, 401, 404, 405, 413, 429, 503}
        for status in statuses:
            schema = op["responses"][str(status)]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
        body = op["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        assert doc["components"]["schemas"][body]["additionalProperties"] is False
    assert set(sent_400) == {"error"} and set(doc["components"]["schemas"]["ErrorResponse"]["properties"]) == {"error"}
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "application/json" not in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    assert not _non_json_schema_keys(doc)  # bounds as minimum/maximum, not pydantic's ge/le


def _non_json_schema_keys(node) -> set[str]:
    if isinstance(node, list):
        return set().union(*map(_non_json_schema_keys, node)) if node else set()
    if not isinstance(node, dict):
        return set()
    own = {k for k in node if k in ("ge", "le", "gt", "lt")}
    return own.union(*(_non_json_schema_keys(v) for v in node.values()))


# --- context length from the checkpoint ---------------------------------------------------------------


def test_max_model_len_comes_from_the_checkpoint(tmp_path):
    from libs.service.config import load_config
    from services.gateway.config import GatewayConfig, checkpoint_context

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    assert checkpoint_context(str(tmp_path)) == 1024
    assert checkpoint_context("") == 4096  # the built-in tiny model's
    env = {"WINDSERVE_MODEL": str(tmp_path)}
    assert load_config(GatewayConfig, env).context_length == 1024
    assert load_config(GatewayConfig, {**env, "WINDSERVE_MAX_MODEL_LEN": "512"}).context_length == 512


async def test_models_reports_the_context_and_prompts_are_checked_against_it():
    async with client_for(make_api(FakeBackend())) as c:
        card = (await c.get("/v1/models")).json()["data"][0]
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 64})
    assert card["max_model_len"] == 64
    assert_error(r, 400, "context is 64")


# --- raw token bytes from a tokenizer.json --------------------------------------------------------


def test_hf_token_bytes_are_raw_bytes(tmp_path):
    from libs.model.tokenizer import load_tokenizer

    write_byte_level_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    text = "<|im_start|>héllo wörld → the fox"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()
    halves = [tok.token_bytes(t) for t in tok.encode("→")]  # an untrained character: one token per byte
    assert halves == [b"\xe2", b"\x86", b"\x92"]
    assert tok.token_bytes(tok.special_tokens["<|im_end|>"]) == b"<|im_end|>"


def test_tokens_the_tokenizer_config_calls_special_are_skipped(tmp_path):
    """A tokenizer.json with <|im_start|> as a plain added token, called special in tokenizer_config.json:
    skipped from skip_special_tokens text like the tokens tokenizer.json itself flags."""
    from tokenizers import Tokenizer

    from libs.model.tokenizer import load_tokenizer

    write_byte_level_tokenizer(tmp_path)
    raw = json.loads(Tokenizer.from_file(str(tmp_path / "tokenizer.json")).to_str())
    for t in raw["added_tokens"]:
        t["special"] = t["content"] != "<|im_start|>"
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"additional_special_tokens": ["<|im_start|>"]}))
    tok = load_tokenizer(str(tmp_path))
    ids = tok.encode("<|im_start|>the fox<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "the fox"
    assert tok.decode(ids) == "<|im_start|>the fox<|im_end|>"


async def test_the_docs_page_loads_its_assets_from_this_server():
    async with client_for(make_api(FakeBackend(), keys=frozenset({"sk-good"}))) as c:
        page = (await c.get("/docs", params={"api_key": "sk-good"})).text
        assert "cdn" not in page.lower() and "/docs/assets/swagger-ui-bundle.js" in page
        js = await c.get("/docs/assets/swagger-ui-bundle.js")  # a browser's <script>: no key
        assert js.status_code == 200 and "SwaggerUIBundle" in js.text[:200000]
