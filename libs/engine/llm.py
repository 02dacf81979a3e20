"""Offline API: `LLM(model).generate(prompts, params)` runs a batch to completion in-process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from libs.engine.config import EngineConfig
from libs.engine.core import EngineCore, load_core
from libs.engine.request import FinishReason, Request, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class Output:
    req_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str | None
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: FinishReason | None
    num_cached_tokens: int


class LLM:
    """In-process engine for benchmarks, tests and scripts.

    model: a model directory, or None for the built-in tiny model. engine_options: EngineConfig
    fields (page_size, num_full_pages, enable_prefix_cache, ...).
    """

    def __init__(self, model: str | None = None, **engine_options) -> None:
        # (tp / ep > 1 over a checkpoint: each rank reads its own shard, no full model is loaded)
        self.core = load_core(model, EngineConfig.from_kwargs(**engine_options))
        self._ids = itertools.count()

    @classmethod
    def from_core(cls, core: EngineCore) -> LLM:
        self = cls.__new__(cls)
        self.core = core
        self._ids = itertools.count()
        return self

    def generate(self, prompts: Sequence[Sequence[int] | str],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Output]:
        """Generate for every prompt (token ids or text); outputs in prompt order."""
        params_list = self._params_for(prompts, params)
        reqs = [Request(f"llm-{next(self._ids)}", self._encode(p), sp)
                for p, sp in zip(prompts, params_list, strict=True)]
        tokens: dict[str, list[int]] = {r.req_id: [] for r in reqs}
        logprobs: dict[str, list[TokenLogprob]] = {r.req_id: [] for r in reqs}
        final: dict[str, tuple[FinishReason | None, int]] = {}
        for r in reqs:
            self.core.add_request(r)
        while len(final) < len(reqs):
            if not self.core.has_work():
                raise RuntimeError(f"engine went idle with {len(reqs) - len(final)} requests unfinished")
            for out in self.core.step():
                if out.req_id not in tokens:
                    continue
                tokens[out.req_id].extend(out.new_token_ids)
                logprobs[out.req_id].extend(out.logprobs or ())
                if out.finished:
                    final[out.req_id] = (out.finish_reason, out.num_cached_tokens)
        return [self._output(r, tokens[r.req_id], logprobs[r.req_id], *final[r.req_id]) for r in reqs]

    def _output(self, req: Request, toks: list[int], lps: list[TokenLogprob], reason, cached: int) -> Output:
        tok = self.core.tokenizer
        text = tok.decode(toks) if tok is not None else None
        return Output(req.req_id, tuple(req.prompt_token_ids), tuple(toks), text,
                      tuple(lps) if req.params.logprobs is not None else None, reason, cached)

    def _encode(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            if self.core.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids instead")
            return list(self.core.tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    @staticmethod
    def _params_for(prompts, params) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        return list(params)

