"""The timing-model engine's step-cost table (libs/engine/mock.py, docs/engine.md "Timing-model engine"), kept
free of torch so the planner (services/planner) reads it without loading the engine."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from libs.engine.step_cost import CostFit

if TYPE_CHECKING:
    from libs.engine.plan import BatchPlan

PROFILES = Path(__file__).resolve().parent / "profiles"
DEFAULT_PROFILE = "tiny-cpu"


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
        return self.predict(plan.num_tokens, plan.attn_pairs, plan.num_prefill_seqs)

    def predict(self, tokens: float, pairs: float, prefill_seqs: float = 0) -> float:
        """A step's seconds from its features (new tokens, attention pairs, prefill chunks)."""
        return CostFit(self.fixed_s, self.per_token_s, self.per_pair_s, self.per_prefill_seq_s).predict(
            tokens, pairs, prefill_seqs)

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
