"""Model parallelism benchmark (#18): tp / ep shards of the tiny model in real rank processes (gloo over
loopback TCP) against one process.

    python -m bench.parallel [--quick] [--out PATH]  ->  bench/results/parallel.json, bench/results/parallel.png

Per layout (tp = 2, ep = 2, tp = 2 + ep = 2, each a real EngineCore over a ParallelRunner): greedy outputs
and logits against one process, KV bytes per rank, bytes rank 1 writes against the all-reduce minimum,
step time (on CPU the ranks share cores: the split's overhead, not a speed-up), and decode tokens/s on GPUs
(null with the reason without two). Goals in `GOALS`; results: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from libs.engine import EngineConfig, EngineCore, Request, SamplingParams
from libs.engine.parallel.comm import Comm, ring_all_reduce_bytes
from libs.engine.parallel.layout import ParallelLayout
from libs.engine.parallel.rank import io_bytes
from libs.engine.plan import BatchPlan, ScheduledSeq
from libs.model.config import ModelConfig
from libs.model.loader import TINY_SEED, load_model, set_dtype
from libs.model.model import MiMoV2Model, init_random_

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAGE = 16
LAYOUTS: dict[str, tuple[int, int]] = {"tp2": (2, 1), "ep2": (1, 2), "tp2_ep2": (2, 2)}
HEADLINE = "tp2_ep2"
RANKS = 2  # every layout of the bench is two ranks
GOALS = {"greedy_identical": "== true", "kv_bytes_per_rank_ratio": "<= 0.5", "comm_bytes_vs_min": "<= 1.1"}
HEADLINE_KEYS = ("greedy_identical", "max_logit_diff", "kv_bytes_per_rank_ratio", "kv_bytes_per_rank_ratio_full",
                 "kv_bytes_per_rank_ratio_swa", "comm_bytes_vs_min", "control_bytes_per_step",
                 "decode_tokens_per_s_gpu_tp1", "decode_tokens_per_s_gpu_tp2")
MARK = "@parallel-bench@"  # starts the all-reduce child's result line
TIMEOUT_S = 120.0  # bound of the all-reduce check's rendezvous and collectives (a loaded 2-core box)


def mimo_kv_config() -> ModelConfig:
    """The tiny model with MiMo-V2's KV-head proportions (query heads / KV heads 4, SWA KV heads twice the
    full-attention ones), so tp = 2 splits both pools."""
    return ModelConfig.tiny().with_(num_heads=8, kv_heads_full=2, kv_heads_swa=4)


def random_model(cfg: ModelConfig) -> MiMoV2Model:
    return set_dtype(init_random_(MiMoV2Model(cfg), TINY_SEED), torch.float32).eval()


def engine_config(tp: int, ep: int, device: str = "cpu", batched_tokens: int = 64) -> EngineConfig:
    # 64 tokens a step: the prompts' prefill is chunked. The static pools on every layout (the ranks' pools are
    # static; the one-process reference compares bytes per rank with them, and the direct forwards below name
    # page ids, which on one arena would read through the cache's unit tables)
    return EngineConfig(page_size=PAGE, num_full_pages=256, num_swa_pages=128, max_num_batched_tokens=batched_tokens,
                        max_num_seqs=16, tp=tp, ep=ep, device=device, kv_arena=False)


def bench_prompts(n: int) -> list[list[int]]:
    """`n` prompts of 60 to 150 tokens sharing a 48-token prefix (deterministic)."""
    g = torch.Generator().manual_seed(18)
    prefix = torch.randint(3, 250, (48,), generator=g).tolist()
    return [prefix + torch.randint(3, 250, (12 + 23 * i % 90,), generator=g).tolist() for i in range(n)]


def greedy(core: EngineCore, prompts: list[list[int]], max_tokens: int, waves: int = 2) -> list[list[int]]:
    """Greedy outputs, the prompts in `waves` waves each arriving after the last finished (the second hits the
    prefix cache on the shared prefix)."""
    out: dict[str, list[int]] = {}
    size = -(-len(prompts) // waves)
    for wave in (range(w, min(w + size, len(prompts))) for w in range(0, len(prompts), size)):
        for i in wave:
            core.add_request(Request(f"p{i}", prompts[i], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                         ignore_eos=True)))
        for _ in range(100_000):
            if not core.has_work():
                break
            for o in core.step():
                out.setdefault(o.req_id, []).extend(o.new_token_ids)
    return [out.get(f"p{i}", []) for i in range(len(prompts))]


def fixed_plan(n_seqs: int, q_len: int, start: int, seed: int) -> BatchPlan:
    """One step over `n_seqs` sequences of `q_len` new tokens at positions [start, start + q_len), each on its
    own pages (the same ids in both pools), every sequence sampling."""
    pages = -(-(start + q_len) // PAGE)
    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i in range(n_seqs):
        ids = tuple(torch.randint(3, 250, (q_len,), generator=g).tolist())
        table = list(range(i * pages, (i + 1) * pages))
        seqs.append(ScheduledSeq(f"b{i}", start, ids, q_len > 1, True, table, table))
    return BatchPlan(tuple(seqs))


# ============================================================================ pure arithmetic


def needed_all_reduces(cfg: ModelConfig, layout: ParallelLayout) -> int:
    """All-reduces one forward needs: a rank holds only a share of a sum at a tp split's attention output and
    MLP / MoE output, and at an ep split's MoE output; nowhere else."""
    n = 0
    for moe in cfg.layer_is_moe:
        n += layout.tp > 1
        n += layout.tp > 1 or (moe and layout.ep > 1)
    return n


