"""Streams that survive a worker's death (#36): a request resumed elsewhere with the tokens it already produced
continues exactly as the uninterrupted one would have.

Engine level: a `Request` with `resumed` output tokens (computed with the prompt, never emitted again) gives the
rest of the uninterrupted output, greedy, seeded sampling (each draw depends on (seed, position, logits) only),
penalties and a JSON grammar whose state is rebuilt from the resumed tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from libs.engine import LLM, Request, SamplingParams
from libs.engine.request import GrammarSpec
from libs.model.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
ENGINE = {"page_size": 16, "num_full_pages": 256, "num_swa_pages": 128}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.manual_seed(0)
    return LLM(None, **ENGINE)


def run(llm: LLM, prompt: list[int], params: SamplingParams, resumed: list[int] = ()) -> list[int]:
    core = llm.core
    rid = f"m-{len(resumed)}-{id(params)}"
    core.add_request(Request(rid, prompt, params, resumed=list(resumed)))
    out: list[int] = []
    while core.has_work():
        for o in core.step():
            if o.req_id == rid:
                out += o.new_token_ids
    return out


PARAMS = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True),
    "penalized": SamplingParams(max_tokens=40, temperature=0.8, seed=3, frequency_penalty=1.5,
                                presence_penalty=0.5, ignore_eos=True),
    "json": SamplingParams(max_tokens=120, temperature=1.0, seed=5, grammar=GrammarSpec("json_schema",
                                                                                       json.dumps(SCHEMA))),
}


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("cut", [1, 17])
def test_a_resumed_request_continues_the_uninterrupted_one(llm, kind, cut):
    prompt = TOK.encode(TOK.apply_chat_template([{"role": "user", "content": f"tell me about {kind}"}]))
    params = PARAMS[kind]
    whole = run(llm, prompt, params)
    assert len(whole) > cut + 3
    rest = run(llm, prompt, params, resumed=whole[:cut])
    assert rest == whole[cut:]
    if kind == "json":
        json.loads(TOK.decode(whole, skip_special_tokens=True))
    usage = llm.core.usage()
    assert (usage.full.in_use, usage.swa.in_use) == (0, 0)


def test_resumed_tokens_count_against_max_tokens():
    with pytest.raises(ValueError, match="leave nothing"):
        Request("r", [1, 2, 3], SamplingParams(max_tokens=2), resumed=[4, 5])
