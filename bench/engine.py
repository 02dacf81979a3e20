"""Engine benchmark: every figure is a ratio of two runs measured side by side in this process.

    python -m bench.engine [--quick] [--out PATH]   ->  bench/results/engine.json, bench/results/engine.png

Figures: step_overhead_ratio (engine decode step over the bare forward, compiled and eager),
compiled_step_speedup, throughput_vs_hf (against transformers `generate`, same weights), startup_warm_cache_s,
l2_hit_ttft_ratio (prefix in the host tier over on device) and short_p90_ttft_ratio (short requests behind
long prefills, with and without length buckets). `--quick` runs each part at tiny sizes (a smoke run; JSON
under .run/bench-quick/). Results: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.model import hf_tiny_dir
from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
from libs.model import load_model

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_RESULTS = RESULTS.parent.parent / ".run" / "bench-quick"
ROUNDS = 8  # short-TTFT rounds per mode
GOALS = {"step_overhead_ratio": ("<=", 1.15), "throughput_vs_hf": (">=", 5.0), "l2_hit_ttft_ratio": ("<=", 1.1),
         "short_p90_ttft_ratio_buckets": ("<=", 1.3), "startup_warm_cache_s": ("<=", 30.0)}
HEADLINE_KEYS = (*GOALS, "compiled_step_speedup")  # top-level keys of engine.json
# --quick: each part's sizes (keyword arguments of its function)
QUICK = {"step_overhead": dict(batch=8, steps=8), "throughput": dict(n_req=8), "startup": dict(runs=1),
         "l2": dict(trials=1), "short_ttft": dict(rounds=1, n_short=6, long_len=1024)}


def tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def make_core(model, cfg, **opts) -> EngineCore:
    base = dict(page_size=16, num_full_pages=4096, num_swa_pages=1024, max_num_batched_tokens=512,
                max_num_seqs=64, bucket_edges=())
    base.update(opts)
    return EngineCore(EngineConfig(**base), model, cfg)


def drain(core: EngineCore) -> int:
    produced = 0
    while core.has_work():
        produced += sum(len(o.new_token_ids) for o in core.step())
    return produced


# ---------------------------------------------------------------- step overhead
def step_overhead(model, cfg, batch: int = 32, steps: int = 30) -> dict:
    """The compiled engine's step vs its bare compiled forward (the headline), the eager pair, and the two
    engines' steps against each other. The compiled engine runs its own model instance (compiling one model
    never reaches another)."""
    eager = _step_overhead(model, cfg, batch, steps, compile=False)
    compiled_model, _ = load_model(None)
    compiled = _step_overhead(compiled_model, cfg, batch, steps, compile=True)
    return {"batch": batch, "compiled": compiled, "eager": eager,
            "step_overhead_ratio": compiled["step_overhead_ratio"],
            "compiled_step_speedup": eager["engine_step_ms"] / compiled["engine_step_ms"]}


def _step_overhead(model, cfg, batch: int, steps: int, compile: bool) -> dict:
    core = make_core(model, cfg, compile=compile)
    for i in range(batch):
        core.add_request(Request(f"s{i}", tokens(i, 64), greedy(steps + 40)))
    while not all(s.is_decoding for s in core.scheduler.running) or len(core.scheduler.running) < batch:
        core.step()
    plan = core.scheduler.schedule()  # one decode plan, replayed by the bare forward
    core.scheduler.update(plan, {s.req_id: _fake(s) for s in plan.seqs})
    # the engine's own inputs for this plan (with an arena KV: its per-chunk physical rows), built once: the bare
    # forward times the model alone
    inp = core.runner.inputs(plan)
    engine_t, bare_t = [], []
    for _ in range(steps):  # interleaved, so background load hits both alike
        t0 = time.perf_counter()
        core.step()
        engine_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(inp.input_ids, inp.meta, core.runner.kv)
        bare_t.append(time.perf_counter() - t0)
    e, b = statistics.median(engine_t), statistics.median(bare_t)
    return {"engine_step_ms": e * 1e3, "bare_forward_ms": b * 1e3, "step_overhead_ratio": e / b}


def _fake(s):
    from libs.engine.scheduler import SampledToken

    return SampledToken(7)


# ---------------------------------------------------------------- throughput vs transformers
def throughput_vs_hf(n_req: int = 32) -> dict:
    """32 concurrent requests with mixed output lengths (8..128 new tokens). transformers generates a
    static batch until the longest is done; only each request's own tokens count as output for both."""
    from transformers import MiMoV2FlashForCausalLM

    prompts = [tokens(100 + i, 24 + (i * 7) % 40) for i in range(n_req)]
    lengths = [8 + (i * 37) % 121 for i in range(n_req)]
    useful = sum(lengths)
    with tempfile.TemporaryDirectory() as tmp:
        path = hf_tiny_dir(Path(tmp))
        model, cfg = load_model(str(path), progress=False)
        hf = MiMoV2FlashForCausalLM.from_pretrained(path).eval()
        compiled_model, _ = load_model(str(path), progress=False)
    engines = {"compiled": make_core(compiled_model, cfg, max_num_batched_tokens=2048, compile=True),
               "eager": make_core(model, cfg, max_num_batched_tokens=2048)}
    best = dict.fromkeys(engines, float("inf"))
    theirs = float("inf")
    for rnd in range(2):  # best of two, alternating
        for name, core in engines.items():
            t0 = time.perf_counter()
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
                core.add_request(Request(f"t{rnd}-{i}", p, greedy(n)))
            produced = drain(core)
            best[name] = min(best[name], time.perf_counter() - t0)
            assert produced == useful
        theirs = min(theirs, _hf_generate(hf, prompts, max(lengths)))
    return {"requests": n_req, "new_tokens_min_max": [min(lengths), max(lengths)], "output_tokens": useful,
            "engine_tok_s": useful / best["compiled"], "eager_engine_tok_s": useful / best["eager"],
            "hf_tok_s": useful / theirs, "throughput_vs_hf": theirs / best["compiled"],
            "eager_throughput_vs_hf": theirs / best["eager"]}