def min_bytes_per_token_per_layer(cfg: ModelConfig, layout: ParallelLayout, elem: int) -> float:
    """The analytic minimum a rank sends per token per layer: the bandwidth-optimal all-reduce bound of one
    token's hidden vector, times the all-reduces the forward needs, over the layers."""
    return needed_all_reduces(cfg, layout) * ring_all_reduce_bytes(cfg.hidden_size * elem, layout.world) \
        / cfg.num_layers


def kv_ratios(single: dict[str, int], ranks: list[dict[str, int]]) -> dict[str, float]:
    """Per pool: the largest rank's KV bytes over the single process's ("max": the larger of the two pools)."""
    out = {pool: max(r[pool] for r in ranks) / single[pool] for pool in ("full", "swa")}
    out["max"] = max(out["full"], out["swa"])
    return out


# ============================================================================ measurements


def _snap(stats: list[tuple[Any, int]]) -> list[tuple[int, int, int]]:
    """(all-reduces, all-reduce payload bytes, bytes written) per rank, copied (rank 0's stats object is live)."""
    return [(s.all_reduces, s.all_reduce_bytes, io) for s, io in stats]


def comm_figures(runner: Any, cfg: ModelConfig, layout: ParallelLayout, plan: BatchPlan, steps: int,
                 elem: int) -> dict[str, Any]:
    """Bytes rank 1 wrote over `steps` forwards of `plan` vs the analytic minimum, and rank 0's control bytes."""
    runner.forward(plan)  # warm-up: gloo's first collectives set up buffers
    runner.reset_stats()
    s0 = _snap(runner.rank_stats())
    s1 = _snap(runner.rank_stats())  # a stats round trip alone: the reply (worker) and request (rank 0) bytes
    for _ in range(steps):
        runner.forward(plan)
    s2 = _snap(runner.rank_stats())
    reply, request = s1[1][2] - s0[1][2], s1[0][2] - s0[0][2]
    worker = s2[1][2] - s1[1][2] - reply
    rank0 = s2[0][2] - s1[0][2] - request
    tokens, layers = plan.num_tokens, cfg.num_layers
    measured = worker / steps / tokens / layers
    minimum = min_bytes_per_token_per_layer(cfg, layout, elem)
    inputs = runner.inputs(plan)
    pickled = (layout.world - 1) * (len(pickle.dumps(("step", (), (), tuple(inputs)))) + 4)  # + send_bytes' header
    # rank 0's writes are its gloo sends (the same as rank 1's in a 2-rank all-reduce) plus the step messages
    control = (rank0 - worker) / steps
    return {"tokens_per_step": tokens, "steps": steps, "layers": layers, "world": layout.world,
            "rank1_bytes_written": worker, "measured_bytes_per_token_per_layer": measured,
            "min_bytes_per_token_per_layer": minimum, "ratio": measured / minimum if minimum else None,
            "all_reduces_per_step": (s2[1][0] - s1[1][0]) / steps,
            "needed_all_reduces_per_step": needed_all_reduces(cfg, layout),
            "all_reduce_payload_bytes_per_step": (s2[1][1] - s1[1][1]) / steps,
            "control_bytes_per_step": control, "control_bytes_per_step_pickled": pickled,
            "control_bytes_per_token": control / tokens}


