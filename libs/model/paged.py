"""The paged KV interface between the engine and the model.

The engine owns two pools (full-attention layers, SWA layers) and, per forward, hands the model page tables
that map each sequence's logical pages to physical pages. The model writes the new tokens' K/V and reads the
cached ones through those tables only; it never allocates KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv import new_token_index
from libs.model.config import ModelConfig


@dataclass
class KVPools:
    """KV tensors owned by the engine. Page p of the full pool holds positions [j*page_size, (j+1)*page_size)
    of whatever sequence's logical page j maps to it (same for the SWA pool)."""

    page_size: int
    full_k: torch.Tensor  # [n_full_layers, num_full_pages, page_size, kv_heads_full, qk_head_dim]
    full_v: torch.Tensor  # [n_full_layers, num_full_pages, page_size, kv_heads_full, v_head_dim]
    swa_k: torch.Tensor  # [n_swa_layers, num_swa_pages, page_size, kv_heads_swa, qk_head_dim]
    swa_v: torch.Tensor  # [n_swa_layers, num_swa_pages, page_size, kv_heads_swa, v_head_dim]

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

    def group(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one pool group: "full" or "swa"."""
        return (self.full_k, self.full_v) if name == "full" else (self.swa_k, self.swa_v)

    def pool_bytes(self) -> dict[str, int]:
        """Bytes each pool holds (K and V together), read off the tensors themselves."""
        return {"full": self.full_k.nbytes + self.full_v.nbytes, "swa": self.swa_k.nbytes + self.swa_v.nbytes}

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
              all_logits: bool = False) -> BatchMeta:
        """From per-sequence page-id lists (ragged; padded with -1). ``swa_pages`` defaults to ``full_pages``."""
        full = _pad(full_pages, device)
        swa = full.clone() if swa_pages is None else _pad(swa_pages, device)
        idx = torch.arange(sum(q_lens), device=device) if all_logits else None
        return cls(list(q_lens), list(kv_lens), full, swa, idx)


def _pad(rows: list[list[int]], device) -> torch.Tensor:
    """Ragged page-id lists padded with -1 to one width (at least 1), as one tensor."""
    w = max(max((len(r) for r in rows), default=0), 1)
    return torch.tensor([[*r, *([-1] * (w - len(r)))] for r in rows], dtype=torch.int64,
                        device=device).view(len(rows), -1)
