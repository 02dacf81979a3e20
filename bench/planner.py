"""`python -m bench.planner`: the SLA planner (#38) against a load that ramps up x4 and back down.

`make run`'s supervisor (`python -m scripts.run`) runs gateway, router, worker and planner; the workers are
timing-model engines (`WINDSERVE_ENGINE_MODE=mock`) with the profile below, the planner acts through the
supervisor connector and sizes `worker` within 1..MAX_WORKERS. An open-loop client sends Poisson arrivals at
BASE req/s, ramps to 4 x BASE, holds, ramps back and holds (PHASES), each request a streamed completion of
PROMPT tokens (its first SHARED tokens one of 10 prefixes) and OUTPUT tokens.

Headline keys: `sla_attainment` (share of requests whose TTFT and whose own ITL p90 are both within the targets;
goal >= 0.95), `instance_seconds_vs_static_peak` (worker-seconds used / the most workers the run held x its
length; goal <= 0.7), `requests_failed` (goal 0: a scale-down drains), `scale_up_reaction_s` (from the start of
the ramp up until the gateway lists more workers than then), `direction_changes` (per ramp phase, goal
<= 1). `--quick`: a short ramp (the same code paths). Results: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from libs.engine.mock_profile import MockProfile
from tests.fixtures.faults import prompt

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUICK_RESULTS = ROOT / ".run" / "bench-quick"
HEADLINE_KEYS = ("sla_attainment", "instance_seconds_vs_static_peak", "requests_failed", "scale_up_reaction_s")
# a slow engine (a worker holds about one request a second), so that 4x the base load needs 4 of them while the
# client, gateway and router stay light enough for 2 cores
PROFILE = MockProfile(fixed_s=0.015, per_token_s=0.003, per_pair_s=0.0, per_prefill_seq_s=0.005,
                      source="bench.planner: a slow engine for the planner's ramp")
STEP_TOKENS = 24  # the workers' token budget per step: a prefill chunk stalls the decodes beside it < 100 ms
SLA_TTFT_S, SLA_ITL_S = 1.5, 0.1
PROMPT, SHARED, OUTPUT, BASE, MAX_WORKERS = 128, 64, 48, 1.5, 6
# (name, seconds, rate at its start, rate at its end) in multiples of BASE
PHASES = (("base", 30, 1, 1), ("up", 60, 1, 4), ("peak", 60, 4, 4), ("down", 60, 4, 1), ("tail", 60, 1, 1))
QUICK_PHASES = (("base", 10, 1, 1), ("up", 20, 1, 4), ("peak", 20, 4, 4), ("down", 20, 4, 1), ("tail", 30, 1, 1))
PLANNER_ENV = {"WINDSERVE_PLANNER_INTERVAL_S": "3", "WINDSERVE_PLANNER_LEAD_S": "9",
               "WINDSERVE_PLANNER_DOWN_AFTER": "3", "WINDSERVE_PLANNER_COOLDOWN_S": "20"}


def rate_at(t: float, phases: tuple) -> float:
    for _, seconds, a, b in phases:
        if t < seconds:
            return BASE * (a + (b - a) * t / seconds)
        t -= seconds
    return 0.0


@dataclass
class Result:
    sent_at: float
    ok: bool = False
    error: str = ""
    ttft_s: float = math.inf
    gaps: list[float] = field(default_factory=list)

    @property
    def itl_p90_s(self) -> float:
        g = sorted(self.gaps)
        return g[min(len(g) - 1, int(0.9 * len(g)))] if g else 0.0

    def met(self) -> bool:
        return self.ok and self.ttft_s <= SLA_TTFT_S and self.itl_p90_s <= SLA_ITL_S


async def one(client: httpx.AsyncClient, url: str, k: int, t0: float) -> Result:
    r = Result(time.monotonic() - t0)
    ids = prompt(k % 10, SHARED) + prompt(100_000 + k, PROMPT - SHARED)
    body = {"model": "windserve-tiny", "prompt": ids, "max_tokens": OUTPUT, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    start = last = time.monotonic()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = str(chunk["error"])[:200]
                    return r
                tokens = len(chunk["choices"][0].get("token_ids") or ()) if chunk.get("choices") else 0
                if not tokens:
                    continue
                now = time.monotonic()
                if r.ttft_s == math.inf:
                    r.ttft_s = now - start
                else:
                    r.gaps.extend([(now - last) / tokens] * tokens)
                last = now
        r.ok = r.ttft_s < math.inf
        r.error = "" if r.ok else "no token"
    except httpx.HTTPError as exc:
        r.error = repr(exc)[:200]
    return r


async def load(url: str, phases: tuple, seed: int) -> list[Result]:
    rng = random.Random(seed)
    total = sum(p[1] for p in phases)
    t0 = time.monotonic()
    tasks = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
        t, k = 0.0, 0
        while True:
            t += rng.expovariate(max(rate_at(t, phases), 1e-3))  # (thinning is not needed at these slopes)
            if t >= total:
                break
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            tasks.append(asyncio.create_task(one(client, url, k, t0)))
            k += 1
        return list(await asyncio.gather(*tasks))


async def watch(url: str, stop: asyncio.Event, t0: float) -> list[tuple[float, int]]:
    """(seconds since t0, workers the gateway lists) every half second."""
    out: list[tuple[float, int]] = []
    async with httpx.AsyncClient(timeout=5) as client:
        while not stop.is_set():
            try:
                body = (await client.get(f"{url}/health")).json()
                out.append((time.monotonic() - t0, len(body.get("services", {}).get("worker", []))))
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.5)
    return out


def start_run(run_dir: Path, port: int, profile: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "WINDSERVE_ENGINE_MODE": "mock", "WINDSERVE_COMPILE": "0",
           "WINDSERVE_MOCK_PROFILE": str(profile), "WINDSERVE_PLANNER_PROFILE": str(profile),
           "WINDSERVE_SLA_TTFT_P90_MS": str(SLA_TTFT_S * 1000), "WINDSERVE_SLA_ITL_P90_MS": str(SLA_ITL_S * 1000),
           "WINDSERVE_PLANNER_ROLES": f"worker=1:{MAX_WORKERS}", "WINDSERVE_MAX_NUM_BATCHED_TOKENS": str(STEP_TOKENS),
           **PLANNER_ENV}
    log = open(run_dir / "run.log", "wb")  # noqa: SIM115 (kept open for the child's life)
    return subprocess.Popen([sys.executable, "-m", "scripts.run", "--services", "gateway,router,worker,planner",
                             "--http-port", str(port), "--run-dir", str(run_dir), "--ready-timeout", "180"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"make run exited {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"not ready within {timeout_s:.0f} s")


def phase_of(t: float, phases: tuple) -> str:
    for name, seconds, _, _ in phases:
        if t < seconds:
            return name
        t -= seconds
    return phases[-1][0]


def summarize(results: list[Result], counts: list[tuple[float, int]], phases: tuple) -> dict:
    length = sum(p[1] for p in phases)
    used = sum(a[1] * (b[0] - a[0]) for a, b in zip(counts, counts[1:], strict=False))  # worker-seconds
    peak = max((n for _, n in counts), default=1)
    up_start = next(sum(p[1] for p in phases[:i]) for i, p in enumerate(phases) if p[0] == "up")
    first = next((n for t, n in counts if t >= up_start), 1)  # the workers when the ramp began
    added = next((t for t, n in counts if t >= up_start and n > first), None)
    changes: dict[str, int] = {}
    trend = [(t, b - a) for (t, a), (_, b) in zip(counts, counts[1:], strict=False) if b != a]
    for name in dict.fromkeys(p[0] for p in phases):
        signs = [d > 0 for t, d in trend if phase_of(t, phases) == name]
        changes[name] = sum(x != y for x, y in zip(signs, signs[1:], strict=False))
    failed = [r for r in results if not r.ok]
    return {
        "sla_attainment": round(sum(r.met() for r in results) / len(results), 4) if results else None,
        "instance_seconds_vs_static_peak": round(used / (peak * length), 3) if counts else None,
        "requests_failed": len(failed),
        "scale_up_reaction_s": round(added - up_start, 1) if added is not None else None,
        "direction_changes": changes, "requests_total": len(results), "peak_workers": peak,
        "worker_seconds": round(used, 1), "length_s": length,
        "ttft_met_share": round(sum(r.ok and r.ttft_s <= SLA_TTFT_S for r in results) / max(1, len(results)), 4),
        "itl_met_share": round(sum(r.ok and r.itl_p90_s <= SLA_ITL_S for r in results) / max(1, len(results)), 4),
        "sla": {"ttft_p90_s": SLA_TTFT_S, "itl_p90_s": SLA_ITL_S}, "errors": [r.error for r in failed][:10],
        "phases": [list(p) for p in phases], "base_rate": BASE, "prompt_tokens": PROMPT, "output_tokens": OUTPUT,
        "profile": asdict(PROFILE), "planner": PLANNER_ENV,
    }


def plot(result: dict, results: list[Result], counts: list[tuple[float, int]], phases: tuple, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    length = sum(p[1] for p in phases)
    ts = [i / 2 for i in range(int(length * 2))]
    a.plot(ts, [rate_at(t, phases) for t in ts])
    a.set_ylabel("offered req/s")
    b.step([t for t, _ in counts], [n for _, n in counts], where="post")
    b.set_ylabel("workers listed")
    ok = [r for r in results if r.ok]
    c.scatter([r.sent_at for r in ok], [r.ttft_s for r in ok], s=4, label="TTFT")
    c.scatter([r.sent_at for r in ok], [r.itl_p90_s for r in ok], s=4, label="ITL p90 (per request)")
    c.axhline(SLA_TTFT_S, ls="--", c="C0")
    c.axhline(SLA_ITL_S, ls="--", c="C1")
    c.set_yscale("log")
    c.set_ylabel("seconds")
    c.set_xlabel("seconds into the run")
    c.legend()
    fig.suptitle(f"planner: SLA attainment {result['sla_attainment']}, instance-seconds vs static peak "
                 f"{result['instance_seconds_vs_static_peak']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def bench(phases: tuple, seed: int, run_dir: Path) -> tuple[dict, list[Result], list[tuple[float, int]]]:
    from scripts.run import free_port

    profile = run_dir / "profile.json"
    PROFILE.save(profile)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_run(run_dir, port, profile)
    try:
        await asyncio.to_thread(wait_ready, url, proc, 240)
        stop = asyncio.Event()
        t0 = time.monotonic()
        watcher = asyncio.create_task(watch(url, stop, t0))
        results = await load(url, phases, seed)
        stop.set()
        counts = await watcher
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return summarize(results, counts, phases), results, counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a short ramp")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                                                           "bench/results/planner.json")
    ap.add_argument("--run-dir", type=Path, default=ROOT / ".run" / "bench-planner",
                    help="the deployment's logs and NATS store (emptied first; kept after the run)")
    args = ap.parse_args(argv)
    phases = QUICK_PHASES if args.quick else PHASES
    run_dir = args.run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    result, results, counts = asyncio.run(bench(phases, args.seed, run_dir))
    out = args.out or (QUICK_RESULTS if args.quick else RESULTS) / "planner.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if result["scale_up_reaction_s"] is None:
        result["null_reasons"] = {"scale_up_reaction_s": "no worker was added after the ramp began"}
    out.write_text(json.dumps({**result, "workers_over_time": counts}, indent=2) + "\n")
    plot(result, results, counts, phases, out.with_suffix(".png"))
    for k in HEADLINE_KEYS:
        print(f"{k:34s} {result[k]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
