"""The paged KV interface between the engine and the model.

The engine owns two pools (full-attention layers, SWA layers) and, per forward, hands the model page tables
that map each sequence's logical pages to physical pages. The model writes the new tokens' K/V and reads the
cached ones through those tables only; it never allocates KV.

With one arena (`KVPools.allocate_arena`, issue #13) both groups live in one K and one V buffer of units; a
page id is translated to the units that hold its layers through the cache's unit table (`KVArena`), once
per step (`BatchMeta.full_rows` / `swa_rows`). Every consumer reads and writes pages through the methods
below (`layer_kv`, `page_rows`, `gather_pages`, `pool_bytes`, ...), never through the tensors by page id.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

import torch

from kernels.kv import new_token_index
from libs.model.config import ModelConfig


@dataclass
class KVArena:
    """Both groups' KV in one K and one V buffer of `units` (docs/kvcache.md, "One arena").

    `k` is [planes, units, page, H, qk dim] (`v` likewise), H = lcm of the two groups' KV heads. Group g views
    a plane as [units x r_g, page, heads_g, dim] (r_g = H / heads_g); layer l of g lies in chunk
    c = l // (planes x r_g), and its row for page p is table_g[p, c] x stride_g + h (sub-slot h; `stride`
    defaults to r_g, larger on a parallel rank whose groups hold unequal head shares). Each plane view is
    contiguous, so kernels see an ordinary pool per layer. `tables` are the ledger's live unit tables, set by
    `bind`.
    """

    k: torch.Tensor
    v: torch.Tensor
    sub: dict[str, int]  # r_g per group
    layers: dict[str, int]  # layers per group (the SWA group includes MTP draft layers)
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    stride: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stride = {g: self.stride.get(g, r) for g, r in self.sub.items()}
        if any(self.stride[g] < r for g, r in self.sub.items()):
            raise ValueError(f"KVArena: stride {self.stride} below the layer-pages per plane slot {self.sub}")

    @property
    def units(self) -> int:
        return self.k.shape[1]

    @property
    def planes(self) -> int:
        return self.k.shape[0]

    def per_unit(self, group: str) -> int:
        return self.planes * self.sub[group]

    def units_per_page(self, group: str) -> int:
        return max(1, -(-self.layers[group] // self.per_unit(group)))

    def where(self, group: str, index: int) -> tuple[int, int, int]:
        """(plane, sub-slot, table row) of layer `index` of `group`; the table row is c x r_g + h."""
        per, r = self.per_unit(group), self.sub[group]
        c, i = divmod(index, per)
        s, h = divmod(i, r)
        return s, h, c * r + h

    def bind(self, tables: dict[str, tuple[array, int]]) -> None:
        """Read the cache ledger's unit tables ({group: (flat int64 array, units per page)}) in place."""
        for g, (t, per_page) in tables.items():
            if per_page != self.units_per_page(g):
                raise ValueError(f"arena: the cache's {g} pages take {per_page} units but the KV buffer's take "
                                 f"{self.units_per_page(g)}")
            # shares the ledger's memory (the array never grows, so its buffer stays where it is)
            self.tables[g] = torch.frombuffer(t, dtype=torch.int64).view(-1, per_page)

    def rows(self, group: str, ids: torch.Tensor, units: torch.Tensor | None = None) -> torch.Tensor:
        """Physical rows of page ids `ids` (CPU int64, any shape; -1 stays -1) for every table row of
        `group`: [chunks x r_g, *ids.shape]. `units` ([*ids.shape, chunks]): the pages' units as recorded
        earlier (a copy made before the page was freed), instead of the table's."""
        r, w = self.sub[group], self.stride[group]
        if units is None:
            table = self.tables[group]
            units = table.index_select(0, ids.clamp(min=0).flatten()).view(*ids.shape, table.shape[1])
        units = units.movedim(-1, 0)  # [chunks, *ids.shape]
        if r == w == 1:  # (a unit slot holds one layer-page: the row is the unit)
            return units.masked_fill(ids.unsqueeze(0) < 0, -1)
        rows = units.unsqueeze(1) * w + torch.arange(r).view(1, r, *([1] * ids.dim()))
        return rows.flatten(0, 1).masked_fill_(ids.unsqueeze(0) < 0, -1)


