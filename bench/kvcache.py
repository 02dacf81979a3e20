"""KV-cache benchmark: capacity in a byte budget, hit rate vs KV budget on the conversation trace, the one
byte arena against static full/SWA splits on the conversation and the agentic trace (overlapped and sequential
replay), and the bookkeeping cost per request against a cache-disabled path.

    python -m bench.kvcache [--requests 2000] [--agentic-requests 1500] [--quick] [--out PATH]
    python -m bench.kvcache --engine-arena    # only the engine's physical arena: two pools vs one arena

Writes bench/results/kvcache.json and kvcache.png, and (--engine-arena) kvcache_engine_arena.json.
`--quick` is a smoke run (JSON under .run/bench-quick/); without the conversation trace (../shared/traces)
it leaves the figures that need it null, with the reason under "null_reasons", and a full run fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import traces
from libs.kvcache import (
    MIMO_V25_PRO,
    KVCache,
    KVCacheConfig,
    block_hashes,
    plan_arena,
    plan_pools,
    rebuild_span,
)

ROOT = Path(__file__).resolve().parent.parent
TRACE = traces.TRACE  # ../shared/traces/conversation_trace.jsonl beside the checkout (or one level up)
OUT = ROOT / "bench" / "results"
QUICK_OUT = ROOT / ".run" / "bench-quick"
BLOCK = 512  # trace block size (tokens per hash id)
PAGE = 64
WINDOW = 128
LAYOUT = MIMO_V25_PRO
FULL_PAGE_B = LAYOUT.full_page_bytes(PAGE)
SWA_PAGE_B = LAYOUT.swa_page_bytes(PAGE)
PREFILL_TOK_PER_S = 20_000.0  # timing model: uncached prompt tokens per second per request
DECODE_S_PER_TOK = 0.025  # timing model: seconds per output token
PREFILL_CHUNK = 2048
GIB = 1 << 30
# SWA window rebuild span of the MiMo-V2.5-Pro layout (what the engine sets): (60 SWA layers + 1) windows
REBUILD_TOKENS = rebuild_span(LAYOUT.swa_layers, WINDOW, PAGE)
# the headline figures (top-level keys of kvcache.json); TRACE_KEYS are the ones the conversation trace feeds
TRACE_KEYS = ("memory_efficiency_at_90pct_oracle", "memory_efficiency_arena", "us_per_request", "no_reuse_ratio",
              "no_reuse_ratio_arena")
HEADLINE_KEYS = ("capacity_ratio_to_limit", "capacity_ratio_to_limit_arena", *TRACE_KEYS,
                 "arena_over_best_static_min", "arena_over_default_min")


@dataclass(frozen=True)
class Request:
    t: float  # arrival, seconds
    prompt: tuple[int, ...]  # tuples: untracked by the GC, so the replayed trace does not slow every GC pass
    output: tuple[int, ...]


def load_trace(n: int) -> list[Request]:
    """Block id b expands to tokens b*512 .. b*512+511 (deterministic, distinct per block); the prompt is cut to
    input_length. Outputs get tokens no prompt uses, distinct per request."""
    reqs = []
    for i, row in enumerate(traces.trace_rows(n, TRACE)):
        toks: list[int] = []
        for b in row["hash_ids"]:
            toks.extend(range(b * BLOCK, (b + 1) * BLOCK))
        out0 = 3_000_000_000 + i * 65_536
        reqs.append(Request(row["timestamp"] / 1000.0, tuple(toks[:row["input_length"]]),
                            tuple(range(out0, out0 + row["output_length"]))))
    return reqs


# ---------------------------------------------------------------- serving one request through the cache API


def run_request(cache: KVCache, sid: str, req: Request, chunk: int = PREFILL_CHUNK,
                hashes: list[int] | None = None) -> tuple[bool, int]:
    """match -> admit -> chunked prefill -> decode (committed a page at a time). (admitted, hit tokens)."""
    hit = cache.match(req.prompt, block_hashes=hashes)
    res = cache.admit(sid, req.prompt, hit, len(req.output), block_hashes=hashes)
    if not res.ok:
        return False, 0
    compute(cache, sid, req, chunk)
    return True, hit.tokens


def compute(cache: KVCache, sid: str, req: Request, chunk: int) -> None:
    full = list(req.prompt + req.output)
    done, known, plen = cache.num_computed(sid), len(req.prompt), len(req.prompt)
    end = len(full) - 1  # the last sampled token's KV is never computed
    while done < end:
        limit = plen - done if done < plen else end - done
        k = min(chunk if done < plen else PAGE, limit)
        if not cache.reserve(sid, k):
            k = min(PAGE - done % PAGE, limit)  # up to the next page boundary always fits the admission promise
            assert cache.reserve(sid, k), f"{sid}: reserve of {k} tokens refused inside its promise"
        done += k
        new = full[known:min(len(full), done + 1)] if done >= plen else []
        cache.commit(sid, k, new)
        known += len(new)


def replay(cache: KVCache, reqs: list[Request]) -> dict[str, float]:
    """Requests arrive at trace times, wait FIFO for memory, and hold it for prefill + decode time."""
    running: list[tuple[float, str]] = []
    queue: list[int] = []
    hit_tokens = input_tokens = dropped = peak = 0
    t_ops = wait = 0.0
    for i, req in enumerate(reqs):
        queue.append(i)
        now = req.t
        while True:
            while running and running[0][0] <= now:
                _, sid = heapq.heappop(running)
                t0 = time.perf_counter()
                cache.finish(sid)
                t_ops += time.perf_counter() - t0
            admitted_any = False
            while queue:
                j = queue[0]
                t0 = time.perf_counter()
                ok, hit = run_request(cache, f"r{j}", reqs[j])
                t_ops += time.perf_counter() - t0
                if not ok:
                    if not running:
                        dropped += 1  # cannot fit even in an empty cache
                        queue.pop(0)
                        continue
                    break
                queue.pop(0)
                admitted_any = True
                wait += now - reqs[j].t
                hit_tokens += hit
                input_tokens += len(reqs[j].prompt)
                busy = (len(reqs[j].prompt) - hit) / PREFILL_TOK_PER_S + len(reqs[j].output) * DECODE_S_PER_TOK
                heapq.heappush(running, (now + busy, f"r{j}"))
                peak = max(peak, len(running))
            if not queue or admitted_any and not running:
                break
            if not running:
                break
            if queue and running[0][0] > (reqs[i + 1].t if i + 1 < len(reqs) else math.inf):
                break
            now = max(now, running[0][0])
    while running:
        cache.finish(heapq.heappop(running)[1])
    n = len(reqs) - dropped
    rb = cache.rebuild_stats()
    # Honest accounting: only hit.tokens (R) count as hit; a rebuild's E - R tokens are prefill work (they are
    # in the uncached prompt of the timing model above too).
    return {"hit_rate": hit_tokens / max(input_tokens, 1), "peak_running": peak, "dropped": dropped,
            "us_per_request": 1e6 * t_ops / max(n, 1), "rebuild_hits": rb.admitted,
            "rebuilt_tokens_share": rb.rebuilt_tokens / max(input_tokens, 1), "mean_wait_s": wait / max(n, 1)}


def replay_sequential(cache: KVCache, reqs: list[Request]) -> dict[str, float]:
    """One request at a time, in trace order: each is served to the end and finished before the next."""
    hit_tokens = input_tokens = dropped = 0
    t_ops = 0.0
    for j, req in enumerate(reqs):
        t0 = time.perf_counter()
        ok, hit = run_request(cache, f"r{j}", req)
        if ok:
            cache.finish(f"r{j}")
        t_ops += time.perf_counter() - t0
        if not ok:
            dropped += 1
            continue
        hit_tokens += hit
        input_tokens += len(req.prompt)
    rb = cache.rebuild_stats()
    return {"hit_rate": hit_tokens / max(input_tokens, 1), "peak_running": 1, "dropped": dropped,
            "us_per_request": 1e6 * t_ops / max(len(reqs) - dropped, 1), "rebuild_hits": rb.admitted,
            "rebuilt_tokens_share": rb.rebuilt_tokens / max(input_tokens, 1), "mean_wait_s": 0.0}


# ---------------------------------------------------------------- systems under one byte budget


def arena_cfg(budget: int, rebuild: bool = True) -> KVCacheConfig:
    """Both groups on one arena of the budget: nothing to split, nothing to tune."""
    plan = plan_arena(budget, LAYOUT, PAGE)
    return KVCacheConfig(page_size=PAGE, window=WINDOW, num_full_pages=0, num_swa_pages=0, arena_units=plan.units,
                         full_page_units=plan.full_page_units, swa_page_units=plan.swa_page_units,
                         retention="checkpoints", checkpoint_align=BLOCK,
                         rebuild_tokens=REBUILD_TOKENS if rebuild else 0)


def windserve_cfg(budget: int, retention: str, seq_tokens: int, max_running: int, ckpts: float,
                  rebuild: bool = False) -> KVCacheConfig:
    plan = plan_pools(budget, LAYOUT, PAGE, WINDOW, seq_tokens, max_running=max_running, checkpoints_per_seq=ckpts)
    return KVCacheConfig(page_size=PAGE, window=WINDOW, num_full_pages=plan.num_full_pages,
                         num_swa_pages=plan.num_swa_pages, retention=retention, checkpoint_align=BLOCK,
                         rebuild_tokens=REBUILD_TOKENS if rebuild else 0)


def single_pool_cfg(budget: int) -> KVCacheConfig:
    """Every layer keeps KV for every token: the full and SWA pools hold the same tokens, and a window longer
    than any sequence makes a hit need SWA KV for its whole prefix (a plain single-pool prefix cache)."""
    pages = budget // (FULL_PAGE_B + SWA_PAGE_B)
    return KVCacheConfig(page_size=PAGE, window=1 << 30, num_full_pages=pages, num_swa_pages=pages, retention="all")


def oracle_cfg() -> KVCacheConfig:
    return KVCacheConfig(page_size=PAGE, window=WINDOW, num_full_pages=1 << 22, num_swa_pages=1 << 22,
                         retention="all")


def budget_for(target: float, points: list[tuple[float, float]]) -> float | None:
    """Smallest budget reaching `target` hit rate, interpolated in log-budget between measured points."""
    pts = sorted(points)
    for (b0, h0), (b1, h1) in zip(pts, pts[1:], strict=False):
        if h0 >= target:
            return b0
        if h1 >= target:
            f = (target - h0) / (h1 - h0)
            return math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0)))
    return pts[-1][0] if pts and pts[-1][1] >= target else None


# ---------------------------------------------------------------- the three measurements


def capacity(budget: int = 80 * GIB, seq_tokens: int = 32 * 1024, arena: bool = False) -> dict[str, float]:
    """Concurrent 32K-token sequences admitted (and fully prefilled) in one byte budget (planner split, or the
    arena)."""
    plan = plan_pools(budget, LAYOUT, PAGE, WINDOW, seq_tokens)
    cache = KVCache(arena_cfg(budget, rebuild=False) if arena else KVCacheConfig(
        page_size=PAGE, window=WINDOW, num_full_pages=plan.num_full_pages, num_swa_pages=plan.num_swa_pages))
    n = 0
    while True:
        prompt = tuple(range(n * seq_tokens, (n + 1) * seq_tokens - 1))
        req = Request(0.0, prompt, (4_000_000_000 + n,))
        if not cache.admit(f"c{n}", prompt, cache.match(prompt), 1).ok:
            break
        compute(cache, f"c{n}", req, PAGE)
        n += 1
    cache.check_invariants()
    theory = budget / LAYOUT.sequence_bytes(seq_tokens, WINDOW)
    single = budget / ((LAYOUT.full_layers + LAYOUT.swa_layers) * LAYOUT.full_bytes_per_token_layer * seq_tokens)
    return {"budget_gib": budget / GIB, "seq_tokens": seq_tokens, "admitted": n, "theoretical_max": theory,
            "capacity_ratio_to_limit": n / theory, "single_pool_theoretical": single,
            "num_full_pages": plan.num_full_pages, "num_swa_pages": plan.num_swa_pages}


def no_reuse_overhead(reqs: list[Request], repeats: int = 15) -> dict[str, object]:
    """Same requests with unique tokens (nothing to reuse), served one at a time with the prefix cache on vs
    off; the cache fills up and evicts. "on" gets the prompt's block hashes from the caller (the gateway
    computes the chain for routing anyway); "on_hashing" makes the cache hash every page itself.

    The box is shared and its speed drifts by tens of percent within seconds, so a mode and the cache-disabled
    path run interleaved request by request (each its own cache, which goes first alternating), and each
    request's process CPU time goes to its mode: both see the same drift. Exactly two caches per pass: a third
    one in between evicts both from the CPU caches, adds the same time to each and so flatters the ratio.
    The ratio is the median over repeats."""
    uniq = []
    for i, r in enumerate(reqs):
        base = 100_000_000 + i * 262_144
        uniq.append(Request(0.0, tuple(range(base, base + len(r.prompt))), r.output))
    hashes = [tuple(block_hashes(r.prompt, PAGE)) for r in uniq]  # tuples, as the prompts: untracked by the GC
    budget = 256 * GIB
    cfg = windserve_cfg(budget, "checkpoints", 14_000, 64, 2.0, rebuild=True)
    cfg_arena = arena_cfg(budget)  # the arena: on and off both on one arena
    res: dict[str, list[float]] = {"on": [], "on_hashing": [], "off": [], "arena": [], "arena_off": []}
    ratio_of: dict[str, list[float]] = {"on": [], "on_hashing": [], "arena": []}
    for _ in range(repeats):
        for mode in ("on", "on_hashing", "arena"):
            us, us_off = _interleaved_pass(cfg_arena if mode == "arena" else cfg, uniq,
                                           None if mode == "on_hashing" else hashes)
            res[mode].append(us)
            if mode in ("on", "arena"):
                res["off" if mode == "on" else "arena_off"].append(us_off)
            ratio_of[mode].append(us / us_off)
    ratios, ratios_h, ratios_a = sorted(ratio_of["on"]), sorted(ratio_of["on_hashing"]), sorted(ratio_of["arena"])
    return {"us_per_request_cache": min(res["on"]), "us_per_request_cache_hashing": min(res["on_hashing"]),
            "us_per_request_disabled": min(res["off"]), "ratio": ratios[len(ratios) // 2],
            "ratio_hashing": ratios_h[len(ratios_h) // 2], "ratio_per_repeat": ratios, "requests": len(uniq),
            "us_per_request_arena": min(res["arena"]), "us_per_request_arena_disabled": min(res["arena_off"]),
            "ratio_arena": ratios_a[len(ratios_a) // 2], "ratio_arena_per_repeat": ratios_a,
            "budget_gib": budget / GIB,
            "measures": "match + admit + reserve/commit (2048-token prefill chunks, decode a page per commit) + "
                        "finish + drain_events, per request (process CPU time, interleaved request by request "
                        "with the cache-disabled path; median over repeats)"}


def _interleaved_pass(cfg: KVCacheConfig, reqs: list[Request], hashes: list[tuple[int, ...]] | None
                      ) -> tuple[float, float]:
    """(us per request with the prefix cache on, with it off): each request is served by both caches back to
    back, which one first alternating; the cache-on one gets the block hashes when `hashes` is given."""
    caches = [KVCache(KVCacheConfig(**{**cfg.__dict__, "enable_prefix_cache": on})) for on in (True, False)]
    spent = [0, 0]
    for i, r in enumerate(reqs):
        for k in (0, 1) if i % 2 else (1, 0):
            cache = caches[k]
            t0 = time.process_time_ns()
            ok, _ = run_request(cache, f"u{i}", r, hashes=hashes[i] if hashes is not None and k == 0 else None)
            assert ok
            cache.finish(f"u{i}")
            cache.drain_events()
            spent[k] += time.process_time_ns() - t0
    return spent[0] / 1e3 / len(reqs), spent[1] / 1e3 / len(reqs)


def hit_rate_sweep(reqs: list[Request], budgets_gib: list[float], ckpts: float) -> dict[str, object]:
    seq_tokens = int(sum(len(r.prompt) + len(r.output) for r in reqs) / len(reqs))
    t0 = time.perf_counter()
    oracle = replay(KVCache(oracle_cfg()), reqs)
    max_running = int(oracle["peak_running"])
    print(f"  oracle hit {oracle['hit_rate']:.3f}, peak running {max_running} ({time.perf_counter() - t0:.1f}s)")
    curves: dict[str, list[tuple[float, float]]] = {"windserve_arena": [], "windserve": [],
                                                    "windserve_no_rebuild": [], "single_pool": [], "tombstone": []}
    rebuilds: list[dict[str, float]] = []
    us: list[float] = []
    for gib in budgets_gib:
        b = int(gib * GIB)
        for name in curves:
            if name == "single_pool":
                cfg = single_pool_cfg(b)
            elif name == "windserve_arena":
                cfg = arena_cfg(b)
            else:
                try:
                    cfg = windserve_cfg(b, "none" if name == "tombstone" else "checkpoints", seq_tokens,
                                        max_running, ckpts, rebuild=name == "windserve")
                except ValueError:
                    continue
            r = replay(KVCache(cfg), reqs)
            curves[name].append((gib, r["hit_rate"]))
            if name == "windserve":
                us.append(r["us_per_request"])
                rebuilds.append({"budget_gib": gib, "rebuild_hits": r["rebuild_hits"],
                                 "rebuilt_tokens_share": r["rebuilt_tokens_share"]})
        print(f"  {gib:8.0f} GiB: " + "  ".join(f"{k} {v[-1][1]:.4f}" for k, v in curves.items() if v
                                                  and v[-1][0] == gib)
              + (f"  (rebuild hits {rebuilds[-1]['rebuild_hits']})" if rebuilds else ""), flush=True)
    target = 0.9 * oracle["hit_rate"]
    need = {k: budget_for(target, v) for k, v in curves.items()}

    def efficiency(name: str) -> float | None:
        return need["single_pool"] / need[name] if need["single_pool"] and need[name] else None

    return {"oracle_hit_rate": oracle["hit_rate"], "max_running": max_running, "seq_tokens_mean": seq_tokens,
            "curves": {k: [{"budget_gib": g, "hit_rate": h} for g, h in v] for k, v in curves.items()},
            "rebuild_tokens": REBUILD_TOKENS, "windserve_rebuilds": rebuilds,
            "budget_gib_for_90pct_oracle": need, "memory_efficiency_at_90pct_oracle": efficiency("windserve"),
            "memory_efficiency_no_rebuild": efficiency("windserve_no_rebuild"),
            "memory_efficiency_arena": efficiency("windserve_arena"),
            "us_per_request_trace": sum(us) / len(us) if us else None}


CKPT_SWEEP = (0.5, 1.0, 1.25, 2.0, 3.0, 5.0)  # checkpoints_per_seq of the static splits the arena is held against
DEFAULT_CKPTS = 1.25  # today's default split (the bench's --checkpoints-per-seq default)


def arena_vs_static(name: str, reqs: list[Request], budgets_gib: list[float], sequential: bool,
                    ckpts: tuple[float, ...] = CKPT_SWEEP) -> list[dict[str, Any]]:
    """Per budget: the arena's hit rate, every static split's (plan_pools at each checkpoints_per_seq, the
    running share from the oracle's peak), the best of them and today's default; the arena's cache stats."""
    run = replay_sequential if sequential else replay
    seq_tokens = int(sum(len(r.prompt) + len(r.output) for r in reqs) / len(reqs))
    max_running = 1 if sequential else int(replay(KVCache(oracle_cfg()), reqs)["peak_running"])
    rows = []
    for gib in budgets_gib:
        b = int(gib * GIB)
        t0 = time.perf_counter()
        cache = KVCache(arena_cfg(b))
        arena = run(cache, reqs)
        st, use = cache.cache_stats(), cache.usage().arena
        static: dict[str, float] = {}
        extra: dict[str, tuple[float, float]] = {}  # checkpoints_per_seq -> (peak running, mean wait s)
        for c in sorted(set(ckpts) | {DEFAULT_CKPTS}):
            try:
                cfg = windserve_cfg(b, "checkpoints", seq_tokens, max_running, c, rebuild=True)
            except ValueError:  # the peak's windows alone exceed the budget: size the running share by the mean
                cfg = windserve_cfg(b, "checkpoints", seq_tokens, 0, c, rebuild=True)
            res = run(KVCache(cfg), reqs)
            static[str(c)] = res["hit_rate"]
            extra[str(c)] = (res["peak_running"], res["mean_wait_s"])
        best_c = max(static, key=lambda k: static[k])
        best, default = static[best_c], static.get(str(DEFAULT_CKPTS))
        rows.append({"trace": name, "mode": "sequential" if sequential else "overlapped", "budget_gib": gib,
                     "arena": arena["hit_rate"], "best_static": best, "best_static_ckpts": float(best_c),
                     "default_static": default, "arena_over_best_static": arena["hit_rate"] / best if best else None,
                     "arena_over_default": arena["hit_rate"] / default if default else None,
                     "static_by_ckpts": static, "arena_us_per_request": arena["us_per_request"],
                     "arena_dropped": arena["dropped"], "arena_peak_running": arena["peak_running"],
                     "arena_mean_wait_s": arena["mean_wait_s"], "best_static_peak_running": extra[best_c][0],
                     "best_static_mean_wait_s": extra[best_c][1],
                     "arena_evictions": {k: {"victims": v[0], "freed": v[1]} for k, v in st.evictions.items()},
                     "arena_swa_lost_tokens_share": st.swa_lost_tokens / max(st.raw_hit_tokens, 1),
                     "arena_end_units": None if use is None else dataclasses.asdict(use)})
        print(f"  {name:12s} {rows[-1]['mode']:10s} {gib:6.0f} GiB: arena {arena['hit_rate']:.4f}  best static "
              f"{best:.4f} (ckpts {best_c})  default {default if default is None else round(default, 4)}  -> "
              f"{rows[-1]['arena_over_best_static']:.3f}x best  ({time.perf_counter() - t0:.1f}s)", flush=True)
    return rows


def plot(sweep: dict[str, Any] | None, path: Path, compare: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 4.8))
    labels = [f"{r['trace'][:4]} {r['mode'][:3]}\n{r['budget_gib']:.0f}G" for r in compare]
    x = range(len(compare))
    for off, key, lab in ((-0.27, "arena", "arena"), (0.0, "best_static", "best static split (ckpt sweep)"),
                          (0.27, "default_static", "default static split")):
        bx.bar([i + off for i in x], [r[key] or 0 for r in compare], width=0.27, label=lab)  # type: ignore[misc]
    bx.set_xticks(list(x), labels, fontsize=7)
    bx.set_ylabel("hit tokens / input tokens")
    bx.set_title("One arena vs static full/SWA splits")
    bx.legend(fontsize=8)
    for name, pts in (sweep or {}).get("curves", {}).items():  # (no sweep: the trace is missing)
        ax.plot([p["budget_gib"] for p in pts], [p["hit_rate"] for p in pts], marker="o", label=name)
    if sweep:
        ax.axhline(sweep["oracle_hit_rate"], color="k", ls="--", label="unlimited-memory oracle")  # type: ignore[arg-type]
    ax.set_xscale("log")
    ax.set_xlabel("KV budget (GiB, MiMo-V2.5-Pro bf16)")
    ax.set_ylabel("hit tokens / input tokens")
    ax.set_title("Prefix hit rate vs KV budget (conversation trace)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)



def engine_arena_headline(out: dict) -> dict:
    """The engine-arena figures as top-level keys: CPU of the arena over the static pools on one schedule,
    sequences run at once on the same bytes (short and long prompts), outputs equal."""
    return {"arena_cpu_ratio": out["same_schedule"]["cpu_ratio"],
            "arena_peak_running_ratio_short": out["short"]["peak_running_ratio"],
            "arena_peak_running_ratio_long": out["long"]["peak_running_ratio"],
            "arena_same_outputs": all(out[k]["same_outputs"] for k in ("short", "long", "same_schedule"))}

def engine_arena(full_pages: int = 192, swa_pages: int = 24, page: int = 16, repeats: int = 7,
                 out_path: Path = OUT / "kvcache_engine_arena.json") -> dict[str, Any]:
    """The engine's physical KV: the tiny model's engine with two static pools and with one arena of the same
    bytes. Capacity on two workloads: 32 short requests (32 + 4 tokens: SWA-bound on the static split) and 4
    long ones (400 + 4: a 400-token chunk needs more transient SWA pages than the static SWA pool has, so the
    static engine produces nothing). CPU cost on a third one both layouts schedule identically (pools large
    enough for everything: same steps, same batches): 24 prompts of 40-200 tokens + 24 greedy tokens, prefix
    cache on, then a second turn extending every first one; the two engines stepped in lockstep (`lockstep`),
    the median over `repeats` runs of the ratio of their process CPU time. Bytes are read off the allocated
    tensors (`KVPools.pool_bytes`)."""
    import statistics

    import torch

    from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
    from libs.model import load_model

    torch.set_num_threads(1)
    model, cfg = load_model(None)
    gen = torch.Generator().manual_seed(7)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, 250, (n,), generator=gen).tolist()

    workloads = {"short": [prompt(32) for _ in range(32)], "long": [prompt(400) for _ in range(4)]}
    first = [prompt(int(torch.randint(40, 200, (1,), generator=gen))) for _ in range(24)]
    out: dict[str, Any] = {"config": {"num_full_pages": full_pages, "num_swa_pages": swa_pages, "page_size": page,
                                      "model": "tiny", "max_num_seqs": 256, "max_tokens": 4, "repeats": repeats,
                                      "torch_threads": 1}}

    def run(mode: str, turns: list[list[list[int]]], n_out: int, **opts) -> tuple[dict[str, Any], dict]:
        core = EngineCore(EngineConfig(page_size=page, bucket_edges=(), kv_arena=mode == "arena", **opts), model, cfg)
        got: dict[str, list[int]] = {}
        peak = steps = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for t, prompts in enumerate(turns):
            for i, p in enumerate(prompts):
                core.add_request(Request(f"t{t}r{i}", p, SamplingParams(max_tokens=n_out, ignore_eos=True)))
            while core.has_work():
                for o in core.step():
                    got.setdefault(o.req_id, []).extend(o.new_token_ids)
                peak, steps = max(peak, len(core.scheduler.running)), steps + 1
        row = {"kv_bytes": sum(core.runner.kv.pool_bytes().values()), "pool_bytes": core.runner.kv.pool_bytes(),
               "peak_running": peak, "steps": steps, "wall_s": round(time.perf_counter() - t0, 3),
               "cpu_s": round(time.process_time() - c0, 3), "hit_tokens": core.scheduler.stats.hit_tokens}
        core.close()
        return row, got

    for name, prompts in workloads.items():
        row: dict[str, Any] = {}
        outs = {}
        for mode in ("static", "arena"):
            row[mode], outs[mode] = run(mode, [prompts], 4, num_full_pages=full_pages, num_swa_pages=swa_pages,
                                        max_num_seqs=256, max_num_batched_tokens=2048, enable_prefix_cache=False)
            print(f"  engine arena, {name} / {mode}: {row[mode]['kv_bytes']} B, peak running "
                  f"{row[mode]['peak_running']}, {row[mode]['wall_s']} s", flush=True)
        row["same_outputs"] = outs["static"] == outs["arena"]
        row["peak_running_ratio"] = row["arena"]["peak_running"] / max(row["static"]["peak_running"], 1)
        out[name] = row
    # the CPU cost: identical schedules (the second turn extends each first prompt by its output + 8 tokens),
    # the two engines stepped in lockstep, each step's process CPU time to its layout (which goes first
    # alternates): the box's speed drifts by tens of percent within seconds, so whole runs side by side do not
    # compare
    opts = dict(num_full_pages=512, num_swa_pages=256, max_num_seqs=16, max_num_batched_tokens=256)
    _, got = run("static", [first], 24, **opts)
    turns = [first, [p + got[f"t0r{i}"] + prompt(8) for i, p in enumerate(first)]]
    ratios, cpu, outs, steps = [], {"static": 0.0, "arena": 0.0}, {}, 0
    for _ in range(repeats):
        spent, outs, steps = lockstep(turns, 24, page, **opts)
        ratios.append(spent["arena"] / spent["static"])
        cpu = {m: cpu[m] + spent[m] / repeats for m in cpu}
    out["same_schedule"] = {
        "steps": steps, "cpu_s_static": round(cpu["static"], 3), "cpu_s_arena": round(cpu["arena"], 3),
        "cpu_ratio": round(statistics.median(ratios), 3), "cpu_ratios": [round(r, 3) for r in ratios],
        "same_outputs": outs["static"] == outs["arena"]}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({**engine_arena_headline(out), **out}, indent=2))
    for name in workloads:
        r = out[name]
        print(f"  engine arena, {name}: {r['static']['kv_bytes']} B static vs {r['arena']['kv_bytes']} B arena; "
              f"peak running {r['static']['peak_running']} vs {r['arena']['peak_running']}; same outputs "
              f"{r['same_outputs']}")
    r = out["same_schedule"]
    print(f"  engine arena, same schedule ({r['steps']} steps): CPU {r['cpu_s_static']:.3f} s static vs "
          f"{r['cpu_s_arena']:.3f} s arena -> {r['cpu_ratio']:.3f}x (median of {r['cpu_ratios']}); same outputs "
          f"{r['same_outputs']}")
    return out


