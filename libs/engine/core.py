"""EngineCore: the synchronous step loop (schedule -> execute -> update) over one model.

Thread-compatible, not thread-safe: one thread calls add_request / abort / step. The
AsyncEngine wraps it for asyncio callers.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kernels.fused import GATHER_MAX_TOKENS, LONG_DECODE_KEYS
from libs.engine.config import EngineConfig
from libs.engine.gcache_tier import StagedValues, ValueLayout, kv_layout
from libs.engine.grammar import ConstrainedRow, GrammarBook, GrammarCache
from libs.engine.mm import MMEmbeddings
from libs.engine.mtp import (
    DraftSpan,
    FirstDrafts,
    HiddenRing,
    as_if_emitted,
    check_draft_layers,
    draft_view,
    drafts_for,
    greedy_accept,
    kv_start_of,
    rejection_accept,
    run_chain,
)
from libs.engine.placement import apply_threads, parse_cpus
from libs.engine.request import (
    AdmittedHit,
    FinishReason,
    PrefillProgress,
    Request,
    RequestOutput,
    SamplingParams,
)
from libs.engine.runner import ModelRunner, PoolSizes, StepInterrupted
from libs.engine.sampling import DRAW_DRAFT, DRAW_VERIFY, History, TokenMask, apply_mask, filter_logits, token_logprobs
from libs.engine.scheduler import SampledToken, Scheduler, SeqStatus
from libs.engine.step_cost import StepCostModel
from libs.kvcache import ArenaPlan, KVCache, KVCacheConfig, plan_arena, rebuild_span
from libs.kvcache.types import CacheStats, PoolUsage
from libs.mm.placeholders import MM_TOKEN_FLAG
from libs.model.compiled import CompiledStep
from libs.model.model import MiMoV2Model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldPrefill:
    """KV of a finished prefill-only request, for shipping to a decode worker."""

    req_id: str
    token_ids: tuple[int, ...]  # prompt + the first sampled token (which has no KV yet)
    num_computed: int
    full_pages: tuple[int, ...]
    swa_pages: tuple[int, ...]


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of what the engine holds, for the worker's registry load, health and metrics."""

    running: int  # sequences holding KV (on decode also remote ones whose KV is still arriving)
    waiting: int  # queued, holding no KV yet
    usage: PoolUsage  # pages per pool (device and host tier)
    prompt_tokens: int  # prompt tokens admitted since start
    hit_tokens: int  # of which served from the prefix cache
    preemptions: int  # sequences preempted (recomputed later) since start
    cache: CacheStats | None = None  # evictions by reason, hit tokens lost to missing SWA KV (since start)
    host_hit_tokens: int = 0  # of hit_tokens, loaded from the host tier (L2)
    l3_hit_tokens: int = 0  # of hit_tokens, imported from GCache (L3) into the host tier and loaded from there
    spec: SpecStats | None = None  # MTP speculative decoding since start (None: off)
    arrivals: int = 0  # requests taken on since start (routers match their picks against it)
    compiled_calls: int = 0  # compiled-step graph calls since start (0: compile off)
    eager_fallbacks: dict[str, int] = field(default_factory=dict)  # compiled-step calls run eager, by reason


@dataclass(frozen=True)
class SpecStats:
    """MTP speculative decoding since start: draft tokens verified, accepted, and verify steps by accepted
    drafts (`accept_hist[m]`: steps that accepted m drafts, i.e. emitted m + 1 tokens)."""

    drafted_tokens: int
    accepted_tokens: int
    accept_hist: tuple[int, ...]

    @property
    def accepted_len(self) -> float:
        """Mean tokens emitted per verify step (1 + accepted drafts)."""
        steps = sum(self.accept_hist)
        return 1.0 + self.accepted_tokens / steps if steps else 0.0


def arena_plan(config: EngineConfig, model_config) -> ArenaPlan | None:
    """With `kv_arena`: the one arena of the bytes the two configured pools would take (`plan_arena` over the
    model's KV layout in the pool dtype, MTP draft layers included); else None. A parallel engine's ranks hold
    this plan's units of their own KV heads (libs/engine/parallel/runner.py `rank_sizes`)."""
    if not config.kv_arena:
        return None
    layout = kv_layout(model_config, config.torch_dtype, config.speculative_tokens)
    budget = (config.num_full_pages * layout.full_page_bytes(config.page_size)
              + config.num_swa_pages * layout.swa_page_bytes(config.page_size))
    return plan_arena(budget, layout, config.page_size)


