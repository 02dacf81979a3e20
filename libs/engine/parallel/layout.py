"""The parallel layout of one engine: `tp` ranks split the attention (and dense MLP) heads, `ep` ranks split the
MoE experts; every rank runs every layer over the whole batch.

World size is max(tp, ep); tp and ep are each 1 or the world size. With ep alone attention is replicated;
with tp alone the experts' intermediate dimension is split. A rank holds kv/tp KV heads when tp divides a
pool's KV heads, else the one KV head its query heads read (replicated); head dims are never split.
`ParallelLayout` validates this (`LayoutError`) and does the shard arithmetic. Pure: no torch.distributed.
Details: docs/parallel.md, "Layout".
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.model.config import ModelConfig


class LayoutError(ValueError):
    """A parallel layout that does not fit the model (names the dimension and both numbers)."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp > 1 and self.ep > 1 and self.tp != self.ep:
            raise LayoutError(f"tp={self.tp} and ep={self.ep}: when both are above 1 they must be equal (the same "
                              f"ranks split attention heads and experts)")

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def is_parallel(self) -> bool:
        return self.world > 1

    def describe(self) -> str:
        return f"tp={self.tp} ep={self.ep} ({self.world} ranks)"

    # ---------------------------------------------------------------- validation
    def validate(self, cfg: ModelConfig) -> None:
        """Raise LayoutError when `cfg` cannot be split this way."""
        problems = list(self._problems(cfg))
        if problems:
            raise LayoutError(f"parallel layout {self.describe()} does not fit the model: " + "; ".join(problems))

    def _problems(self, cfg: ModelConfig):
        tp = self.tp
        if cfg.num_heads % tp:
            yield f"num_heads={cfg.num_heads} is not divisible by tp={tp}"
        for name in ("kv_heads_full", "kv_heads_swa"):
            kv = getattr(cfg, name)
            if kv % tp and tp % kv:
                yield f"{name}={kv} neither divides nor is divisible by tp={tp}"
        if cfg.intermediate_size % tp:
            yield f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}"
        if any(cfg.layer_is_moe):
            if self.ep > 1 and cfg.num_experts % self.ep:
                yield f"num_experts={cfg.num_experts} is not divisible by ep={self.ep}"
            if self.ep == 1 and cfg.moe_intermediate_size % tp:
                yield f"moe_intermediate_size={cfg.moe_intermediate_size} is not divisible by tp={tp} (ep=1 splits it)"

    # ---------------------------------------------------------------- shard arithmetic
    def q_heads(self, cfg: ModelConfig, rank: int) -> range:
        n = cfg.num_heads // self.tp
        return range(rank % self.tp * n, rank % self.tp * n + n)

    def kv_heads(self, cfg: ModelConfig, rank: int, swa: bool) -> range:
        kv = cfg.kv_heads_swa if swa else cfg.kv_heads_full
        r = rank % self.tp
        if kv % self.tp == 0:
            n = kv // self.tp
            return range(r * n, r * n + n)
        head = r // (self.tp // kv)  # fewer KV heads than ranks: the one this rank's query heads read
        return range(head, head + 1)

    def inter(self, size: int, rank: int) -> range:
        """This rank's slice of an MLP intermediate dimension split over tp."""
        n = size // self.tp
        return range(rank % self.tp * n, rank % self.tp * n + n)

    def moe_inter(self, cfg: ModelConfig, rank: int) -> range:
        """This rank's slice of each expert's intermediate dimension (all of it when ep splits the experts)."""
        if self.ep > 1:
            return range(cfg.moe_intermediate_size)
        return self.inter(cfg.moe_intermediate_size, rank)

    def experts(self, cfg: ModelConfig, rank: int) -> range:
        if self.ep == 1:
            return range(cfg.num_experts)
        n = cfg.num_experts // self.ep
        return range(rank % self.ep * n, rank % self.ep * n + n)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The per-rank attention and dense-MLP shapes (heads, KV heads, MLP width), every other field as is:
        what a rank's KV pools and attention modules are built from."""
        return cfg.with_(num_heads=cfg.num_heads // self.tp,
                         kv_heads_full=len(self.kv_heads(cfg, 0, swa=False)),
                         kv_heads_swa=len(self.kv_heads(cfg, 0, swa=True)),
                         intermediate_size=cfg.intermediate_size // self.tp)

    def kv_bytes_ratio(self, cfg: ModelConfig, swa: bool) -> float:
        """A rank's KV bytes of one pool over a single process's."""
        kv = cfg.kv_heads_swa if swa else cfg.kv_heads_full
        return len(self.kv_heads(cfg, 0, swa)) / kv