def step_ms(runner: Any, plan: BatchPlan, repeats: int) -> float:
    """Median wall time of one forward of `plan`, in ms (after a warm-up forward)."""
    runner.forward(plan)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward(plan)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run_layout(model: MiMoV2Model, cfg: ModelConfig, tp: int, ep: int, prompts: list[list[int]],
               plans: dict[str, BatchPlan], a: argparse.Namespace, ref: dict[str, Any] | None = None, *,
               comm: bool = True, timing: bool = True) -> dict[str, Any]:
    """One engine at tp / ep: greedy outputs, the logits of one forward, its pools' bytes per rank; the
    communicated bytes (parallel layouts) when `comm`, step times when `timing`. `ref`: the one-process
    figures to compare with."""
    layout = ParallelLayout(tp, ep)
    # Every process computes with the same torch threads: a 2-rank layout's share of the cores, which is what
    # ParallelRunner gives its rank processes (one process is also timed on all the cores, below).
    cores = os.cpu_count() or 1
    threads = max(1, cores // RANKS)
    torch.set_num_threads(threads)
    config = engine_config(tp, ep)
    core = EngineCore(config, model, cfg)
    try:
        out: dict[str, Any] = {"tp": tp, "ep": ep, "torch_threads_per_rank": threads}
        out["tokens"] = greedy(core, prompts, a.max_tokens)
        runner = core.runner
        # The engine is idle now: the direct forwards below write KV into pages its cache considers free or
        # cached; nothing reads them afterwards (the engine is closed next).
        out["logits"] = runner.forward(plans["logits"]).float()
        out["pool_bytes"] = runner.rank_pool_bytes() if layout.is_parallel else [runner.kv.pool_bytes()]
        if ref is not None:
            out["greedy_identical"] = out["tokens"] == ref["tokens"]
            out["max_logit_diff"] = float((out["logits"] - ref["logits"]).abs().max())
            out["kv_bytes_per_rank_ratio"] = kv_ratios(ref["pool_bytes"][0], out["pool_bytes"])
        if layout.is_parallel and comm:
            elem = torch.empty(0, dtype=config.torch_dtype).element_size()
            out["comm"] = comm_figures(runner, cfg, layout, plans["comm"], a.steps, elem)
            # a decode step of 8 tokens, for scale: gloo's per-message overhead is no longer negligible there
            out["comm_decode"] = comm_figures(runner, cfg, layout, plans["decode"], a.steps, elem)
        if timing:
            out["step_ms"] = {k: step_ms(runner, plans[k], a.repeats) for k in ("decode", "prefill")}
            if not layout.is_parallel and cores > threads and not a.quick:
                # (fewer repeats: on a busy box torch's threads over every core can be very slow)
                torch.set_num_threads(cores)
                out["step_ms_all_cores"] = {k: step_ms(runner, plans[k], min(a.repeats, 3))
                                            for k in ("decode", "prefill")}
        return out
    finally:
        core.close()


def check_io_counting(numel: int, iters: int) -> dict[str, Any]:
    """A plain all-reduce of a known size between this process and a child over the bench's Comm: the bytes each
    wrote (wchar) per all-reduce over the bandwidth-optimal bound. Near 1 means wchar sees gloo's sends."""
    comm = Comm(0, 2)
    port = comm.host_store("127.0.0.1", TIMEOUT_S)
    child = subprocess.Popen([sys.executable, "-m", "bench.parallel", "--role", "allreduce", "--port", str(port),
                              "--numel", str(numel), "--iters", str(iters)], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True)
    try:
        comm.connect("127.0.0.1", port, timeout_s=TIMEOUT_S)
        mine = _all_reduce_writes(comm, numel, iters)
        stdout, _ = child.communicate(timeout=TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5.0)
    line = next(x for x in stdout.splitlines() if x.startswith(MARK))
    theirs = int(line.split()[1])
    bound = ring_all_reduce_bytes(numel * 4, 2) * iters
    return {"bytes_per_all_reduce": numel * 4, "all_reduces": iters, "rank0_written": mine, "rank1_written": theirs,
            "rank0_over_bound": mine / bound, "rank1_over_bound": theirs / bound}


def _all_reduce_writes(comm: Comm, numel: int, iters: int) -> int:
    t = torch.ones(numel)
    comm.all_reduce(t)  # warm-up
    before = io_bytes()
    for _ in range(iters):
        comm.all_reduce(t)
    return io_bytes() - before


def allreduce_child(a: argparse.Namespace) -> None:
    comm = Comm(1, 2)
    comm.connect("127.0.0.1", a.port, timeout_s=TIMEOUT_S)
    written = _all_reduce_writes(comm, a.numel, a.iters)
    print(MARK, written, flush=True)


def gpu_decode(a: argparse.Namespace) -> dict[str, Any]:
    """Decode tokens/s of the tiny model on GPUs: tp = 1 on one, tp = 2 on two (rank r on the r-th GPU)."""
    if not torch.cuda.is_available():
        reason = "no CUDA device here (torch.cuda.is_available() is False): CPU-only run"
        return {"tp1": None, "tp2": None, "reasons": {"tp1": reason, "tp2": reason}}
    model, cfg = load_model(None, device="cuda", progress=False)
    n_out = 32 if a.quick else 128
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                           "requests": 8, "max_tokens": n_out, "reasons": {}}
    for tag, tp in (("tp1", 1), ("tp2", 2)):
        if tp > torch.cuda.device_count():
            out[tag], out["reasons"][tag] = None, f"needs {tp} GPUs, {torch.cuda.device_count()} here"
            continue
        try:
            out[tag] = _decode_rate(EngineCore(engine_config(tp, 1, device="cuda", batched_tokens=512), model, cfg),
                                    n_out)
        except Exception as exc:  # a figure of its own: the CPU figures above stand without it
            out[tag], out["reasons"][tag] = None, f"failed: {exc!r}"
    return out


