"""Cache configuration, the per-model KV byte layout and the byte-budget planner that derives the pool split."""

from __future__ import annotations

import math
from dataclasses import dataclass

from libs.kvcache.retention import POLICIES

DEFAULT_HASH_SEED = 0x5EED_CAFE_F00D_0001


@dataclass(frozen=True)
class KVCacheConfig:
    page_size: int
    """Tokens per page (both pools)."""
    window: int
    """SWA keys a query attends. A hit of length L is valid when full KV exists for [0, L) and SWA KV for
    [L - window, L) (clamped at 0)."""
    num_full_pages: int
    num_swa_pages: int
    num_host_full_pages: int = 0
    """L2 host tier capacity (0 = no host tier)."""
    num_host_swa_pages: int = 0
    host_arena_units: int = 0
    """L2 host tier on one arena instead (0 = the two host pools above, or none): both groups' host copies draw
    from this many units (the device arena's unit: `full_page_units` / `swa_page_units` per page); the host
    evicts whole copies by value per unit (docs/kvcache.md, "One arena")."""
    enable_prefix_cache: bool = True
    retention: str = "checkpoints"
    """SWA retention policy: "checkpoints" (end of sequence, turn boundary, branch points, optional periodic),
    "none" (only the window a sequence holds when it finishes), "all" (SWA KV for every token)."""
    checkpoint_align: int = 0
    """Tokens; the turn-boundary checkpoint goes at the last multiple of this inside the prompt, i.e. at the
    granularity at which other requests share blocks (the router's hash block). 0 = page_size."""
    checkpoint_every_pages: int = 0
    """Extra periodic checkpoints every this many pages (0 = off)."""
    hash_seed: int = DEFAULT_HASH_SEED
    max_pending_events: int = 1 << 16
    """Undrained events kept; older ones are dropped (consumers see a gap in event ids)."""
    arena_units: int = 0
    """One device arena shared by both groups, in units (0 = the two static pools `num_full_pages` /
    `num_swa_pages`, which must then be 0 with an arena). A full page takes `full_page_units` units and an SWA
    page `swa_page_units`; any free unit serves either group (docs/kvcache.md, "One arena")."""
    full_page_units: int = 1
    swa_page_units: int = 1
    rebuild_tokens: int = 0
    """S, tokens an SWA window rebuild recomputes (0 = off): when full KV is cached up to E but no SWA checkpoint
    is near E, `match` may return a rebuild hit that skips only R = E - S tokens (see `PrefixHit`). The engine
    sets it to `rebuild_span(swa_layers, window, page)`. The cache trusts the SWA KV the span writes only
    on pages from one window (in pages) before E on (exact when page <= window, see docs/kvcache.md)."""

    def __post_init__(self) -> None:
        _positive(self, "page_size", "window", "max_pending_events")
        _non_negative(self, "num_full_pages", "num_swa_pages", "num_host_full_pages", "num_host_swa_pages",
                      "checkpoint_align", "checkpoint_every_pages", "rebuild_tokens", "arena_units", "host_arena_units")
        _positive(self, "full_page_units", "swa_page_units")
        if self.arena_units and (self.num_full_pages or self.num_swa_pages):
            raise ValueError("an arena (arena_units > 0) replaces num_full_pages / num_swa_pages: set them to 0")
        if self.rebuild_tokens and (self.rebuild_tokens % self.page_size or self.rebuild_tokens < self.window):
            raise ValueError(f"rebuild_tokens={self.rebuild_tokens} must be a multiple of page_size="
                             f"{self.page_size} and >= window={self.window} (or 0 = off)")
        if self.retention not in POLICIES:
            raise ValueError(f"retention must be one of {sorted(POLICIES)}, got {self.retention!r}")
        if self.checkpoint_align % self.page_size:
            raise ValueError(f"checkpoint_align={self.checkpoint_align} must be a multiple of "
                             f"page_size={self.page_size}")
        if not 0 <= self.hash_seed < 1 << 64:
            raise ValueError("hash_seed must fit in 64 bits")
        if (self.num_host_full_pages == 0) != (self.num_host_swa_pages == 0):
            raise ValueError("host tier needs both num_host_full_pages and num_host_swa_pages (or neither)")
        if self.host_arena_units and self.num_host_full_pages:
            raise ValueError("a host arena (host_arena_units > 0) replaces num_host_full_pages / num_host_swa_pages: "
                             "set them to 0")

    @property
    def window_pages(self) -> int:
        """Pages that hold one window ending at a page boundary (one SWA checkpoint)."""
        return -(-self.window // self.page_size)

    @property
    def seq_swa_pages(self) -> int:
        """Most SWA pages a running sequence holds for its own window: window + one page, in pages."""
        return self.window_pages + 1

    @property
    def arena(self) -> bool:
        return self.arena_units > 0

    @property
    def has_host(self) -> bool:
        """An L2 host tier (two host pools or one host arena)."""
        return bool(self.num_host_full_pages or self.host_arena_units)

    @property
    def align(self) -> int:
        return self.checkpoint_align or self.page_size


def _positive(obj: object, *names: str) -> None:
    for n in names:
        if getattr(obj, n) <= 0:
            raise ValueError(f"{type(obj).__name__}.{n} must be > 0, got {getattr(obj, n)}")


def _non_negative(obj: object, *names: str) -> None:
    for n in names:
        if getattr(obj, n) < 0:
            raise ValueError(f"{type(obj).__name__}.{n} must be >= 0, got {getattr(obj, n)}")


@dataclass(frozen=True)
class KVLayout:
    """KV bytes of one model: layers per group and bytes per token per layer (bf16 K and V, all KV heads)."""

    full_layers: int
    swa_layers: int
    full_bytes_per_token_layer: int
    swa_bytes_per_token_layer: int

    def __post_init__(self) -> None:
        _non_negative(self, "full_layers", "swa_layers")
        _positive(self, "full_bytes_per_token_layer", "swa_bytes_per_token_layer")

    def full_page_bytes(self, page_size: int) -> int:
        return self.full_layers * self.full_bytes_per_token_layer * page_size

    def swa_page_bytes(self, page_size: int) -> int:
        return self.swa_layers * self.swa_bytes_per_token_layer * page_size

    def sequence_bytes(self, tokens: int, window: int) -> int:
        """Theoretical bytes of one sequence in the dual layout: full layers for every token, SWA for one window."""
        return (self.full_layers * self.full_bytes_per_token_layer * tokens
                + self.swa_layers * self.swa_bytes_per_token_layer * min(tokens, window))


# MiMo-V2.5-Pro: 10 full + 60 SWA layers, 8 KV heads x (192 + 128) dims x 2 bytes = 5120 B per token per layer.
MIMO_V25_PRO = KVLayout(full_layers=10, swa_layers=60, full_bytes_per_token_layer=5120, swa_bytes_per_token_layer=5120)


@dataclass(frozen=True)
class PoolPlan:
    num_full_pages: int
    num_swa_pages: int
    max_running: int


def plan_pools(budget_bytes: int, layout: KVLayout, page_size: int, window: int, expected_seq_tokens: int,
               max_running: int = 0, checkpoints_per_seq: float = 0.0) -> PoolPlan:
    """Split one byte budget into the two pools so no operator has to tune a ratio.

    The SWA pool gets (window + page) per running sequence plus `checkpoints_per_seq` retained windows per cached
    sequence; the full pool gets the rest. `expected_seq_tokens` is the typical sequence length (prompt + output);
    `max_running` = 0 sizes the running share for as many sequences of that length as fit.
    """
    if budget_bytes <= 0 or expected_seq_tokens <= 0 or max_running < 0 or checkpoints_per_seq < 0:
        raise ValueError("plan_pools: budget, expected_seq_tokens must be > 0; max_running, checkpoints >= 0")
    fpb, spb = layout.full_page_bytes(page_size), layout.swa_page_bytes(page_size)
    wp = -(-window // page_size)
    seq_full = -(-expected_seq_tokens // page_size)
    per_seq = seq_full * fpb + (wp + 1) * spb
    running = max_running or budget_bytes // per_seq
    left = budget_bytes - running * (wp + 1) * spb
    if left < 0:
        raise ValueError(f"budget {budget_bytes} B cannot hold the SWA windows of {running} running sequences")
    # Each cached sequence costs its full pages plus its checkpoints' SWA pages; fill `left` with such sequences.
    per_cached = seq_full * fpb + checkpoints_per_seq * wp * spb
    cached_seqs = left / per_cached
    swa = running * (wp + 1) + math.floor(cached_seqs * checkpoints_per_seq * wp)
    full = (budget_bytes - swa * spb) // fpb
    return PoolPlan(num_full_pages=int(full), num_swa_pages=int(swa), max_running=int(running))


@dataclass(frozen=True)
class ArenaPlan:
    """One byte arena for both groups: `units` of `unit_bytes` each; a full page is `full_page_units` units, an
    SWA page `swa_page_units`. A unit is `planes` layer planes of `plane_bytes` (the least common multiple of
    the two groups' bytes per layer and page), so it holds whole layer-pages of either group: a page's layers
    are spread over its units in chunks and any unit can serve either group (docs/kvcache.md, "One arena").
    `waste`: per group (full, SWA), the share of a page's units its layers leave empty."""

    units: int
    unit_bytes: int
    full_page_units: int
    swa_page_units: int
    planes: int = 1
    plane_bytes: int = 0
    waste: tuple[float, float] = (0.0, 0.0)

    def config_fields(self) -> dict[str, int]:
        """The `KVCacheConfig` fields of this arena."""
        return {"num_full_pages": 0, "num_swa_pages": 0, "arena_units": self.units,
                "full_page_units": self.full_page_units, "swa_page_units": self.swa_page_units}


def plan_arena(budget_bytes: int, layout: KVLayout, page_size: int) -> ArenaPlan:
    """Size the one arena from a byte budget: no ratio to choose, the split between the groups follows the
    workload (the cache's eviction decides it).

    The unit must hold whole layer-pages of both groups (the engine's buffer is viewed per layer): it is
    `planes` x lcm(full, SWA bytes per layer-page). Of the plane counts up to a page's, the one whose pages
    waste the least (the larger on a tie: fewer chunks per page) wins; when the greatest common divisor of
    the page sizes holds whole layers (MiMo-V2.5-Pro: one full page, an SWA page = 6 units) nothing is lost."""
    if budget_bytes <= 0:
        raise ValueError("plan_arena: budget must be > 0")
    groups = [(n, b * page_size) for n, b in ((layout.full_layers, layout.full_bytes_per_token_layer),
                                              (layout.swa_layers, layout.swa_bytes_per_token_layer))]
    plane = math.lcm(*(b for n, b in groups if n)) if any(n for n, _ in groups) else groups[0][1]
    best: tuple[float, int] | None = None
    for planes in range(1, max(-(-n * b // plane) for n, b in groups) + 1):
        worst = max(_page_waste(n, b, planes * plane) for n, b in groups)
        if best is None or worst <= best[0] + 1e-12:
            best = (worst, planes)
    assert best is not None
    unit = best[1] * plane
    per_page = [max(1, -(-n * b // unit)) for n, b in groups]
    waste = (_page_waste(*groups[0], unit), _page_waste(*groups[1], unit))
    return ArenaPlan(units=budget_bytes // unit, unit_bytes=unit, full_page_units=per_page[0],
                     swa_page_units=per_page[1], planes=best[1], plane_bytes=plane, waste=waste)


def _page_waste(layers: int, layer_bytes: int, unit: int) -> float:
    """Share of a page's units (of `unit` bytes) its layers leave empty (0 for a group without layers)."""
    if layers == 0:
        return 0.0
    need = layers * layer_bytes
    return (-(-need // unit) * unit - need) / need


def rebuild_span(swa_layers: int, window: int, page_size: int) -> int:
    """`KVCacheConfig.rebuild_tokens` for a model: one window per SWA layer (the errors of the span's first
    tokens, which lack their left context, move forward one window per layer) plus the window itself, in whole
    pages; 0 (no rebuild) without SWA layers or when a page is longer than the window (the cache trusts the
    span's last window of SWA pages only when a page fits in it)."""
    if swa_layers <= 0 or page_size > window:
        return 0
    return -(-(swa_layers + 1) * window // page_size) * page_size
