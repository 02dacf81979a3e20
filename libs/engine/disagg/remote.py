"""The engine cores' side of the hand-off.

Prefill: `first_token_finishes` (does the token a prefill-only request sampled already end it?).

Decode: `DisaggEngineCore` is an EngineCore that also accepts a `RemoteRequest`, whose prompt KV is
computed elsewhere. Admission reserves pages in both pools right away (the pages the transfer writes
into); the sequence then waits outside the scheduler (`pending`) until `activate()` (KV landed, first
token known) puts it into the running set as a decoding sequence. Because a RemoteRequest goes through
`add_request`, the stock `AsyncEngine.generate()` streams its outputs and aborts it when the caller walks
away; `abort()` of a pending request frees every page reserved for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from libs.engine.core import EngineCore, EngineLoad
from libs.engine.disagg.plan import plan_shipment
from libs.engine.mtp import FirstDrafts
from libs.engine.plan import BatchPlan
from libs.engine.request import AdmittedHit, FinishReason, Request, SamplingParams
from libs.engine.scheduler import Seq, SeqStatus
from libs.engine.stopping import check_stop


# ---------------------------------------------------------------------------------------------- prefill side
def first_token_finishes(core: EngineCore, params: SamplingParams, first_token: int,
                         resumed: Sequence[int] = ()) -> FinishReason | None:
    """Does the token prefill sampled already end the request (EOS, stop token/string, max_tokens)? `resumed`: the
    output tokens before it (a migrated stream's)."""
    sch = core.scheduler
    return check_stop([*resumed, first_token], 0, params, sch.eos_token_ids, sch.decode)


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
    """A request whose prompt KV is computed by a prefill worker and shipped here. Its first output token is
    the one prefill sampled, given to `activate()`; the engine's outputs start with the second.

    on_admitted: called on the engine thread with the RemoteSlot once both pools reserved the prompt's
    pages (the transfer's destinations).
    """

    on_admitted: Callable[[RemoteSlot], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prefill_only:
            raise ValueError(f"remote request {self.req_id!r} cannot be prefill_only")


@dataclass
class _Pending:
    req: RemoteRequest
    hit_tokens: int
    host_tokens: int = 0  # of hit_tokens, loaded from the host tier (L2) ...
    l3_tokens: int = 0  # ... or imported there from GCache (L3)


class DisaggEngineCore(EngineCore):
    """EngineCore that also admits RemoteRequests (decode role). Same thread rules as EngineCore."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending: dict[str, _Pending] = {}
        self._remote_order = 1 << 40  # admit_order of remote sequences (newest = first preemption victim)

    @property
    def max_remote_prompt_tokens(self) -> int:
        """Longest prompt whose KV can ever land here. `_admit_remote` reserves the whole prompt at once, one
        full and one SWA page per prompt page (the window slides only once the KV is committed), and its
        admission a full page for the first token: static pools, one SWA page per prompt page (as before:
        page x num_swa_pages); one arena, the longest L with (L // page + 1) x fu + ceil(L / page) x su <=
        units (fu, su: a full and an SWA page's units)."""
        cfg, page = self.cache.cfg, self.config.page_size
        if not cfg.arena:
            return page * self.config.num_swa_pages
        fu, su = cfg.full_page_units, cfg.swa_page_units
        pages = cfg.arena_units // (fu + su)  # L = pages x page - 1 fits: pages x (fu + su) units
        return pages * page if cfg.arena_units - pages * (fu + su) >= fu else pages * page - 1

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
        if len(sch.running) + len(self.pending) >= self.config.scheduler.max_num_seqs:
            raise DecodeFull(f"request {req.req_id!r}: decode engine is full "
                             f"({self.config.scheduler.max_num_seqs} sequences running or arriving)")
        prompt = req.start_token_ids  # the KV that arrives (a migrated stream's tokens too)
        # no rebuild hit: prefill sends the KV from hit.tokens on, and a rebuild hit's pages below its
        # full_tokens are shared tree pages that must not be written
        hit = cache.match(prompt, rebuild=False)
        if hit.load_copies:  # host-tier hits: copy before the pages are read, as a copies-only step (so that a
            # parallel runner's every rank loads its own host copies, not rank 0 alone)
            self.runner.forward(BatchPlan(load_copies=tuple(hit.load_copies)))
        growth = req.params.max_tokens - len(req.resumed)
        if self.config.scheduler.admission_decode_tokens is not None:
            growth = min(growth, self.config.scheduler.admission_decode_tokens)
        # the SWA KV that arrives: the last window only (checkpoints below it would cache pages never written)
        swa_from = plan_shipment(len(prompt), cache.cfg.page_size, cache.cfg.window, hit.tokens).swa_pages[0]
        result = cache.admit(req.req_id, prompt, hit, growth, swa_from=swa_from * cache.cfg.page_size)
        if not result.ok:
            raise DecodeFull(f"request {req.req_id!r}: no KV room on this decode worker: {result.reason}")
        if not cache.reserve(req.req_id, len(prompt) - hit.tokens):
            cache.abort(req.req_id)
            raise DecodeFull(f"request {req.req_id!r}: no KV room on this decode worker for the prompt")
        l3 = min(hit.l3_tokens, hit.tokens)
        self.pending[req.req_id] = _Pending(req, hit.tokens, min(hit.host_tokens, hit.tokens) - l3, l3)
        sch.stats.arrivals += 1
        if sch.admissions is not None:  # the decode-side hit: the pages prefill does not ship
            sch.admissions.append(AdmittedHit(req.req_id, len(prompt), hit.tokens))
        full, swa = cache.page_tables(req.req_id)
        return RemoteSlot(req.req_id, hit.tokens, tuple(full), tuple(swa))

    def activate(self, req_id: str, first_token: int, land: Callable[[], None] | None = None,
                 first: FirstDrafts | None = None) -> bool:
        """The prompt's KV has landed: commit it and start decoding after `first_token` (sampled by prefill).

        `land` (the transfer's `Landing.land`): puts the received pages into the pools first, here on the engine
        thread before any step can read them (a parallel engine scatters each rank's KV heads). When it raises,
        the request stays pending (its abort frees the pages).

        `first`: the prefill engine's drafts after `first_token` and its newest hidden states (MTP in prefill):
        the first decode step verifies them. Returns whether they were taken; drafts this engine cannot use
        (it does not draft, a sampled request, wrong sizes or positions) are dropped: the first step decodes one
        token and the drafting starts after it, as without them."""
        if req_id not in self.pending:
            raise KeyError(f"activate({req_id!r}): no remote request waits for KV under that id")
        if land is not None:
            land()
        p = self.pending.pop(req_id)
        prompt = p.req.start_token_ids  # computed by prefill (num_prompt: the prompt alone)
        self.cache.commit(req_id, len(prompt) - p.hit_tokens, (first_token,))
        sch = self.scheduler
        seq = Seq(p.req, [*prompt, first_token], bucket=sch.buckets.classify(len(prompt) - p.hit_tokens),
                  status=SeqStatus.RUNNING, num_computed=len(prompt), num_cached_tokens=p.hit_tokens,
                  admit_order=self._remote_order, computed_from=p.hit_tokens)
        self._remote_order += 1
        sch.seqs[req_id] = seq
        sch.running.append(seq)
        sch.stats.admitted += 1
        sch.stats.hit_tokens += p.hit_tokens
        sch.stats.host_hit_tokens += p.host_tokens
        sch.stats.l3_hit_tokens += p.l3_tokens
        sch.stats.prompt_tokens += len(prompt)
        return first is not None and self._take_first_drafts(seq, first)

    def _take_first_drafts(self, seq: Seq, first: FirstDrafts) -> bool:
        cfg, k, n = self.model_config, self.draft_layers, len(seq.token_ids) - 1  # n: the prompt's length
        if self._kv_mtp is None or not seq.req.params.greedy or not 0 < len(first.drafts) <= k:
            return False
        if not all(0 <= t < cfg.vocab_size for t in first.drafts):
            return False
        rows = first.hidden
        if rows is not None:
            if (rows.ndim != 2 or rows.shape[1] != cfg.hidden_size or not 0 < rows.shape[0] <= self._ring.keep
                    or first.hidden_from + rows.shape[0] != n or first.hidden_from < 0):
                return False
            dtype = self.config.torch_dtype  # (the model's: a draft's hidden rows are activations)
            self._ring.put(seq.req_id, first.hidden_from, rows.to(self.runner.device, dtype))
        seq.drafts = list(first.drafts)
        return True

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