# ---------------------------------------------------------------- start-up with a warm compile cache
def startup(runs: int = 2) -> dict:
    """Seconds for a fresh process to load the tiny model and build a compiled engine (the services' default
    sizes, warm-up included), `runs` times in a row: the first fills the compile cache where it was empty, the
    last is the headline."""
    import subprocess
    import sys

    probe = ("import time; t = time.perf_counter(); from libs.engine import LLM; "
             "llm = LLM(None, compile=True); print(time.perf_counter() - t, llm.core.compile_stats['enabled'])")
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, check=True)
        built_s, enabled = out.stdout.split()
        assert enabled == "True", out.stdout + out.stderr[-2000:]
        times.append({"process_s": time.perf_counter() - t0, "engine_built_s": float(built_s)})
    return {"startup_runs": times, "startup_warm_cache_s": times[-1]["process_s"]}


def _hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects for decoder-only models
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - t0
    assert out.shape[1] == width + new_tokens
    return elapsed


# ---------------------------------------------------------------- L2 hit TTFT
def ttft(core: EngineCore, req: Request) -> float:
    t0 = time.perf_counter()
    core.add_request(req)
    while True:
        if any(o.req_id == req.req_id and o.new_token_ids for o in core.step()):
            elapsed = time.perf_counter() - t0
            drain(core)
            return elapsed


def l2_ttft(model, cfg, prefix_len: int = 1024, trials: int = 15) -> dict:
    """Per trial and per load mode: warm a prefix, measure an L1 hit, push the prefix to the host tier
    with a filler request, measure an L2 hit. Modes are interleaved so background load hits all alike."""
    modes = ("thread", "inline", "sync")
    # Device pool sized so the filler evicts the prefix; everything cached is backed up at once.
    cores = {m: make_core(model, cfg, num_full_pages=96, num_swa_pages=48, num_host_full_pages=1024,
                          num_host_swa_pages=512, l2_backup_watermark=1.0, l2_backup_pages=512, l2_load_mode=m)
             for m in modes}
    l1: dict[str, list[float]] = {m: [] for m in modes}
    l2: dict[str, list[float]] = {m: [] for m in modes}
    loaded = []
    for t in range(trials):
        for m, core in cores.items():
            prefix = tokens(1000 + t, prefix_len)
            drain_req(core, Request(f"warm{t}", prefix + tokens(2000 + t, 8), greedy(1)))
            drain_req(core, Request(f"flush{t}", tokens(3000 + t, 4), greedy(1)))  # lets the backup happen
            l1[m].append(ttft(core, Request(f"l1-{t}", prefix + tokens(4000 + t, 8), greedy(1))))
            drain_req(core, Request(f"flush2{t}", tokens(3500 + t, 4), greedy(1)))
            drain_req(core, Request(f"evict{t}", tokens(5000 + t, 1400), greedy(1)))  # prefix -> L2 only
            drain_req(core, Request(f"flush3{t}", tokens(3700 + t, 4), greedy(1)))  # the filler's backup
            before = core.scheduler.stats.loaded_pages
            l2[m].append(ttft(core, Request(f"l2-{t}", prefix + tokens(6000 + t, 8), greedy(1))))
            loaded.append(core.scheduler.stats.loaded_pages - before)
    out: dict = {"prefix_tokens": prefix_len, "pages_loaded_per_l2_hit": statistics.median(loaded)}
    for m in modes:
        a, b = statistics.median(l1[m]), statistics.median(l2[m])
        out[f"l2_{m}"] = {"l1_ttft_ms": a * 1e3, "l2_ttft_ms": b * 1e3, "ratio": b / a}
    out["l2_hit_ttft_ratio"] = out[f"l2_{EngineConfig().resolved_load_mode}"]["ratio"]
    return out


