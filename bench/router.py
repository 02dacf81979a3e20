"""Router benchmark: a cluster of N real KV caches (MiMo-V2.5-Pro layout, one byte budget each) behind each
routing policy, on the conversation trace and a generated agentic trace; plus the index's decision time at
N = 32 with >= 1M indexed blocks.

    python -m bench.router [--requests 1500] [--quick] [--out PATH]

Writes bench/results/router.json (headline figures at N = 16, the worse trace, as top-level keys; the full
grid under "grid") and router.png. `--quick` is a smoke run (JSON under .run/bench-quick/); without the
conversation trace (../shared/traces) it writes every headline figure null, with the reason under
"null_reasons", and a full run fails. Figures: docs/routing.md, "Benchmark".
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.kvcache import LAYOUT, PAGE, PREFILL_CHUNK, WINDOW, compute, windserve_cfg
from bench.traces import TRACE, Request, agentic, conversation
from libs.kvcache import KVCache, KVEvent, block_hashes, rebuild_span
from libs.routing import (
    AffinityRouter,
    AffinityWeights,
    ClusterPrefixIndex,
    Fleet,
    Instance,
    LengthBuckets,
    pick_worker,
)

OUT = Path(__file__).resolve().parent / "results"
QUICK_OUT = OUT.parent.parent / ".run" / "bench-quick"
# the headline figures (top-level keys of router.json): windserve's at N = 16 on the worse trace
HEADLINE_KEYS = ("hit_ratio_to_pooled_oracle", "load_imbalance", "load_imbalance_lower_bound", "mispredicted_share",
                 "raw_overlap_mispredicted_share", "decision_p99_ms_n32_1m_blocks", "index_bytes_per_block")
GOALS = {"hit_ratio_to_pooled_oracle": ">= 0.9", "load_imbalance": "<= 1.25", "mispredicted_share": "<= 0.01",
         "decision_p99_ms_n32_1m_blocks": "<= 2"}
GIB = 1 << 30
BUDGET = 32 * GIB  # per worker
SEQ_TOKENS = 16_384  # plan_pools' typical sequence
CKPTS = 1.25
PREFILL_TOK_PER_S = 20_000.0  # timing model: one prefill at a time per worker
HOST_TOK_PER_S = 200_000.0  # host-tier tokens copied to device before the prefill
DECODE_S_PER_TOK = 0.025  # decode runs beside prefills, holding its KV
WINDOW_S = 10.0
S = rebuild_span(LAYOUT.swa_layers, WINDOW, PAGE)
POLICIES = ("random", "round_robin", "least_loaded", "raw_overlap", "windserve")


@dataclass
class Job:
    rid: int
    req: Request
    hashes: list[int]
    arrival: float
    predicted: int = -1  # -1: the policy predicts nothing


@dataclass
class Worker:
    name: str
    cache: KVCache
    lanes: int = 1
    busy: int = 0
    queue: deque[Job] = field(default_factory=deque)
    queued_tokens: int = 0  # predicted uncached tokens of the queued jobs
    decoding: int = 0
    windows: dict[int, int] = field(default_factory=dict)  # 10 s window -> prefill tokens computed


@dataclass
class Stats:
    hit: int = 0
    prompt: int = 0
    predicted: int = 0
    over: int = 0
    ttft: list[float] = field(default_factory=list)
    decide: list[float] = field(default_factory=list)
    dropped: int = 0


class Sim:
    """Event-driven: arrivals at trace times; a worker prefills one job per lane (match + admit when it
    starts, FIFO; a job that does not fit waits for a decode to finish), then decodes beside the next."""

    def __init__(self, n: int, lanes: int, budget: int, pick: Callable[[Sim, Job], Worker],
                 checkpoint_every_pages: int = 0) -> None:
        cfg = replace(windserve_cfg(budget, "checkpoints", SEQ_TOKENS, 0, CKPTS, rebuild=True),
                      checkpoint_every_pages=checkpoint_every_pages)
        self.workers = [Worker(f"w{i}", KVCache(cfg), lanes) for i in range(n)]
        self.pick = pick
        self.stats = Stats()
        self.heap: list[tuple[float, int, str, object]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.window_jobs: dict[int, list[int]] = {}  # 10 s window -> prefill tokens computed, per request

    def run(self, jobs: list[Job]) -> Stats:
        for j in jobs:
            self._at(j.arrival, "arrive", j)
        while self.heap:
            self.now, _, kind, x = heapq.heappop(self.heap)
            if kind == "arrive":
                job = x  # type: ignore[assignment]
                w = self.pick(self, job)  # type: ignore[arg-type]
                w.queue.append(job)  # type: ignore[arg-type]
                w.queued_tokens += len(job.req.prompt) - max(job.predicted, 0)  # type: ignore[union-attr]
                self._start(w)
            elif kind == "prefilled":
                w, job = x  # type: ignore[misc]
                self.on_prefilled(w, job)
                w.busy -= 1
                w.decoding += 1
                self._at(self.now + len(job.req.output) * DECODE_S_PER_TOK, "done", (w, job))
                self._start(w)
            else:
                w, job = x  # type: ignore[misc]
                w.decoding -= 1
                self.on_finished(w, job)  # (before finish, as the engine's hook: the page tables are there)
                w.cache.finish(f"r{job.rid}")
                self._start(w)
        return self.stats

    # Hooks for a shared tier beside the workers' own caches (bench.gcache's L3); the plain cluster has none.
    def remote_hit(self, w: Worker, job: Job, local_tokens: int) -> tuple[int, float]:
        """(prompt tokens a shared tier adds beyond the local hit, seconds to load them)."""
        return 0, 0.0

    def on_prefilled(self, w: Worker, job: Job) -> None:
        """A prefill finished (its prompt's KV is complete)."""

    def on_finished(self, w: Worker, job: Job) -> None:
        """A sequence finished (prompt + output), before the worker's cache takes it back."""

    def _at(self, t: float, kind: str, x: object) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, x))

    def _start(self, w: Worker) -> None:
        while w.busy < w.lanes and w.queue:
            job = w.queue[0]
            req, sid = job.req, f"r{job.rid}"
            hit = w.cache.match(req.prompt, job.hashes)
            if not w.cache.admit(sid, req.prompt, hit, len(req.output), job.hashes).ok:
                if w.decoding or w.busy:
                    return  # waits for memory
                self.stats.dropped += 1
            else:
                compute(w.cache, sid, req, PREFILL_CHUNK)  # the cache's state at finish is the same
                extra, extra_s = self.remote_hit(w, job, hit.tokens)
                uncached = len(req.prompt) - hit.tokens - extra
                dur = uncached / PREFILL_TOK_PER_S + hit.host_tokens / HOST_TOK_PER_S + extra_s
                self._account(w, job, hit.tokens + extra, uncached, dur)
                w.busy += 1
                self._at(self.now + dur, "prefilled", (w, job))
            w.queue.popleft()
            w.queued_tokens -= len(req.prompt) - max(job.predicted, 0)

    def _account(self, w: Worker, job: Job, hit: int, uncached: int, dur: float) -> None:
        st = self.stats
        st.hit += hit
        st.prompt += len(job.req.prompt)
        st.ttft.append(self.now + dur - job.arrival)
        k = int(self.now // WINDOW_S)
        w.windows[k] = w.windows.get(k, 0) + uncached
        self.window_jobs.setdefault(k, []).append(uncached)
        if job.predicted >= 0:
            st.predicted += job.predicted
            st.over += max(0, job.predicted - hit)

    def instances(self) -> tuple[Instance, ...]:
        return tuple(Instance(w.name, running=w.busy + w.decoding, waiting=len(w.queue),
                              kv_full_used=w.cache.usage().full.in_use, kv_full_total=w.cache.usage().full.capacity,
                              prefill_tokens_queued=w.queued_tokens) for w in self.workers)


# ---------------------------------------------------------------- policies


def _feed(sim: Sim, index: ClusterPrefixIndex) -> None:
    for w in sim.workers:
        events: list[KVEvent] = w.cache.drain_events()
        if events and not index.apply(w.name, events):
            raise AssertionError(f"{w.name}: event gap in an in-process simulation")


def policy(name: str, seed: int = 0) -> Callable[[Sim, Job], Worker]:
    rng = random.Random(seed)
    rr = itertools.count()
    buckets = LengthBuckets()
    router: AffinityRouter | None = None
    if name in ("raw_overlap", "windserve"):
        router = AffinityRouter(ClusterPrefixIndex(PAGE, WINDOW, S),
                                weights=AffinityWeights(credit="raw" if name == "raw_overlap" else "valid"))

    def pick(sim: Sim, job: Job) -> Worker:
        by_name = {w.name: w for w in sim.workers}
        if name == "random":
            return rng.choice(sim.workers)
        if name == "round_robin":
            return sim.workers[next(rr) % len(sim.workers)]
        if name == "least_loaded":
            return by_name[pick_worker(sim.instances(), len(job.req.prompt), buckets, str(job.rid)).instance_id]
        assert router is not None
        _feed(sim, router.index)
        fleet = Fleet(workers=sim.instances())
        t0 = time.perf_counter()
        route = router.route(fleet, str(job.rid), len(job.req.prompt), sim.now, block_hashes=job.hashes)
        sim.stats.decide.append(time.perf_counter() - t0)
        job.predicted = route.predicted_hit
        return by_name[route.prefill]

    pick.router = router  # type: ignore[attr-defined]
    return pick


# ---------------------------------------------------------------- runs and figures


def compulsory_rate(reqs: list[Request], chains: list[list[int]]) -> float:
    """Prefill tokens per second no cache can avoid: pages whose block hash no earlier request had."""
    seen: set[int] = set()
    new = 0
    for ch in chains:
        new += sum(1 for h in ch if h not in seen)
        seen.update(ch)
    span = max(r.t for r in reqs) - min(r.t for r in reqs) or 1.0
    return new * PAGE / span


def jobs_for(reqs: list[Request]) -> list[Job]:
    t0 = min(r.t for r in reqs)
    return [Job(i, r, block_hashes(r.prompt, PAGE), r.t - t0) for i, r in enumerate(reqs)]


def agentic_like(conv: list[Request], n: int) -> list[Request]:
    """The agentic trace with its session rate set so it offers the conversation trace's compulsory rate."""
    rate = compulsory_rate(conv, [block_hashes(r.prompt, PAGE) for r in conv])
    probe = agentic(n, rate_sessions_s=1.0)
    f = rate / compulsory_rate(probe, [block_hashes(r.prompt, PAGE) for r in probe])
    return agentic(n, rate_sessions_s=f)


def figures(sim: Sim, st: Stats) -> dict[str, float]:
    keys = sorted({k for w in sim.workers for k in w.windows})
    ratios, bounds = [], []
    for k in keys:
        per = [w.windows.get(k, 0) for w in sim.workers]
        if sum(per):
            mean = sum(per) / len(per)
            ratios.append(max(per) / mean)
            # No assignment of the window's requests does better: a request's prefill is not split, so the
            # busiest worker holds at least the window's largest request (and at least the mean).
            bounds.append(max(1.0, max(sim.window_jobs[k]) / mean))
    q = statistics.quantiles(st.ttft, n=10) if len(st.ttft) > 1 else [0.0] * 9
    return {"hit_tokens": st.hit, "hit_rate": st.hit / max(st.prompt, 1),
            "load_imbalance": statistics.fmean(ratios) if ratios else 1.0,
            "load_imbalance_lower_bound": statistics.fmean(bounds) if bounds else 1.0,
            "mispredicted_share": st.over / st.predicted if st.predicted else None,
            "ttft_p50_s": statistics.median(st.ttft), "ttft_p90_s": q[8],
            "decision_p99_ms": 1e3 * sorted(st.decide)[int(0.99 * (len(st.decide) - 1))] if st.decide else None,
            "dropped": st.dropped}


def run_grid(traces: dict[str, list[Request]], ns: list[int]) -> dict[str, dict[str, dict[str, object]]]:
    grid: dict[str, dict[str, dict[str, object]]] = {}
    for tname, reqs in traces.items():
        jobs = jobs_for(reqs)
        for n in ns:
            oracle = Sim(1, n, n * BUDGET, lambda s, j: s.workers[0])
            ost = oracle.run([Job(j.rid, j.req, j.hashes, j.arrival) for j in jobs])
            row: dict[str, object] = {"pooled_oracle_hit_tokens": ost.hit, "pooled_oracle_hit_rate":
                                      ost.hit / max(ost.prompt, 1)}
            for p in POLICIES:
                t0 = time.perf_counter()
                sim = Sim(n, 1, BUDGET, policy(p))
                f = figures(sim, sim.run([Job(j.rid, j.req, j.hashes, j.arrival) for j in jobs]))
                f["hit_ratio_to_pooled_oracle"] = f["hit_tokens"] / max(ost.hit, 1)
                f["sim_s"] = time.perf_counter() - t0
                row[p] = f
                print(f"[router] {tname} N={n} {p}: " + ", ".join(
                    f"{k}={v:.3g}" for k, v in f.items() if isinstance(v, float)), flush=True)
            grid.setdefault(tname, {})[str(n)] = row
    return grid


def decision_time(reqs: list[Request], n: int = 32, target: int = 1_000_000) -> dict[str, float]:
    """Route requests over an index of >= `target` (worker, block) entries spread over n workers: each trace
    request's chain (and suffixes made distinct per copy) stored on 1-3 workers, some SWA, some host tier."""
    from libs.kvcache import EventKind, Tier
    rng = random.Random(1)
    index = ClusterPrefixIndex(PAGE, WINDOW, S)
    router = AffinityRouter(index)
    ids = [0] * n
    chains = [block_hashes(r.prompt, PAGE) for r in reqs]
    copy = 0
    while index.entries() < target:
        for ch in chains:
            tail = [h ^ (copy << 1) for h in ch[len(ch) // 2:]] if copy else []
            chain = ch[:len(ch) // 2] + tail if copy else ch
            for w in rng.sample(range(n), rng.randint(1, 3)):
                held = tuple(rng.random() < 0.1 for _ in chain)
                tier = Tier.HOST if rng.random() < 0.2 else Tier.DEVICE
                index.apply(f"w{w}", [KVEvent(ids[w], EventKind.STORED, tier, tuple(chain), None, (), held)])
                ids[w] += 1
        copy += 1
    fleet = Fleet(workers=tuple(Instance(f"w{i}") for i in range(n)))
    times = []
    for i, ch in enumerate(chains * 2):
        t0 = time.perf_counter()
        router.route(fleet, f"q{i}", len(ch) * PAGE + 1, i * 0.01, block_hashes=ch)  # 100 requests/s
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"workers": n, "indexed_entries": index.entries(), "distinct_blocks": len(index),
            "decision_p50_ms": 1e3 * times[len(times) // 2], "decision_p99_ms": 1e3 * times[int(0.99 * len(times))],
            "index_bytes_per_block": index.memory_bytes() / len(index),
            "index_bytes_per_entry": index.memory_bytes() / index.entries(),
            "chain_pages_mean": statistics.fmean(len(c) for c in chains),
            "chain_pages_p99": sorted(len(c) for c in chains)[int(0.99 * (len(chains) - 1))]}


def plot(grid: dict[str, dict[str, dict[str, object]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, tname in zip(axes, grid, strict=False):
        for p in POLICIES:
            ns = sorted(grid[tname], key=int)
            ax.plot([int(n) for n in ns], [grid[tname][n][p]["hit_ratio_to_pooled_oracle"] for n in ns],  # type: ignore[index]
                    marker="o", label=p)
        ax.axhline(0.9, ls="--", c="grey", lw=0.8)
        ax.set(title=f"{tname}: cluster hit tokens / pooled oracle", xlabel="workers N", ylim=(0, 1.05))
        ax.set_xscale("log", base=2)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=None, help="requests per trace (default 1500, --quick 300)")
    ap.add_argument("--quick", action="store_true", help="300 requests, N = 8 and 16 only, a 200K-entry index")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                    "bench/results/router.json, with --quick .run/bench-quick/router.json")
    a = ap.parse_args(argv)
    n_req = a.requests or (300 if a.quick else 1500)
    ns = [8, 16] if a.quick else [8, 16, 32]
    out_path = a.out or (QUICK_OUT if a.quick else OUT) / "router.json"
    setup = {"requests_per_trace": n_req, "conversation_trace": "first requests of conversation_trace.jsonl",
             "workers": ns, "budget_gib_per_worker": BUDGET / GIB, "page": PAGE, "window": WINDOW,
             "rebuild_tokens": S, "prefill_tok_per_s": PREFILL_TOK_PER_S, "decode_s_per_tok": DECODE_S_PER_TOK,
             "arrivals": "conversation: the trace's timestamps; agentic: sessions at the rate that offers the "
                         "same compulsory (never cached) prefill tokens per second", "load_window_s": WINDOW_S,
             "quick": a.quick}
    t0 = time.perf_counter()
    if a.quick and not TRACE.exists():  # a smoke run where the trace is not checked out (CI)
        why = f"the conversation trace is not here ({TRACE}): not measured (the agentic trace derives from it too)"
        out: dict = {**dict.fromkeys(HEADLINE_KEYS), "null_reasons": dict.fromkeys(HEADLINE_KEYS, why),
                     "goals": GOALS, "setup": setup}
        grid = None
    else:
        conv = conversation(n_req)
        traces = {"conversation": conv, "agentic": agentic_like(conv, n_req)}
        grid = run_grid(traces, ns)
        dt = decision_time(conv + traces["agentic"], target=200_000 if a.quick else 1_000_000)
        head = {t: grid[t]["16"]["windserve"] for t in grid}
        worse = min(head, key=lambda t: head[t]["hit_ratio_to_pooled_oracle"])  # type: ignore[arg-type,return-value]
        h = head[worse]
        out = {
            "hit_ratio_to_pooled_oracle": h["hit_ratio_to_pooled_oracle"],  # type: ignore[index]
            "load_imbalance": max(head[t]["load_imbalance"] for t in head),  # type: ignore[type-var,index]
            # the same figure for the best assignment of each window's requests (largest request / mean): what the
            # trace itself forces, whatever the policy
            "load_imbalance_lower_bound": max(head[t]["load_imbalance_lower_bound"] for t in head),  # type: ignore[type-var,index]
            "mispredicted_share": max(head[t]["mispredicted_share"] for t in head),  # type: ignore[type-var,index]
            "raw_overlap_mispredicted_share": max(grid[t]["16"]["raw_overlap"]["mispredicted_share"]  # type: ignore[index]
                                                  for t in grid),
            "decision_p99_ms_n32_1m_blocks": dt["decision_p99_ms"],
            "index_bytes_per_block": dt["index_bytes_per_block"],
            "headline_trace": worse,
            "goals": GOALS,
            "setup": setup,
            "decision_time": dt,
            "grid": grid,
        }
    out["runtime_s"] = time.perf_counter() - t0
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(out, indent=1))
    if grid is not None:
        plot(grid, out_path.with_suffix(".png"))
    print(json.dumps({k: v for k, v in out.items() if k not in ("grid", "setup", "goals")}, indent=1))


if __name__ == "__main__":
    main()
