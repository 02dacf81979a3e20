"""Engine configuration: one frozen, validated dataclass; narrower configs derive from it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from libs.engine.parallel.layout import ParallelLayout
from libs.engine.placement import parse_cpus
from libs.engine.scheduler import SchedulerConfig
from libs.nesting import composed, leaves

if TYPE_CHECKING:
    import torch

_DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name (torch is imported where they are used)


@composed
@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine (a colocated worker or the offline LLM); its scheduler's are a part of it
    (`EngineConfig(max_num_seqs=8)` sets `scheduler.max_num_seqs`)."""

    page_size: int = 16
    """Tokens per KV page (both pools and the host tier)."""
    num_full_pages: int = 2048
    """Device pages of the full-attention pool."""
    num_swa_pages: int = 512
    """Device pages of the SWA pool (needs about window/page + 1 per running sequence plus checkpoints)."""
    num_host_full_pages: int = 0
    """Host (L2) full-attention pages; 0 disables the host tier."""
    num_host_swa_pages: int = 0
    """Host (L2) SWA pages. With the arena (`kv_arena`) the two host counts only size the host tier: their bytes
    become one host arena (docs/kvcache.md, "One arena"), as the device pools' do; prefer `host_kv_bytes`."""
    host_kv_bytes: int = 0
    """The host tier (L2) as one byte budget, no ratio (0: `num_host_full_pages` / `num_host_swa_pages`, or no
    host tier). With the arena it is one host arena of these bytes, both groups drawing from it; with the static
    device pools (kv_arena off, tp / ep > 1) it is split into two host pools in the device pools' byte shares."""
    kv_arena: bool = True
    """One device KV arena for both layer groups (issue #13, docs/kvcache.md "One arena"; the default): the
    bytes the two pools above would take (num_full_pages full + num_swa_pages SWA pages) become one K and one V
    buffer of units that either group draws pages from, so the split follows the workload. False (env
    WINDSERVE_KV_ARENA=0 on the engine roles): the two static pools. With tp / ep > 1 every rank holds an arena
    of the same units (its own KV heads in each), addressed by rank 0's cache (docs/parallel.md)."""
    enable_prefix_cache: bool = True
    """Reuse KV across requests through the SWA-aware radix tree."""
    retention: str = "checkpoints"
    """SWA retention policy of the prefix cache ("checkpoints", "none", "all")."""
    checkpoint_every_pages: int = 0
    """The prefix cache also keeps an SWA checkpoint every this many pages (0 = off; best effort, from free SWA
    memory: docs/kvcache.md, "Retention"); GCache's write-back stores the ones kept (docs/gcache.md)."""
    swa_rebuild: bool = True
    """When the cache holds full KV of a prefix further than its last SWA checkpoint, rebuild the SWA window
    there by recomputing the (SWA layers + 1) windows before it instead of everything after the checkpoint."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The scheduling policy: step budget, concurrency, length buckets (libs/engine/scheduler.py)."""
    l2_load_mode: str = "auto"
    """How host-tier hits are loaded: "thread" (copy thread / CUDA side stream running ahead of the
    forward, layer by layer), "inline" (layer i copied just before layer i runs), "sync" (all before),
    "auto" = thread on CUDA, sync on CPU (measured fastest there: a CPU copy competes with the compute
    for the same cores, so there is nothing to overlap, and one indexed copy per pool tensor costs the
    fewest operations; see docs/engine.md)."""
    dtype: str = "float32"
    """KV and activation dtype: float32, bfloat16 or float16."""
    device: str = "cpu"
    """torch device of the model and the KV pools."""
    seed: int = 0
    """Seed of the engine-wide generator used by unseeded sampled requests."""
    speculative_tokens: int = 0
    """MTP speculative decoding: draft tokens per decode step from the model's MTP layers (0 = off; beyond
    the model's number of MTP layers the last one is reused, chained; see docs/mtp.md). Their KV lives in
    extra SWA-pool layers, one per draft token."""
    speculative_in_prefill: bool = True
    """With speculative_tokens: the last prefill step drafts after the first token too, so the first decode
    step already verifies (False: drafting starts after the first decode step)."""
    tp: int = 1
    """Tensor-parallel ranks: attention heads (and the KV heads of both pools) and dense MLPs split across them
    (see docs/parallel.md)."""
    ep: int = 1
    """Expert-parallel ranks: MoE experts placed across them (tp and ep above 1 must be equal: the same ranks)."""
    parallel_timeout_s: float = 30.0
    """With tp or ep > 1: bound of one collective (a rank that stops answering fails the engine after it)."""
    compile: bool = False
    """Run the model through the compiled step (libs/model/compiled.py, docs/engine.md "Compiled step"): a pure
    decode step as one torch.compile'd graph, other steps with each layer's dense segments compiled. Warmed up
    when the engine is built. The engine services turn it on by default (WINDSERVE_COMPILE); the offline LLM
    leaves it off unless asked. Not with tp / ep > 1 (the ranks run eager)."""
    compile_warmup_s: float = 300.0
    """Bound of the compile warm-up; past it the engine runs eager (and says so in its compile stats)."""
    compile_cache_dir: str = ""
    """Where inductor caches compiled code ("" = ~/.cache/windserve/torch-compile; TORCHINDUCTOR_CACHE_DIR wins)."""
    compute_threads: int = 0
    """torch intra-op threads of the engine process (0 = one per compute CPU when those are set, else every usable
    core but one, at least one: the rest is left to the service's event loop and the other processes)."""
    compute_cpus: str = ""
    """CPUs the engine's step thread is pinned to, as a Linux CPU list ("1", "2-7"); "" = not pinned."""
    engine_mode: str = "real"
    """"real", or "mock": the timing-model engine (libs/engine/mock.py): no weights and no forward, each step
    sleeps for the time `mock_profile` predicts and emits deterministic tokens; the scheduler, KV cache and KV
    bytes are real (for tests and benchmarks of many engines on one machine)."""
    mock_profile: str = ""
    """The mock engine's step-cost profile: a name in libs/engine/profiles or a .json path ("" = tiny-cpu)."""

    def __post_init__(self) -> None:
        for name in ("page_size", "num_full_pages", "num_swa_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_host_full_pages", "num_host_swa_pages", "host_kv_bytes", "checkpoint_every_pages"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        if (self.num_host_full_pages == 0) != (self.num_host_swa_pages == 0):
            raise ValueError("EngineConfig: set both num_host_full_pages and num_host_swa_pages, or neither")
        if self.host_kv_bytes and self.num_host_full_pages:
            raise ValueError("EngineConfig: host_kv_bytes replaces num_host_full_pages / num_host_swa_pages: set "
                             "one or the other")
        if self.l2_load_mode not in ("auto", "thread", "inline", "sync"):
            raise ValueError(f"EngineConfig.l2_load_mode must be auto, thread, inline or sync, "
                             f"got {self.l2_load_mode!r}")
        if self.speculative_tokens < 0:
            raise ValueError(f"EngineConfig.speculative_tokens must be >= 0, got {self.speculative_tokens}")
        if self.parallel_timeout_s <= 0:
            raise ValueError(f"EngineConfig.parallel_timeout_s must be > 0, got {self.parallel_timeout_s}")
        if self.layout.is_parallel and self.speculative_tokens:
            raise ValueError("EngineConfig: speculative decoding (speculative_tokens > 0) does not run with "
                             "tp / ep > 1 yet")
        if self.compile_warmup_s <= 0 or self.compute_threads < 0:
            raise ValueError("EngineConfig: compile_warmup_s must be > 0 and compute_threads >= 0")
        parse_cpus(self.compute_cpus)  # a bad list fails here, named
        if self.engine_mode not in ("real", "mock"):
            raise ValueError(f"EngineConfig.engine_mode must be real or mock, got {self.engine_mode!r}")
        if self.engine_mode == "mock" and (self.speculative_tokens or self.layout.is_parallel):
            raise ValueError("EngineConfig: the mock engine runs without MTP (speculative_tokens 0) and tp = ep = 1")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def resolved_load_mode(self) -> str:
        if self.l2_load_mode != "auto":
            return self.l2_load_mode
        return "thread" if self.device.partition(":")[0] == "cuda" else "sync"

    @property
    def has_host_tier(self) -> bool:
        return bool(self.host_kv_bytes or self.num_host_full_pages)

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(self.tp, self.ep)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)} | set(leaves(cls))
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)
