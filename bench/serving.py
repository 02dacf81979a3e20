"""Serving benchmark: the disaggregated pipeline (gateway -> router -> prefill -> UCX -> decode) under load.

    python -m bench.serving [--requests 64] [--concurrency 8] [--in-scale 64] [--out-scale 16]
    python -m bench.serving --overlap-only [--long-prompts 4] [--out PATH]
    python -m bench.serving --compose [--requests 64] [--concurrency 8]
    python -m bench.serving --quick [--out PATH]

Starts the `make run` topology as processes and replays the conversation trace, scaled to the tiny model,
with concurrent streaming clients: TTFT / TPOT, tokens/s, KV bytes moved against a full-KV transfer,
gateway overhead per token, and `handoff_overlap_ratio` (second-token latency of long prompts,
disaggregated over colocated). `--compose` compares the docker compose topology with `make run`; `--quick`
is a smoke run (synthetic prompts where the trace is not checked out) that writes under .run/bench-quick/.
Writes bench/results/serving.json and serving.png (`HEADLINE_KEYS` top-level); results: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import traces

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUICK_RESULTS = ROOT / ".run" / "bench-quick"
TRACE = traces.TRACE  # ../shared/traces/conversation_trace.jsonl beside the checkout (or one level up)
# --quick: these argument values instead of the defaults (flags given explicitly still win)
QUICK = {"requests": 8, "concurrency": 4, "sequential": 2, "max_in": 256, "max_out": 16, "long_prompts": 1}
# the headline figures (top-level keys of serving.json)
HEADLINE_KEYS = ("handoff_overlap_ratio", "transfer_bytes_ratio", "output_tokens_per_s", "ttft_p90_ms", "tpot_p90_ms",
                 "overhead_ms_per_token", "ucx_engine_over_raw")
MODEL = "windserve-tiny"
ENGINE_ENV = {"WINDSERVE_PAGE_SIZE": "16", "WINDSERVE_NUM_FULL_PAGES": "4096", "WINDSERVE_NUM_SWA_PAGES": "512",
              "WINDSERVE_MAX_NUM_BATCHED_TOKENS": "512", "WINDSERVE_LOAD_INTERVAL_S": "0.2"}
DISAGGREGATED = "gateway,router,prefill,decode"
COLOCATED = "gateway,router,worker"
# Probes answered late on a loaded machine must not fail a benchmark stream (failure detection is not measured).
LIVENESS_ENV = {"WINDSERVE_LIVENESS_MISSES": "6"}
# The tiny model's config says 4096 positions (the gateway's context check since #15); the overlap prompts are
# 4096 tokens plus output, and the tiny model's RoPE serves any length, so the gateway is told more.
GATEWAY_ENV = {"WINDSERVE_MAX_MODEL_LEN": "32768"}
LONG_CHUNKS = 8  # a "long" prompt of the overlap figure spans this many prefill chunks


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int


def block_tokens(block_id: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(int(block_id))
    return torch.randint(0, 250, (n,), generator=g).tolist()


def load_jobs(path: Path, count: int, in_scale: int, out_scale: int, max_in: int, max_out: int) -> list[Job]:
    jobs: list[Job] = []
    per_block = max(1, 512 // in_scale)
    with path.open() as f:
        for line in f:
            if len(jobs) == count:
                break
            row = json.loads(line)
            n_in = min(max_in, max(8, row["input_length"] // in_scale))
            toks = [t for b in row["hash_ids"] for t in block_tokens(b, per_block)][:n_in]
            jobs.append(Job(toks, min(max_out, max(2, row["output_length"] // out_scale))))
    return jobs


def synthetic_jobs(count: int, max_in: int, max_out: int) -> list[Job]:
    """Trace-shaped jobs without the trace (a --quick run where it is not checked out): every other prompt shares a
    prefix with the one before, lengths spread over [max_in / 8, max_in] and [2, max_out]."""
    jobs = []
    for i in range(count):
        n_in = max(8, max_in // 8 + (i * 37) % (max_in - max_in // 8 + 1))
        toks = (block_tokens(800_000 + i // 2, n_in // 2) + block_tokens(810_000 + i, n_in))[:n_in]
        jobs.append(Job(toks, 2 + (i * 5) % (max_out - 1)))
    return jobs


def trace_jobs(args: argparse.Namespace) -> tuple[list[Job], str]:
    """The jobs of a run and where they come from (the trace; synthetic only in a --quick run without it)."""
    if args.quick and not TRACE.exists():
        return synthetic_jobs(args.requests, args.max_in, args.max_out), f"synthetic (no trace at {TRACE})"
    return load_jobs(TRACE, args.requests, args.in_scale, args.out_scale, args.max_in, args.max_out), str(TRACE)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


# ------------------------------------------------------------------------------------------ the system
class System:
    """One topology (its own nats-server and gateway) as processes."""

    def __init__(self, run_dir: Path, services: str = DISAGGREGATED) -> None:
        from scripts.run import RunConfig, Supervisor, parse_services

        os.environ.update(ENGINE_ENV)
        os.environ.update(LIVENESS_ENV)
        os.environ.update(GATEWAY_ENV)
        os.environ.setdefault("UCX_LOG_LEVEL", "error")
        self.sup = Supervisor(RunConfig(services=parse_services(services), http_port=0,
                                        run_dir=run_dir, ready_timeout_s=120, grace_s=10))

    def __enter__(self) -> System:
        from scripts.run import StopFlag

        try:
            self.sup.start_nats()
            self.sup.start_services()
            self.sup.wait_ready(StopFlag())
        except BaseException:  # (__exit__ does not run when __enter__ raises: nothing may be left running)
            self.sup.stop_all()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.sup.stop_all()

    def client(self):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.sup.http_url}/v1", api_key="none", max_retries=0, timeout=120)

    async def worker_details(self) -> dict[str, dict[str, str]]:
        from libs.bus import Bus, Registry
        from protos import subjects
        from protos.messages import HealthReply, HealthRequest
        from scripts.run import namespace

        ns = namespace()
        bus = await Bus.connect(self.sup.nats_url, name="bench-serving")
        try:
            out: dict[str, dict[str, str]] = {}
            for e in await (await Registry.open(bus, subjects.registry_bucket(ns))).list():
                if e.role.value in ("prefill", "decode"):
                    reply = await bus.request(subjects.health(ns, e.instance_id), HealthRequest(), HealthReply, 5)
                    out[e.role.value] = reply.details
            return out
        finally:
            await bus.close()


async def stream_one(client, job: Job) -> dict[str, float]:
    start = time.perf_counter()
    first = None
    tokens = 0
    stream = await client.completions.create(model=MODEL, prompt=job.prompt, max_tokens=job.max_tokens,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    async for ev in stream:
        for c in ev.choices:
            n = len(getattr(c, "token_ids", None) or [])
            if n and first is None:
                first = time.perf_counter()
            tokens += n
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - start, "tpot": (end - first) / max(1, tokens - 1), "tokens": tokens, "e2e": end - start}


def summarize(rows: list[dict], wall: float, concurrency: int) -> dict:
    """TTFT / TPOT percentiles and output tokens/s of one concurrent phase."""
    return {"requests": len(rows), "concurrency": concurrency, "wall_s": wall,
            "ttft_p50_ms": 1e3 * pct([r["ttft"] for r in rows], 0.5),
            "ttft_p90_ms": 1e3 * pct([r["ttft"] for r in rows], 0.9),
            "tpot_p50_ms": 1e3 * pct([r["tpot"] for r in rows], 0.5),
            "tpot_p90_ms": 1e3 * pct([r["tpot"] for r in rows], 0.9),
            "output_tokens_per_s": sum(r["tokens"] for r in rows) / wall}


async def concurrent_phase(client, jobs: list[Job], concurrency: int) -> tuple[list[dict], float]:
    sem = asyncio.Semaphore(concurrency)

    async def run(job: Job) -> dict:
        async with sem:
            return await stream_one(client, job)

    start = time.perf_counter()
    rows = await asyncio.gather(*(run(j) for j in jobs))
    return rows, time.perf_counter() - start


async def token_times(client, job: Job) -> list[float]:
    """Arrival time of each output token at the client, seconds after the request was sent."""
    start = time.perf_counter()
    times: list[float] = []
    stream = await client.completions.create(model=MODEL, prompt=job.prompt, max_tokens=job.max_tokens,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    async for ev in stream:
        for c in ev.choices:
            times += [time.perf_counter() - start] * len(getattr(c, "token_ids", None) or [])
    return times


def long_jobs(count: int) -> list[Job]:
    """Distinct prompts of LONG_CHUNKS prefill chunks (no prefix shared with anything else in the run)."""
    n = LONG_CHUNKS * int(ENGINE_ENV["WINDSERVE_MAX_NUM_BATCHED_TOKENS"])
    return [Job(block_tokens(900_000 + i, n), 4) for i in range(count)]


async def overlap_phase(disagg, coloc, jobs: list[Job]) -> dict:
    """First-to-second-token time of long prompts, disaggregated vs colocated, alternated request by request
    (after one warm-up request each, not counted)."""
    clients = {"disaggregated": disagg, "colocated": coloc}
    warm = long_jobs(len(jobs) + 1)[-1]
    for client in clients.values():
        await token_times(client, warm)
    rows: dict[str, list[list[float]]] = {name: [] for name in clients}
    for job in jobs:
        for name, client in clients.items():
            rows[name].append(await token_times(client, job))

    def side(times: list[list[float]]) -> dict:
        gaps = [t[1] - t[0] for t in times]
        return {"ttft_ms": 1e3 * statistics.median(t[0] for t in times),
                "first_to_second_ms": 1e3 * statistics.median(gaps), "gaps_ms": [1e3 * g for g in gaps]}

    out = {name: side(times) for name, times in rows.items()}
    return {"prompts": len(jobs), "prompt_tokens": len(jobs[0].prompt), "prefill_chunks": LONG_CHUNKS, **out,
            "ratio": out["disaggregated"]["first_to_second_ms"] / out["colocated"]["first_to_second_ms"]}


class Offline:
    """The offline engine with the services' knobs, for the per-token overhead comparison."""

    def __init__(self) -> None:
        from libs.engine import LLM

        self.llm = LLM(None, page_size=16, num_full_pages=4096, num_swa_pages=512, max_num_batched_tokens=512)
        self._n = 0

    def tpot(self, job: Job) -> float:
        """Per-token decode time of one request alone (prefill and first token excluded, like served TPOT)."""
        from libs.engine import Request, SamplingParams

        core = self.llm.core
        self._n += 1
        core.add_request(Request(f"off{self._n}", job.prompt, SamplingParams(max_tokens=job.max_tokens,
                                                                              ignore_eos=True)))
        n = 0
        while n == 0:  # prefill (possibly chunked) up to the first token
            n = sum(len(o.new_token_ids) for o in core.step())
        t0, n = time.perf_counter(), 0
        while core.has_work():
            n += sum(len(o.new_token_ids) for o in core.step())
        return (time.perf_counter() - t0) / max(1, n)