def _decode_rate(core: EngineCore, n_out: int) -> float:
    """Output tokens/s of 8 concurrent greedy requests of `n_out` tokens (their prefill included), then closes."""
    try:
        greedy(core, bench_prompts(1), 4)  # warm-up
        t0 = time.perf_counter()
        tokens = greedy(core, bench_prompts(8), n_out, waves=1)
        return sum(map(len, tokens)) / (time.perf_counter() - t0)
    finally:
        core.close()


# ============================================================================ results


def build_results(ref: dict[str, Any], layouts: dict[str, dict[str, Any]], variant: dict[str, Any] | None,
                  io_check: dict[str, Any] | None, gpu: dict[str, Any], setup: dict[str, Any]) -> dict[str, Any]:
    """The JSON: headline keys at the top (null where not measured, with the reason under "null_reasons"), the
    goals, and the per-layout tables behind them."""
    out: dict[str, Any] = dict.fromkeys(HEADLINE_KEYS)
    reasons: dict[str, str] = {}
    head = layouts.get(HEADLINE)
    if head is not None:
        out["greedy_identical"] = head["greedy_identical"]
        out["max_logit_diff"] = head["max_logit_diff"]
        if head.get("comm"):
            out["comm_bytes_vs_min"] = head["comm"]["ratio"]
            out["control_bytes_per_step"] = head["comm"]["control_bytes_per_step"]
    for k in ("greedy_identical", "max_logit_diff", "comm_bytes_vs_min", "control_bytes_per_step"):
        if out[k] is None:
            reasons[k] = f"layout {HEADLINE} not measured"
    out["greedy_identical_by_layout"] = {n: r["greedy_identical"] for n, r in layouts.items()}
    out["max_logit_diff_by_layout"] = {n: r["max_logit_diff"] for n, r in layouts.items()}
    out["comm_bytes_vs_min_by_layout"] = {n: r["comm"]["ratio"] for n, r in layouts.items() if r.get("comm")}
    if variant is not None:
        kv = variant["tp2"]["kv_bytes_per_rank_ratio"]
        out["kv_bytes_per_rank_ratio"] = kv["max"]
        out["kv_bytes_per_rank_ratio_full"], out["kv_bytes_per_rank_ratio_swa"] = kv["full"], kv["swa"]
    else:
        for k in ("kv_bytes_per_rank_ratio", "kv_bytes_per_rank_ratio_full", "kv_bytes_per_rank_ratio_swa"):
            reasons[k] = "the MiMo-proportion variant was not run (--quick)"
    tiny_tp = next((r for n, r in layouts.items() if r["tp"] == 2), None)
    if tiny_tp is not None:
        out["kv_bytes_per_rank_ratio_tiny"] = {
            **tiny_tp["kv_bytes_per_rank_ratio"], "layout": f"tp={tiny_tp['tp']} ep={tiny_tp['ep']}",
            "why": "the built-in tiny has kv_heads_full=1: tp=2 cannot split one KV head, so each rank keeps it "
                   "(full-pool ratio 1.0, as vLLM replicates KV heads); its kv_heads_swa=2 splits (0.5)"}
    for k in ("decode_tokens_per_s_gpu_tp1", "decode_tokens_per_s_gpu_tp2"):
        tag = k.rsplit("_", 1)[1]
        out[k] = gpu.get(tag)
        if out[k] is None:
            reasons[k] = gpu.get("reasons", {}).get(tag, "not measured")
    out["step_ms"] = {"tp1": ref.get("step_ms"), "tp1_all_cores": ref.get("step_ms_all_cores"),
                      **{n: r.get("step_ms") for n, r in layouts.items()},
                      "note": "forward time of one step on CPU (median, ms); every process computes with "
                              f"{setup.get('threads_per_process')} torch thread(s) (a 2-rank layout's share of the "
                              f"machine's {setup.get('cpus')} cores), tp1_all_cores is one process on all of them; "
                              "the ranks of a layout share the same cores (and this box's other load), so this is "
                              "the split's overhead on CPU, not a speed-up (a figure, not a goal)"}
    out["goals"] = GOALS
    out["met"] = {k: _met(out[k], g) for k, g in GOALS.items()}
    out["null_reasons"] = reasons
    out["setup"] = setup
    out["io_counting_check"] = io_check
    out["comm"] = {n: r["comm"] for n, r in layouts.items() if r.get("comm")}
    out["comm_decode_step"] = {n: r["comm_decode"] for n, r in layouts.items() if r.get("comm_decode")}
    out["pool_bytes"] = {"tp1": ref["pool_bytes"], **{n: r["pool_bytes"] for n, r in layouts.items()}}
    if variant is not None:
        out["mimo_kv_variant"] = {
            "config": variant["config"], "greedy_identical_tp2": variant["tp2"]["greedy_identical"],
            "max_logit_diff_tp2": variant["tp2"]["max_logit_diff"], "pool_bytes_tp1": variant["tp1"]["pool_bytes"],
            "pool_bytes_tp2": variant["tp2"]["pool_bytes"], "kv_bytes_per_rank_ratio": variant["tp2"][
                "kv_bytes_per_rank_ratio"]}
    out["gpu"] = gpu
    return out