def drain_req(core: EngineCore, req: Request) -> None:
    core.add_request(req)
    drain(core)


# ---------------------------------------------------------------- short-request TTFT in a mix
def mixed_ttft(model, cfg, edges: tuple[int, ...], with_long: bool, n_short: int = 24, gap_s: float = 0.03,
               long_len: int = 3072, long_max: int | None = None, adaptive: bool = True,
               interrupt: bool = True, **opts) -> tuple[list[float], list[float], list[float]]:
    """TTFT of each short request and of each long one, and each short's mean time per output token after
    the first. Arrivals are checked between steps and, as AsyncEngine does when a request comes in, between
    the layers (and before the MLPs) of a step that carries long prefill (`interrupt`)."""
    core = make_core(model, cfg, max_num_batched_tokens=256, bucket_edges=edges, long_prefill_max_tokens=long_max,
                     adaptive_long_cap=adaptive, interruptible_steps=interrupt, **opts)
    arrivals: list[tuple[float, Request]] = []
    if with_long:
        arrivals += [(0.0, Request(f"long{i}", tokens(7000 + i, long_len), greedy(4))) for i in range(2)]
    arrivals += [(0.01 + gap_s * i, Request(f"short{i}", tokens(8000 + i, 48), greedy(4))) for i in range(n_short)]
    start = time.perf_counter()
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    pending = sorted(arrivals, key=lambda a: a[0])

    def arrived() -> bool:  # an urgent (short-bucket) request is due: what AsyncEngine's flag reports
        return bool(pending) and pending[0][0] <= time.perf_counter() - start and core.is_urgent(pending[0][1])

    while pending or core.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, req = pending.pop(0)
            core.add_request(req)
            added[req.req_id] = at
        if not core.has_work():
            # idle until the next arrival: sleep to 1 ms before it, then spin, so a late wake-up of the harness
            # (this VM oversleeps by 10+ ms at times) is not counted as the engine's TTFT
            gap = pending[0][0] - now
            if gap > 2e-3:
                time.sleep(gap - 1e-3)
            continue
        for o in core.step(interrupt=arrived if interrupt else None):
            if o.new_token_ids:
                first.setdefault(o.req_id, time.perf_counter() - start)
                last[o.req_id] = time.perf_counter() - start
    ttft = {r: first[r] - added[r] for r in added}
    tpot = [(last[r] - first[r]) / 3 for r in added if r.startswith("short")]  # greedy(4): 3 tokens after the first
    return ([v for r, v in ttft.items() if r.startswith("short")], [v for r, v in ttft.items() if r.startswith("long")],
            tpot)


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1]


