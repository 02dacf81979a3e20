"""Images through the serving path (#16): the engine's embedding step (pseudo tokens -> pad id, rows overridden),
prefix caching across images, chunked prefill over an image; the gateway's content parts, limits, prompt assembly
and errors (real HTTP into the gateway app, an in-process EncoderAPI); the workers' fetch before admission.

References are independent of the override path: the same model with its embedding table extended by the image
rows (the prompt then names those rows as ordinary token ids), decoded by full recompute (`direct_greedy`)."""

from __future__ import annotations

import asyncio
import base64
import copy
import http.server
import threading
from collections.abc import Sequence

import cv2
import httpx
import numpy as np
import pytest
import torch

from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
from libs.engine.mm import MMEmbeddings
from libs.engine.runner import direct_greedy
from libs.mm.api import Encoded, EncoderMissing, EncoderUnavailable
from libs.mm.local import LocalEncoder
from libs.mm.placeholders import hash_view, is_mm_token, mm_token
from libs.model.vision import VisionTower
from protos.messages import (
    GenerateRequest,
    MMKind,
    RegistryEntry,
    Role,
    WireFinishReason,
    WireMMItem,
    WireSamplingParams,
)
from tests import test_engine
from tests.test_engine import PAGE, assert_baseline

pytestmark = [pytest.mark.timeout(120)]

tiny = test_engine.tiny  # the tiny model fixture (model, config, tokenizer)


def make_core(tiny, **overrides) -> EngineCore:
    return test_engine.make_core(
        tiny, **{"num_full_pages": 256, "max_num_batched_tokens": 256, "max_num_seqs": 8, **overrides})


