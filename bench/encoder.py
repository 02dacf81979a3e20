"""Encoder-tier benchmark (#16): batched vs unbatched through the real service, and cached vs cold latency.

    python -m bench.encoder [--quick] [--out PATH]

Runs a real topology (nats-server, one encoder process per configuration) driven by `EncoderClient`, the
configurations taking turns: saturation QPS batched vs unbatched, latency at a fixed offered load, cached vs
cold latency, and `bench.mm_prep.measure` merged into the same JSON. The tower is this checkout's
`libs.model.vision.VisionTower` with the model's vision config (`setup.tower` records which). Writes
bench/results/encoder.json (`HEADLINE_KEYS` top-level) and encoder.png; `--quick` is a smoke run with its
JSON under .run/bench-quick/. Results: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUICK_RESULTS = ROOT / ".run" / "bench-quick"
NAMESPACE = "encbench"
CONCURRENCY = 32
LOAD_SHARE = 0.7
IMAGE_HW = (192, 256)
CONFIGS = {"batched": {"WINDSERVE_MAX_BATCH_ITEMS": "16", "WINDSERVE_MAX_WAIT_MS": "5"},
           "unbatched": {"WINDSERVE_MAX_BATCH_ITEMS": "1", "WINDSERVE_MAX_WAIT_MS": "0"}}
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_LOG_LEVEL": "error"}
GOALS = {"qps_batched_vs_unbatched": ">= 2", "p90_batched_vs_unbatched": "<= 0.8"}
# the headline figures (top-level keys of encoder.json): the encoder's, then bench.mm_prep's (merged in)
HEADLINE_KEYS = (*GOALS, "cached_vs_cold_latency", "preprocess_speedup_vs_transformers", "video_parallel_speedup")


def images(seed: int, n: int, hw: tuple[int, int] = IMAGE_HW) -> list[bytes]:
    """`n` distinct PNGs: a smooth gradient (compresses like a photo more than noise does) plus a little noise."""
    rng = np.random.default_rng(seed)
    h, w = hw
    ramp = (np.add.outer(np.arange(h), np.arange(w)) % 256).astype(np.uint8)
    out = []
    for _ in range(n):
        noise = rng.integers(0, 24, (h, w, 3), dtype=np.uint8)
        ok, buf = cv2.imencode(".png", np.dstack([ramp, ramp[::-1], ramp.T[:h, :w] if h == w else ramp]) + noise)
        assert ok
        out.append(buf.tobytes())
    return out


@contextlib.asynccontextmanager
async def encoder_topology(run_dir: Path, name: str) -> AsyncIterator[Any]:
    """nats-server + one encoder process of configuration `name` in its own namespace (scripts.run's supervisor,
    driven from a thread), and a client for it."""
    from libs.mm.client import EncoderClientConfig, connect_client
    from scripts.run import RunConfig, StopFlag, Supervisor

    namespace = f"{NAMESPACE}_{name}"
    saved = dict(os.environ)
    os.environ.update(UCX_ENV, **CONFIGS[name], WINDSERVE_NAMESPACE=namespace)
    sup = Supervisor(RunConfig(services=(("encoder", 1),), http_port=0, run_dir=run_dir / name,
                               ready_timeout_s=120))
    try:
        sup.start_nats()
        sup.start_services()
        await asyncio.to_thread(sup.wait_ready, StopFlag())
        async with connect_client(sup.nats_url, namespace, EncoderClientConfig(vision=_vision(), encode_timeout_s=120),
                                  wait_s=60) as client:
            yield client
    finally:
        await asyncio.to_thread(sup.stop_all)
        os.environ.clear()
        os.environ.update(saved)


def _vision() -> Any:
    from services.encoder.service import vision_config

    return vision_config(os.environ.get("WINDSERVE_MODEL", ""))


async def _encode(client: Any, rid: str, data: bytes) -> None:
    from protos.messages import MMKind

    await client.encode(rid, MMKind.IMAGE, data)


async def saturation(client: Any, data: list[bytes]) -> tuple[float, list[float]]:
    """CONCURRENCY workers encode `data` (distinct images) as fast as replies come back: (seconds, latencies)."""
    queue = list(reversed(data))
    lat: list[float] = []

    async def worker() -> None:
        while queue:
            d = queue.pop()
            t0 = time.perf_counter()
            await _encode(client, f"sat-{len(queue)}", d)
            lat.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return time.perf_counter() - start, lat


async def fixed_load(client: Any, data: list[bytes], rate: float, seed: int = 7) -> tuple[float, list[float]]:
    """Poisson arrivals at `rate`/s; latency from the scheduled arrival (queueing included) to the reply."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(data)))
    lat: list[float] = []
    start = time.perf_counter()

    async def one(i: int, d: bytes) -> None:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        await _encode(client, f"load-{i}", d)
        lat.append(time.perf_counter() - (start + arrivals[i]))

    await asyncio.gather(*(one(i, d) for i, d in enumerate(data)))
    return time.perf_counter() - start, lat