@dataclass(frozen=True)
class HostPlan:
    """The host tier (L2): two host pools of `full` / `swa` pages, or one host `arena` (both 0 then)."""

    full: int = 0
    swa: int = 0
    arena: ArenaPlan | None = None


def host_plan(config: EngineConfig, model_config, arena: ArenaPlan | None) -> HostPlan:
    """The host tier's sizing. With a device arena: one host arena of `host_kv_bytes` (or the bytes the two host
    page counts would take), in the device arena's units (same layout, same unit). With the static device pools:
    the host page counts, or `host_kv_bytes` split in the device pools' byte shares."""
    if not config.has_host_tier:
        return HostPlan()
    if arena is None and not config.host_kv_bytes:
        return HostPlan(config.num_host_full_pages, config.num_host_swa_pages)
    layout = kv_layout(model_config, config.torch_dtype, config.speculative_tokens)
    fpb, spb = layout.full_page_bytes(config.page_size), layout.swa_page_bytes(config.page_size)
    budget = config.host_kv_bytes or config.num_host_full_pages * fpb + config.num_host_swa_pages * spb
    if arena is not None:
        host = plan_arena(budget, layout, config.page_size)
        assert (host.unit_bytes, host.full_page_units, host.swa_page_units) == (
            arena.unit_bytes, arena.full_page_units, arena.swa_page_units)
        if host.units < host.full_page_units + host.swa_page_units:
            raise ValueError(f"host_kv_bytes={budget} B cannot hold one full and one SWA page ({host})")
        return HostPlan(arena=host)
    dev_full, dev_swa = config.num_full_pages * fpb, config.num_swa_pages * spb
    full = budget * dev_full // (dev_full + dev_swa) // fpb if fpb else 0
    swa = (budget - full * fpb) // spb if spb else 0
    if full < 1 or swa < 1:
        raise ValueError(f"host_kv_bytes={budget} B split like the device pools leaves {full} full and {swa} SWA "
                         f"host pages")
    return HostPlan(int(full), int(swa))


def cache_config(config: EngineConfig, model_config, arena: ArenaPlan | None,
                 host: HostPlan | None = None) -> KVCacheConfig:
    """The KV cache's config: the two pools, or one arena (`arena_plan`); the host tier (`host_plan`)."""
    pools = arena.config_fields() if arena is not None else {
        "num_full_pages": config.num_full_pages, "num_swa_pages": config.num_swa_pages}
    host = host_plan(config, model_config, arena) if host is None else host
    return KVCacheConfig(
        page_size=config.page_size, window=model_config.sliding_window, **pools,
        num_host_full_pages=host.full, num_host_swa_pages=host.swa,
        host_arena_units=host.arena.units if host.arena is not None else 0,
        enable_prefix_cache=config.enable_prefix_cache, retention=config.retention,
        checkpoint_every_pages=config.checkpoint_every_pages,
        rebuild_tokens=rebuild_span(len(model_config.swa_layers), model_config.sliding_window, config.page_size)
        if config.swa_rebuild else 0)


def _runner(config: EngineConfig, model, model_config, sizes: PoolSizes, draft_layers: int,
            model_path: str | None, eos: tuple[int, ...] = ()) -> ModelRunner:
    layout = config.layout
    if config.engine_mode == "mock":
        from libs.engine.mock import MockProfile, MockRunner

        return MockRunner(model_config, sizes, MockProfile.load(config.mock_profile), avoid=eos,
                          dtype=config.torch_dtype, device=config.device, seed=config.seed,
                          load_mode=config.resolved_load_mode)
    if not layout.is_parallel:
        if model is None:
            raise ValueError("EngineCore needs a model (only a parallel engine loads from model_path alone)")
        return ModelRunner(model, model_config, sizes, dtype=config.torch_dtype, device=config.device,
                           seed=config.seed, load_mode=config.resolved_load_mode, draft_layers=draft_layers)
    from libs.engine.parallel.runner import ParallelRunner  # (spawns the other ranks)

    if model_path is not None:  # every rank reads its own shard of the checkpoint
        model = None
    elif model is None:
        raise ValueError("a parallel EngineCore needs a model or a model_path")
    return ParallelRunner(model, model_config, sizes, layout=layout, dtype=config.torch_dtype, device=config.device,
                          seed=config.seed, load_mode=config.resolved_load_mode, timeout_s=config.parallel_timeout_s,
                          checkpoint=model_path)


class _Built(type):
    """Runs `_built()` once the whole construction, a subclass's `__init__` included, is done."""

    def __call__(cls, *args, **kwargs):
        core = super().__call__(*args, **kwargs)
        core._built()
        return core


