"""Reasoning output (#37): a model's `<think>…</think>` comes back as `reasoning_content`, split from the answer,
whole and streamed, however the text is cut into pieces."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.model.tokenizer import ByteTokenizer
from protos.messages import TokenChunk, Usage, WireFinishReason
from services.gateway.reasoning import ReasoningSplit, reasoning_mode
from tests.test_gateway import MODEL, make_api, sdk_for

pytestmark = pytest.mark.unit

# ChatML that knows the tags (as Qwen3's and MiMo's templates do): the generation prompt opens no reasoning
THINK_TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                  "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
                  "{#- a reasoning model answers after </think> #}")

CASES = [  # (mode, output, reasoning, content)
    ("detect", "<think>I should greet.</think>\n\nHello!", "I should greet.", "Hello!"),
    ("detect", "  \n<think>x < y</think>answer <think> stays", "x < y", "answer <think> stays"),
    ("detect", "Hello <think>not reasoning</think>", "", "Hello <think>not reasoning</think>"),
    ("detect", "<think>cut by max_tokens", "cut by max_tokens", ""),
    ("detect", "<thin", "", "<thin"),
    ("open", "already open</think>done", "already open", "done"),
]


def split_all(mode: str, pieces: list[str]) -> tuple[str, str]:
    split, reasoning, content = ReasoningSplit(mode), "", ""
    for piece in pieces:
        r, c = split.feed(piece)
        assert "<think>" not in r and "</think>" not in r
        reasoning, content = reasoning + r, content + c
    r, c = split.finish()
    assert (split.reasoning, split.content) == (reasoning + r, content + c)
    return reasoning + r, content + c


@pytest.mark.parametrize("mode, output, reasoning, content", CASES)
@given(cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=12))
def test_any_cut_of_the_output_splits_the_same(mode, output, reasoning, content, cuts):
    bounds = sorted({c % (len(output) + 1) for c in cuts})
    pieces = [output[a:b] for a, b in zip([0, *bounds], [*bounds, len(output)], strict=True)]
    assert split_all(mode, pieces) == (reasoning, content)


def test_only_a_template_that_knows_the_tags_turns_it_on():
    assert reasoning_mode(None, "x") is None and reasoning_mode("{{ messages }}", "x") is None
    assert reasoning_mode(THINK_TEMPLATE, "...assistant\n") == "detect"
    assert reasoning_mode(THINK_TEMPLATE, "...assistant\n<think>\n") == "open"


class ScriptedBackend:
    """A worker whose model writes `OUTPUT`, one byte per chunk, then stops; it keeps the last prompt's text."""

    OUTPUT = ""

    async def generate(self, request_id, token_ids, sampling, **_):
        self.prompt = bytes(t for t in token_ids if t < 256).decode()
        data = self.OUTPUT.encode()
        for i, b in enumerate(data):
            last = i == len(data) - 1
            yield TokenChunk(request_id=request_id, token_ids=[b],
                             finish_reason=WireFinishReason.STOP if last else None,
                             usage=Usage(prompt_tokens=len(token_ids), completion_tokens=len(data)) if last else None)
            await asyncio.sleep(0)


class ThinkingBackend(ScriptedBackend):
    """A worker whose model thinks before it answers."""

    OUTPUT = "<think>The user says hi.</think>\n\nHello there!"


async def test_chat_returns_reasoning_content_whole_and_streamed():
    api = make_api(ThinkingBackend())
    api.tokenizer = ByteTokenizer(THINK_TEMPLATE)
    client = sdk_for(api)
    messages = [{"role": "user", "content": "hi"}]
    whole = (await client.chat.completions.create(model=MODEL, messages=messages)).choices[0].message
    assert (whole.content, whole.model_extra["reasoning_content"]) == ("Hello there!", "The user says hi.")
    reasoning, content = "", ""
    async for event in await client.chat.completions.create(model=MODEL, messages=messages, stream=True):
        delta = event.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (content, reasoning) == ("Hello there!", "The user says hi.")


async def test_a_model_without_the_tags_in_its_template_gets_no_split():
    api = make_api(ThinkingBackend())
    message = (await sdk_for(api).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}])).choices[0].message
    assert message.content == ThinkingBackend.OUTPUT and "reasoning_content" not in json.loads(message.to_json())


# Qwen3-style: thinking can be turned off per request; the template then writes an empty reasoning itself
SWITCH_TEMPLATE = THINK_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\\n' }}",
    "{{ '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")


@pytest.mark.parametrize("off", [False, True])
async def test_thinking_can_be_turned_off_per_request_where_the_template_can(off):
    from tests.test_gateway import FakeBackend

    backend = FakeBackend()
    api = make_api(backend)
    api.tokenizer = ByteTokenizer(SWITCH_TEMPLATE)
    extra = {"chat_template_kwargs": {"enable_thinking": False}} if off else {}
    await sdk_for(api).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, extra_body=extra)
    assert ("<think>\n\n</think>" in api.tokenizer.decode(backend.requests[-1][1])) == off


OPEN_TEMPLATE = THINK_TEMPLATE.replace("{{ '<|im_start|>assistant\\n' }}", "{{ '<|im_start|>assistant\\n<think>\\n' }}")


@pytest.mark.parametrize("template, extra, want", [
    (OPEN_TEMPLATE, {}, "open"), (THINK_TEMPLATE, {}, "detect"), (SWITCH_TEMPLATE, {}, "detect"),
    (SWITCH_TEMPLATE, {"chat_template_kwargs": {"enable_thinking": False}}, ""), (None, {}, "")])
async def test_a_constrained_answer_follows_the_reasoning(template, extra, want):
    """JSON output (and tool calls) of a reasoning model are constrained after `</think>`, not in the reasoning;
    when the template closed the reasoning itself (thinking off) or knows no tags, from the first token."""
    from tests.test_gateway import FakeBackend

    backend = FakeBackend()
    api = make_api(backend)
    api.tokenizer = ByteTokenizer(template)
    await sdk_for(api).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, response_format={"type": "json_object"},
                                               extra_body=extra)
    assert backend.requests[-1][2].grammar.reasoning == want