def drain(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Every request's tokens and cached prompt tokens, stepping until the engine is idle."""
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for _ in range(2000):
        if not core.has_work():
            return got, cached
        for out in core.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
            cached[out.req_id] = out.num_cached_tokens
        core.check_invariants()
    raise AssertionError("engine did not drain")


def rows_of(seed: int, n: int, hidden: int) -> torch.Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def image_prompt(cfg, mm_hash: int, n: int, before: Sequence[int], after: Sequence[int]) -> tuple[list[int], int]:
    """before + <|vision_start|> + n pads + <|vision_end|> + after, in the hash view; (ids, offset of the pads)."""
    ids = [*before, cfg.vision_start_token_id, *[cfg.image_token_id] * n, cfg.vision_end_token_id, *after]
    offset = len(before) + 1
    return hash_view(ids, [(mm_hash, offset, n)]), offset


def reference(tiny, prompt: list[int], mm: MMEmbeddings, max_new: int) -> list[int]:
    """Greedy tokens of the same model whose embedding table is extended by the image rows: the image positions
    name those extra rows (vocab + j), so the override path is not involved at all."""
    model, cfg, _ = tiny
    ref = copy.deepcopy(model)
    extra = torch.cat([r.to(ref.model.embed_tokens.weight.dtype) for r in mm.rows])
    ref.model.embed_tokens = torch.nn.Embedding.from_pretrained(torch.cat([ref.model.embed_tokens.weight, extra]))
    ids = list(prompt)
    j = cfg.vocab_size
    for (a, b) in mm.spans():
        ids[a:b] = range(j, j + b - a)
        j += b - a
    return direct_greedy(ref, cfg, ids, max_new, page_size=PAGE)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


TEXT_A = list(b"look: ")
TEXT_B = list(b" what is it?")


# --- engine -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [256, 8])
def test_override_equals_embeddings_fed_directly_and_chunked_prefill(tiny, chunk):
    """One-chunk and 8-token-chunk prefill (chunks end inside the image) both equal the extended-vocabulary
    reference: the rows land at their positions whatever the chunking."""
    _, cfg, _ = tiny
    prompt, off = image_prompt(cfg, 11, 20, TEXT_A, TEXT_B)
    mm = MMEmbeddings((off,), (rows_of(1, 20, cfg.hidden_size),))
    core = make_core(tiny, max_num_batched_tokens=chunk)
    core.add_request(Request("a", prompt, greedy(8), mm=mm))
    got, _ = drain(core)
    assert got["a"] == reference(tiny, prompt, mm, 8)
    assert_baseline(core)


def test_same_image_hits_the_prefix_cache_and_prefix_hit_inside_an_image(tiny):
    """The same image again: the cached tokens cover the image. A prompt whose hit ends inside an image
    computes the rest of the image from the remaining rows (== reference)."""
    _, cfg, _ = tiny
    rows = rows_of(2, 16, cfg.hidden_size)
    # image at [6, 22), <|vision_end|> at 22: a 23-token prompt caches its full pages up to 20 (inside the image)
    first, off = image_prompt(cfg, 22, 16, list(b"pic: "), [])
    assert (off, len(first)) == (6, 23)
    mm = MMEmbeddings((off,), (rows,))
    core = make_core(tiny)
    core.add_request(Request("first", first, greedy(1), mm=mm))
    drain(core)
    longer = first + list(b" and now?")
    core.add_request(Request("inside", longer, greedy(6), mm=mm))
    got, cached = drain(core)
    assert off < cached["inside"] < off + 16, cached  # the hit ends inside the image
    assert got["inside"] == reference(tiny, longer, mm, 6)
    core.add_request(Request("again", longer, greedy(6), mm=mm))
    got, cached = drain(core)
    assert cached["again"] >= off + 16  # covers every image token
    assert got["again"] == reference(tiny, longer, mm, 6)
    assert_baseline(core)


def test_different_images_same_text_differ_and_never_share_kv(tiny):
    _, cfg, _ = tiny
    core = make_core(tiny)
    outs, cached = {}, {}
    for name, h, seed in (("one", 101, 3), ("two", 202, 4)):
        prompt, off = image_prompt(cfg, h, 16, TEXT_A, TEXT_B)
        core.add_request(Request(name, prompt, greedy(8),
                                 mm=MMEmbeddings((off,), (rows_of(seed, 16, cfg.hidden_size),))))
        got, hits = drain(core)
        outs[name], cached[name] = got[name], hits[name]
    assert outs["one"] != outs["two"]
    assert cached["two"] <= len(TEXT_A) + 1  # only the text before the image is shared
    assert_baseline(core)


@pytest.mark.parametrize("chunk", [256, 8])
def test_mtp_over_image_prompts_equals_the_reference(tiny, chunk):
    """Speculative decoding (k = 3) over prompts with images, one chunk or 8-token chunks ending inside the
    image, then the same image again (a prefix hit over it): the drafting blocks read the pad id at image
    positions (their drafts are verified), the outputs equal the extended-vocabulary reference, drafts are
    verified, and the pools end at baseline."""
    _, cfg, _ = tiny
    prompt, off = image_prompt(cfg, 31, 20, TEXT_A, TEXT_B)
    mm = MMEmbeddings((off,), (rows_of(5, 20, cfg.hidden_size),))
    want = reference(tiny, prompt, mm, 10)
    core = make_core(tiny, max_num_batched_tokens=chunk, speculative_tokens=3)
    for rid in ("first", "again"):
        core.add_request(Request(rid, prompt, greedy(10), mm=mm))
        got, cached = drain(core)
        assert got[rid] == want, rid
    assert cached["again"] >= off + 20  # the second one hit the image's KV (draft layers' too)
    spec = core.spec_stats()
    assert spec is not None and spec.drafted_tokens > 0
    assert_baseline(core)


def test_pseudo_tokens_need_their_rows(tiny):
    _, cfg, _ = tiny
    prompt, off = image_prompt(cfg, 5, 4, TEXT_A, TEXT_B)
    core = make_core(tiny)
    with pytest.raises(ValueError, match="no embedding rows"):
        core.add_request(Request("x", prompt, greedy(2)))
    with pytest.raises(ValueError, match="where an image's embedding row goes"):
        core.add_request(Request("y", prompt, greedy(2),
                                 mm=MMEmbeddings((off - 1,), (rows_of(0, 4, cfg.hidden_size),))))
    with pytest.raises(ValueError, match="hidden size"):
        core.add_request(Request("z", prompt, greedy(2), mm=MMEmbeddings((off,), (torch.zeros(4, 3),))))
    assert_baseline(core)


# --- worker: fetch before admission -------------------------------------------------------------------------------


def png_bytes(seed: int, w: int = 48, h: int = 40) -> bytes:
    img = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ok, buf = cv2.imencode(".png", img)
    assert ok
    return buf.tobytes()


@pytest.fixture(scope="module")
def encoder(tiny):
    _, cfg, _ = tiny
    torch.manual_seed(1)
    return LocalEncoder(VisionTower(cfg.vision).eval())


def wire_item(enc: Encoded, offset: int) -> WireMMItem:
    return WireMMItem(mm_hash=enc.mm_hash, kind=enc.kind, offset=offset, num_tokens=enc.num_tokens,
                      grid_thw=list(enc.grid_thw), encoder_instance=enc.encoder_instance)


class BrokenEncoder:
    async def encode(self, request_id, kind, data):
        raise EncoderUnavailable("no encoder answered within 0.1s")

    async def fetch(self, items, dtype):
        raise EncoderUnavailable("encoder enc-1 is gone")


def test_mm_refusal_checks_items_against_the_prompt(tiny, encoder):
    from libs.worker.mm import mm_refusal

    _, cfg, _ = tiny
    enc = asyncio.run(encoder.encode("r", MMKind.IMAGE, png_bytes(0)))
    prompt, off = image_prompt(cfg, enc.mm_hash, enc.num_tokens, TEXT_A, TEXT_B)
    item = wire_item(enc, off)
    assert mm_refusal(prompt, [item], True) is None
    assert "no vision tower" in mm_refusal(prompt, [item], False)
    assert "does not carry its pseudo tokens" in mm_refusal(prompt, [wire_item(enc, off - 1)], True)
    assert "outside a prompt" in mm_refusal(prompt[:off + 2], [item], True)
    assert "no mm_item covers" in mm_refusal(prompt + [mm_token(7, 0)], [item], True)


def test_worker_fetches_embeddings_before_admission_and_fails_explicitly(tiny, encoder):
    """The combined worker's Generations: a request with an image streams what the engine gives for its rows
    (== the extended-vocabulary reference); a dead encoder is a retryable error chunk and no KV is held."""
    from libs.engine import AsyncEngine
    from libs.worker.mm import EmbeddingFetcher
    from libs.worker.tasks import RequestTasks
    from services.worker.handlers import Generations

    _, cfg, _ = tiny

    async def main():
        enc = await encoder.encode("r", MMKind.IMAGE, png_bytes(3))
        prompt, off = image_prompt(cfg, enc.mm_hash, enc.num_tokens, TEXT_A, TEXT_B)
        item = wire_item(enc, off)
        (rows,) = await encoder.fetch([item], torch.float32)
        engine = AsyncEngine(make_core(tiny, max_num_batched_tokens=16))
        engine.start()
        chunks: list = []

        async def publish(_subject, chunk):
            chunks.append(chunk)

        try:
            for name, fetcher in (("ok", EmbeddingFetcher(encoder)), ("dead", EmbeddingFetcher(BrokenEncoder()))):
                gens = Generations(engine, publish, RequestTasks(), "w1", fetcher)
                req = GenerateRequest(request_id=name, token_ids=prompt, stream_subject="s", mm_items=[item],
                                      sampling=WireSamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
                await asyncio.wait_for(gens.start(req), 60)
            usage = await engine.call(lambda core: core.usage())
            seqs = await engine.call(lambda core: len(core.scheduler.seqs))
        finally:
            engine.shutdown()
        return prompt, MMEmbeddings((off,), (rows,)), chunks, usage, seqs

    prompt, mm, chunks, usage, seqs = asyncio.run(main())
    ok = [c for c in chunks if c.request_id == "ok"]
    assert [t for c in ok for t in c.token_ids] == reference(tiny, prompt, mm, 5)
    assert ok[-1].usage.prompt_tokens == len(prompt)
    (dead,) = [c for c in chunks if c.request_id == "dead"]
    assert dead.finish_reason is WireFinishReason.ERROR and dead.retryable and "encoder enc-1 is gone" in dead.error
    assert dead.error_code == "encoder_unavailable"  # (the gateway says so, not "server is at capacity")
    assert usage.full.in_use == 0 and usage.swa.in_use == 0 and seqs == 0


# --- gateway: real HTTP into the app, an in-process encoder, a recording backend -------------------------------


class RecordingBackend:
    """Answers every request with 2 tokens; records (token ids, mm_items)."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], list[WireMMItem]]] = []

    async def generate(self, request_id, token_ids, sampling, mm_items=()):
        from protos.messages import TokenChunk, Usage

        self.requests.append((list(token_ids), list(mm_items)))
        yield TokenChunk(request_id=request_id, token_ids=[104, 105], finish_reason=WireFinishReason.LENGTH,
                         usage=Usage(prompt_tokens=len(token_ids), completion_tokens=2, cached_tokens=0))


def gateway_client(encoder, *, vision: bool = True, **media):
    from libs.model.config import ModelConfig
    from libs.model.tokenizer import ByteTokenizer
    from services.gateway.admission import Admission, AdmissionConfig
    from services.gateway.config import MediaConfig
    from services.gateway.generation import Limits
    from services.gateway.handlers import Api, build_app
    from services.gateway.media import VisionTokens

    tok = ByteTokenizer()
    backend = RecordingBackend()

    async def services():
        return []

    api = Api(backend, tok, "tiny", Limits(max_model_len=4096, default_max_tokens=2),
              Admission(AdmissionConfig(4, 4, 5.0)), retry_after_s=2,
              vision=VisionTokens.of(ModelConfig.tiny(), tok.decode) if vision else None, encoder=encoder,
              media=MediaConfig(**{"mm_max_items": 2, "mm_max_item_bytes": 1 << 20, "mm_url_timeout_s": 1.0,
                                   **{f"mm_{k}": v for k, v in media.items()}}))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(services, "gw", api)), base_url="http://gw")
    return client, backend


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def chat_body(*parts, text: str = "what is this?") -> dict:
    content = [{"type": "text", "text": text}, *parts]
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2, "temperature": 0}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


async def post(client, body) -> httpx.Response:
    async with client:
        return await client.post("/v1/chat/completions", json=body)


def test_gateway_assembles_the_prompt_with_image_tokens(encoder):
    client, backend = gateway_client(encoder)
    img = png_bytes(5)
    resp = asyncio.run(post(client, chat_body(image_part(data_uri(img)), image_part(data_uri(img)))))
    assert resp.status_code == 200, resp.text
    ((ids, items),) = backend.requests
    enc = asyncio.run(encoder.encode("x", MMKind.IMAGE, img))
    assert [i.mm_hash for i in items] == [enc.mm_hash] * 2 and items[0].num_tokens == enc.num_tokens > 1
    from libs.model.config import ModelConfig

    cfg = ModelConfig.tiny()
    for item in items:  # <|vision_start|> pseudo tokens <|vision_end|> at the offsets of the final ids
        assert ids[item.offset - 1] == cfg.vision_start_token_id
        assert ids[item.offset + item.num_tokens] == cfg.vision_end_token_id
        assert ids[item.offset:item.offset + item.num_tokens] == [mm_token(enc.mm_hash, k)
                                                                  for k in range(enc.num_tokens)]
    assert sum(map(is_mm_token, ids)) == 2 * enc.num_tokens
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)  # image tokens count


def test_returned_prompt_token_ids_show_pad_ids_not_pseudo_tokens(encoder):
    """return_token_ids: the prompt comes back as the model's ids (the image pad id at the image's positions); the
    pseudo tokens of the hash view are internal (ids >= 2**31, no vocabulary id) and used to leak here."""
    from libs.model.config import ModelConfig

    client, backend = gateway_client(encoder)
    resp = asyncio.run(post(client, {**chat_body(image_part(data_uri(png_bytes(6)))), "return_token_ids": True}))
    assert resp.status_code == 200, resp.text
    ((ids, (item,)),) = backend.requests
    shown = resp.json()["choices"][0]["prompt_token_ids"]
    assert len(shown) == len(ids) and not any(map(is_mm_token, shown))
    assert shown[item.offset:item.offset + item.num_tokens] == [ModelConfig.tiny().image_token_id] * item.num_tokens
    assert [t for t in shown if t != ModelConfig.tiny().image_token_id] == [t for t in ids if not is_mm_token(t)]


def _mp4(path) -> bytes:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 4.0, (32, 32))
    for i in range(6):
        writer.write(np.full((32, 32, 3), 40 * i, np.uint8))
    writer.release()
    return path.read_bytes()


def test_gateway_video_part_and_local_path_under_root(encoder, tmp_path):
    video = _mp4(tmp_path / "clip.mp4")
    (tmp_path / "pic.png").write_bytes(png_bytes(6))
    client, backend = gateway_client(encoder, local_root=str(tmp_path))
    body = chat_body({"type": "video_url", "video_url": {"url": data_uri(video, "video/mp4")}},
                     image_part(f"file://{tmp_path}/pic.png"))
    resp = asyncio.run(post(client, body))
    assert resp.status_code == 200, resp.text
    ((ids, items),) = backend.requests
    assert [i.kind for i in items] == [MMKind.VIDEO, MMKind.IMAGE]


BAD_INPUTS = {
    "truncated image": (lambda: chat_body(image_part(data_uri(png_bytes(1)[:60]))), "truncated"),
    "non-image bytes": (lambda: chat_body(image_part(data_uri(b"GIF? no, plain text" * 10))), "not an image"),
    "too many images": (lambda: chat_body(*[image_part(data_uri(png_bytes(1)))] * 3), "more than 2"),
    "bad data URI": (lambda: chat_body(image_part("data:image/png;base64,@@not-base64@@")), "not valid base64"),
    "not base64 at all": (lambda: chat_body(image_part("data:image/png,rawbytes")), "data:<type>;base64"),
    "item too large": (lambda: chat_body(image_part(data_uri(b"\0" * (2 << 20)))), "at most"),
    "URLs off": (lambda: chat_body(image_part("http://127.0.0.1:9/x.png")), "off on this server"),
    "vision specials in text": (lambda: chat_body(image_part(data_uri(png_bytes(1))), text="<|image_pad|> hi"),
                                "may not contain the vision token"),
    "local path off": (lambda: chat_body(image_part("/etc/passwd")), "local paths are off"),
    "vision token in tool text": (lambda: {**chat_body(image_part(data_uri(png_bytes(1)))), "tools": [
        {"type": "function", "function": {"name": "f", "description": "<|vision_start|>"}}]},
        "not this request's images"),
    "image in an assistant message": (lambda: {"model": "tiny", "messages": [
        {"role": "assistant", "content": [image_part(data_uri(png_bytes(1)))]}]}, "only user messages"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_gateway_refuses_bad_media_with_400_before_queueing(encoder, case):
    make, message = BAD_INPUTS[case]
    client, backend = gateway_client(encoder)
    resp = asyncio.run(post(client, make()))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert message in err["message"] and err["type"] == "invalid_request_error"
    assert backend.requests == []


def test_gateway_without_vision_refuses_images_and_unavailable_encoder_is_503(encoder):
    client, backend = gateway_client(encoder, vision=False)
    resp = asyncio.run(post(client, chat_body(image_part(data_uri(png_bytes(1))))))
    assert resp.status_code == 400 and "no vision tower" in resp.json()["error"]["message"]
    client, backend = gateway_client(BrokenEncoder())
    resp = asyncio.run(post(client, chat_body(image_part(data_uri(png_bytes(1))))))
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "encoder_unavailable"
    assert resp.headers["retry-after"] == "2" and backend.requests == []


class NoEncoder:
    async def encode(self, request_id, kind, data):
        raise EncoderMissing("this deployment runs no encoder")


def test_a_deployment_without_an_encoder_is_a_400_that_says_what_to_start(encoder):
    """Permanent, so not a 503 with Retry-After that a client would retry forever."""
    client, backend = gateway_client(NoEncoder())
    resp = asyncio.run(post(client, chat_body(image_part(data_uri(png_bytes(1))))))
    assert resp.status_code == 400 and "retry-after" not in resp.headers
    err = resp.json()["error"]
    assert err["code"] == "encoder_missing" and "encoder" in err["message"] and "start one" in err["message"]
    assert backend.requests == []


class _EmptyView:
    def live(self, now, role):
        return self.entries

    async def resync_if_older(self, age_s):
        return None


@pytest.mark.parametrize("seen_before", [False, True])
def test_encoder_client_tells_a_missing_tier_from_a_gone_one(seen_before):
    from libs.mm.client import EncoderClient, EncoderClientConfig

    view = _EmptyView()
    view.entries = [RegistryEntry(role=Role.ENCODER, instance_id="enc-1", address="127.0.0.1:1")] if seen_before else []
    client = EncoderClient(None, "ns", view, config=EncoderClientConfig(missing_after_s=0.0))
    if seen_before:
        assert asyncio.run(client.candidates(1)) == ["enc-1"]
        view.entries = []  # the one encoder went away: it may come back
    with pytest.raises(EncoderUnavailable) as caught:
        asyncio.run(client.encode("r", MMKind.IMAGE, png_bytes(1)))
    assert isinstance(caught.value, EncoderMissing) is not seen_before


class _Handler(http.server.BaseHTTPRequestHandler):
    png = b""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            threading.Event().wait(3)  # past the gateway's 1 s bound: it has given up by now
            return
        if self.path == "/elsewhere":
            self.send_response(302)
            self.send_header("Location", "http://not-allowed.example/x.png")
            self.end_headers()
            return
        if self.path == "/missing.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.png)))
        self.end_headers()
        self.wfile.write(self.png)

    def log_message(self, *args):
        pass


@pytest.fixture
def media_server():
    _Handler.png = png_bytes(9)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("path,status,message", [
    ("/ok.png", 200, ""), ("/slow.png", 400, "did not answer within"), ("/missing.png", 400, "HTTP 404"),
    ("/elsewhere", 400, "not on this server's allow-list")])
def test_gateway_fetches_allow_listed_urls_with_limits(encoder, media_server, path, status, message):
    client, backend = gateway_client(encoder, url_hosts="127.0.0.1")
    resp = asyncio.run(post(client, chat_body(image_part(media_server + path))))
    assert resp.status_code == status, resp.text
    assert message in (resp.json().get("error") or {}).get("message", "")
    assert len(backend.requests) == (status == 200)


def test_gateway_unreachable_and_unlisted_urls_are_400(encoder):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client, _ = gateway_client(encoder, url_hosts="127.0.0.1")
    resp = asyncio.run(post(client, chat_body(image_part(f"http://127.0.0.1:{port}/x.png"))))
    assert resp.status_code == 400 and "could not be fetched" in resp.json()["error"]["message"]
    client, _ = gateway_client(encoder, url_hosts="127.0.0.1")
    resp = asyncio.run(post(client, chat_body(image_part("http://localhost/x.png"))))
    assert resp.status_code == 400 and "allow-list" in resp.json()["error"]["message"]


def test_preempted_image_requests_recompute_from_their_rows(tiny):
    """Small pools and little decode growth reserved: sequences get preempted and recompute their prompts, the
    image rows included (they stay with the request)."""
    _, cfg, _ = tiny
    # (the static pools: 16 full pages are the pressure; one arena of their bytes and the SWA pool's has room)
    core = make_core(tiny, num_full_pages=16, num_swa_pages=64, max_num_batched_tokens=16, admission_decode_tokens=2,
                     kv_arena=False)
    reqs = {}
    for i in range(3):
        prompt, off = image_prompt(cfg, 300 + i, 16, TEXT_A, TEXT_B[:4])
        reqs[f"r{i}"] = (prompt, MMEmbeddings((off,), (rows_of(10 + i, 16, cfg.hidden_size),)))
        core.add_request(Request(f"r{i}", prompt, greedy(16), mm=reqs[f"r{i}"][1]))
    got, _ = drain(core)
    assert core.scheduler.stats.preemptions > 0
    roomy = make_core(tiny)  # no preemption (its outputs equal the reference: the tests above)
    for rid, (prompt, mm) in reqs.items():
        roomy.add_request(Request(rid, prompt, greedy(16), mm=mm))
    assert got == drain(roomy)[0]
    assert roomy.scheduler.stats.preemptions == 0
    assert_baseline(core)


# --- disaggregated: prefill fetches before the reservation, decode fetches for a recompute ----------------------


def test_disaggregated_image_request_and_decode_fetch_failure(tiny, encoder):
    from libs.engine import AsyncEngine
    from libs.engine import disagg as dg
    from libs.transfer import TransferBackend, create_engine
    from libs.worker.mm import EmbeddingFetcher
    from services.decode.handlers import DecodeWorker
    from services.prefill.handlers import PrefillWorker

    model, cfg, tok = tiny
    config = EngineConfig(page_size=PAGE, num_full_pages=128, num_swa_pages=64, max_num_batched_tokens=16,
                          bucket_edges=(), max_num_seqs=8)

    async def main():
        enc = await encoder.encode("r", MMKind.IMAGE, png_bytes(7))
        prompt, off = image_prompt(cfg, enc.mm_hash, enc.num_tokens, TEXT_A, TEXT_B)
        (rows,) = await encoder.fetch([wire_item(enc, off)], torch.float32)
        pre = AsyncEngine(EngineCore(config, model, cfg, tok), output_timeout_s=60)
        dec = AsyncEngine(dg.DisaggEngineCore(config, model, cfg, tok), output_timeout_s=60)
        tx, rx = create_engine(backend=TransferBackend.TCP), create_engine(backend=TransferBackend.TCP)
        finals: dict[str, asyncio.Event] = {}
        chunks: dict[str, list] = {}

        async def publish(subject, chunk):
            chunks.setdefault(chunk.request_id, []).append(chunk)
            if chunk.finish_reason is not None:
                finals.setdefault(chunk.request_id, asyncio.Event()).set()

        pre.start()
        dec.start()
        await tx.start()
        await rx.start()
        try:
            for name, decode_encoder in (("ok", encoder), ("decode-fetch-fails", BrokenEncoder())):
                decode = DecodeWorker(dec, rx, "d0", publish, transfer_timeout_s=30,
                                      fetcher=EmbeddingFetcher(decode_encoder))
                prefill = PrefillWorker(pre, tx, "p0", lambda _d, m, w=decode: w.prepare(m), publish,
                                        commit=lambda _d, m, w=decode: w.commit(m), transfer_timeout_s=30,
                                        fetcher=EmbeddingFetcher(encoder))
                req = GenerateRequest(request_id=name, token_ids=prompt, stream_subject="s", decode_instance="d0",
                                      mm_items=[wire_item(enc, off)],
                                      sampling=WireSamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
                await prefill.submit(req)
                await asyncio.wait_for(finals.setdefault(name, asyncio.Event()).wait(), 60)
                await prefill.tasks.drain(30)  # both sides' request tasks ended (cleanups done)
                await decode.tasks.drain(30)
            usage = [await e.call(lambda core: core.usage()) for e in (pre, dec)]
            pending = len(dec.core.pending)
        finally:
            await tx.close()
            await rx.close()
            await asyncio.to_thread(pre.shutdown)
            await asyncio.to_thread(dec.shutdown)
        return prompt, MMEmbeddings((off,), (rows,)), chunks, usage, pending

    prompt, mm, chunks, usage, pending = asyncio.run(main())
    assert [t for c in chunks["ok"] for t in c.token_ids] == reference(tiny, prompt, mm, 6)
    failed = chunks["decode-fetch-fails"][-1]
    assert failed.finish_reason is WireFinishReason.ERROR and "could not be fetched" in failed.error
    for u in usage:
        assert u.full.in_use == 0 and u.swa.in_use == 0 and u.full.reserved == 0
    assert pending == 0


# --- services over a real nats-server: gateway + combined worker (encoder injected in-process) ----------------


@pytest.mark.integration
def test_services_serve_an_image_and_cache_it_across_requests(nats_url, encoder):
    """Real HTTP into the gateway service, GenerateRequest with mm_items over NATS, the worker's checks, fetch and
    engine: the same image twice -> the second request's cached tokens cover the image tokens."""
    import uuid

    from services.gateway.config import GatewayConfig
    from services.gateway.service import GatewayService
    from services.worker.config import WorkerConfig
    from services.worker.service import WorkerService

    namespace = f"mm_{uuid.uuid4().hex[:8]}"
    common = dict(nats_url=nats_url, namespace=namespace, registry_ttl_s=2, heartbeat_interval_s=0.3)
    img = png_bytes(11)
    n_image = asyncio.run(encoder.encode("x", MMKind.IMAGE, img)).num_tokens

    async def main():
        worker = WorkerService(WorkerConfig(**common, load_interval_s=0.1, page_size=PAGE, num_full_pages=256,
                                            num_swa_pages=96, max_num_batched_tokens=64, bucket_edges=[]))
        gateway = GatewayService(GatewayConfig(**common, http_port=0, served_model_name="tiny"))
        worker.encoder = gateway.encoder = encoder
        await worker.start()
        await gateway.start()
        try:
            async with httpx.AsyncClient(base_url=gateway.http_url, timeout=60) as client:
                bodies = []
                for _ in range(2):
                    resp = await client.post("/v1/chat/completions",
                                             json={**chat_body(image_part(data_uri(img))), "max_tokens": 6})
                    assert resp.status_code == 200, resp.text
                    bodies.append(resp.json())
        finally:
            await gateway.stop()
            await worker.stop()
        return bodies

    first, second = asyncio.run(main())
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] > n_image
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_image
    assert first["choices"][0]["message"]["content"] == second["choices"][0]["message"]["content"]


def test_lazy_encoder_builds_on_first_use_and_retries_a_failed_build(encoder):
    from libs.worker.mm import EmbeddingFetcher, LazyEncoder

    builds = []

    async def make():
        builds.append(len(builds))
        if len(builds) == 1:
            raise OSError("registry unreachable")
        return encoder

    async def main():
        enc = await encoder.encode("r", MMKind.IMAGE, png_bytes(2))
        fetcher = EmbeddingFetcher(LazyEncoder(make), timeout_s=5)
        assert builds == []  # nothing built before a request needs it
        with pytest.raises(EncoderUnavailable, match="could not start"):
            await fetcher.fetch([wire_item(enc, 3)])
        mm = await fetcher.fetch([wire_item(enc, 3)])
        await fetcher.fetch([wire_item(enc, 3)])
        return mm, enc

    mm, enc = asyncio.run(main())
    assert builds == [0, 1] and mm.offsets == (3,) and mm.rows[0].shape[0] == enc.num_tokens
