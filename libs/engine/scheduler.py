"""The pure scheduler: ids and counts in, a BatchPlan out. Imports no torch.

One engine step is schedule -> execute -> update:

  schedule()  decode tokens first (one per running decode sequence), then prefill chunks under
              the remaining token budget, shortest length bucket first; inside a bucket oldest
              first, with a share of the tokens for prefills shorter than the oldest (the short
              lane); admission of waiting requests goes through the KV cache (match -> admit ->
              reserve), and a failed reserve preempts the newest running sequence (recompute),
              never drops one.
  execute     (the runner, torch) copies pages between tiers, runs the model, samples.
  update()    commits the written KV to the cache, appends sampled tokens, checks stops,
              finishes sequences (insert into the prefix cache) and emits RequestOutputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from libs.buckets import BucketConfig, LengthBuckets
from libs.engine.plan import BatchPlan, ScheduledSeq
from libs.engine.request import AdmittedHit, FinishReason, Request, RequestOutput, TokenLogprob
from libs.engine.step_cost import StepCostModel
from libs.engine.stopping import check_stop
from libs.kvcache import block_hashes
from libs.nesting import composed

# Longest longer-bucket prefill chunk per step while the step cost model has no fit yet (adaptive cap).
COLD_LONG_CHUNK = 32
# Steps in a row a pending long prefill may get no token next to short work; the next step schedules it as if
# no short work were there (aging: bounded waits for long requests without taxing every short step).
LONG_STARVE_STEPS = 16


class SeqStatus(Enum):
    WAITING = "waiting"  # not holding KV (new, or preempted for recompute)
    RUNNING = "running"  # admitted into the cache; prefilling or decoding
    HELD = "held"  # prefill-only request done; KV kept until release()
    FINISHED = "finished"


@composed
@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduling policy knobs."""

    max_num_seqs: int = 64
    """Most sequences running (holding KV) at once."""
    max_num_batched_tokens: int = 512
    """Token budget of one step: decode tokens plus prefill chunk tokens."""
    buckets: BucketConfig = field(default_factory=BucketConfig)
    """The length buckets (over uncached, to-compute tokens), shared with the router."""
    served_buckets: tuple[int, ...] | None = None
    """Buckets this worker is meant for (advertised to the router), a JSON list; None or [] = all. Requests from
    other buckets are still served (the router's prediction can be off) and counted as misrouted."""
    long_prefill_share: float = 0.05
    """While a shorter-bucket request waits or prefills, longer-bucket prefill chunks may take at most
    this share of the step's tokens (and, with adaptive_long_cap, of its predicted time), so a step that
    carries a short request's first token grows by at most 1 / (1 - share). 1.0 = no cap. Long prompts
    move mostly in steps without a waiting short request (decode or long-only steps), so a small share
    costs them little."""
    long_prefill_max_tokens: int | None = None
    """Most prefill tokens of longer-bucket (bucket > 0) requests in any step, even with no short request
    waiting: a short request arriving mid-step waits for the step (or, with interruptible_steps, its
    current layer) to end; this bounds that wait at the cost of more steps for long prompts. None = only
    the step budget."""
    adaptive_long_cap: bool = True
    """Size longer-bucket prefill chunks by the measured step cost (StepCostModel) instead of token counts:
    next to a shorter request's prefill the long tokens may add at most long_prefill_share of the step's
    predicted time (the model counts each prefill chunk's own cost, so a tiny long chunk may not fit at all)
    and at most long_prefill_share of its tokens; a step without one may cost at most long_step_cost x the
    fixed step cost. Token shares are used until the model has seen enough steps."""
    interruptible_steps: bool = True
    """The caller polls for arrivals during a step (EngineCore.step(interrupt=...); AsyncEngine does), so a
    step that carries longer-bucket prefill may be stopped between layers when a short request arrives (its
    other work, e.g. decodes, is redone by the next step): plans are marked interruptible. A short arrival
    then waits for half a layer of such a step instead of all of it."""
    long_step_cost: float = 2.0
    """Most predicted cost of a step that carries longer-bucket prefill but no shorter request's first token
    (a long-only step, or decodes plus a long chunk), in fixed step costs. Larger = long prompts move faster;
    the cost: decodes in those steps get slower (time per output token up to this factor) and, without
    interruptible_steps, a short arrival waits for the whole step."""
    short_lane_share: float = 0.25
    """Inside one length bucket, when its prefill work (running chunks and waiting prompts) exceeds the step's
    remaining tokens, at most this share of them goes to the prefills with the fewest tokens left that are
    shorter than the oldest one (the short lane); the oldest gets the rest first. A short prompt that arrives
    behind long ones in the same bucket is not queued behind all of them: its first token comes within about
    len / (share x budget) steps. The oldest prefill always gets at least (1 - share) of what is left, so
    long prompts are never starved (their prefill is at most 1 / (1 - share) slower while shorter ones pass).
    0 = plain FIFO inside a bucket; with one bucket (bucket_edges []) the lane is off too."""
    admission_decode_tokens: int | None = None
    """Decode growth accounted for at admission: None = the request's whole max_tokens (a running
    sequence then never runs out of pages); a smaller number admits more requests at once and relies
    on preemption (recompute) when decode growth finds the pools full."""
    l2_backup_watermark: float = 0.125
    """Back cached device pages up to the host tier when free device pages fall below this share."""
    l2_backup_pages: int = 64
    """Most pages backed up per step."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "served_buckets", tuple(self.served_buckets) or None if self.served_buckets else None)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not 0.0 < self.long_prefill_share <= 1.0:
            raise ValueError(f"long_prefill_share must be in (0, 1], got {self.long_prefill_share}")
        if not 0.0 <= self.short_lane_share < 1.0:
            raise ValueError(f"short_lane_share must be in [0, 1), got {self.short_lane_share}")
        if not 0.0 <= self.l2_backup_watermark <= 1.0:
            raise ValueError(f"l2_backup_watermark must be in [0, 1], got {self.l2_backup_watermark}")
        if self.long_step_cost < 1.0:
            raise ValueError(f"long_step_cost must be >= 1 (fixed step costs), got {self.long_step_cost}")
        if self.long_prefill_max_tokens is not None and self.long_prefill_max_tokens < 1:
            raise ValueError(f"long_prefill_max_tokens must be None or >= 1, got {self.long_prefill_max_tokens}")
        if self.admission_decode_tokens is not None and self.admission_decode_tokens < 0:
            raise ValueError(f"admission_decode_tokens must be None or >= 0, got {self.admission_decode_tokens}")
        if self.l2_backup_pages < 0:
            raise ValueError(f"l2_backup_pages must be >= 0, got {self.l2_backup_pages}")
        if self.served_buckets is not None:
            nb = len(self.buckets.bucket_edges) + 1
            if not self.served_buckets or any(not 0 <= b < nb for b in self.served_buckets):
                raise ValueError(f"served_buckets {self.served_buckets} must name buckets in [0, {nb})")

    def long_prefill_cap(self, other_tokens: int) -> int | None:
        """Most longer-bucket prefill tokens next to `other_tokens` already in the step (None = no cap)."""
        if self.long_prefill_share >= 1.0 or other_tokens == 0:
            return None  # nothing short is in the step (e.g. short requests wait for memory): no cap
        return int(other_tokens * self.long_prefill_share / (1.0 - self.long_prefill_share))


@dataclass(eq=False)
class Seq:
    """Scheduler-side state of one request. token_ids = prompt + generated output."""

    req: Request
    token_ids: list[int]
    bucket: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV sits in the cache (mirrors the cache's sequence view)
    num_cached_tokens: int = -1  # prefix-hit tokens at first admission; -1 = not admitted yet
    admit_order: int = -1
    num_preemptions: int = 0
    # SWA window rebuild of the current admission: full KV cached up to full_from, computed from swa_from
    full_from: int = 0
    swa_from: int = 0
    finish_reason: FinishReason | None = None
    # host-tier tokens the matches of this request loaded, and of those the ones imported from GCache (L3):
    # how its first admission's hit splits across tiers (a classification probe may load them before admit)
    loaded_host: int = 0
    loaded_l3: int = 0
    # MTP speculative decoding: draft tokens for the next decode step (never part of token_ids: hashing, the
    # cache and the outputs see only verified tokens), and the first position this admission computed (KV
    # below it is the prefix cache's: the drafter never writes there)
    drafts: list[int] = field(default_factory=list)
    computed_from: int = 0
    # tokens left to compute as last classified (prompt minus the prefix hit then): the short lane's key while waiting
    uncached: int = 0
    # xxhash chain of token_ids' full pages, computed once per length and handed to every match/admit
    _hashes: list[int] = field(default_factory=list)
    _hashed_len: int = -1
    num_prompt: int = field(init=False)  # len(req.prompt_token_ids), read several times per step
    req_id: str = field(init=False)  # req.req_id (a plain attribute: read several times per sequence per step)

    def __post_init__(self) -> None:
        self.num_prompt = len(self.req.prompt_token_ids)
        self.req_id = self.req.req_id

    def block_hashes(self, page_size: int, seed: int) -> list[int]:
        if self._hashed_len != len(self.token_ids):
            self._hashes = block_hashes(self.token_ids, page_size, seed)
            self._hashed_len = len(self.token_ids)
        return self._hashes

    @property
    def num_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        # The newest token was sampled and has no KV yet; everything before it is computed.
        return self.num_computed == len(self.token_ids) - 1 and len(self.token_ids) > self.num_prompt

    @property
    def remaining_new_tokens(self) -> int:
        return max(1, self.req.params.max_tokens - (len(self.token_ids) - self.num_prompt))


class SampledToken(NamedTuple):
    token_id: int
    logprob: TokenLogprob | None = None
    # a verify step: the logprob entries of the accepted drafts before token_id, one per accepted draft (empty
    # when the request asks for no logprobs)
    accepted_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class SchedulerStats:
    preemptions: int = 0
    misrouted: int = 0
    backed_up_pages: int = 0
    loaded_pages: int = 0
    admitted: int = 0
    arrivals: int = 0  # requests queued since start (a decode engine: also remote ones at their reservation)
    hit_tokens: int = 0
    host_hit_tokens: int = 0  # of hit_tokens, loaded from the host tier (L2) ...
    l3_hit_tokens: int = 0  # ... or imported from GCache (L3) into it and loaded from there
    prompt_tokens: int = 0
    drafted_tokens: int = 0  # MTP draft tokens verified
    accepted_tokens: int = 0  # of which accepted
    # verify steps by accepted drafts: accept_hist[m] = steps that accepted m drafts (emitted m + 1 tokens)
    accept_hist: list[int] = field(default_factory=list)

    def observe_verify(self, drafted: int, accepted: int) -> None:
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accept_hist) <= accepted:
            self.accept_hist.extend([0] * (accepted + 1 - len(self.accept_hist)))
        self.accept_hist[accepted] += 1


@dataclass
class _StepState:
    budget: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    scheduled_ids: set[str] = field(default_factory=set)
    preempted: list[str] = field(default_factory=list)
    load_copies: list = field(default_factory=list)
    num_tokens: int = 0
    long_cap: int | None = None  # cap on this bucket's prefill tokens (None = none)
    long_tokens: int = 0  # this bucket's prefill tokens so far
    attn_pairs: int = 0  # sum of q_len * kv_len over the scheduled sequences (step cost model input)
    long_budget_s: float | None = None  # predicted seconds this bucket's prefill chunks may still add
    long_seqs: int = 0  # scheduled sequences that are longer-bucket prefill chunks
    prefill_seqs: int = 0  # scheduled chunks of more than one token (step cost model input)
    admit_blocked: bool = False  # this bucket's oldest waiting request was not admitted (FIFO admission stops)


class Scheduler:
    """Continuous batching with chunked prefill over a libs.kvcache.KVCache.

    `cache` is the pure KV cache; `decode` (token ids -> text) is needed only for stop strings;
    `eos_token_ids` finish a request unless its params say ignore_eos.
    """

    def __init__(self, config: SchedulerConfig, cache, *, eos_token_ids: Sequence[int] = (),
                 decode: Callable[[list[int]], str] | None = None) -> None:
        self.config = config
        self.cache = cache
        self.buckets = LengthBuckets(config.buckets.bucket_edges)
        self.eos_token_ids = tuple(eos_token_ids)
        self.decode = decode
        self.seqs: dict[str, Seq] = {}
        self.waiting: list[deque[Seq]] = [deque() for _ in range(self.buckets.num_buckets)]
        self.running: list[Seq] = []
        self.stats = SchedulerStats()
        # first admissions and their hits, for the worker's hit reports; None = nobody reads them
        self.admissions: deque[AdmittedHit] | None = None
        # called with a sequence that finishes into the prefix cache, right before cache.finish (its pages still
        # its own): the GCache write-back copies its KV out here (libs/engine/gcache_tier.py)
        self.on_finish: Callable[[Seq], None] | None = None
        # called with a generating sequence each time its computed tokens cross a multiple of `progress_every`
        # (after the commit): the GCache write-back of running sequences, so a stream that migrates finds its
        # prefix in L3 (libs/worker/gcache.py)
        self.on_progress: Callable[[Seq], None] | None = None
        self.progress_every = 0
        self._admit_counter = 0
        self._pending_outputs: list[RequestOutput] = []
        self._probe_loads: list = []  # load copies of classification probes, for the next plan
        self.cost = StepCostModel()
        self._long_starved = 0  # steps in a row in which pending long prefill got no token
        # buckets whose oldest waiting request found no KV room at its latest try: until it is admitted the short
        # lane admits nobody there (shorter requests must not keep taking the pages it waits for)
        self._head_blocked: set[int] = set()

    # ----------------------------------------------------------------- requests
    def add_request(self, req: Request) -> None:
        if req.req_id in self.seqs:
            raise ValueError(f"request id {req.req_id!r} is already in the engine")
        if req.params.stop and self.decode is None:
            raise ValueError(f"request {req.req_id!r} has stop strings but the engine has no tokenizer")
        seq = Seq(req, req.start_token_ids, bucket=0)  # (resumed: computed as a preempted one's outputs)
        seq.bucket = self._classify(seq)
        served = self.config.served_buckets
        if served is not None and seq.bucket not in served:
            self.stats.misrouted += 1
        self.seqs[req.req_id] = seq
        self.waiting[seq.bucket].append(seq)
        self.stats.arrivals += 1

    def abort(self, req_id: str) -> bool:
        """Drop a request at any point; frees every page it held. False if unknown/finished."""
        seq = self.seqs.get(req_id)
        if seq is None:
            return False
        if seq.status is SeqStatus.WAITING:
            self.waiting[seq.bucket].remove(seq)
        elif seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.cache.abort(req_id)
        elif seq.status is SeqStatus.HELD:
            self.cache.abort(req_id)
        self._finish(seq, FinishReason.ABORT)
        self._pending_outputs.append(self._output(seq, (), None))
        return True

    def release(self, req_id: str, cache: bool = True) -> None:
        """End a held prefill-only request: insert its KV into the prefix cache (or free it)."""
        seq = self.seqs.get(req_id)
        if seq is None or seq.status is not SeqStatus.HELD:
            raise KeyError(f"release({req_id!r}): no prefill-only request holds KV under that id")
        if cache and self.on_finish is not None:
            self.on_finish(seq)
        self.cache.finish(req_id, cache=cache)
        del self.seqs[req_id]
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return (bool(self.running) or any(self.waiting) or bool(self._pending_outputs)
                or bool(self._probe_loads))

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting)

    # ----------------------------------------------------------------- schedule
    def schedule(self) -> BatchPlan:
        backups = self._maybe_backup()
        st = _StepState(budget=self.config.max_num_batched_tokens)
        st.load_copies, self._probe_loads = self._probe_loads, []
        self._schedule_decodes(st)
        self._schedule_prefills(st)
        if st.long_seqs:
            self._long_starved = 0
        elif self._long_pending():
            self._long_starved += 1
        return BatchPlan(tuple(st.scheduled), tuple(st.load_copies), tuple(backups), tuple(st.preempted),
                         num_tokens=st.num_tokens, attn_pairs=st.attn_pairs, num_prefill_seqs=st.prefill_seqs,
                         interruptible=self.config.interruptible_steps and st.long_seqs > 0)

    def _schedule_decodes(self, st: _StepState) -> None:
        for seq in list(self.running):
            if st.budget == 0:
                return
            if seq.status is not SeqStatus.RUNNING or not seq.is_decoding:
                continue
            k = min(len(seq.drafts), seq.remaining_new_tokens - 1, st.budget - 1) if seq.drafts else 0
            if k > 0 and self.cache.reserve(seq.req_id, 1 + k, evict=False):
                # speculation never preempts nor evicts: without free pages for the drafts the step decodes one
                # token (a prefix-cache page evicted for a draft that is then rejected would be lost for nothing)
                self._add_scheduled(seq, 1, st, drafts=seq.drafts[:k])
            elif self._reserve(seq, 1, st):
                self._add_scheduled(seq, 1, st)
            elif seq.status is SeqStatus.RUNNING:
                self._preempt_or_fail(seq, st)

    def _schedule_prefills(self, st: _StepState) -> None:
        prefilling: list[list[Seq]] = [[] for _ in range(self.buckets.num_buckets)]
        for s in self.running:
            if not s.is_decoding:
                prefilling[s.bucket].append(s)
        for bucket in range(self.buckets.num_buckets):
            # a long prefill starved for LONG_STARVE_STEPS steps is scheduled as if no short work were there
            shorter_waiting = self._shorter_work_exists(bucket) and self._long_starved < LONG_STARVE_STEPS
            st.long_cap = self.config.long_prefill_cap(st.num_tokens) if shorter_waiting else None
            st.long_tokens = 0
            st.long_budget_s = self._long_budget(bucket, shorter_waiting, st)
            st.admit_blocked = False
            lane = self._short_lane(prefilling[bucket], bucket, st)
            if lane is not None:
                self._serve_lane(*lane, bucket, shorter_waiting, st)
            if not self._serve_fifo(prefilling[bucket], bucket, shorter_waiting, st):
                return

    def _serve_fifo(self, prefilling: list[Seq], bucket: int, shorter_waiting: bool, st: _StepState) -> bool:
        """The bucket's prefills oldest first: running chunks, then admissions in arrival order until one fails.
        False = the step's budget is spent (no later bucket gets anything)."""
        for seq in prefilling:
            if st.budget == 0:
                return False
            self._serve_running(seq, bucket, shorter_waiting, st)
        if st.preempted or st.admit_blocked:
            return True  # memory is short: do not admit new work in a step that preempted
        queue = self.waiting[bucket]
        while queue and st.budget > 0:
            if not self._serve_waiting(queue[0], bucket, shorter_waiting, st):
                break
        return True

    def _serve_running(self, seq: Seq, bucket: int, shorter_waiting: bool, st: _StepState) -> None:
        """Schedule the next chunk of a running prefill (not if it is already in this step)."""
        if st.budget == 0 or seq.req_id in st.scheduled_ids or seq.status is not SeqStatus.RUNNING:
            return
        chunk = self._chunk_size(seq.num_to_compute, bucket, shorter_waiting, st, seq.num_computed)
        if chunk <= 0:
            return
        if self._reserve(seq, chunk, st):
            self._add_scheduled(seq, chunk, st, long=bucket > 0)
        elif not st.scheduled and self.running == [seq]:
            self._alone_without_room(seq, chunk, bucket, st)

    def _serve_waiting(self, seq: Seq, bucket: int, shorter_waiting: bool, st: _StepState) -> bool:
        """Admit a waiting request with its first chunk; False = not admitted (admission stops)."""
        if st.preempted or len(self.running) >= self.config.max_num_seqs or st.budget == 0:
            return False
        return self._admit(seq, bucket, shorter_waiting, st)

    def _short_lane(self, prefilling: list[Seq], bucket: int,
                    st: _StepState) -> tuple[Seq, list[Seq], int] | None:
        """(oldest, lane, tokens): the bucket's oldest prefill, the shorter ones that get `tokens` of the step
        before the oldest's followers, fewest tokens left first; None = plain FIFO this step (no lane, nothing
        shorter than the oldest, or the step's remaining budget holds all of the bucket's prefill work)."""
        share = self.config.short_lane_share
        if share == 0.0 or self.buckets.num_buckets == 1:
            return None
        work = [s for s in prefilling if s.status is SeqStatus.RUNNING and s.req_id not in st.scheduled_ids]
        work += self.waiting[bucket]
        if len(work) < 2 or (bucket in self._head_blocked and work[0].status is SeqStatus.WAITING):
            return None
        left = {s.req_id: self._tokens_left(s) for s in work}
        if sum(left.values()) <= st.budget:
            return None  # no contention: FIFO serves everything
        oldest = work[0]
        admit = bucket not in self._head_blocked
        lane = sorted((s for s in work[1:] if left[s.req_id] < left[oldest.req_id]
                       and (admit or s.status is SeqStatus.RUNNING)), key=lambda s: left[s.req_id])
        tokens = min(int(share * st.budget), sum(left[s.req_id] for s in lane))
        return (oldest, lane, tokens) if lane and tokens > 0 else None

    @staticmethod
    def _tokens_left(seq: Seq) -> int:
        return seq.num_to_compute if seq.status is SeqStatus.RUNNING else seq.uncached

    def _serve_lane(self, oldest: Seq, lane: list[Seq], tokens: int, bucket: int, shorter_waiting: bool,
                    st: _StepState) -> None:
        """The oldest prefill first, with all but the lane's tokens; then the lane within its tokens. The FIFO
        pass after it hands out what is left (the lane's tokens included, if its requests needed fewer)."""
        st.budget -= tokens
        self._serve_one(oldest, bucket, shorter_waiting, st)
        rest = st.budget
        st.budget = tokens
        for seq in lane:
            if st.budget == 0:
                break
            if not self._serve_one(seq, bucket, shorter_waiting, st) or st.admit_blocked:
                break
        st.budget += rest

    def _serve_one(self, seq: Seq, bucket: int, shorter_waiting: bool, st: _StepState) -> bool:
        """A running prefill's chunk or a waiting request's admission; False = a waiting request not admitted (and
        then, if it was the bucket's oldest waiting one, no other is admitted this step: FIFO admission)."""
        if seq.status is SeqStatus.RUNNING:
            self._serve_running(seq, bucket, shorter_waiting, st)
            return True
        if self._serve_waiting(seq, bucket, shorter_waiting, st):
            return True
        if self.waiting[bucket] and self.waiting[bucket][0] is seq:
            st.admit_blocked = True
        return False

    def _long_pending(self) -> bool:
        """Is a longer-bucket request waiting or still prefilling?"""
        if self.buckets.num_buckets == 1:
            return False
        return (any(self.waiting[b] for b in range(1, self.buckets.num_buckets))
                or any(s.bucket > 0 and not s.is_decoding for s in self.running))

    def _shorter_work_exists(self, bucket: int) -> bool:
        """Is a request from a shorter bucket waiting or still prefilling?"""
        if bucket == 0:
            return False
        if any(self.waiting[b] for b in range(bucket)):
            return True
        return any(s.bucket < bucket and not s.is_decoding for s in self.running)

    def _long_budget(self, bucket: int, shorter_waiting: bool, st: _StepState) -> float | None:
        """Seconds longer-bucket prefill may add to this step (None = no time bound; see adaptive_long_cap)."""
        fit = self.cost.fit
        if bucket == 0 or not self.config.adaptive_long_cap or fit is None:
            return None  # (before the model has a fit, _chunk_size applies COLD_LONG_CHUNK instead)
        share = self.config.long_prefill_share
        if share >= 1.0:
            return None
        if shorter_waiting and st.num_tokens > 0:
            return share * fit.predict(st.num_tokens, st.attn_pairs, st.prefill_seqs)
        # no first token waits in this step (at most decodes are in it): a short request arriving meanwhile
        # waits for one layer of it (interruptible steps) or for all of it
        return (self.config.long_step_cost - 1.0) * fit.fixed

    def _chunk_size(self, to_compute: int, bucket: int, shorter_waiting: bool, st: _StepState,
                    prefix: int) -> int:
        chunk = min(to_compute, st.budget)
        if bucket > 0 and self.config.long_prefill_max_tokens is not None:
            chunk = min(chunk, self.config.long_prefill_max_tokens - st.long_tokens)
        if bucket > 0 and st.long_budget_s is not None and self.cost.fit is not None:
            chunk = self.cost.fit.max_chunk(st.long_budget_s, prefix, max(chunk, 0))
        if bucket > 0 and shorter_waiting and st.long_cap is not None:
            # the token share also bounds the time-based chunk: a poor early fit cannot put a big long chunk
            # next to a short request's prefill
            chunk = min(chunk, st.long_cap - st.long_tokens)
        if bucket > 0 and self.config.adaptive_long_cap and self.cost.fit is None:
            # cold start: no step cost measured yet, so keep long chunks small until there is
            chunk = min(chunk, COLD_LONG_CHUNK - st.long_tokens)
        if (bucket > 0 and chunk <= 0 and st.long_tokens == 0 and min(to_compute, st.budget) > 0
                and (st.num_tokens == 0 or self._long_starved >= LONG_STARVE_STEPS)):
            chunk = 1  # a step with nothing else in it, or a starved long prefill, moves forward whatever the fit
        return chunk

    def _admit(self, seq: Seq, bucket: int, shorter_waiting: bool, st: _StepState) -> bool:
        """Try to admit the head of a waiting queue; False stops admission from this queue."""
        hashes = self._hashes(seq)
        hit = self.cache.match(seq.token_ids, hashes)
        # A host-tier hit is on device pages in the cache's books from now on, admitted or not:
        # its copies must run whatever happens next.
        st.load_copies.extend(hit.load_copies)
        self.stats.loaded_pages += len(hit.load_copies)
        seq.loaded_host += hit.host_tokens
        seq.loaded_l3 += hit.l3_tokens
        actual_bucket = self.buckets.classify(len(seq.token_ids) - hit.tokens)
        chunk = self._chunk_size(len(seq.token_ids) - hit.tokens, actual_bucket, shorter_waiting, st, hit.tokens)
        if chunk <= 0:
            self.cache.release_hit(hit)
            return False
        growth = seq.remaining_new_tokens
        if self.config.admission_decode_tokens is not None:
            growth = min(growth, self.config.admission_decode_tokens)
        result = self.cache.admit(seq.req_id, seq.token_ids, hit, growth, block_hashes=hashes)
        head = self.waiting[bucket][0] is seq
        if not result.ok:
            if head:
                self._head_blocked.add(bucket)
            return False
        if head:
            self._head_blocked.discard(bucket)
        self.waiting[bucket].remove(seq)  # (the head, except for the short lane's admissions)
        seq.status = SeqStatus.RUNNING
        seq.bucket = actual_bucket
        seq.num_computed = seq.computed_from = hit.tokens
        # (rebuild hits and the tokens they recompute are counted by the cache: cache.rebuild_stats())
        seq.full_from, seq.swa_from = (hit.full_tokens, hit.tokens) if hit.is_rebuild else (0, 0)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = hit.tokens
            self.stats.hit_tokens += hit.tokens
            l3 = min(seq.loaded_l3, hit.tokens)
            self.stats.l3_hit_tokens += l3
            self.stats.host_hit_tokens += min(seq.loaded_host, hit.tokens) - l3
            self.stats.prompt_tokens += seq.num_prompt
            if self.admissions is not None:
                self.admissions.append(AdmittedHit(seq.req_id, seq.num_prompt, hit.tokens))
        self.stats.admitted += 1
        seq.admit_order = self._admit_counter
        self._admit_counter += 1
        self.running.append(seq)
        if self._reserve(seq, chunk, st):
            self._add_scheduled(seq, chunk, st, long=actual_bucket > 0)
        return True

    def _reserve(self, seq: Seq, num_new: int, st: _StepState) -> bool:
        """Reserve pages for seq's next num_new tokens, preempting newer unscheduled sequences."""
        while not self.cache.reserve(seq.req_id, num_new):
            victim = self._pick_victim(seq, st)
            if victim is None:
                return False
            self._preempt(victim, st)
        return True

    def _pick_victim(self, seq: Seq, st: _StepState) -> Seq | None:
        candidates = [s for s in self.running if s is not seq and s.req_id not in st.scheduled_ids]
        return max(candidates, key=lambda s: s.admit_order, default=None)

    def _preempt(self, seq: Seq, st: _StepState) -> None:
        """Free seq's KV and requeue it at the front for recompute; its output so far is kept."""
        self.cache.abort(seq.req_id)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        seq.drafts = []
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        seq.bucket = self._classify(seq)
        self.waiting[seq.bucket].appendleft(seq)
        st.preempted.append(seq.req_id)

    def _preempt_or_fail(self, seq: Seq, st: _StepState) -> None:
        """seq cannot get pages even after preempting every other candidate."""
        if st.scheduled or len(self.running) > 1:
            self._preempt(seq, st)  # the others will finish and free memory
        else:
            self._fail_capacity(seq)

    def _alone_without_room(self, seq: Seq, chunk: int, bucket: int, st: _StepState) -> None:
        """seq runs alone and its prefill chunk found no room: a chunk longer than a page takes transient SWA
        pages for its own keys from memory nobody was promised, which a full SWA pool or arena does not have,
        so shrink it to the tokens up to the next page boundary (the admission promise covers those); only
        when even that fails can seq never fit."""
        page = self.cache.cfg.page_size
        small = min(chunk, page - seq.num_computed % page)
        if small < chunk and self.cache.reserve(seq.req_id, small):
            self._add_scheduled(seq, small, st, long=bucket > 0)
        else:
            self._fail_capacity(seq)

    def _fail_capacity(self, seq: Seq) -> None:
        """Alone in the engine and still no room: it can never fit. Finish it explicitly (length)."""
        self.running.remove(seq)
        self.cache.abort(seq.req_id)
        self._finish(seq, FinishReason.LENGTH)
        self._pending_outputs.append(self._output(seq, (), None))

    def _add_scheduled(self, seq: Seq, num_new: int, st: _StepState, long: bool = False,
                       drafts: Sequence[int] = ()) -> None:
        start = seq.num_computed
        full, swa = self.cache.page_tables(seq.req_id)
        end = start + num_new
        n = len(seq.token_ids)
        # (is_decoding inlined: this runs for every sequence of every step)
        rebuild = start < seq.full_from
        is_prefill = not (start == n - 1 and n > seq.num_prompt)
        tokens = tuple(seq.token_ids[start:end])
        if drafts:
            tokens += tuple(drafts)
            num_new += len(drafts)
            end += len(drafts)
        st.scheduled.append(ScheduledSeq(
            seq.req_id, start, tokens, is_prefill,
            end - len(drafts) == n, full, swa, seq.full_from if rebuild else 0, seq.swa_from if rebuild else 0,
            len(drafts)))
        st.prefill_seqs += num_new > 1  # (a 1-token chunk shares the decode rows' attention block)
        st.scheduled_ids.add(seq.req_id)
        st.budget -= num_new
        st.num_tokens += num_new
        st.attn_pairs += num_new * end
        if long:
            st.long_seqs += 1
            st.long_tokens += num_new
            if st.long_budget_s is not None and self.cost.fit is not None:
                st.long_budget_s -= self.cost.fit.chunk_cost(num_new, start)

    def _maybe_backup(self) -> list:
        cfg = self.config
        usage = self.cache.usage()
        if usage.host_full.capacity == 0 or cfg.l2_backup_pages == 0:
            return []
        low = any(p.free < cfg.l2_backup_watermark * p.capacity for p in (usage.full, usage.swa))
        if not low:
            return []
        copies = self.cache.backup_to_host(cfg.l2_backup_pages)
        self.stats.backed_up_pages += len(copies)
        return copies

    def _hashes(self, seq: Seq) -> list[int]:
        return seq.block_hashes(self.cache.cfg.page_size, self.cache.cfg.hash_seed)

    def _classify(self, seq: Seq) -> int:
        """Bucket by uncached tokens: probe the prefix cache and give the hit back at once.

        A probe that hits the host tier has already moved those nodes to device pages in the
        cache's books, so its load copies must still run: they join the next plan."""
        hit = self.cache.match(seq.token_ids, self._hashes(seq))
        self._probe_loads.extend(hit.load_copies)
        self.stats.loaded_pages += len(hit.load_copies)
        seq.loaded_host += hit.host_tokens
        seq.loaded_l3 += hit.l3_tokens
        self.cache.release_hit(hit)
        seq.uncached = len(seq.token_ids) - hit.tokens
        return self.buckets.classify(seq.uncached)

    def observe_step(self, plan: BatchPlan, seconds: float) -> None:
        """Feed the measured execute time of a plan to the step cost model (see adaptive_long_cap)."""
        if plan.seqs:
            self.cost.observe(plan.num_tokens, plan.attn_pairs, seconds, plan.num_prefill_seqs)

    # ----------------------------------------------------------------- update
    def update(self, plan: BatchPlan, sampled: dict[str, SampledToken],
               accepted: Mapping[str, Sequence[int]] | None = None) -> list[RequestOutput]:
        """Commit the step's KV, append sampled tokens, finish what stopped; outputs per request.

        `accepted`: per verified sequence (num_draft > 0), its leading draft tokens the verification accepted
        (the sampled token follows them); the KV of the rejected drafts is rolled back."""
        outputs, self._pending_outputs = self._pending_outputs, []
        for item in plan.seqs:
            seq = self.seqs.get(item.req_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted between schedule and update
            if item.num_draft:
                acc = accepted.get(item.req_id, ()) if accepted else ()
                outputs.append(self._accept(seq, item, acc, sampled[item.req_id]))
                continue
            # The cache already knows the tokens whose KV was written; it is told the sampled one.
            tok = sampled[item.req_id] if item.sample else None
            self.cache.commit(seq.req_id, item.num_new, () if tok is None else (tok.token_id,))
            seq.num_computed += item.num_new
            if self.on_progress is not None:
                self._progressed(seq, item.num_new)
            if tok is not None:
                outputs.append(self._append_token(seq, tok))
        return outputs

    def _accept(self, seq: Seq, item: ScheduledSeq, accepted: Sequence[int], tok: SampledToken) -> RequestOutput:
        """A verify step: emit the accepted drafts and the sampled token up to the first stop (with their
        logprob entries, when asked for), commit the KV of the positions that hold verified tokens and free the
        pages reserved for the rejected ones (their K/V sits past num_computed: no attention reads it, and the
        next step overwrites it)."""
        sampled = tok.token_id
        if len(accepted) > item.num_draft:
            raise ValueError(f"{seq.req_id}: {len(accepted)} accepted drafts of {item.num_draft}")
        self.stats.observe_verify(item.num_draft, len(accepted))
        first = len(seq.token_ids)
        reason = None
        for t in (*accepted, sampled):
            seq.token_ids.append(t)
            reason = check_stop(seq.token_ids, seq.num_prompt, seq.req.params, self.eos_token_ids, self.decode)
            if reason is not None:
                break
        new = tuple(seq.token_ids[first:])
        # KV is valid for the sequence's last token and the accepted drafts that were emitted before a stop
        n_kv = item.num_new - item.num_draft + len(new) - 1
        self.cache.commit(seq.req_id, n_kv, new)
        seq.num_computed += n_kv
        self.cache.trim(seq.req_id)
        if self.on_progress is not None:
            self._progressed(seq, n_kv)
        if reason is not None:
            self._finish_into_cache(seq, reason)
        logprobs = None
        if tok.logprob is not None:
            if len(tok.accepted_logprobs) != len(accepted):
                raise ValueError(f"{seq.req_id}: {len(tok.accepted_logprobs)} logprob entries for "
                                 f"{len(accepted)} accepted drafts")
            logprobs = (*tok.accepted_logprobs, tok.logprob)[:len(new)]
        return self._output(seq, new, logprobs)

    def _progressed(self, seq: Seq, n: int) -> None:
        """Call `on_progress` when a generating sequence's computed tokens crossed a multiple of `progress_every`."""
        every, done = self.progress_every, seq.num_computed
        if every > 0 and done > seq.num_prompt and done // every > (done - n) // every:
            self.on_progress(seq)  # type: ignore[misc]

    def _append_token(self, seq: Seq, tok: SampledToken) -> RequestOutput:
        seq.token_ids.append(tok.token_id)
        logprobs = None if tok.logprob is None else (tok.logprob,)
        if seq.req.prefill_only:
            self.running.remove(seq)
            seq.status = SeqStatus.HELD
            seq.finish_reason = FinishReason.PREFILLED
            return self._output(seq, (tok.token_id,), logprobs)
        reason = check_stop(seq.token_ids, seq.num_prompt, seq.req.params, self.eos_token_ids, self.decode)
        if reason is not None:
            self._finish_into_cache(seq, reason)
        return self._output(seq, (tok.token_id,), logprobs)

    def _finish_into_cache(self, seq: Seq, reason: FinishReason) -> None:
        self.running.remove(seq)
        if self.on_finish is not None:
            self.on_finish(seq)
        self.cache.finish(seq.req_id, cache=True)
        self._finish(seq, reason)

    def _finish(self, seq: Seq, reason: FinishReason) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.req_id, None)

    def _output(self, seq: Seq, new_ids: tuple[int, ...], logprobs) -> RequestOutput:
        return RequestOutput(
            req_id=seq.req_id, new_token_ids=new_ids, logprobs=logprobs,
            finished=seq.finish_reason is not None, finish_reason=seq.finish_reason,
            num_cached_tokens=max(seq.num_cached_tokens, 0))

    def check_invariants(self) -> None:
        """Scheduler bookkeeping is consistent with itself and with the cache."""
        ids_running = {s.req_id for s in self.running}
        assert len(ids_running) == len(self.running), "a sequence appears twice in running"
        assert len(self.running) <= self.config.max_num_seqs, "running set exceeds max_num_seqs"
        for s in self.running:
            assert s.status is SeqStatus.RUNNING, f"{s.req_id} in running with status {s.status}"
            assert 0 <= s.num_computed < len(s.token_ids), f"{s.req_id}: num_computed out of range"
        for q in self.waiting:
            for s in q:
                assert s.status is SeqStatus.WAITING and s.num_computed == 0, f"{s.req_id} bad waiting state"
        self.cache.check_invariants()
