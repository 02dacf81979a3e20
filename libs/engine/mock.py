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

import json
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import xxhash

from libs.engine import mm as mm_rows
from libs.engine.plan import BatchPlan
from libs.engine.runner import ModelRunner, PoolSizes, StepInterrupted
from libs.engine.step_cost import CostFit

PROFILES = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "tiny-cpu"
TOKEN_SEED = 0x6D6F636B  # "mock"
_LOGIT = 30.0  # the chosen token's logit (every other token: 0): sampling at any temperature keeps it
_POLL_S = 0.002  # how often a sleeping step polls its interrupt check


@dataclass(frozen=True)
class MockProfile:
    """Step time in seconds: `fixed_s` + `per_token_s` x new tokens (the dense and MoE work) + `per_pair_s` x
    attention pairs (sum over sequences of new tokens x keys) + `per_prefill_seq_s` x prefill chunks: the
    features of the scheduler's own step-cost model (libs/engine/step_cost.py), fitted by `python -m
    bench.profile` on the device it runs on."""

    fixed_s: float
    per_token_s: float
    per_pair_s: float
    per_prefill_seq_s: float = 0.0
    source: str = ""  # where the figures come from (model, device, how they were fitted)

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_token_s", "per_pair_s", "per_prefill_seq_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"MockProfile.{name} must be >= 0, got {getattr(self, name)}")

    def step_s(self, plan: BatchPlan) -> float:
        return CostFit(self.fixed_s, self.per_token_s, self.per_pair_s, self.per_prefill_seq_s).predict(
            plan.num_tokens, plan.attn_pairs, plan.num_prefill_seqs)

    @classmethod
    def load(cls, name_or_path: str = "") -> MockProfile:
        """A profile by name (libs/engine/profiles/<name>.json) or path; "" = the default."""
        name = name_or_path or DEFAULT_PROFILE
        path = Path(name) if name.endswith(".json") else PROFILES / f"{name}.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            known = sorted(p.stem for p in PROFILES.glob("*.json"))
            raise ValueError(f"no mock profile {name_or_path!r} ({path}); built in: {known}") from None
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")


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