@dataclass
class KVPools:
    """KV tensors owned by the engine. Page p of the full pool holds positions [j*page_size, (j+1)*page_size)
    of whatever sequence's logical page j maps to it (same for the SWA pool).

    With an `arena` (allocate_arena) the four tensors are placeholders with zero pages (shapes and dtype
    only): every page access goes through the methods, which read the arena."""

    page_size: int
    full_k: torch.Tensor  # [n_full_layers, num_full_pages, page_size, kv_heads_full, qk_head_dim]
    full_v: torch.Tensor  # [n_full_layers, num_full_pages, page_size, kv_heads_full, v_head_dim]
    swa_k: torch.Tensor  # [n_swa_layers, num_swa_pages, page_size, kv_heads_swa, qk_head_dim]
    swa_v: torch.Tensor  # [n_swa_layers, num_swa_pages, page_size, kv_heads_swa, v_head_dim]
    arena: KVArena | None = None
    swa_offset: int = 0  # a view's first SWA layer (the MTP blocks' view of the engine's pools)
    _views: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, int]] = field(
        default_factory=dict, repr=False, compare=False)  # arena: layer_kv's plane views, made once per layer

    @classmethod
    def allocate(cls, cfg: ModelConfig, num_full_pages: int, num_swa_pages: int, page_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 *, n_full_layers: int | None = None, n_swa_layers: int | None = None) -> KVPools:
        """Zero-filled pools for ``cfg``'s layers (override the layer counts e.g. for the MTP pools)."""
        nf = len(cfg.full_layers) if n_full_layers is None else n_full_layers
        ns = len(cfg.swa_layers) if n_swa_layers is None else n_swa_layers

        def z(n_layers, pages, heads, dim):
            return torch.zeros(n_layers, pages, page_size, heads, dim, dtype=dtype, device=device)

        return cls(page_size,
                   z(nf, num_full_pages, cfg.kv_heads_full, cfg.qk_head_dim),
                   z(nf, num_full_pages, cfg.kv_heads_full, cfg.v_head_dim),
                   z(ns, num_swa_pages, cfg.kv_heads_swa, cfg.qk_head_dim),
                   z(ns, num_swa_pages, cfg.kv_heads_swa, cfg.v_head_dim))

    @classmethod
    def allocate_arena(cls, cfg: ModelConfig, units: int, planes: int, page_size: int,
                       dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                       *, n_swa_layers: int | None = None, unit_bytes: int = 0,
                       sub: dict[str, int] | None = None) -> KVPools:
        """One zero-filled K and one V buffer of `units` units of `planes` layer planes (from
        `libs.kvcache.plan_arena`; `unit_bytes`, when given, is checked against this layout). `sub`: the
        layer-pages per plane slot of each group to keep (a parallel rank: the whole model's, `arena_sub`),
        padding the plane slot where `cfg`'s KV heads are not in the model's proportion (`KVArena.stride`)."""
        hf, hs = cfg.kv_heads_full, cfg.kv_heads_swa
        sub = arena_sub(cfg) if sub is None else sub
        heads = math.lcm(hf, hs)  # (times the smallest factor that holds r_g layer-pages of both groups)
        heads *= -(-max(sub["full"] * hf, sub["swa"] * hs) // heads)
        es = torch.empty((), dtype=dtype).element_size()
        got = planes * page_size * heads * (cfg.qk_head_dim + cfg.v_head_dim) * es
        if unit_bytes and unit_bytes != got:
            raise ValueError(f"arena plan: units of {unit_bytes} B, but {planes} planes of this model are {got} B")
        k = torch.zeros(planes, units, page_size, heads, cfg.qk_head_dim, dtype=dtype, device=device)
        v = torch.zeros(planes, units, page_size, heads, cfg.v_head_dim, dtype=dtype, device=device)
        ns = len(cfg.swa_layers) if n_swa_layers is None else n_swa_layers
        arena = KVArena(k, v, dict(sub), {"full": len(cfg.full_layers), "swa": ns},
                        stride={"full": heads // hf, "swa": heads // hs})
        pools = cls.allocate(cfg, 0, 0, page_size, dtype, device, n_swa_layers=ns)  # zero pages: shapes only
        pools.arena = arena
        return pools

    # ------------------------------------------------------------------ access by page id

    @property
    def dtype(self) -> torch.dtype:
        return self.full_k.dtype

    @property
    def device(self) -> torch.device:
        return self.full_k.device

    def _tensors(self, group: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of a group: the pools, or with an arena the placeholders (shapes and dtype only)."""
        return (self.full_k, self.full_v) if group == "full" else (self.swa_k, self.swa_v)

    def num_layers(self, group: str) -> int:
        return self._tensors(group)[0].shape[0]

    def group(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one static pool group: "full" or "swa" (not with an arena: use the methods below)."""
        if self.arena is not None:
            raise TypeError("KVPools.group: an arena has no per-group tensors (use layer_kv / page_rows)")
        return self._tensors(name)

    def layer_kv(self, group: str, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(K, V, table row) of one layer: K / V are [rows, page, heads, dim] pools (static: rows = page ids;
        arena: a plane view, rows from `page_rows` or `BatchMeta.*_rows[table row]`)."""
        a = self.arena
        if a is None:
            k, v = self.group(group)
            return k[index], v[index], 0
        got = self._views.get((group, index))
        if got is None:  # (the views stay valid: the buffers are never replaced)
            s, _, row = a.where(group, index + (self.swa_offset if group == "swa" else 0))
            heads = self._tensors(group)[0].shape[3]
            kk, vv = a.k[s], a.v[s]
            got = self._views[group, index] = (kk.view(-1, self.page_size, heads, kk.shape[-1]),
                                               vv.view(-1, self.page_size, heads, vv.shape[-1]), row)
        return got

    def layer_base(self, group: str, index: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """(K buffer, V buffer, plane, table row) of one layer: `layer_kv`'s pools are plane `plane` of the
        buffers (static: the group's [layers, ...] tensors; arena: its K / V), seen as [rows, page, heads, dim].
        The compiled decode step takes the buffers themselves, so no two of its inputs alias."""
        a = self.arena
        if a is None:
            k, v = self.group(group)
            return k, v, index, 0
        s, _, row = a.where(group, index + (self.swa_offset if group == "swa" else 0))
        return a.k, a.v, s, row

    def page_rows(self, group: str, index: int, ids: torch.Tensor, units: torch.Tensor | None = None) -> torch.Tensor:
        """Rows of `layer_kv(group, index)`'s pools that hold pages `ids` (int64; static: `ids` itself).
        `units`: see `KVArena.rows`."""
        if self.arena is None:
            return ids
        return self.arena.rows(group, ids.cpu(), units)[self.layer_kv(group, index)[2]].to(ids.device)

    def flat_kv(self, group: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of every layer of `group` as one [rows, page elements] view each, indexed by `flat_rows`:
        a copy of many layers' pages is one indexed copy per tensor (static: layer x pages + page id; arena:
        the whole buffer seen as the group's layer-pages, plane x units x r_g + the table's row)."""
        if self.arena is None:
            k, v = self.group(group)
        else:
            heads = self._tensors(group)[0].shape[3]
            k = self.arena.k.view(-1, self.page_size, heads, self.arena.k.shape[-1])
            v = self.arena.v.view(-1, self.page_size, heads, self.arena.v.shape[-1])
        return k.view(-1, math.prod(k.shape[-3:])), v.view(-1, math.prod(v.shape[-3:]))  # (views: writes land)

    def flat_rows(self, group: str, ids: torch.Tensor, units: torch.Tensor | None = None,
                  layers: range | None = None) -> torch.Tensor:
        """Rows of `flat_kv(group)` that hold pages `ids` (CPU int64 [n]) of each of `layers` (default all):
        [len(layers), n] on the pools' device. `units`: see `KVArena.rows`."""
        layers = range(self.num_layers(group)) if layers is None else layers
        lay = torch.as_tensor(layers, dtype=torch.int64)
        a = self.arena
        if a is None:
            return (lay[:, None] * self._tensors(group)[0].shape[1] + ids[None]).to(self.device)
        g_rows = a.rows(group, ids, units)  # [table rows, n]
        off = self.swa_offset if group == "swa" else 0
        where = [a.where(group, i + off) for i in layers]
        plane = torch.tensor([s for s, _, _ in where], dtype=torch.int64) * (a.units * a.stride[group])
        return (plane[:, None] + g_rows[[row for _, _, row in where]]).to(self.device)

    def gather_pages(self, group: str, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages' K and V, page-major: [len(pages), layers, page, heads, dim] each, contiguous copies on
        the pools' device (one indexed copy per tensor)."""
        if self.arena is None:
            idx = torch.tensor(pages, dtype=torch.int64, device=self.device)
            k, v = self.group(group)
            return k.transpose(0, 1).index_select(0, idx), v.transpose(0, 1).index_select(0, idx)
        rows = self.flat_rows(group, torch.tensor(pages, dtype=torch.int64)).t().flatten()  # page-major
        shape = (len(pages), self.num_layers(group), *self._tensors(group)[0].shape[2:4])
        k, v = self.flat_kv(group)
        return (k.index_select(0, rows).view(*shape, -1), v.index_select(0, rows).view(*shape, -1))

    def layer_page_bytes(self, group: str) -> int:
        """Bytes of one page of one layer of `group` (K and V)."""
        k, v = self._tensors(group)
        return math.prod(k.shape[2:]) * k.element_size() + math.prod(v.shape[2:]) * v.element_size()

    def page_bytes(self, group: str) -> int:
        """Bytes of one page of `group` across its layers (K and V)."""
        return self.num_layers(group) * self.layer_page_bytes(group)

    def pool_bytes(self) -> dict[str, int]:
        """Bytes the KV buffers hold (K and V together), read off the tensors themselves: per pool, or
        {"arena": ...} for one arena."""
        if self.arena is not None:
            return {"arena": self.arena.k.nbytes + self.arena.v.nbytes}
        return {"full": self.full_k.nbytes + self.full_v.nbytes, "swa": self.swa_k.nbytes + self.swa_v.nbytes}

    def batch_rows(self, full: torch.Tensor, swa: torch.Tensor,
                   device: str | torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-layer-chunk physical page tables of a batch's page tables (CPU int64 [B, W]): (full rows, SWA
        rows), each [table rows, B, W] on `device`; (None, None) for static pools."""
        a = self.arena
        if a is None:
            return None, None
        # (a view without full layers, the MTP blocks', passes SWA ids in both tables)
        fr = a.rows("full", full).to(device) if self.num_layers("full") else None
        return fr, a.rows("swa", swa).to(device)

    @classmethod
    def allocate_mtp(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> KVPools:
        """Pools for the MTP blocks: each is an SWA block, so only the SWA pool has layers."""
        return cls.allocate(cfg, 0, num_pages, page_size, dtype, device, n_full_layers=0,
                            n_swa_layers=cfg.num_mtp_layers)


@dataclass
class BatchMeta:
    """One forward over a ragged batch: any mix of prefill chunks and decode steps."""

    q_lens: list[int]  # new tokens per sequence this step
    kv_lens: list[int]  # tokens of the sequence after this step (cached prefix + new)
    full_page_table: torch.Tensor  # int64 [B, max_pages]; logical page j of seq b -> full-pool page id (-1 unused)
    swa_page_table: torch.Tensor  # int64 [B, max_pages]; -1 where the page holds no SWA KV
    logits_indices: torch.Tensor | None = None  # rows of the flattened new tokens that need logits
    # SWA window rebuild (see docs/engine.md), per sequence; None = no sequence rebuilds:
    full_write_from: list[int] | None = None  # full-attention K/V of positions below this is cached: not written
    swa_kv_start: list[int] | None = None  # SWA layers read no key left of this position (pages there may be -1)
    # One arena (KVPools.arena): per layer chunk, the physical rows of the page tables ([table rows, B, W],
    # KVPools.batch_rows); a layer reads row `layer_kv(...)[2]`. None = static pools (the page tables are rows).
    full_rows: torch.Tensor | None = None
    swa_rows: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b = len(self.q_lens)
        if len(self.kv_lens) != b:
            raise ValueError(f"q_lens has {b} entries but kv_lens has {len(self.kv_lens)}")
        for i, (q, kv) in enumerate(zip(self.q_lens, self.kv_lens, strict=True)):
            if q < 1 or kv < q:
                raise ValueError(f"sequence {i}: need 1 <= q_len <= kv_len, got q_len={q} kv_len={kv}")
        for name in ("full_write_from", "swa_kv_start"):
            if getattr(self, name) is not None and len(getattr(self, name)) != b:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {b} sequences")
        for name in ("full_page_table", "swa_page_table"):
            t = getattr(self, name)
            if t.dim() != 2 or t.shape[0] != b:
                raise ValueError(f"{name} must be [B={b}, max_pages], got {tuple(t.shape)}")

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def positions(self) -> torch.Tensor:
        """Position of every new token, flattened in batch order."""
        return new_token_index(self.q_lens, self.kv_lens, self.full_page_table.device)[1]

    def logits_rows(self) -> torch.Tensor:
        if self.logits_indices is not None:
            return self.logits_indices
        return torch.tensor(self.q_lens, device=self.full_page_table.device).cumsum(0) - 1

    @classmethod
    def build(cls, q_lens: list[int], kv_lens: list[int], full_pages: list[list[int]],
              swa_pages: list[list[int]] | None = None, device: str | torch.device = "cpu",
              all_logits: bool = False, kv: KVPools | None = None) -> BatchMeta:
        """From per-sequence page-id lists (ragged; padded with -1). ``swa_pages`` defaults to ``full_pages``.
        ``kv``: the pools the forward uses (an arena's page tables are translated here, once per step)."""
        full = _pad(full_pages, "cpu")
        swa = full.clone() if swa_pages is None else _pad(swa_pages, "cpu")
        idx = torch.arange(sum(q_lens), device=device) if all_logits else None
        rows = kv.batch_rows(full, swa, device) if kv is not None else (None, None)
        return cls(list(q_lens), list(kv_lens), full.to(device), swa.to(device), idx, full_rows=rows[0],
                   swa_rows=rows[1])


def _pad(rows: list[list[int]], device) -> torch.Tensor:
    """Ragged page-id lists padded with -1 to one width (at least 1), as one tensor."""
    w = max(max((len(r) for r in rows), default=0), 1)
    return torch.tensor([[*r, *([-1] * (w - len(r)))] for r in rows], dtype=torch.int64,
                        device=device).view(len(rows), -1)


def arena_sub(cfg: ModelConfig) -> dict[str, int]:
    """Layer-pages of each group per plane slot of `cfg`'s arena (r_g = lcm of the KV heads / the group's)."""
    heads = math.lcm(cfg.kv_heads_full, cfg.kv_heads_swa)
    return {"full": heads // cfg.kv_heads_full, "swa": heads // cfg.kv_heads_swa}
