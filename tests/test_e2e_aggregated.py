"""Aggregated serving end to end: real nats-server, gateway + router + worker as processes with the
tiny model, driven by the official `openai` client; greedy outputs checked against the offline `LLM`."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from libs.engine import LLM, SamplingParams
from libs.model.tokenizer import ByteTokenizer
from tests.fixtures.nats import start_nats_server
from tests.fixtures.services import ServiceGroup

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "windserve-tiny"
KEY = "sk-e2e"
ENGINE = {"page_size": 16, "num_full_pages": 512, "num_swa_pages": 256}
TOK = ByteTokenizer()


class System(ServiceGroup):
    def client(self, timeout: float = 30.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=timeout)


def start_system(nats_url: str, logs: Path, services: dict[str, str], namespace: str, gateway_env: dict[str, str]
                 ) -> System:
    """Start `services` ({instance id: service name}); wait until the gateway's /health lists them all."""
    system = System(nats_url, logs, env={"WINDSERVE_LOG_LEVEL": "WARNING"}, namespace=namespace)
    per_service = {
        "worker": {f"WINDSERVE_{k.upper()}": str(v) for k, v in ENGINE.items()},
        "gateway": gateway_env,
        "router": {},
    }
    try:
        for instance, name in services.items():
            system.start(instance, name, per_service[name])
        system.wait_ready(timeout=90)
    except Exception:
        system.stop()
        raise
    return system


@pytest.fixture(scope="module")
def system(nats_server, tmp_path_factory) -> Iterator[System]:
    services = {"agg-gw": "gateway", "agg-router": "router", "agg-w1": "worker"}
    sys_ = start_system(nats_server.url, tmp_path_factory.mktemp("agg-logs"), services, "agg",
                        {"WINDSERVE_API_KEYS": KEY, "WINDSERVE_MAX_MODEL_LEN": "32768"})  # above the pool
    try:
        yield sys_
    finally:
        sys_.stop()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(None, **ENGINE)


def prompt_ids(n: int, salt: int) -> list[int]:
    """Deterministic byte-range prompt of n tokens."""
    return [(salt * 31 + i * 7) % 250 + 3 for i in range(n)]


# --- correctness against the offline engine -------------------------------------------------------


def test_greedy_completions_equal_offline_llm_incl_long_prompts(system, llm):
    prompts = [prompt_ids(5, 1), prompt_ids(120, 2), prompt_ids(77, 3)]  # window 16: 120 tokens = 7.5 windows
    want = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    c = system.client()
    batch = c.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0,
                                 extra_body={"return_token_ids": True})
    got = [ch.model_extra["token_ids"] for ch in sorted(batch.choices, key=lambda ch: ch.index)]
    assert got == [list(o.token_ids) for o in want]
    assert [ch.text for ch in sorted(batch.choices, key=lambda ch: ch.index)] == [
        TOK.decode(list(o.token_ids), skip_special_tokens=True) for o in want]
    streamed = c.completions.create(model=MODEL, prompt=prompts[1], max_tokens=12, temperature=0, stream=True,
                                    extra_body={"return_token_ids": True})
    ids = [t for chunk in streamed for ch in chunk.choices for t in ch.model_extra.get("token_ids", [])]
    assert ids == list(want[1].token_ids)


def test_chat_stream_and_not_equal_offline_llm(system, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
    ids = TOK.encode(TOK.apply_chat_template(messages))
    want = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
    text = TOK.decode(list(want.token_ids), skip_special_tokens=True)
    c = system.client()
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert whole.choices[0].message.content == text
    assert whole.choices[0].model_extra["token_ids"] == list(want.token_ids)
    assert whole.choices[0].finish_reason == want.finish_reason.value
    assert whole.usage.prompt_tokens == len(ids) and whole.usage.completion_tokens == len(want.token_ids)
    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_logprobs_equal_offline_llm(system, llm):
    prompt = prompt_ids(40, 4)
    want = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=2))[0]
    r = system.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    for top, ref in zip(lp.top_logprobs, want.logprobs, strict=True):
        expected = {f"token_id:{t}": v for t, v in ref.top} | {f"token_id:{ref.token_id}": ref.logprob}
        assert top == pytest.approx(expected, abs=1e-4)


