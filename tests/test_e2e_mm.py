"""Multimodal end to end (#16): real nats-server, gateway, router, encoder and engine roles as processes with the
tiny model (tiny vision tower), driven by the official `openai` client with data-URI images and a short mp4 the
test writes with opencv.

Aggregated (gateway, router, worker, encoder): a PNG, a JPEG and an mp4 chat return 200; the same image twice ->
the second request's cached tokens cover the image tokens and the encoder's cache-hit counter rises; two
different images with the same text -> different greedy outputs. Disaggregated (prefill + decode): the same chats
give the aggregated deployment's greedy outputs (the colocated reference). The PNG as an Anthropic Messages
image block gives the chat's answer (#37). Bad media -> 400 and the workers'
pools back to baseline.
"""

from __future__ import annotations

import asyncio
import base64
import os
import tempfile
import time

import anthropic
import cv2
import numpy as np
import openai
import pytest

from libs.model.tokenizer import ByteTokenizer
from tests.fixtures.services import ServiceGroup, start_group

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PAGE = 16
ENGINE = {"WINDSERVE_PAGE_SIZE": str(PAGE), "WINDSERVE_NUM_FULL_PAGES": "512", "WINDSERVE_NUM_SWA_PAGES": "256",
          "WINDSERVE_BUCKET_EDGES": "[]"}
COMMON = {"WINDSERVE_LOG_LEVEL": "WARNING", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_LOG_LEVEL": "error",
          **ENGINE}
TEXT = "What is in this picture?"


def image(seed: int, h: int = 192, w: int = 256) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (h // 16, w // 16, 3), dtype=np.uint8)
    return cv2.resize(base, (w, h), interpolation=cv2.INTER_NEAREST)  # blocky: survives JPEG


def data_uri(arr: np.ndarray, ext: str) -> str:
    ok, buf = cv2.imencode(ext, arr)
    assert ok
    mime = {".png": "image/png", ".jpg": "image/jpeg"}[ext]
    return f"data:{mime};base64,{base64.b64encode(buf.tobytes()).decode()}"


def mp4_uri(seed: int, frames: int = 8) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "clip.mp4")
        out = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), 4.0, (128, 96))
        for k in range(frames):
            out.write(image(seed + k, 96, 128))
        out.release()
        data = open(path, "rb").read()
    return f"data:video/mp4;base64,{base64.b64encode(data).decode()}"


def message(part: dict) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": TEXT}]}]


def image_part(uri: str) -> dict:
    return {"type": "image_url", "image_url": {"url": uri}}


async def chat(client: openai.AsyncOpenAI, part: dict) -> tuple[str, int, int]:
    """Greedy chat: (text, prompt tokens, cached tokens)."""
    resp = await client.chat.completions.create(model="windserve-tiny", messages=message(part), max_tokens=12,
                                                temperature=0)
    usage = resp.usage
    assert usage is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0 if usage.prompt_tokens_details else 0
    return resp.choices[0].message.content or "", usage.prompt_tokens, cached


def suffix_tokens() -> int:
    """Tokens after the image's last pad: <|vision_end|>, the text, the end of the turn and the assistant header."""
    return len(ByteTokenizer().encode(f"<|vision_end|>{TEXT}<|im_end|>\n<|im_start|>assistant\n"))


async def encoder_hits(group: ServiceGroup, encoder: str) -> int:
    return int((await group.details(encoder)).get("cache_hits", 0))


async def settled(group: ServiceGroup, instance: str, timeout_s: float = 20.0) -> None:
    """Until `instance` holds no request and no KV page (its health details; a finished request is released on
    the engine thread a moment after its last chunk)."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = await group.details(instance)
        if d.get("running") == "0" and d.get("kv_full_used") == "0" and d.get("kv_swa_used") == "0":
            return
        assert time.monotonic() < deadline, f"{instance} did not return to its KV baseline: {d}"
        await asyncio.sleep(0.2)


def client_for(group: ServiceGroup) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{group.url}/v1", api_key="none", max_retries=0, timeout=120)


async def run_chats(group: ServiceGroup) -> dict[str, str]:
    client = client_for(group)
    try:
        outs = {}
        for name, part in (("png", image_part(data_uri(image(1), ".png"))),
                           ("jpeg", image_part(data_uri(image(2), ".jpg"))),
                           ("mp4", {"type": "video_url", "video_url": {"url": mp4_uri(3)}})):
            outs[name], _, _ = await chat(client, part)
        return outs
    finally:
        await client.close()


@pytest.fixture(scope="module")
def aggregated_outputs():
    return {}


async def test_aggregated_images_video_cache_and_identity(nats_server, tmp_path, aggregated_outputs):
    services = {"gw": "gateway", "router": "router", "w0": "worker", "enc": "encoder"}
    group = start_group(nats_server.url, tmp_path / "agg", services, COMMON)
    try:
        aggregated_outputs.update(await run_chats(group))
        client = client_for(group)
        try:
            part = image_part(data_uri(image(7), ".png"))
            hits = await encoder_hits(group, "enc")
            out1, prompt1, _ = await chat(client, part)
            out2, prompt2, cached2 = await chat(client, part)
            assert prompt1 == prompt2 and out1 == out2
            image_end = prompt2 - suffix_tokens() + 1  # index after the last pad
            assert cached2 >= image_end, (cached2, image_end, prompt2)
            assert await encoder_hits(group, "enc") > hits
            other, prompt3, _ = await chat(client, image_part(data_uri(image(8), ".png")))
            assert prompt3 == prompt1 and other != out1
            with pytest.raises(openai.BadRequestError):
                await chat(client, image_part("data:image/png;base64," + base64.b64encode(b"not an image").decode()))
            # #37: the same PNG as an Anthropic image block gives the chat's greedy answer, from the prefix cache
            ok, png = cv2.imencode(".png", image(1))
            block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                 "data": base64.b64encode(png.tobytes()).decode()}}
            async with anthropic.AsyncAnthropic(base_url=group.url, api_key="none", max_retries=0, timeout=120) as ant:
                answer = await ant.messages.create(
                    model="windserve-tiny", max_tokens=12, extra_body={"temperature": 0},  # (no SDK argument)
                    messages=[{"role": "user", "content": [block, {"type": "text", "text": TEXT}]}])
            assert answer.content[0].text == aggregated_outputs["png"]
            assert answer.usage.cache_read_input_tokens >= image_end
        finally:
            await client.close()
        await settled(group, "w0")
    finally:
        group.stop()


async def test_disaggregated_equals_aggregated(nats_server, tmp_path, aggregated_outputs):
    if not aggregated_outputs:
        pytest.skip("needs the aggregated run's outputs (run the module)")
    services = {"gw": "gateway", "router": "router", "p0": "prefill", "d0": "decode", "enc": "encoder"}
    group = start_group(nats_server.url, tmp_path / "disagg", services, COMMON)
    try:
        assert await run_chats(group) == aggregated_outputs
    finally:
        group.stop()