def _met(value: Any, goal: str) -> bool | None:
    if value is None:
        return None
    op, bound = goal.split()
    if op == "==":
        return value is (bound == "true")
    return value >= float(bound) if op == ">=" else value <= float(bound) + 1e-9  # (a ratio of exactly 0.5)


def _pair_bars(ax: Any, rows: dict[str, dict[str, float]], keys: tuple[str, str], labels: tuple[str, str]) -> None:
    """Two bars per row (rows[name][keys[0]] and [keys[1]]), the row names under them."""
    xs = range(len(rows))
    for shift, key, label in ((-0.2, keys[0], labels[0]), (0.2, keys[1], labels[1])):
        ax.bar([x + shift for x in xs], [r[key] for r in rows.values()], 0.4, label=label)
    ax.set_xticks(list(xs), list(rows), fontsize=8)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    comm = out["comm"]
    _pair_bars(a, comm, ("measured_bytes_per_token_per_layer", "min_bytes_per_token_per_layer"),
               ("measured (rank 1 wchar)", "analytic minimum"))
    for x, row in enumerate(comm.values()):
        a.text(x, row["measured_bytes_per_token_per_layer"], f"{row['ratio']:.3f}x", ha="center", va="bottom",
               fontsize=8)
    top = max((r["measured_bytes_per_token_per_layer"] for r in comm.values()), default=1.0)
    a.set(title="bytes communicated per token per layer", ylabel="bytes", ylim=(0, 1.3 * top))
    groups: dict[str, dict[str, Any]] = {}
    if out.get("kv_bytes_per_rank_ratio_tiny"):
        groups["tiny (kv 1/2)"] = out["kv_bytes_per_rank_ratio_tiny"]
    if out.get("kv_bytes_per_rank_ratio") is not None:
        groups["MiMo-proportion (kv 2/4)"] = {"full": out["kv_bytes_per_rank_ratio_full"],
                                              "swa": out["kv_bytes_per_rank_ratio_swa"]}
    _pair_bars(b, groups, ("full", "swa"), ("full pool", "SWA pool"))
    b.axhline(0.5, ls="--", c="grey", lw=0.8)
    b.set(title="KV bytes per rank / one process (tp=2)", ylim=(0, 1.1))
    steps = {k: v for k, v in out["step_ms"].items() if isinstance(v, dict)}
    _pair_bars(c, steps, ("decode", "prefill"), ("decode step (8 seqs)", "prefill step (512 tok)"))
    c.set(title=f"CPU step time, ranks share {out['setup'].get('cpus')} cores", ylabel="ms (log)", yscale="log")
    for ax in (a, b, c):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke test: tp=2+ep=2 only, 3 prompts, 256-token batch, "
                   "no MiMo-proportion variant, one timed forward per step figure")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16, help="greedy output tokens per prompt")
    p.add_argument("--steps", type=int, default=5, help="forwards of the fixed batch the bytes are counted over")
    p.add_argument("--repeats", type=int, default=15, help="timed forwards per step-time figure (median)")
    p.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                   "bench/results/parallel.json, with --quick .run/bench-quick/parallel.json")
    # the all-reduce check's child process
    p.add_argument("--role", choices=["main", "allreduce"], default="main")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--numel", type=int, default=0)
    p.add_argument("--iters", type=int, default=0)
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.max_tokens, a.steps, a.repeats = min(a.prompts, 3), min(a.max_tokens, 6), 3, 1
    a.out = a.out or (ROOT / ".run" / "bench-quick" if a.quick else RESULTS) / "parallel.json"
    return a