def test_stop_string_truncates_like_offline_text(system, llm):
    c = system.client()
    for salt in range(10, 40):  # find a prompt whose greedy text contains a printable ASCII character
        prompt = prompt_ids(30, salt)
        full = TOK.decode(list(llm.generate([prompt], SamplingParams(max_tokens=24))[0].token_ids),
                          skip_special_tokens=True)
        stop = next((ch for ch in full[1:] if ch.isascii() and ch.isprintable()), None)
        if stop is not None:
            break
    else:
        pytest.fail("no greedy output with a printable character found")
    r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible_and_matches_offline_seeds(system, llm):
    prompt = prompt_ids(20, 5)
    c = system.client()
    kw = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, n=3, seed=1234,
              extra_body={"return_token_ids": True})
    first = [ch.model_extra["token_ids"] for ch in sorted(c.completions.create(**kw).choices, key=lambda x: x.index)]
    again = [ch.model_extra["token_ids"] for ch in sorted(c.completions.create(**kw).choices, key=lambda x: x.index)]
    assert first == again
    assert len({tuple(x) for x in first}) > 1  # choice i samples with seed + i
    want = llm.generate([prompt] * 3, [SamplingParams(max_tokens=10, temperature=1.0, seed=1234 + i) for i in range(3)])
    assert first == [list(o.token_ids) for o in want]


def test_repeated_prompt_reports_cached_tokens(system, llm):
    prompt = prompt_ids(90, 6)
    offline = [llm.generate([prompt], SamplingParams(max_tokens=4))[0] for _ in range(2)]
    c = system.client()
    one = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    two = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < 90 and cached == offline[1].num_cached_tokens
    assert two.choices[0].text == one.choices[0].text


# --- errors, auth, disconnects, failures ----------------------------------------------------------


def test_errors_reach_the_client_with_openai_statuses(system):
    c = system.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        c.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=MODEL, prompt="x", temperature=9)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        c.completions.create(model=MODEL, prompt="x", logit_bias={"100000": 1})
    with pytest.raises(openai.BadRequestError, match="vocabulary"):  # refused by the worker, not the gateway
        c.completions.create(model=MODEL, prompt=[5, 100_000], max_tokens=2)
    # the worker's KV, under max_model_len: one arena of 512 full + 256 SWA pages' bytes = 1536 units (a full page
    # 1, an SWA page 4) holds 1528 full pages beside one window's 2 SWA pages: 1528 x 16 tokens (static: 8192)
    with pytest.raises(openai.BadRequestError, match="limit of 24448") as info:
        c.completions.create(model=MODEL, prompt=prompt_ids(100, 7), max_tokens=24349)
    assert info.value.status_code == 400
    bad_key = openai.OpenAI(base_url=f"{system.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    assert [m.id for m in c.models.list()] == [MODEL]


def _worker_load(system: System, instance: str) -> dict:
    entry = next(e for e in system.health()["instances"] if e["instance_id"] == instance)
    return entry["load"]


def test_client_disconnect_mid_stream_aborts_and_frees_kv(system):
    before = asyncio.run(system.details("agg-w1"))
    stream = system.client().completions.create(model=MODEL, prompt=prompt_ids(50, 8), max_tokens=4000,
                                                temperature=0, stream=True, extra_body={"ignore_eos": True})
    seen = 0
    for _ in stream:
        seen += 1
        if seen == 3:
            break
    assert _worker_load(system, "agg-w1")["running"] >= 0  # the registry view is readable mid-request
    stream.close()  # drop the HTTP connection
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        details = asyncio.run(system.details("agg-w1"))
        if int(details["aborted"]) > int(before["aborted"]) and details["running"] == "0":
            break
        time.sleep(0.2)
    assert int(details["aborted"]) == int(before["aborted"]) + 1
    assert int(details["finished"]) == int(before["finished"])  # aborted, not run to max_tokens
    assert (details["running"], details["waiting"], details["kv_full_used"], details["kv_swa_used"]) == (
        "0", "0", "0", "0")


def test_killed_worker_gives_client_an_error_in_bounded_time(tmp_path):
    """Own nats-server and no router: the gateway picks from the registry itself (fallback path)."""
    nats = start_nats_server(str(tmp_path / "nats"))
    system = None
    try:
        system = start_system(nats.url, tmp_path / "logs", {"kill-gw": "gateway", "kill-w1": "worker"},
                              "kill", {})
        c = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=30)
        stream = c.completions.create(model=MODEL, prompt=prompt_ids(20, 9), max_tokens=4000, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        received = 0
        with pytest.raises(openai.APIError, match="kill-w1") as info:
            for _ in stream:
                received += 1
                if received == 2:
                    system.procs["kill-w1"].send_signal(signal.SIGKILL)
        assert not isinstance(info.value, openai.APITimeoutError)  # the gateway answered, it did not hang
        with pytest.raises(openai.InternalServerError) as after:
            c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert after.value.status_code == 503
    finally:
        if system is not None:
            system.stop()
        nats.stop()