def dual_pool_limit(jobs: list[Job]) -> float:
    """Bytes ratio if prefill shipped exactly full pages + the SWA window (no decode-side hits)."""
    from libs.engine import disagg as dg
    from libs.model import ModelConfig
    from libs.model.paged import KVPools

    cfg = ModelConfig.tiny()
    kv = KVPools.allocate(cfg, 1, 1, 16)
    ship = full = 0
    for job in jobs:
        plan = dg.plan_shipment(len(job.prompt), 16, cfg.sliding_window)
        layers = dg.shipment_layers(cfg.layer_is_swa, plan, [0] * plan.num_pages, [0] * plan.num_pages)
        ship += dg.shipment_bytes(kv, layers)
        full += dg.full_transfer_bytes(kv, cfg.layer_is_swa, len(job.prompt))
    return ship / full


async def raw_vs_engine(total_bytes: int) -> dict:
    from bench.transfer import layer_specs, measure, summarize

    mib = max(1, round(total_bytes / (1 << 20)))
    times = await measure("ucx", "tcp", mib, 6, 3)
    nbytes = sum(s.nbytes for s in layer_specs(mib, 6))
    res = {k: summarize(nbytes, v) for k, v in times.items()}
    return {"bytes": nbytes, "engine_gbps": res["engine"]["gbps"], "raw_gbps": res["raw"]["gbps"],
            "engine_over_raw": res["engine"]["gbps"] / res["raw"]["gbps"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    c = result["concurrent"]
    axes[0].bar(["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"],
                [c["ttft_p50_ms"], c["ttft_p90_ms"], c["tpot_p50_ms"], c["tpot_p90_ms"]], color="tab:blue")
    axes[0].set_ylabel("ms")
    axes[0].set_title(f"{c['requests']} trace requests, {c['concurrency']} clients\n"
                      f"{c['output_tokens_per_s']:.0f} output tok/s")
    kv = result["kv_transfer"]
    axes[1].bar(["measured", "dual-pool limit", "full KV"], [kv["transfer_bytes_ratio"], kv["dual_pool_limit"], 1.0],
                color=["tab:green", "tab:olive", "tab:gray"])
    axes[1].set_title("KV bytes prefill -> decode (ratio to full KV)")
    t = result["ucx"]
    o = result["overhead"]
    axes[2].bar(["engine (served)", "engine (same bytes)", "raw ucxx"],
                [kv["served_engine_gbps"], t["engine_gbps"], t["raw_gbps"]], color="tab:orange")
    axes[2].set_ylabel("GB/s")
    axes[2].set_title(f"UCX tcp loopback; gateway+bus overhead {o['overhead_ms_per_token']:.2f} ms/token")
    h = result["handoff_overlap"]
    names = ("disaggregated", "colocated")
    axes[3].bar([f"{n}\nTTFT" for n in names], [h[n]["ttft_ms"] for n in names], color="tab:gray")
    axes[3].bar([f"{n}\n1st->2nd" for n in names], [h[n]["first_to_second_ms"] for n in names], color="tab:red")
    axes[3].set_ylabel("ms")
    axes[3].set_title(f"{h['prompts']} prompts of {h['prompt_tokens']} tokens ({h['prefill_chunks']} chunks)\n"
                      f"handoff_overlap_ratio {result['handoff_overlap_ratio']:.2f} (goal <= 1.15)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def bench_overlap(args: argparse.Namespace) -> dict:
    with (tempfile.TemporaryDirectory(prefix="windserve-bench-") as tmp, System(Path(tmp) / "d") as disagg,
          System(Path(tmp) / "c", COLOCATED) as coloc):
        h = await overlap_phase(disagg.client(), coloc.client(), long_jobs(args.long_prompts))
    return {"handoff_overlap_ratio": h["ratio"], "handoff_overlap": h}


def compose_override(path: Path) -> Path:
    """A compose override giving every container the environment System gives make run's processes (engine
    knobs, liveness, context length) and no GCache (make run's topology has no storage nodes)."""
    env = {**ENGINE_ENV, **LIVENESS_ENV, **GATEWAY_ENV, "WINDSERVE_GCACHE": "0", "UCX_LOG_LEVEL": "error"}
    services = {name: {"environment": env} for name in ("gateway", "router", "prefill", "decode")}
    path.write_text(json.dumps({"services": services}))  # JSON is YAML
    return path


async def measure_topology(client, jobs: list[Job], concurrency: int) -> dict:
    import openai

    for attempt in range(10):  # warm-up (model pages, UCX endpoints); not measured, so retried
        try:
            await stream_one(client, jobs[0])
            break
        except openai.APIConnectionError:
            if attempt == 9:
                raise
            await asyncio.sleep(2)
    rows, wall = await concurrent_phase(client, jobs, concurrency)
    return summarize(rows, wall, concurrency)


async def bench_compose(args: argparse.Namespace) -> dict:
    """2 prefill x 2 decode containerised (docker compose) vs the same topology under make run, same requests,
    one after the other (never both at once: they share the CPUs)."""
    import openai

    from scripts.compose import COMPOSE_FILE, Stack, prepared
    from scripts.run import free_port

    jobs, source = trace_jobs(args)
    with tempfile.TemporaryDirectory(prefix="windserve-bench-") as tmp:
        with System(Path(tmp) / "d", "gateway,router,prefill=2,decode=2") as native:
            make_run = await measure_topology(native.client(), jobs, args.concurrency)
        with prepared(args.base_image) as (compose, _daemon):
            stack = Stack(compose, project=f"windserve-bench-{os.getpid()}", http_port=free_port(),
                          files=[COMPOSE_FILE, compose_override(Path(tmp) / "bench.override.json")])
            try:
                stack.up({"prefill": 2, "decode": 2, "cache": 0})
                client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
                containers = await measure_topology(client, jobs, args.concurrency)
            except Exception:
                print(stack.logs(40), file=sys.stderr)
                raise
            finally:
                stack.down()
    return {"topology": "gateway, router, 2 prefill, 2 decode (tiny model, CPU)",
            "workload": {"trace": source, "requests": len(jobs), "concurrency": args.concurrency},
            "make_run": make_run, "compose": containers,
            "throughput_ratio": containers["output_tokens_per_s"] / make_run["output_tokens_per_s"]}


async def bench(args: argparse.Namespace) -> dict:
    jobs, source = trace_jobs(args)
    seq_jobs = jobs[: args.sequential]
    with (tempfile.TemporaryDirectory(prefix="windserve-bench-") as tmp, System(Path(tmp) / "d") as system,
          System(Path(tmp) / "c", COLOCATED) as coloc):
        client = system.client()
        offline = Offline()
        await stream_one(client, jobs[0])  # warm-up (model pages, UCX endpoints)
        offline.tpot(jobs[0])
        seq, off = [], []
        for job in seq_jobs:  # served and offline alternate, one request at a time, same requests
            seq.append(await stream_one(client, job))
            off.append(await asyncio.to_thread(offline.tpot, job))
        rows, wall = await concurrent_phase(client, jobs, args.concurrency)
        details = await system.worker_details()
        overlap = await overlap_phase(client, coloc.client(), long_jobs(args.long_prompts))
    pre = details["prefill"]
    sent, full_eq = int(pre["kv_bytes_sent"]), int(pre["kv_full_equivalent_bytes"])
    secs, kv_reqs = float(pre["kv_transfer_seconds"]), int(pre["kv_requests"])
    served_tpot = statistics.median(r["tpot"] for r in seq)
    offline_tpot = statistics.median(off)
    concurrent = summarize(rows, wall, args.concurrency)
    ucx = await raw_vs_engine(sent)
    return {
        "handoff_overlap_ratio": overlap["ratio"], "transfer_bytes_ratio": sent / max(1, full_eq),
        "output_tokens_per_s": concurrent["output_tokens_per_s"], "ttft_p90_ms": concurrent["ttft_p90_ms"],
        "tpot_p90_ms": concurrent["tpot_p90_ms"], "overhead_ms_per_token": 1e3 * (served_tpot - offline_tpot),
        "ucx_engine_over_raw": ucx["engine_over_raw"], "quick": args.quick,
        "workload": {"trace": source, "requests": len(jobs), "in_scale": args.in_scale,
                     "out_scale": args.out_scale, "mean_prompt_tokens": statistics.mean(len(j.prompt) for j in jobs),
                     "mean_output_tokens": statistics.mean(j.max_tokens for j in jobs)},
        "concurrent": concurrent,
        "kv_transfer": {"requests": kv_reqs, "bytes_per_request": sent / max(1, kv_reqs),
                        "full_kv_bytes_per_request": full_eq / max(1, kv_reqs),
                        "transfer_bytes_ratio": sent / max(1, full_eq), "dual_pool_limit": dual_pool_limit(jobs),
                        "decode_hit_tokens": int(details["decode"]["kv_hit_tokens"]),
                        "served_engine_gbps": sent / secs / 1e9 if secs else 0.0},
        "ucx": ucx,
        "overhead": {"sequential_requests": len(seq), "served_tpot_ms": 1e3 * served_tpot,
                     "offline_tpot_ms": 1e3 * offline_tpot,
                     "overhead_ms_per_token": 1e3 * (served_tpot - offline_tpot),
                     "served_over_offline": served_tpot / offline_tpot},
        "handoff_overlap": overlap,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sequential", type=int, default=10, help="requests of the overhead phase (one at a time)")
    p.add_argument("--in-scale", type=int, default=64, help="trace input lengths are divided by this")
    p.add_argument("--out-scale", type=int, default=16, help="trace output lengths are divided by this")
    p.add_argument("--max-in", type=int, default=1024)
    p.add_argument("--max-out", type=int, default=48)
    p.add_argument("--long-prompts", type=int, default=8, help="prompts of the overlap figure (each way)")
    p.add_argument("--overlap-only", action="store_true", help="measure only handoff_overlap_ratio")
    p.add_argument("--out", type=Path, default=None,
                   help="the JSON (PNG beside it); default bench/results/serving.json (--quick: "
                        ".run/bench-quick/serving.json; --overlap-only: serving_overlap.json; --compose: "
                        "serving_compose.json)")
    p.add_argument("--compose", action="store_true", help="only containerised 2x2 (docker compose) vs make run's")
    p.add_argument("--base-image", default=os.environ.get("WINDSERVE_BASE_IMAGE", "windserve-base:bookworm"),
                   help="with --compose: base of the image (scripts/compose.py)")
    p.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    args = p.parse_args(argv)
    if args.quick:  # the quick sizes, except where a flag was given
        given = p.parse_args(argv, argparse.Namespace(**dict.fromkeys(QUICK)))
        for k, v in QUICK.items():
            if getattr(given, k) is None:
                setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sys.path.insert(0, str(ROOT))
    if args.compose:
        result = asyncio.run(bench_compose(args))
        out = args.out or RESULTS / "serving_compose.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        for name in ("make_run", "compose"):
            c = result[name]
            print(f"{name}: {c['requests']} req x{c['concurrency']}: TTFT p50 {c['ttft_p50_ms']:.0f} ms p90 "
                  f"{c['ttft_p90_ms']:.0f} ms, TPOT p50 {c['tpot_p50_ms']:.1f} ms p90 {c['tpot_p90_ms']:.1f} ms, "
                  f"{c['output_tokens_per_s']:.0f} output tok/s")
        print(f"compose / make run throughput: {result['throughput_ratio']:.2f} (goal >= 0.9); wrote {out}")
        return 0
    if args.overlap_only:
        result = asyncio.run(bench_overlap(args))
        out = args.out or RESULTS / "serving_overlap.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print_overlap(result["handoff_overlap"])
        print(f"wrote {out}")
        return 0
    result = asyncio.run(bench(args))
    out = args.out or (QUICK_RESULTS if args.quick else RESULTS) / "serving.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    c, kv, u, o = result["concurrent"], result["kv_transfer"], result["ucx"], result["overhead"]
    print(f"concurrent: {c['requests']} req x{c['concurrency']}: TTFT p50 {c['ttft_p50_ms']:.0f} ms p90 "
          f"{c['ttft_p90_ms']:.0f} ms, TPOT p50 {c['tpot_p50_ms']:.1f} ms p90 {c['tpot_p90_ms']:.1f} ms, "
          f"{c['output_tokens_per_s']:.0f} output tok/s")
    print(f"KV: {kv['bytes_per_request'] / 1024:.1f} KiB/request vs full {kv['full_kv_bytes_per_request'] / 1024:.1f}"
          f" KiB: ratio {kv['transfer_bytes_ratio']:.3f} (dual-pool limit {kv['dual_pool_limit']:.3f}); "
          f"served {kv['served_engine_gbps']:.3f} GB/s")
    print(f"UCX same bytes ({u['bytes'] / 2**20:.1f} MiB): engine {u['engine_gbps']:.3f} GB/s, raw "
          f"{u['raw_gbps']:.3f} GB/s ({u['engine_over_raw']:.2f})")
    print(f"overhead: served TPOT {o['served_tpot_ms']:.2f} ms vs offline {o['offline_tpot_ms']:.2f} ms "
          f"(+{o['overhead_ms_per_token']:.2f} ms/token)")
    print_overlap(result["handoff_overlap"])
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


def print_overlap(h: dict) -> None:
    d, c = h["disaggregated"], h["colocated"]
    print(f"hand-off overlap: {h['prompts']} prompts of {h['prompt_tokens']} tokens: 1st->2nd token "
          f"{d['first_to_second_ms']:.1f} ms disaggregated vs {c['first_to_second_ms']:.1f} ms colocated: "
          f"handoff_overlap_ratio {h['ratio']:.2f} (TTFT {d['ttft_ms']:.0f} vs {c['ttft_ms']:.0f} ms)")


if __name__ == "__main__":
    raise SystemExit(main())