def lockstep(turns: list[list[list[int]]], n_out: int, page: int, **opts) -> tuple[dict[str, float], dict, int]:
    """Both layouts' engines over the same turns, stepped in lockstep: (CPU seconds per layout, outputs per
    layout, steps). Raises when the schedules differ (a step count apart)."""
    from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
    from libs.model import load_model

    model, cfg = load_model(None)
    cores = {m: EngineCore(EngineConfig(page_size=page, bucket_edges=(), kv_arena=m == "arena", **opts), model, cfg)
             for m in ("static", "arena")}
    spent = {m: 0.0 for m in cores}
    got: dict[str, dict[str, list[int]]] = {m: {} for m in cores}
    steps = 0
    for t, prompts in enumerate(turns):
        for core in cores.values():
            for i, p in enumerate(prompts):
                core.add_request(Request(f"t{t}r{i}", p, SamplingParams(max_tokens=n_out, ignore_eos=True)))
        while cores["static"].has_work() or cores["arena"].has_work():
            if cores["static"].has_work() != cores["arena"].has_work():
                raise AssertionError(f"the two layouts' schedules differ at step {steps}")
            for m in (("static", "arena") if steps % 2 == 0 else ("arena", "static")):
                c0 = time.process_time()
                outs = cores[m].step()
                spent[m] += time.process_time() - c0
                for o in outs:
                    got[m].setdefault(o.req_id, []).extend(o.new_token_ids)
            steps += 1
    for core in cores.values():
        core.close()
    return spent, got, steps


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=None, help="trace prefix length (default 2000, --quick 200)")
    ap.add_argument("--checkpoints-per-seq", type=float, default=1.25,
                    help="planner share of SWA checkpoints (hit at 512 GiB: 1.1: 0.253, 1.2: 0.259, 1.25: 0.260, "
                         "1.3: 0.258, 1.5: 0.258, 2: 0.257, 3: 0.248)")
    ap.add_argument("--agentic-requests", type=int, default=None,
                    help="requests of the generated agentic trace (default 1500, --quick 200)")
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer requests, budgets and repeats")
    ap.add_argument("--engine-arena", action="store_true", help="only the engine's static pools vs one arena "
                    "(writes <out stem>_engine_arena.json)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                    "bench/results/kvcache.json, with --quick .run/bench-quick/kvcache.json")
    a = ap.parse_args(argv)
    a.requests = a.requests or (200 if a.quick else 2000)
    a.agentic_requests = a.agentic_requests or (200 if a.quick else 1500)
    a.out = a.out or (QUICK_OUT if a.quick else OUT) / "kvcache.json"
    return a


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.engine_arena:
        engine_arena(repeats=2 if args.quick else 7,
                     out_path=args.out.with_name(f"{args.out.stem}_engine_arena.json"))
        return
    reasons: dict[str, str] = {}
    if TRACE.exists() or not args.quick:
        reqs = load_trace(args.requests)
    else:  # a smoke run where the trace is not checked out (CI): the figures it feeds are null, with the reason
        reqs = []
        reasons.update(dict.fromkeys(TRACE_KEYS, f"the conversation trace is not here ({TRACE}): not measured"))
    print(f"kvcache bench: {len(reqs)} trace requests, page {PAGE}, window {WINDOW}, MiMo-V2.5-Pro bytes")
    cap = capacity()
    cap_arena = capacity(arena=True)
    print(f"  capacity: {cap['admitted']} x 32K sequences in {cap['budget_gib']:.0f} GiB, "
          f"theory {cap['theoretical_max']:.1f} -> ratio {cap['capacity_ratio_to_limit']:.3f} (arena: "
          f"{cap_arena['admitted']} -> {cap_arena['capacity_ratio_to_limit']:.3f})")
    over: dict[str, Any] | None = None
    if reqs:
        over = no_reuse_overhead(reqs[:100] if args.quick else reqs[:500], repeats=3 if args.quick else 15)
        print(f"  no-reuse: {over['us_per_request_cache']:.0f} us/request with cache "
              f"({over['us_per_request_cache_hashing']:.0f} us hashing itself), {over['us_per_request_disabled']:.0f} "
              f"us disabled -> {over['ratio']:.2f}x ({over['ratio_hashing']:.2f}x); arena "
              f"{over['us_per_request_arena']:.0f} vs {over['us_per_request_arena_disabled']:.0f} us -> "
              f"{over['ratio_arena']:.2f}x")
    # Finer around the two 90%-of-oracle crossings (windserve ~0.5-1 TiB, single pool ~2-4 TiB): the budget
    # needed is interpolated log-linearly between neighbouring points.
    budgets = [64, 256, 1024, 4096] if args.quick else [32, 64, 128, 256, 384, 448, 512, 576, 640, 768, 1024,
                                                         1536, 2048, 2560, 3072, 3584, 4096, 8192]
    sweep = hit_rate_sweep(reqs, budgets, args.checkpoints_per_seq) if reqs else None
    agentic = traces.agentic(args.agentic_requests)
    conv = reqs[:500] if args.quick else reqs
    compare: list[dict[str, Any]] = []
    for sequential in (False, True):
        compare += arena_vs_static("agentic", agentic, [4, 16] if args.quick else [4, 16, 64], sequential)  # type: ignore[arg-type]
        if conv:
            compare += arena_vs_static("conversation", conv, [64, 256] if args.quick else [64, 256, 1024],
                                       sequential)
    ratios = [r["arena_over_best_static"] for r in compare if r["arena_over_best_static"] is not None]
    ratios_d = [r["arena_over_default"] for r in compare if r["arena_over_default"] is not None]
    result = {
        "capacity_ratio_to_limit": cap["capacity_ratio_to_limit"],
        "capacity_ratio_to_limit_arena": cap_arena["capacity_ratio_to_limit"],
        "memory_efficiency_at_90pct_oracle": sweep["memory_efficiency_at_90pct_oracle"] if sweep else None,
        "memory_efficiency_arena": sweep["memory_efficiency_arena"] if sweep else None,
        "us_per_request": sweep["us_per_request_trace"] if sweep else None,
        "no_reuse_ratio": over["ratio"] if over else None,
        "no_reuse_ratio_arena": over["ratio_arena"] if over else None,
        "arena_over_best_static_min": min(ratios), "arena_over_default_min": min(ratios_d),  # type: ignore[type-var]
        "arena_over_default_max": max(ratios_d),  # type: ignore[type-var]
        "quick": args.quick,
        "trace": {"file": "shared/traces/conversation_trace.jsonl", "requests_used": len(reqs),
                  "note": f"first {len(reqs)} of 12,031 requests; block id b -> tokens b*512..b*512+511"},
        "config": {"page_size": PAGE, "window": WINDOW, "layout": LAYOUT.__dict__, "checkpoint_align": BLOCK,
                   "rebuild_tokens": REBUILD_TOKENS,
                   "checkpoints_per_seq": args.checkpoints_per_seq, "prefill_tok_per_s": PREFILL_TOK_PER_S,
                   "decode_s_per_tok": DECODE_S_PER_TOK, "prefill_chunk": PREFILL_CHUNK},
        "capacity": cap, "capacity_arena": cap_arena, "hit_rate": sweep, "no_reuse": over,
        "arena_vs_static": compare,
        "agentic_trace": {"generator": "bench.traces.agentic", "requests": len(agentic),
                          "ckpts_sweep": list(CKPT_SWEEP), "default_ckpts": DEFAULT_CKPTS},
    }
    for k in ("memory_efficiency_at_90pct_oracle", "memory_efficiency_arena"):
        if result[k] is None and k not in reasons:
            reasons[k] = ("90% of the oracle's hit rate is not reached by both this layout and the single pool "
                          f"within the budgets swept ({budgets} GiB)")
    if reasons:
        result["null_reasons"] = reasons
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(sweep, args.out.with_suffix(".png"), compare)
    if sweep:
        print(f"  oracle {sweep['oracle_hit_rate']:.4f}; budget for 90% of oracle: "
              f"{sweep['budget_gib_for_90pct_oracle']} -> memory efficiency "
              f"{sweep['memory_efficiency_at_90pct_oracle']} (no rebuild: {sweep['memory_efficiency_no_rebuild']})")
    for k, why in reasons.items():
        print(f"  {k}: null ({why})")
    print(f"  wrote {args.out} and {args.out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
