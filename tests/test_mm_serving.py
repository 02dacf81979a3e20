"""Images through the serving path (#16): the engine's embedding step (pseudo tokens -> pad id, rows overridden),
prefix caching across images, chunked prefill over an image; the gateway's content parts, limits, prompt assembly
and errors (real HTTP into the gateway app, an in-process EncoderAPI); the workers' fetch before admission.

References are independent of the override path: the same model with its embedding table extended by the image
rows (the prompt then names those rows as ordinary token ids), decoded by full recompute (`direct_greedy`)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Sequence

import cv2
import numpy as np
import pytest
import torch

from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
from libs.engine.mm import MMEmbeddings
from libs.engine.runner import direct_greedy
from libs.mm.api import Encoded, EncoderUnavailable
from libs.mm.local import LocalEncoder
from libs.mm.spec import hash_view, mm_token
from libs.model import load_model, load_tokenizer
from libs.model.vision import VisionTower
from protos.messages import GenerateRequest, MMKind, WireFinishReason, WireMMItem, WireSamplingParams

pytestmark = [pytest.mark.timeout(120)]

PAGE = 4


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model, cfg = load_model(None)
    return model, cfg, load_tokenizer(None)


def make_core(tiny, **overrides) -> EngineCore:
    model, cfg, tok = tiny
    opts = dict(page_size=PAGE, num_full_pages=256, num_swa_pages=128, max_num_batched_tokens=256,
                bucket_edges=(), max_num_seqs=8)
    opts.update(overrides)
    return EngineCore(EngineConfig(**opts), model, cfg, tok)


def drain(core: EngineCore) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for _ in range(2000):
        if not core.has_work():
            core.cached = cached  # type: ignore[attr-defined]
            return got
        for out in core.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
            cached[out.req_id] = out.num_cached_tokens
        core.check_invariants()
    raise AssertionError("engine did not drain")


def assert_baseline(core: EngineCore) -> None:
    u = core.usage()
    for pool in (u.full, u.swa):
        assert pool.in_use == 0 and pool.free + pool.cached == pool.capacity, pool
    assert not core.scheduler.seqs and not core.scheduler.running


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
    got = drain(core)
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
    got = drain(core)
    assert off < core.cached["inside"] < off + 16, core.cached  # the hit ends inside the image
    assert got["inside"] == reference(tiny, longer, mm, 6)
    core.add_request(Request("again", longer, greedy(6), mm=mm))
    got = drain(core)
    assert core.cached["again"] >= off + 16  # covers every image token
    assert got["again"] == reference(tiny, longer, mm, 6)
    assert_baseline(core)


def test_different_images_same_text_differ_and_never_share_kv(tiny):
    _, cfg, _ = tiny
    core = make_core(tiny)
    outs, cached = {}, {}
    for name, h, seed in (("one", 101, 3), ("two", 202, 4)):
        prompt, off = image_prompt(cfg, h, 16, TEXT_A, TEXT_B)
        core.add_request(Request(name, prompt, greedy(8), mm=MMEmbeddings((off,), (rows_of(seed, 16, cfg.hidden_size),))))
        outs[name] = drain(core)[name]
        cached[name] = core.cached[name]
    assert outs["one"] != outs["two"]
    assert cached["two"] <= len(TEXT_A) + 1  # only the text before the image is shared
    assert_baseline(core)


def test_pseudo_tokens_need_their_rows(tiny):
    _, cfg, _ = tiny
    prompt, off = image_prompt(cfg, 5, 4, TEXT_A, TEXT_B)
    core = make_core(tiny)
    with pytest.raises(ValueError, match="no embedding rows"):
        core.add_request(Request("x", prompt, greedy(2)))
    with pytest.raises(ValueError, match="where an image's embedding row goes"):
        core.add_request(Request("y", prompt, greedy(2), mm=MMEmbeddings((off - 1,), (rows_of(0, 4, cfg.hidden_size),))))
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
    assert usage.full.in_use == 0 and usage.swa.in_use == 0 and seqs == 0