async def cached_vs_cold(client: Any, data: list[bytes]) -> dict[str, dict[str, float]]:
    cold, cached = [], []
    for i, d in enumerate(data):
        t0 = time.perf_counter()
        await _encode(client, f"cold-{i}", d)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await _encode(client, f"hit-{i}", d)
        cached.append(time.perf_counter() - t0)
    return {"cold": _percentiles(cold), "cached": _percentiles(cached)}


def _percentiles(lat: list[float]) -> dict[str, float]:
    q = np.percentile(np.array(lat) * 1000, [50, 90, 99])
    return {"mean_ms": statistics.fmean(lat) * 1000, "p50_ms": float(q[0]), "p90_ms": float(q[1]),
            "p99_ms": float(q[2])}


def batch_stats(client: Any) -> dict[str, float]:
    """Mean items per tower call and tower seconds, scraped from the encoder's /metrics."""
    from protos.messages import Role

    [entry] = client.view.live(time.time(), Role.ENCODER)
    with urllib.request.urlopen(entry.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith(("windserve_encoder_batch_items_", "windserve_encoder_tower_seconds_"))}
    calls = values.get("windserve_encoder_batch_items_count", 0.0)
    return {"tower_calls": calls,
            "mean_batch_items": values.get("windserve_encoder_batch_items_sum", 0.0) / calls if calls else 0.0,
            "mean_tower_ms": 1000 * values.get("windserve_encoder_tower_seconds_sum", 0.0) / calls if calls else 0.0}


async def phase(clients: dict[str, Any], rounds: int, run: Any) -> dict[str, tuple[float, list[float]]]:
    """`run(client, round)` on each configuration, alternating which goes first per round (a load change on the
    shared machine hits both alike); seconds and latencies pooled over the rounds."""
    pooled: dict[str, tuple[float, list[float]]] = {n: (0.0, []) for n in clients}
    for r in range(rounds):
        for name in (list(clients) if r % 2 == 0 else list(reversed(clients))):
            took, lat = await run(clients[name], r)
            pooled[name] = (pooled[name][0] + took, pooled[name][1] + lat)
    return pooled


