"""The timing-model engine (#38): everything of a real engine but the forward pass.

`EngineConfig.engine_mode = "mock"` (`WINDSERVE_ENGINE_MODE=mock`) gives an EngineCore whose runner is a
`MockRunner`: the scheduler, the KV cache (pools or arena, prefix tree, events, L2 / L3 bookkeeping), the KV
tensors and their copies (host tier, hand-off, GCache values: real bytes of the model's layout) are the real
ones; no weights are loaded and each step sleeps for the time a `MockProfile` predicts from what it computes,
then emits deterministic tokens. So routing, admission, caching, failover and planning can be tested with many
engines on a small machine.

Tokens: the token after position p is a hash of (the token at p, p) (xxhash, fixed seed), drawn from the
vocabulary less the tokenizer's end-of-sequence ids: a request's output depends only on its prompt, the same
on every mock engine and after a migration. Sampling, penalties and grammars act on one-hot logits, so a
grammar still shapes the output.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable

import torch
import xxhash

from libs.engine import mm as mm_rows
from libs.engine.mock_profile import MockProfile
from libs.engine.plan import BatchPlan
from libs.engine.runner import ModelRunner, PoolSizes, StepInterrupted

TOKEN_SEED = 0x6D6F636B  # "mock"
_LOGIT = 30.0  # the chosen token's logit (every other token: 0): sampling at any temperature keeps it
_POLL_S = 0.002  # how often a sleeping step polls its interrupt check


def mock_token(last: int, position: int, vocab: int, avoid: frozenset[int] = frozenset()) -> int:
    """The mock engine's token at `position` after token `last` (never one of `avoid`)."""
    tok = xxhash.xxh64_intdigest(struct.pack("<qq", last, position), seed=TOKEN_SEED) % vocab
    while tok in avoid:
        tok = (tok + 1) % vocab
    return tok


class MockRunner(ModelRunner):
    """A ModelRunner without a model: the KV tensors, copies and sampling of the real one; `forward` sleeps for
    the profile's step time (polling the interrupt check) and returns one-hot logits at `mock_token`."""

    def __init__(self, model_config, sizes: PoolSizes, profile: MockProfile, *, avoid: Iterable[int] = (),
                 dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, load_mode: str = "sync",
                 sleep: Callable[[float], None] = time.sleep) -> None:
        super().__init__(None, model_config, sizes, dtype=dtype, device=device, seed=seed, load_mode=load_mode)
        self.profile = profile
        self.vocab = int(model_config.vocab_size)
        self.avoid = frozenset(int(t) for t in avoid)
        if len(self.avoid) >= self.vocab:
            raise ValueError("MockRunner: every token of the vocabulary is avoided")
        self._sleep = sleep
        self.slept_s = 0.0  # total modelled step time (tests read it)

    def forward(self, plan: BatchPlan, interrupt: Callable[[], bool] | None = None,
                mm: mm_rows.Lookup | None = None) -> torch.Tensor:
        self.backup(plan.backup_copies)
        self.start_load(plan.load_copies)
        self.finish_load()
        if not plan.seqs:
            return torch.empty(0)
        if any(s.num_draft for s in plan.seqs):
            raise ValueError("the mock engine does not verify MTP drafts (speculative_tokens must be 0)")
        self._wait(self.profile.step_s(plan), interrupt)
        rows = [s for s in plan.seqs if s.sample]
        logits = torch.zeros(len(rows), self.vocab)
        for i, s in enumerate(rows):
            logits[i, mock_token(s.token_ids[-1], s.kv_len, self.vocab, self.avoid)] = _LOGIT
        return logits.to(self.device)

    def _wait(self, seconds: float, interrupt: Callable[[], bool] | None) -> None:
        self.slept_s += seconds
        if interrupt is None:
            self._sleep(seconds)
            return
        deadline = time.perf_counter() + seconds
        while (left := deadline - time.perf_counter()) > 0:
            if interrupt():
                raise StepInterrupted("mock step interrupted")
            self._sleep(min(left, _POLL_S))