def main(a: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    torch.manual_seed(0)
    model, cfg = load_model(None, progress=False)
    prompts = bench_prompts(a.prompts)
    batch = (4, 64) if a.quick else (8, 64)  # sequences x tokens of the fixed prefill batch
    plans = {"logits": fixed_plan(*batch, 0, 1), "comm": fixed_plan(*batch, 0, 2), "prefill": fixed_plan(*batch, 0, 3),
             "decode": fixed_plan(8, 1, 63, 4)}
    io_check = check_io_counting(batch[0] * batch[1] * cfg.hidden_size, 10)
    ref = run_layout(model, cfg, 1, 1, prompts, plans, a)
    names = [HEADLINE] if a.quick else list(LAYOUTS)
    layouts = {n: run_layout(model, cfg, *LAYOUTS[n], prompts, plans, a, ref) for n in names}
    variant = None
    if not a.quick:
        vcfg = mimo_kv_config()
        ParallelLayout(tp=2).validate(vcfg)
        vmodel = random_model(vcfg)
        vref = run_layout(vmodel, vcfg, 1, 1, prompts, plans, a, comm=False, timing=False)
        vtp2 = run_layout(vmodel, vcfg, 2, 1, prompts, plans, a, vref, comm=False, timing=False)
        variant = {"config": {k: getattr(vcfg, k) for k in ("num_heads", "kv_heads_full", "kv_heads_swa",
                                                             "qk_head_dim", "v_head_dim", "hidden_size")},
                   "tp1": vref, "tp2": vtp2}
    gpu = gpu_decode(a)
    setup = {"quick": a.quick, "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
             "max_tokens": a.max_tokens, "engine": {"page_size": PAGE, "num_full_pages": 256, "num_swa_pages": 128,
                                                    "max_num_batched_tokens": 64},
             "fixed_batch": {"seqs": batch[0], "tokens_per_seq": batch[1], "steps": a.steps},
             "decode_batch": {"seqs": 8, "context": 64}, "repeats": a.repeats, "dtype": "float32",
             "comm_backend": "gloo (loopback TCP)", "cpus": os.cpu_count(),
             "threads_per_process": max(1, (os.cpu_count() or 1) // RANKS), "torch": torch.__version__,
             "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]]}
    out = build_results(ref, layouts, variant, io_check, gpu, setup)
    out["runtime_s"] = time.perf_counter() - t0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1))
    plot(out, a.out.with_suffix(".png"))
    print(json.dumps({k: out[k] for k in (*HEADLINE_KEYS, "met", "null_reasons", "runtime_s")}, indent=1))
    return out


if __name__ == "__main__":
    cli = parse()
    if cli.role == "allreduce":
        allreduce_child(cli)
    else:
        main(cli)
