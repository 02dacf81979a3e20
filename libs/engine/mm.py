"""Image / video embedding rows attached to an engine request (#16).

A multimodal prompt arrives in the *hash view* (libs/mm/placeholders.py): item pad positions carry pseudo
tokens ``mm_token(mm_hash, k)``, which the prefix cache hashes like any token (two images never share KV).
The runner maps them to the pad id (`model_token_ids`) and overwrites the embedding output there with the
rows of `MMEmbeddings`, indexed by position, so a chunk starting inside an image takes exactly its own rows.
The rows stay with the request while it lives: a preempted request recomputes its prompt from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from libs.mm.placeholders import MM_TOKEN_FLAG, model_token_ids


@dataclass(frozen=True)
class MMEmbeddings:
    """Item i's rows ``rows[i]`` (``[n_i, hidden]``) fill prompt positions ``[offsets[i], offsets[i] + n_i)``."""

    offsets: tuple[int, ...]
    rows: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.rows):
            raise ValueError(f"{len(self.offsets)} offsets for {len(self.rows)} embedding tensors")
        spans = sorted(zip(self.offsets, (r.shape[0] for r in self.rows), strict=True))
        for (a, n), (b, _) in zip(spans, spans[1:], strict=False):
            if a + n > b:
                raise ValueError(f"embedding items at {a} (+{n}) and {b} overlap")

    def spans(self) -> list[tuple[int, int]]:
        return [(o, o + r.shape[0]) for o, r in zip(self.offsets, self.rows, strict=True)]

    def check(self, prompt: Sequence[int], hidden: int) -> None:
        """ValueError unless the pseudo tokens of `prompt` are exactly the positions the rows fill."""
        covered: set[int] = set()
        for (start, end), rows in zip(self.spans(), self.rows, strict=True):
            if rows.ndim != 2 or rows.shape[1] != hidden:
                raise ValueError(f"embedding rows of shape {tuple(rows.shape)}; the model's hidden size is {hidden}")
            if start < 0 or end > len(prompt):
                raise ValueError(f"embedding item at [{start}, {end}) outside a prompt of {len(prompt)} tokens")
            covered.update(range(start, end))
        check_pseudo_tokens(prompt, covered)

    def chunk(self, start: int, num_new: int) -> list[tuple[int, torch.Tensor]]:
        """(index in the chunk, rows) of every embedding row at positions ``[start, start + num_new)``."""
        out = []
        end = start + num_new
        for (a, b), rows in zip(self.spans(), self.rows, strict=True):
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                out.append((lo - start, rows[lo - a:hi - a]))
        return out


def check_pseudo_tokens(prompt: Sequence[int], covered: set[int]) -> None:
    """ValueError when a pseudo token sits outside `covered`, or a covered position holds a vocabulary id."""
    for i, t in enumerate(prompt):
        if (t >= MM_TOKEN_FLAG) != (i in covered):
            what = "a multimodal pseudo token without embedding rows" if t >= MM_TOKEN_FLAG else \
                f"token {t} where an image's embedding row goes"
            raise ValueError(f"prompt position {i}: {what}")


Lookup = Callable[[str], "MMEmbeddings | None"]


def overrides(seqs: Sequence, lookup: Lookup, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat rows, values) of the embedding rows that a step's chunks (ScheduledSeqs, flattened in order)
    carry; None when no chunk touches an image."""
    index: list[int] = []
    values: list[torch.Tensor] = []
    base = 0
    for s in seqs:
        mm = lookup(s.req_id)
        if mm is not None:
            for i, rows in mm.chunk(s.start, s.num_new):
                index.extend(range(base + i, base + i + rows.shape[0]))
                values.append(rows)
        base += s.num_new
    if not index:
        return None
    rows_t = torch.tensor(index, dtype=torch.int64, device=device)
    return rows_t, torch.cat(values).to(device)  # (the model casts to its dtype)


def model_inputs(input_ids: torch.Tensor, seqs: Sequence, lookup: Lookup,
                 pad_id: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """The ids the embedding layer may look up (pseudo tokens -> `pad_id`) and the rows to override."""
    embeds = overrides(seqs, lookup, input_ids.device)
    if embeds is None:
        return input_ids, None
    return model_token_ids(input_ids, pad_id), embeds