class EngineCore(metaclass=_Built):
    """Continuous-batching engine over one model and one dual-pool KV cache."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None, model_config, tokenizer=None, *,
                 model_path: str | None = None) -> None:
        """`model`: the whole model in memory. A parallel engine (tp / ep > 1) given `model_path` (a checkpoint
        directory; `model` may then be None) has each rank read its own shard from it instead."""
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        arena = arena_plan(config, model_config)
        host = host_plan(config, model_config, arena)
        self.cache = KVCache(cache_config(config, model_config, arena, host))
        eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ()) if tokenizer is not None else ()
        decode = tokenizer.decode if tokenizer is not None else None
        self.scheduler = Scheduler(config.scheduler, self.cache, eos_token_ids=eos, decode=decode)
        sizes = PoolSizes(config.page_size, config.num_full_pages, config.num_swa_pages,
                          host.full, host.swa, arena, host.arena)
        self.draft_layers = check_draft_layers(config.speculative_tokens, model_config)
        self.runner = _runner(config, model, model_config, sizes, self.draft_layers, model_path, eos)
        if self.cache.arena is not None:  # the KV buffer is indexed by unit: it reads the ledger's unit tables
            assert self.runner.kv.arena is not None
            self.runner.kv.arena.bind({g: self.cache.arena.unit_table(g) for g in ("full", "swa")})
        if self.cache.host is not None and self.cache.host.arena:  # so is the host KV buffer (one host arena)
            assert self.runner.host is not None and self.runner.host.arena is not None
            self.runner.host.arena.bind({g: self.cache.host.unit_table(g) for g in ("full", "swa")})
        self._ring = HiddenRing(max(self.draft_layers - 1, 0))
        self._draft_q: dict[str, list[torch.Tensor]] = {}  # sampled drafts' distributions, per request
        self._kv_mtp = draft_view(self.runner.kv, len(model_config.swa_layers)) if self.draft_layers else None
        self.num_steps = 0
        self.num_interrupted = 0  # steps stopped by step(interrupt=...) before they finished
        self._grammars: GrammarBook | None = None  # built on the first constrained request (tokenizer tables)
        self.compute_threads = apply_threads(config.compute_threads, parse_cpus(config.compute_cpus))
        self.compile_stats: dict = {"enabled": False, "reason": "off (EngineConfig.compile)"}

    def _built(self) -> None:
        """After construction (of a subclass too: the warm-up's requests go through its own step)."""
        if self.config.compile:
            self._compile()

    def _compile(self) -> None:
        """Put the model on the compiled step and warm it up (docs/engine.md, "Compiled step")."""
        model = getattr(self.runner, "model", None)
        if self.config.engine_mode == "mock":
            self.compile_stats = {"enabled": False, "reason": "mock engine: no forward to compile"}
            return
        if self.config.layout.is_parallel or not isinstance(model, MiMoV2Model):
            self.compile_stats = {"enabled": False, "reason": "tp / ep > 1: the ranks run eager"}
            return
        step = CompiledStep(self.config.scheduler.max_num_batched_tokens, self.config.compile_cache_dir or None)
        model.set_compiled(step)
        if step.warm_up(self._warmup_stages(), self.config.compile_warmup_s):
            self.compile_stats = step.stats()
        else:
            model.set_compiled(None)
            self.compile_stats = {"enabled": False, "warmup_s": step.warmup_s,
                                  "reason": f"warm-up passed its bound ({self.config.compile_warmup_s:.0f} s)"}
        self.scheduler.cost = StepCostModel()  # the warm-up's steps (compile time) are no step-cost sample
        self.num_steps = 0

    def _warmup_stages(self) -> list[Callable[[], None]]:
        """Steps whose shapes select every compiled graph: decode at 1, 2 and past `fused.GATHER_MAX_TOKENS`
        sequences (the last also a prefill of one token each, which is decode-shaped), prefill chunks of 2 and of
        more than that many tokens. Each runs real requests through the engine and aborts them (no KV is cached,
        no page is kept)."""
        big = min(GATHER_MAX_TOKENS + 1, self.config.scheduler.max_num_seqs,
                  self.config.scheduler.max_num_batched_tokens)

        def stage(n: int, prompt: int):
            return lambda: self._warmup_requests(n, prompt)

        stages = [stage(1, 2), stage(1, GATHER_MAX_TOKENS + 1), stage(2, 3), stage(big, 1)]
        # inductor sums more than 4096 floats another way (and guards the length): decode past 4096 keys is a graph
        # of its own, compiled here for one and two sequences where the engine holds such lengths
        long = LONG_DECODE_KEYS + 1
        if min(self.max_request_tokens, self.model_config.max_position_embeddings) >= long + 64:
            stages += [stage(1, long), stage(2, long)]
        return stages

    def _warmup_requests(self, n: int, prompt: int) -> None:
        # room to keep decoding while the others prefill (a finished request would be cached): all n decode at once
        steps = -(-n * prompt // self.config.scheduler.max_num_batched_tokens) + n + 4
        params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        ids = [f"compile-warmup-{n}-{prompt}-{i}" for i in range(n)]
        for i, req_id in enumerate(ids):
            self.add_request(Request(req_id, [(7 + i + j) % self.model_config.vocab_size for j in range(prompt)],
                                     params))
        tokens = dict.fromkeys(ids, 0)
        for _ in range(2 * steps):  # (bounded: prefill, then two decode steps for every request)
            for out in self.step():
                tokens[out.req_id] = tokens.get(out.req_id, 0) + len(out.new_token_ids)
            if all(tokens[r] >= 2 for r in ids):
                break
        for req_id in ids:
            self.abort(req_id)
        while self.has_work():
            self.step()

    @property
    def max_seq_pages(self) -> int:
        """Most full pages one sequence can hold: the full pool, or with an arena what its units hold beside
        the sequence's own SWA window."""
        cfg = self.cache.cfg
        if not cfg.arena:
            return self.config.num_full_pages
        return (cfg.arena_units - cfg.seq_swa_pages * cfg.swa_page_units) // cfg.full_page_units

    @property
    def max_request_tokens(self) -> int:
        """Prompt + max_tokens one request may ever hold here (`add_request` refuses more): `max_seq_pages`
        pages. What the services advertise and refuse beyond (413)."""
        return self.config.page_size * self.max_seq_pages

    @property
    def kv_layer_is_swa(self) -> tuple[bool, ...]:
        """Per KV layer of the pools, in slot order: the model's layers, then the MTP draft blocks (SWA). What a
        disaggregated hand-off ships, so a decode worker receives the draft layers' KV of the prompt too."""
        return (*self.model_config.layer_is_swa, *([True] * self.draft_layers))

    @property
    def grammars(self) -> GrammarBook:
        """The per-sequence grammar matchers and this engine's compile cache (built on first use)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("constrained decoding needs a tokenizer (EngineCore was built without one)")
            cache = GrammarCache(self.tokenizer, self.model_config.vocab_size, self.scheduler.eos_token_ids)
            self._grammars = GrammarBook(cache)
        return self._grammars

    # ------------------------------------------------------------------ requests
    def add_request(self, req: Request) -> None:
        """Queue a request. Raises ValueError when it can never fit the pools or its id is taken."""
        need = -(-(len(req.prompt_token_ids) + req.params.max_tokens) // self.config.page_size)
        if need > self.max_seq_pages:
            raise ValueError(
                f"request {req.req_id!r}: prompt ({len(req.prompt_token_ids)} tokens) + max_tokens "
                f"({req.params.max_tokens}) needs {need} KV pages but the full pool has {self.max_seq_pages}")
        if req.params.stop and self.tokenizer is None:
            raise ValueError(f"request {req.req_id!r} uses stop strings but the engine has no tokenizer")
        bad_bias = [t for t, _ in req.params.logit_bias if t >= self.model_config.vocab_size]
        if bad_bias:
            raise ValueError(f"request {req.req_id!r}: logit_bias token id {bad_bias[0]} is outside the "
                             f"vocabulary [0, {self.model_config.vocab_size})")
        if req.params.grammar is not None:
            self.grammars.cache.compile(req.params.grammar)  # refuse a bad grammar now; warm the cache
        self._check_mm(req)
        self.scheduler.add_request(req)

    def _check_mm(self, req: Request) -> None:
        """A prompt with pseudo tokens (images, libs/mm/placeholders.py) needs rows for exactly those positions."""
        if req.mm is None and not any(t >= MM_TOKEN_FLAG for t in req.prompt_token_ids):
            return
        if self.model_config.vision is None:
            raise ValueError(f"request {req.req_id!r} carries images but this model has no vision config")
        if req.mm is None:
            raise ValueError(f"request {req.req_id!r}: prompt has multimodal pseudo tokens but no embedding rows")
        req.mm.check(req.prompt_token_ids, self.model_config.hidden_size)

    def _mm_of(self, req_id: str) -> MMEmbeddings | None:
        seq = self.scheduler.seqs.get(req_id)
        return seq.req.mm if seq is not None else None

    def abort(self, req_id: str) -> bool:
        """Abort a request (waiting, running or held); frees all its KV. Its final output (finish
        reason abort) comes out of the next step(). False when the id is unknown or finished."""
        self._forget(req_id)
        return self.scheduler.abort(req_id)

    def _forget(self, req_id: str, ring: bool = True) -> None:
        """Drop a finished or aborted request's per-request state (generator, grammar matcher, hidden rows)."""
        self.runner.forget(req_id)
        if ring:
            self._ring.forget(req_id)
        self._draft_q.pop(req_id, None)
        if self._grammars is not None:
            self._grammars.release(req_id)

    def release(self, req_id: str, cache: bool = True) -> None:
        """Free (and by default cache) the KV of a finished prefill-only request."""
        self.scheduler.release(req_id, cache=cache)
        self._ring.forget(req_id)
        self._draft_q.pop(req_id, None)

    def held_prefill(self, req_id: str) -> HeldPrefill:
        seq = self.scheduler.seqs.get(req_id)
        if seq is None or seq.status is not SeqStatus.HELD:
            raise KeyError(f"held_prefill({req_id!r}): no prefill-only request holds KV under that id")
        full, swa = self.cache.page_tables(req_id)
        return HeldPrefill(req_id, tuple(seq.token_ids), seq.num_computed, tuple(full), tuple(swa))

    def first_drafts(self, req_id: str) -> FirstDrafts | None:
        """A held prefill-only request's drafts after its first token and its newest target hidden states (on
        the CPU), for its decode worker (MTP in prefill, disaggregated); None when it has no drafts."""
        seq = self.scheduler.seqs.get(req_id)
        if seq is None or seq.status is not SeqStatus.HELD or not seq.drafts:
            return None
        ring = self._ring.get(req_id)
        if ring is None:
            return FirstDrafts(tuple(seq.drafts), seq.num_computed, None)
        first, rows = ring
        return FirstDrafts(tuple(seq.drafts), first, rows.detach().to("cpu", copy=True))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ GCache (L3)
    def l3_layout(self) -> ValueLayout:
        """Byte sizes of this engine's GCache values (libs/engine/gcache_tier.py)."""
        return ValueLayout.of(self.runner.kv_access().shapes, self.cache.cfg.window_pages)  # (every KV head)

    def import_l3(self, tokens: Sequence[int], block_hashes: Sequence[int], first: int, end: int,
                  values: StagedValues) -> int:
        """Import the L3 hit [first, end) of `tokens` (the full values of those blocks and the SWA checkpoint at
        block end - 1, staged by `libs.engine.gcache_tier.stage_values`) into the host tier; pages imported (0: the
        cache refused, see `KVCache.import_blocks`). The request's match then loads them like any L2 copy."""
        if values.blocks != end - first or values.swa_pages != min(self.cache.cfg.window_pages, end):
            raise ValueError(f"GCache import of pages [{first}, {end}): {values.blocks} blocks and "
                             f"{values.swa_pages} checkpoint pages staged")
        imp = self.cache.import_blocks(tokens, block_hashes, first, end)
        if imp is None:
            return 0
        self.runner.write_host_blocks(imp.full, imp.swa, values, skip=imp.start - first)
        return imp.end - imp.start

    def close(self) -> None:
        """Detach from the model (its layer hooks) and stop helper threads; also happens on GC."""
        self.runner.close()

    # ------------------------------------------------------------------ step
    def is_urgent(self, req: Request) -> bool:
        """Would `req` be worth interrupting a step for: is it in the shortest length bucket, whatever its
        prefix hit? (Its raw prompt length is an upper bound on what it has left to compute.)"""
        return self.scheduler.buckets.num_buckets > 1 and self.scheduler.buckets.classify(
            len(req.prompt_token_ids)) == 0

    def step(self, interrupt: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """One schedule -> execute -> update round; outputs of every request that progressed.

        `interrupt` (e.g. "a short request has arrived", see is_urgent) is polled before each decoder layer and
        each layer's MLP of a step that carries longer-bucket prefill chunks. When it fires the step stops there
        and nothing is committed: its work is rescheduled by the next step, next to the new short work, with the
        long chunks capped by long_prefill_share. A short request then waits for half a layer, not a whole step."""
        plan = self.scheduler.schedule()
        t0 = time.perf_counter()
        try:
            logits = self.runner.forward(plan, interrupt if plan.interruptible else None, mm=self._mm_of)
        except StepInterrupted:
            self.num_interrupted += 1
            return []
        sampled, accepted = self._sample(plan, logits)
        elapsed = time.perf_counter() - t0
        outputs = self.scheduler.update(plan, sampled, accepted)
        if self.draft_layers:  # (the drafting pass is part of the step's cost)
            t1 = time.perf_counter()
            self._draft(plan)
            elapsed += time.perf_counter() - t1
        self.scheduler.observe_step(plan, elapsed)
        self._report_progress(plan)
        for out in outputs:
            if out.finished:  # (a held prefill keeps its hidden rows for `first_drafts` until release)
                self._forget(out.req_id, ring=out.finish_reason is not FinishReason.PREFILLED)
        self.num_steps += 1
        return outputs

    def _report_progress(self, plan) -> None:
        """Call the on_progress hooks of the requests this step computed (after update committed it)."""
        for item in plan.seqs:
            seq = self.scheduler.seqs.get(item.req_id)
            if seq is None or seq.req.on_progress is None or seq.status is SeqStatus.WAITING:
                continue  # no hook, finished or preempted: nothing of this step is held
            full, swa = self.cache.page_tables(seq.req_id)
            try:
                seq.req.on_progress(PrefillProgress(seq.num_computed, full, swa))
            except Exception:  # a hook must not stop the step loop: fail its request instead
                log.exception("on_progress hook of request %s failed; aborting it", seq.req_id)
                self.abort(seq.req_id)

    def _sample(self, plan, logits: torch.Tensor) -> tuple[dict[str, SampledToken], dict[str, tuple[int, ...]]]:
        """The sampled token of every sampling sequence, and for verified ones the drafts accepted before it."""
        items = [s for s in plan.seqs if s.sample]
        if not any(s.num_draft for s in items):
            return self._sample_rows([s.req_id for s in items], logits), {}
        out: dict[str, SampledToken] = {}
        accepted: dict[str, tuple[int, ...]] = {}
        plain, last, row = [], [], 0
        for s in items:
            seq = self.scheduler.seqs[s.req_id]
            params = seq.req.params
            if s.num_draft:
                drafts = s.token_ids[-s.num_draft:]
                raw = logits[row:row + s.num_draft + 1]
                rows = as_if_emitted(raw, params, seq.token_ids, seq.num_prompt, drafts)
                c = s.num_draft  # drafts to verify
                if params.grammar is not None:  # row i masked by the grammar's state after drafts[:i]
                    row_mask, applied, allowed = self.grammars.verify_bitmask(
                        ConstrainedRow(0, s.req_id, params.grammar, seq.token_ids, seq.num_prompt), drafts,
                        logits.device)
                    rows = rows.clone() if rows is raw else rows  # (raw stays unmasked: the logprobs' rows)
                    apply_mask(rows, TokenMask(row_mask, applied))
                    # a refused draft (the one after the allowed ones) is verified too: its masked row gives
                    # it probability 0, so it is rejected, as it must be for the rejection test to be exact
                    c = min(allowed + 1, s.num_draft)
                if params.greedy:
                    acc, tok = greedy_accept(rows[:c + 1].argmax(dim=-1).tolist(), drafts[:c])
                else:
                    q = torch.stack(self._draft_q.pop(s.req_id)[:c])  # (c >= 1)
                    gen = self.runner.generator(s.req_id, params, len(seq.token_ids), DRAW_VERIFY)
                    acc, tok = rejection_accept(self._probs(rows[:c + 1], params), q, drafts[:c], gen)
                if params.grammar is not None:
                    self.grammars.settle(s.req_id, len(acc), tok)
                accepted[s.req_id] = acc
                if params.logprobs is None:
                    out[s.req_id] = SampledToken(tok)
                else:  # row i is the target's distribution after the tokens before it: what MTP off reports
                    lps = token_logprobs(raw[:len(acc) + 1], [*acc, tok], [params] * (len(acc) + 1))
                    out[s.req_id] = SampledToken(tok, lps[-1], tuple(lps[:-1]))  # type: ignore[arg-type]
            else:
                plain.append(s.req_id)
                last.append(row)
            row += s.num_draft + 1
        if plain:
            out.update(self._sample_rows(plain, logits[torch.tensor(last, device=logits.device)]))
        return out, accepted

    def _draft(self, plan) -> None:
        """Run the MTP blocks over what this step committed: their KV, and the next drafts of the plain greedy
        decoding sequences (docs/mtp.md). Prefill chunks fill the blocks' KV; the last one (MTP in prefill)
        already drafts after the first token."""
        hidden, sch, page = self.runner.hidden, self.scheduler, self.config.page_size
        if hidden is None or self._kv_mtp is None:
            return
        spans: list[DraftSpan] = []
        rows: list[torch.Tensor] = []
        off = 0
        for item in plan.seqs:
            first, off = off, off + item.num_new
            seq = sch.seqs.get(item.req_id)
            if seq is None or seq.status not in (SeqStatus.RUNNING, SeqStatus.HELD):
                continue
            seq.drafts = []
            done = seq.num_computed - item.start
            self._draft_q.pop(seq.req_id, None)
            if done <= 0 or not drafts_for(seq.req.params):
                continue
            hi = item.start + done - 1
            swa = self.cache.page_tables(seq.req_id)[1]
            kv_start = kv_start_of(swa, hi, page)
            lo, h = self._ring.span(seq.req_id, item.start, hidden[first:first + done],
                                    max(seq.computed_from, kv_start))
            if lo > hi:
                continue
            # a held prefill-only request (its first token sampled) drafts for its decode worker
            # (`first_drafts`); only greedy ones: a sampled draft's distribution q stays here
            drafting = (seq.is_decoding and (self.config.speculative_in_prefill or not item.is_prefill)
                        and (seq.status is SeqStatus.RUNNING
                             or (seq.status is SeqStatus.HELD and seq.req.params.greedy)))
            spans.append(DraftSpan(seq.req_id, lo, hi, seq.token_ids, swa, kv_start, drafting))
            rows.append(h)
        if not spans:
            return
        pad = self.model_config.image_token_id or 0
        try:
            drafts = run_chain(self.runner.model, spans, rows, self._kv_mtp, self.draft_layers, pad,
                               self.runner.device, self._choose)
        finally:  # constrained drafts advanced their matchers (`_choose`): back to the verified tokens
            if self._grammars is not None:
                for span in spans:
                    self._grammars.unwind(span.req_id)
        for req_id, d in drafts.items():
            sch.seqs[req_id].drafts = d

    def _probs(self, logits: torch.Tensor, params) -> torch.Tensor:
        """The distribution a sampled request draws from (temperature, min-p, top-k, top-p), rows on the CPU."""
        n = logits.shape[0]
        dev = logits.device

        def full(v, dtype=None):
            return torch.full((n,), v, device=dev, dtype=dtype)
        return filter_logits(logits.float(), full(float(params.temperature)), full(params.top_k, torch.int64),
                             full(float(params.top_p)), full(float(params.min_p))).softmax(dim=-1).cpu()

    def _choose(self, req_ids: list[str], logits: torch.Tensor, drafts: list[list[int]]) -> list[int]:
        """One draft token per drafting row: the argmax for greedy requests; for sampled ones a draw from their
        own distribution, which is kept for the rejection test of the verify step. A request's logit bias and
        penalties apply to its drafts as to the tokens it emits (the drafts so far counted), so they agree
        with the verification more often."""
        seqs = [self.scheduler.seqs[r] for r in req_ids]
        if any(s.req.params.adjusts_logits for s in seqs):
            logits = torch.cat([as_if_emitted(logits[i:i + 1], s.req.params, [*s.token_ids, *d], s.num_prompt, ())
                                for i, (s, d) in enumerate(zip(seqs, drafts, strict=True))])
        constrained = [ConstrainedRow(i, s.req_id, s.req.params.grammar, s.token_ids, s.num_prompt)
                       for i, s in enumerate(seqs) if s.req.params.grammar is not None]
        if constrained:  # a grammar's drafts follow it: its matcher is fed the drafts so far (unwound after)
            logits = logits.clone()
            apply_mask(logits, TokenMask(*self.grammars.bitmask(constrained, len(seqs), logits.device)))
        best = logits.argmax(dim=-1).tolist()
        for i, (req_id, seq) in enumerate(zip(req_ids, seqs, strict=True)):
            params = seq.req.params
            if params.greedy:
                continue
            q = self._probs(logits[i:i + 1], params)[0]
            gen = self.runner.generator(req_id, params, len(seq.token_ids) + len(drafts[i]), DRAW_DRAFT)
            best[i] = int(torch.multinomial(q, 1, generator=gen))
            self._draft_q.setdefault(req_id, []).append(q)
        for c in constrained:
            self.grammars.feed_draft(c.req_id, best[c.row])
        return best

    def _sample_rows(self, rows: list[str], logits: torch.Tensor) -> dict[str, SampledToken]:
        if not rows:
            return {}
        seqs = [self.scheduler.seqs[r] for r in rows]
        params = [s.req.params for s in seqs]
        if all(p.plain_greedy for p in params):  # the common case: one argmax, one transfer
            return {r: SampledToken(t) for r, t in zip(rows, logits.argmax(dim=-1).tolist(), strict=True)}
        histories = [History(s.token_ids, s.num_prompt) if p.penalized else None
                     for s, p in zip(seqs, params, strict=True)]
        constrained = [ConstrainedRow(j, s.req_id, p.grammar, s.token_ids, s.num_prompt)
                       for j, (s, p) in enumerate(zip(seqs, params, strict=True)) if p.grammar is not None]
        mask = TokenMask(*self.grammars.bitmask(constrained, len(rows), logits.device)) if constrained else None
        result = self.runner.sample(logits, rows, params, [len(s.token_ids) for s in seqs], histories, mask)
        for c in constrained:
            self.grammars.accept(c.req_id, result.token_ids[c.row])
        return {r: SampledToken(t, lp) for r, t, lp in zip(rows, result.token_ids, result.logprobs, strict=True)}

    # ------------------------------------------------------------------ introspection
    def drain_kv_events(self) -> list:
        return self.cache.drain_events()

    def record_admissions(self, max_kept: int = 4096) -> None:
        """Start recording first admissions (`drain_admissions`), the newest `max_kept` kept."""
        self.scheduler.admissions = deque(maxlen=max_kept)

    def drain_admissions(self) -> list[AdmittedHit]:
        """First admissions since the last call, oldest first (empty when not recording)."""
        adm = self.scheduler.admissions
        if not adm:
            return []
        out = list(adm)
        adm.clear()
        return out

    def usage(self) -> PoolUsage:
        return self.cache.usage()

    def load(self) -> EngineLoad:
        """What this engine holds now (call on the engine thread, e.g. through AsyncEngine.call). Raises when
        part of the engine is gone (a parallel rank): the service's load loop then stops the service."""
        self.runner.check_alive()
        sch = self.scheduler
        return EngineLoad(running=len(sch.running), waiting=sch.num_waiting, usage=self.cache.usage(),
                          prompt_tokens=sch.stats.prompt_tokens, hit_tokens=sch.stats.hit_tokens,
                          preemptions=sch.stats.preemptions, cache=self.cache.cache_stats(),
                          host_hit_tokens=sch.stats.host_hit_tokens, l3_hit_tokens=sch.stats.l3_hit_tokens,
                          spec=self.spec_stats(), arrivals=sch.stats.arrivals, **self._compile_counts())

    def _compile_counts(self) -> dict:
        step = getattr(getattr(self.runner, "model", None), "compiled", None)
        if step is None:
            return {}
        return {"compiled_calls": step.compiled_calls, "eager_fallbacks": dict(step.fallbacks)}

    def spec_stats(self) -> SpecStats | None:
        """MTP speculative decoding counters (None when it is off)."""
        if not self.draft_layers:
            return None
        st = self.scheduler.stats
        hist = [*st.accept_hist, *([0] * (self.draft_layers + 1 - len(st.accept_hist)))]
        return SpecStats(st.drafted_tokens, st.accepted_tokens, tuple(hist))

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()


def load_core(model_path: str | None, config: EngineConfig | None = None,
              core_class: type[EngineCore] = EngineCore, tiny_weights: str | None = None) -> EngineCore:
    """`core_class` over libs.model.load_model(model_path) (None = built-in tiny model) and its tokenizer; a
    parallel engine over a checkpoint loads no full model: each rank reads its own shard of `model_path`."""
    from libs.model import load_model, load_tokenizer
    from libs.model.loader import checkpoint_config

    config = config or EngineConfig()
    if config.engine_mode == "mock":  # no weights: the model's config only
        from libs.model.config import ModelConfig

        model_config = checkpoint_config(model_path) if model_path is not None else ModelConfig.tiny()
        return core_class(config, None, model_config, load_tokenizer(model_path))
    if model_path is not None and config.layout.is_parallel:
        return core_class(config, None, checkpoint_config(model_path), load_tokenizer(model_path),
                          model_path=model_path)
    model, model_config = load_model(model_path, dtype=config.torch_dtype, device=config.device,
                                     tiny_weights=tiny_weights)
    return core_class(config, model, model_config, load_tokenizer(model_path))