async def measure_configs(quick: bool) -> dict[str, Any]:
    n_sat, n_load, rounds = (64, 48, 1) if quick else (200, 150, 2)
    with tempfile.TemporaryDirectory(prefix="encbench-") as tmp:
        async with encoder_topology(Path(tmp), "unbatched") as unbatched, \
                encoder_topology(Path(tmp), "batched") as batched:
            clients = {"unbatched": unbatched, "batched": batched}
            for c in clients.values():  # warm-up (threads, connections, allocator)
                await saturation(c, images(999, CONCURRENCY))
            sat = await phase(clients, rounds, lambda c, r: saturation(c, images(10 + r, n_sat)))
            rate = LOAD_SHARE * len(sat["unbatched"][1]) / sat["unbatched"][0]
            load = await phase(clients, rounds, lambda c, r: fixed_load(c, images(20 + r, n_load), rate, seed=r))
            out: dict[str, Any] = {
                name: {"saturation": {"qps": len(sat[name][1]) / sat[name][0], "requests": len(sat[name][1]),
                                      **_percentiles(sat[name][1])},
                       "fixed_load": {"offered_qps": rate, "achieved_qps": len(load[name][1]) / load[name][0],
                                      "requests": len(load[name][1]), **_percentiles(load[name][1])},
                       **batch_stats(c)}
                for name, c in clients.items()}
            out["cache"] = await cached_vs_cold(batched, images(30, max(10, n_load // 10)))
    out["rounds"] = rounds
    return out


def merge_mm_prep(quick: bool) -> dict[str, Any]:
    """The preprocessing / video-decode figures (`bench.mm_prep.measure`) in the same JSON."""
    from bench.mm_prep import measure

    return dict(measure(quick))


async def measure_all(quick: bool) -> dict[str, Any]:
    runs = await measure_configs(quick)
    batched, unbatched, cache = runs["batched"], runs["unbatched"], runs["cache"]
    vc = _vision()
    return {
        "qps_batched_vs_unbatched": batched["saturation"]["qps"] / unbatched["saturation"]["qps"],
        "p90_batched_vs_unbatched": batched["fixed_load"]["p90_ms"] / unbatched["fixed_load"]["p90_ms"],
        "cached_vs_cold_latency": cache["cached"]["p50_ms"] / cache["cold"]["p50_ms"],
        "goals": GOALS,
        "batched": batched, "unbatched": unbatched, "cache": cache,
        "setup": {
            "tower": _tower_name(vc), "vision_config": {k: getattr(vc, k) for k in (
                "depth", "hidden_size", "patch_size", "spatial_merge_size", "out_hidden_size", "max_pixels")},
            "image_hw": list(IMAGE_HW), "concurrency": CONCURRENCY, "load_share_of_unbatched_qps": LOAD_SHARE,
            "configs": CONFIGS, "rounds": runs["rounds"], "quick": quick, "cpus": os.cpu_count(),
            "transfer": "UCX tcp,self on loopback",
            "encoder_device": os.environ.get("WINDSERVE_DEVICE", "cpu"),
        },
    }


def _tower_name(vc: Any) -> str:
    from libs.model import vision

    stub = "CONTRACT STUB" in (vision.__doc__ or "")
    model = os.environ.get("WINDSERVE_MODEL", "") or "built-in tiny model"
    return (f"{'stub ' if stub else ''}VisionTower of {model} (depth {vc.depth}, hidden {vc.hidden_size}), "
            "random weights")


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = ["unbatched", "batched"]
    axes[0].bar(names, [out[n]["saturation"]["qps"] for n in names], color=["#999", "#3a7"])
    axes[0].set_title(f"saturation QPS (x{out['qps_batched_vs_unbatched']:.2f})")
    pcts = ["p50_ms", "p90_ms", "p99_ms"]
    x = np.arange(len(pcts))
    for i, n in enumerate(names):
        axes[1].bar(x + 0.4 * i, [out[n]["fixed_load"][p] for p in pcts], 0.4, label=n)
    axes[1].set_xticks(x + 0.2, ["p50", "p90", "p99"])
    axes[1].set_title(f"latency at {out['unbatched']['fixed_load']['offered_qps']:.0f} QPS offered (ms)")
    axes[1].legend()
    axes[2].bar(["cold", "cached"], [out["cache"]["cold"]["p50_ms"], out["cache"]["cached"]["p50_ms"]],
                color=["#c63", "#36c"])
    axes[2].set_title("p50 latency, one at a time (ms)")
    fig.suptitle(out["setup"]["tower"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.encoder", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                        "bench/results/encoder.json, with --quick .run/bench-quick/encoder.json")
    args = parser.parse_args(argv)
    path = args.out or (QUICK_RESULTS if args.quick else RESULTS) / "encoder.json"
    out = asyncio.run(measure_all(args.quick))
    out.update(merge_mm_prep(args.quick))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    plot(out, path.with_suffix(".png"))
    for key in HEADLINE_KEYS:
        print(f"{key}: {out[key]:.3f}" + (f" (goal {GOALS[key]})" if key in GOALS else ""))
    print(f"wrote {path} and {path.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
