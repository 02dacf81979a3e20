"""Disaggregated prefill / decode on top of the engine's public API.

Prefill side: a `prefill_only` Request leaves its KV held (`EngineCore.held_prefill`). `plan_shipment`
decides which logical pages the decode worker lacks, `layer_specs` / `gather_layer` turn them into one
transfer payload per model layer (model layer order, so decode could consume layer by layer).

Decode side: `DisaggEngineCore` is an EngineCore that also accepts a `RemoteRequest`: its prompt KV is
computed elsewhere. Admission reserves pages in both pools right away (the pages the transfer writes
into), the sequence then waits outside the scheduler until `activate()` (KV landed) puts it into the
running set as a decoding sequence. Because a RemoteRequest goes through `add_request`, the stock
`AsyncEngine.generate()` streams its outputs and aborts it when the caller walks away.

Which SWA pages travel: the decode cache, once the prompt is committed, holds SWA pages for logical
pages >= n // P - ceil(W / P) (the window plus the page being filled). Exactly those pages are sent, so
no page the decode cache believes live is left unwritten (a later prefix hit would read it):

    logical pages   0 ........ hit_pages-1 | hit_pages ...... n_pages-1
    full layers     decode has (prefix hit) | sent
    SWA layers      decode has / not needed | not needed | sent: [max(hit_pages, n//P - ceil(W/P)), n_pages)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from libs.engine.core import EngineCore, EngineLoad
from libs.engine.host_tier import LayerSlot, layer_slots
from libs.engine.request import FinishReason, Request, SamplingParams
from libs.engine.scheduler import Seq, SeqStatus
from libs.engine.stopping import check_stop
from libs.model.paged import KVPools
from libs.transfer import LayerSpec

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- plan (pure)
@dataclass(frozen=True)
class ShipPlan:
    """Logical pages of one prompt's KV that prefill sends to a decode worker holding [0, hit_tokens)."""

    num_tokens: int
    page_size: int
    window: int
    hit_tokens: int
    full_pages: tuple[int, ...]
    swa_pages: tuple[int, ...]

    @property
    def num_pages(self) -> int:
        return -(-self.num_tokens // self.page_size)


def plan_shipment(num_tokens: int, page_size: int, window: int, hit_tokens: int = 0) -> ShipPlan:
    """Full-layer pages after the decode side's hit, SWA pages of the last window after it (see module doc)."""
    if num_tokens < 1 or page_size < 1 or window < 1:
        raise ValueError(f"plan_shipment: need num_tokens, page_size, window >= 1, got "
                         f"{num_tokens}, {page_size}, {window}")
    if hit_tokens % page_size or not 0 <= hit_tokens < num_tokens:
        raise ValueError(f"plan_shipment: hit of {hit_tokens} tokens must be page aligned and < {num_tokens}")
    n_pages = -(-num_tokens // page_size)
    hit_pages = hit_tokens // page_size
    first_window_page = max(0, num_tokens // page_size - (-(-window // page_size)))
    return ShipPlan(num_tokens, page_size, window, hit_tokens, tuple(range(hit_pages, n_pages)),
                    tuple(range(max(hit_pages, first_window_page), n_pages)))


def full_kv_pages(num_tokens: int, page_size: int) -> int:
    """Pages a naive transfer would move per layer (every layer holding the whole prompt)."""
    return -(-num_tokens // page_size)


# ---------------------------------------------------------------------------------------------- layers
def _pool(kv: KVPools, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (kv.full_k, kv.full_v) if group == "full" else (kv.swa_k, kv.swa_v)


def _dtype_name(kv: KVPools) -> str:
    return str(kv.full_k.dtype).removeprefix("torch.")


def page_bytes(kv: KVPools, group: str) -> int:
    """Bytes of one page of one layer of `group` (K and V)."""
    k, v = _pool(kv, group)
    return (k[0, 0].numel() * k.element_size()) + (v[0, 0].numel() * v.element_size())


@dataclass(frozen=True)
class LayerPages:
    """One model layer's share of a shipment: its pool slot and the physical pages to move."""

    slot: LayerSlot
    pages: tuple[int, ...]


def shipment_layers(layer_is_swa: Sequence[bool], plan: ShipPlan, full_table: Sequence[int],
                    swa_table: Sequence[int]) -> list[LayerPages]:
    """Per model layer (model order), the physical page ids of `plan`'s logical pages in this engine.

    Raises ValueError when a page the plan needs is missing (-1), which would mean the engine no longer
    holds the window the plan was computed for."""
    full = [full_table[j] for j in plan.full_pages]
    swa = [swa_table[j] for j in plan.swa_pages]
    if min(full, default=0) < 0 or min(swa, default=0) < 0:
        raise ValueError(f"KV pages missing for the shipment (full {full}, swa {swa})")
    out = []
    for slot in layer_slots(layer_is_swa):
        pages = tuple(full if slot.group == "full" else swa)
        if pages:
            out.append(LayerPages(slot, pages))
    return out


def layer_specs(kv: KVPools, layers: Sequence[LayerPages]) -> list[LayerSpec]:
    """The transfer header: one LayerSpec per layer; payload = K pages then V pages, flattened per page."""
    dtype = _dtype_name(kv)
    specs = []
    for lp in layers:
        per_page = page_bytes(kv, lp.slot.group) // kv.full_k.element_size()
        specs.append(LayerSpec(lp.slot.group, lp.slot.index, len(lp.pages), dtype, (len(lp.pages), per_page)))
    return specs


def gather_layer(kv: KVPools, lp: LayerPages) -> list[torch.Tensor]:
    """Sender payload of one layer: [K pages, V pages] as two contiguous tensors (copies)."""
    k, v = _pool(kv, lp.slot.group)
    idx = torch.tensor(lp.pages, dtype=torch.int64, device=k.device)
    return [k[lp.slot.index].index_select(0, idx), v[lp.slot.index].index_select(0, idx)]


def destination_views(kv: KVPools, lp: LayerPages) -> list[torch.Tensor]:
    """Receiver destination of one layer: the pool's own page views (K pages, then V pages), written in
    place, in the same byte order as `gather_layer`."""
    k, v = _pool(kv, lp.slot.group)
    return [k[lp.slot.index, p] for p in lp.pages] + [v[lp.slot.index, p] for p in lp.pages]


def shipment_bytes(kv: KVPools, layers: Sequence[LayerPages]) -> int:
    return sum(len(lp.pages) * page_bytes(kv, lp.slot.group) for lp in layers)


def full_transfer_bytes(kv: KVPools, layer_is_swa: Sequence[bool], num_tokens: int) -> int:
    """What shipping every layer's pages for the whole prompt would move (the non-SWA-aware baseline)."""
    pages = full_kv_pages(num_tokens, kv.page_size)
    return sum(pages * page_bytes(kv, s.group) for s in layer_slots(layer_is_swa))


# ---------------------------------------------------------------------------------------------- prefill side
def first_token_finishes(core: EngineCore, params: SamplingParams, first_token: int) -> FinishReason | None:
    """Does the token prefill sampled already end the request (EOS, stop token/string, max_tokens=1)?"""
    sch = core.scheduler
    return check_stop([first_token], 0, params, sch.eos_token_ids, sch.decode)


# ---------------------------------------------------------------------------------------------- decode side
class DecodeFull(ValueError):
    """This decode engine has no room for the request now (sequences or KV pages); another one may."""


@dataclass(frozen=True)
class RemoteSlot:
    """Pages the decode engine reserved for a remote prompt; `*_table` map logical -> physical page."""

    req_id: str
    hit_tokens: int
    full_table: tuple[int, ...]
    swa_table: tuple[int, ...]


@dataclass
class RemoteRequest(Request):
    """A request whose prompt KV is computed by a prefill worker and shipped here.

    first_token: the token prefill sampled (its output #1). on_admitted: called on the engine thread
    with the RemoteSlot once both pools reserved the prompt's pages (the transfer's destinations).
    """

    first_token: int = -1
    on_admitted: Callable[[RemoteSlot], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.first_token < 0:
            raise ValueError(f"remote request {self.req_id!r}: first_token must be set")
        if self.prefill_only:
            raise ValueError(f"remote request {self.req_id!r} cannot be prefill_only")


@dataclass
class _Pending:
    req: RemoteRequest
    hit_tokens: int


class DisaggEngineCore(EngineCore):
    """EngineCore that also admits RemoteRequests (decode role). Same thread rules as EngineCore."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[str, _Pending] = {}
        self._remote_order = 1 << 40  # admit_order of remote sequences (newest = first preemption victim)

    def add_request(self, req: Request) -> None:
        if not isinstance(req, RemoteRequest):
            super().add_request(req)
            return
        slot = self._admit_remote(req)
        if req.on_admitted is not None:
            req.on_admitted(slot)

    def _admit_remote(self, req: RemoteRequest) -> RemoteSlot:
        sch, cache = self.scheduler, self.cache
        if req.req_id in sch.seqs or req.req_id in self.pending:
            raise ValueError(f"request id {req.req_id!r} is already in the engine")
        if len(sch.running) + len(self.pending) >= self.config.max_num_seqs:
            raise DecodeFull(f"request {req.req_id!r}: decode engine is full "
                             f"({self.config.max_num_seqs} sequences running or arriving)")
        prompt = req.prompt_token_ids
        # no rebuild hit: prefill sends the KV from hit.tokens on, and a rebuild hit's pages below its
        # full_tokens are shared tree pages that must not be written
        hit = cache.match(prompt, rebuild=False)
        self.runner.start_load(hit.load_copies)  # host-tier hits: copy before the pages are read
        self.runner.finish_load()
        growth = req.params.max_tokens
        if self.config.admission_decode_tokens is not None:
            growth = min(growth, self.config.admission_decode_tokens)
        result = cache.admit(req.req_id, prompt, hit, growth)
        if not result.ok:
            raise DecodeFull(f"request {req.req_id!r}: no KV room on this decode worker: {result.reason}")
        if not cache.reserve(req.req_id, len(prompt) - hit.tokens):
            cache.abort(req.req_id)
            raise DecodeFull(f"request {req.req_id!r}: no KV room on this decode worker for the prompt")
        self.pending[req.req_id] = _Pending(req, hit.tokens)
        full, swa = cache.page_tables(req.req_id)
        return RemoteSlot(req.req_id, hit.tokens, tuple(full), tuple(swa))

    def activate(self, req_id: str) -> None:
        """The prompt's KV has landed: commit it and start decoding after the first token."""
        p = self.pending.pop(req_id, None)
        if p is None:
            raise KeyError(f"activate({req_id!r}): no remote request waits for KV under that id")
        prompt, first = p.req.prompt_token_ids, p.req.first_token
        self.cache.commit(req_id, len(prompt) - p.hit_tokens, (first,))
        sch = self.scheduler
        seq = Seq(p.req, [*prompt, first], bucket=sch.buckets.classify(len(prompt) - p.hit_tokens),
                  status=SeqStatus.RUNNING, num_computed=len(prompt), num_cached_tokens=p.hit_tokens,
                  admit_order=self._remote_order)
        self._remote_order += 1
        sch.seqs[req_id] = seq
        sch.running.append(seq)
        sch.stats.admitted += 1
        sch.stats.hit_tokens += p.hit_tokens
        sch.stats.prompt_tokens += len(prompt)

    def abort(self, req_id: str) -> bool:
        p = self.pending.pop(req_id, None)
        if p is None:
            return super().abort(req_id)
        self.cache.abort(req_id)  # frees every page reserved for the transfer
        self.runner.forget(req_id)
        return True

    def load(self) -> EngineLoad:
        """Remote requests whose KV is still arriving hold pages: they count as running."""
        load = super().load()
        return dataclasses.replace(load, running=load.running + len(self.pending))