def short_ttft(model, cfg, rounds: int = ROUNDS, **mix) -> dict:
    """Shorts (48 tokens) arrive every 30 ms while two 3072-token prompts prefill, in one worker. Run side by
    side: shorts alone; mix with buckets (edge 512) and the defaults (share 0.05, step-cost-adaptive long cap,
    steps with long prefill interrupted when a short arrives); the same with share 0.2; without interruption;
    with a static token cap instead (token share + long chunks <= 32 tokens); buckets with neither cap; no
    buckets (FCFS). The long requests' TTFT and the shorts' time per output token are reported too: what the
    protection of short first tokens costs the others."""
    edges = (512,)
    runs = {"alone": dict(edges=edges, with_long=False), "buckets": dict(edges=edges, with_long=True),
            "buckets_share0.2": dict(edges=edges, with_long=True, long_prefill_share=0.2),
            "buckets_no_interrupt": dict(edges=edges, with_long=True, interrupt=False),
            "buckets_static32": dict(edges=edges, with_long=True, long_max=32, adaptive=False),
            "buckets_uncapped": dict(edges=edges, with_long=True, adaptive=False),
            "fcfs": dict(edges=(), with_long=True)}
    ttfts: dict[str, list[float]] = {k: [] for k in runs}
    longs: dict[str, list[float]] = {k: [] for k in runs}
    tpots: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):  # interleaved rounds (the p90 tail is noisy and the machine's speed drifts)
        for k, kw in runs.items():
            short, long, tpot = mixed_ttft(model, cfg, **kw, **mix)
            ttfts[k] += short
            longs[k] += long
            tpots[k] += tpot
    p = {k: p90(v) for k, v in ttfts.items()}
    out = {f"short_p90_{k}_ms": v * 1e3 for k, v in p.items()}
    out.update({f"short_median_{k}_ms": statistics.median(v) * 1e3 for k, v in ttfts.items()})
    out.update({f"long_ttft_median_{k}_ms": statistics.median(v) * 1e3 for k, v in longs.items() if v})
    out.update({f"short_tpot_median_{k}_ms": statistics.median(v) * 1e3 for k, v in tpots.items()})
    out.update({f"short_p90_ttft_ratio_{k}": v / p["alone"] for k, v in p.items() if k != "alone"})
    return out


# ---------------------------------------------------------------- main
def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    extra = ["compiled_step_speedup", "eager_throughput_vs_hf", "short_p90_ttft_ratio_buckets_share0.2",
             "short_p90_ttft_ratio_buckets_static32", "short_p90_ttft_ratio_fcfs"]
    names = list(GOALS) + extra
    vals = [results[n] for n in names]
    fig, ax = plt.subplots(figsize=(10, 4))
    bars = ax.bar(range(len(names)), vals, color=["tab:blue"] * len(GOALS) + ["tab:gray"] * len(extra))
    for i, n in enumerate(names):
        if n in GOALS:
            ax.hlines(GOALS[n][1], i - 0.4, i + 0.4, colors="red", linestyles="dashed")
    ax.bar_label(bars, fmt="%.2f")
    ax.set_xticks(range(len(names)), [n.replace("_ratio", "").replace("_", "\n") for n in names], fontsize=8)
    ax.set_yscale("log")
    ax.set_title("windserve engine (tiny model, CPU): ratios (start-up in s); red = goal")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                   "bench/results/engine.json, with --quick .run/bench-quick/engine.json")
    a = p.parse_args(argv)
    out = a.out or (QUICK_RESULTS if a.quick else RESULTS) / "engine.json"
    kw = QUICK if a.quick else {}
    torch.manual_seed(0)
    model, cfg = load_model(None)
    results: dict = {"device": "cpu", "torch_threads": torch.get_num_threads(), "quick": a.quick}
    for name, fn in (("step_overhead", lambda: step_overhead(model, cfg, **kw.get("step_overhead", {}))),
                     ("throughput", lambda: throughput_vs_hf(**kw.get("throughput", {}))),
                     ("l2", lambda: l2_ttft(model, cfg, **kw.get("l2", {}))),
                     ("short_ttft", lambda: short_ttft(model, cfg, **kw.get("short_ttft", {}))),
                     ("startup", lambda: startup(**kw.get("startup", {})))):
        t0 = time.perf_counter()
        results.update(fn())
        print(f"[engine bench] {name} done in {time.perf_counter() - t0:.1f}s", flush=True)
    results["torch_threads"] = torch.get_num_threads()  # (the engines set it: all cores but one)
    results["goals"] = {k: f"{op} {v}" for k, (op, v) in GOALS.items()}
    results["goals_met"] = {k: (results[k] <= v if op == "<=" else results[k] >= v) for k, (op, v) in GOALS.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    for k in list(GOALS) + ["short_p90_ttft_ratio_buckets_static32", "short_p90_ttft_ratio_fcfs"]:
        print(f"{k:32s} {results[k]:8.3f}")
    print(f"wrote {out} and {out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
