"""KV transfer throughput: the transfer engine vs a raw ucxx tagged send of the same bytes.

    python -m bench.transfer [--mib 64] [--layers 16] [--iters 5] [--quick] [--out PATH]

Receiver in this process, sender in a child process (like prefill -> decode); per UCX transport the engine's
`send` and a raw tagged send per layer alternate round by round on the same workers, each timed from the first
byte offered to the receiver's final answer; the plain-TCP engine is measured too. Writes
bench/results/transfer.json and transfer.png (`HEADLINE_KEYS` top-level, null with the reason under
"null_reasons" for a transport this host lacks). `--quick` is a smoke run (JSON under .run/bench-quick/).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from libs.transfer import LayerSpec, TransferBackend, TransferConfig, create_engine

RESULTS = Path(__file__).resolve().parent / "results"
QUICK_RESULTS = RESULTS.parent.parent / ".run" / "bench-quick"
QUICK = {"mib": 8, "layers": 4, "iters": 2}
RUNS = (("ucx-tcp", "ucx", "tcp"), ("ucx-sm", "ucx", "sm"), ("tcp-fallback", "tcp", "tcp"))
# the headline figures: the transfer engine over raw ucxx per UCX transport, and the fallback engine's GB/s
HEADLINE_KEYS = ("engine_over_raw_ucx_tcp", "engine_over_raw_ucx_sm", "tcp_fallback_gbps")
PAGE_SHAPE = (16, 8, 320)  # page of 16 tokens, 8 KV heads, k 192 + v 128 dims (bf16)
TRANSPORTS = {"tcp": (("TLS", "tcp,self"), ("NET_DEVICES", "lo")), "sm": (("TLS", "sm,self"),)}
RAW_TAG, ACK_TAG = 0x5A00_0000, 0x5AFF_FFFF


def layer_specs(mib: int, layers: int) -> list[LayerSpec]:
    page_bytes = 2 * PAGE_SHAPE[0] * PAGE_SHAPE[1] * PAGE_SHAPE[2]
    pages = max(1, (mib << 20) // layers // page_bytes)
    return [LayerSpec("swa" if i % 6 else "full", i, pages, "bfloat16", (pages, *PAGE_SHAPE)) for i in range(layers)]


def make_layers(specs: list[LayerSpec]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(s.shape).to(torch.bfloat16) for s in specs]


def raw_tag(iteration: int, layer: int) -> int:
    return RAW_TAG + iteration * 4096 + layer


# -- the raw ucxx path (shared with bench.gcache: the baseline every engine is measured against) ---------
def ucx_env(transport: str) -> dict[str, str]:
    """The UCX_* variables of a transport, for processes that take their UCX settings from the environment."""
    return {f"UCX_{k}": v for k, v in TRANSPORTS[transport]}


def raw_address(engine) -> str:
    """The engine's UCX worker address, base64 (what a raw peer dials)."""
    return base64.b64encode(bytes(engine.ucx_context.worker_address)).decode()


async def raw_connect(engine, peer: str):
    """A raw endpoint from the engine's own UCX worker to a peer's (base64) worker address."""
    import ucxx

    return await engine.ucx_context.create_endpoint_from_worker_address(
        ucxx.get_ucx_address_from_buffer(base64.b64decode(peer)),
        endpoint_error_handling=engine.config.endpoint_error_handling())


async def raw_send(ep, bufs, tag0: int) -> None:
    """Send the buffers one after another as tagged messages tag0, tag0 + 1, ..."""
    for i, b in enumerate(bufs):
        await ep.send(b, tag=tag0 + i, force_tag=True)


def raw_post_recvs(engine, bufs, tag0: int) -> list[asyncio.Future]:
    """Post one tagged receive per buffer on the engine's worker (any peer), tags tag0, tag0 + 1, ..."""
    return [asyncio.ensure_future(engine.ucx_context.recv(b, tag=tag0 + i)) for i, b in enumerate(bufs)]


async def raw_ack(ep, tag: int) -> None:
    await ep.send(torch.ones(1, dtype=torch.uint8).numpy(), tag=tag, force_tag=True)


async def raw_wait_ack(engine, tag: int) -> None:
    await engine.ucx_context.recv(torch.zeros(1, dtype=torch.uint8).numpy(), tag=tag)


def as_bytes(t: torch.Tensor):
    """A tensor's bytes as a flat uint8 numpy view (what ucxx sends and receives into)."""
    return t.view(torch.uint8).numpy().reshape(-1)


# -- sender (child process) ----------------------------------------------------------------
async def sender(args: argparse.Namespace) -> None:
    specs = layer_specs(args.mib, args.layers)
    src = make_layers(specs)
    engine = create_engine(TransferConfig(ucx_options=TRANSPORTS.get(args.transport, ())),
                           TransferBackend(args.backend))
    await engine.start()
    ep = None
    if args.backend == "ucx":
        print("ADDR", raw_address(engine), flush=True)  # the raw path uses the very same UCX worker as the engine
        ep = await raw_connect(engine, args.peer)
    else:
        print("ADDR -", flush=True)
    loop = asyncio.get_running_loop()
    while (line := (await loop.run_in_executor(None, sys.stdin.readline)).split()):
        method, iteration = line[0], int(line[1])
        start = time.perf_counter()
        if method == "engine":
            await engine.send(args.address, f"it{iteration}", specs, src)
        else:
            await raw_send(ep, [as_bytes(t) for t in src], raw_tag(iteration, 0))
            await raw_wait_ack(engine, ACK_TAG + iteration)
        print("T", method, iteration, time.perf_counter() - start, flush=True)
    await engine.close()


# -- receiver (this process) -----------------------------------------------------------------
async def measure(backend: str, transport: str, mib: int, layers: int, iters: int) -> dict[str, list[float]]:
    specs = layer_specs(mib, layers)
    engine = create_engine(TransferConfig(ucx_options=TRANSPORTS.get(transport, ())), TransferBackend(backend))
    await engine.start()
    peer = raw_address(engine) if backend == "ucx" else "-"
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.transfer", "--role", "sender", "--backend", backend, "--transport", transport,
         "--address", engine.address, "--peer", peer, "--mib", str(mib), "--layers", str(layers)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    async def read() -> list[str]:
        return (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)).split()

    def order(method: str, iteration: int) -> None:
        proc.stdin.write(f"{method} {iteration}\n")
        proc.stdin.flush()

    times: dict[str, list[float]] = {"engine": [], "raw": []}
    try:
        _, child_addr = await read()
        ep = None
        if backend == "ucx":
            ep = await raw_connect(engine, child_addr)
        dests = [torch.empty(s.shape, dtype=torch.bfloat16) for s in specs]
        for it in range(iters + 1):  # round 0 warms both paths up and is not reported
            inc = engine.expect(f"it{it}", dests)
            order("engine", it)
            await inc.wait(60)
            times["engine"].append(float((await read())[3]))
            if ep is None:
                continue
            recvs = raw_post_recvs(engine, [as_bytes(d) for d in dests], raw_tag(it, 0))
            order("raw", it)
            await asyncio.wait_for(asyncio.gather(*recvs), 60)
            await raw_ack(ep, ACK_TAG + it)
            times["raw"].append(float((await read())[3]))
        reference = make_layers(specs)
        if not all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for a, b in zip(reference, dests, strict=True)):
            raise RuntimeError(f"{backend}/{transport}: received bytes differ from the sent layers")
    finally:
        proc.stdin.close()
        proc.wait(30)
        await engine.close()
    return {k: v[1:] for k, v in times.items() if v}


def summarize(nbytes: int, times: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times), "gbps": nbytes / statistics.median(times) / 1e9,
            "best_gbps": nbytes / min(times) / 1e9}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, engine, raw = [], [], []
    for row in results:
        labels.append(row["name"])
        engine.append(row["engine"]["gbps"])
        raw.append(row["raw"]["gbps"] if "raw" in row else 0.0)
    xs = range(len(labels))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([x - 0.2 for x in xs], engine, 0.4, label="TransferEngine")
    ax.bar([x + 0.2 for x in xs], raw, 0.4, label="raw ucxx send")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"KV transfer, {results[0]['mib']} MiB in {results[0]['layers']} layers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def headline(rows: list[dict], skipped: dict[str, str]) -> dict:
    """HEADLINE_KEYS from the rows; a null one's reason (the run that was skipped) under "null_reasons"."""
    by = {r["name"]: r for r in rows}
    out: dict = {"engine_over_raw_ucx_tcp": by.get("ucx-tcp", {}).get("engine_over_raw"),
                 "engine_over_raw_ucx_sm": by.get("ucx-sm", {}).get("engine_over_raw"),
                 "tcp_fallback_gbps": by["tcp-fallback"]["engine"]["gbps"] if "tcp-fallback" in by else None}
    source = dict(zip(HEADLINE_KEYS, ("ucx-tcp", "ucx-sm", "tcp-fallback"), strict=True))
    out["null_reasons"] = {k: f"{source[k]} skipped: {skipped.get(source[k], 'no result')}"
                           for k in HEADLINE_KEYS if out[k] is None}
    return out


async def main(args: argparse.Namespace) -> None:
    specs = layer_specs(args.mib, args.layers)
    nbytes = sum(s.nbytes for s in specs)
    results = []
    skipped: dict[str, str] = {}
    for name, backend, transport in RUNS:
        try:
            times = await measure(backend, transport, args.mib, args.layers, args.iters)
        except Exception as exc:  # a transport missing on this host is reported, not fatal
            print(f"{name}: skipped ({exc!r})")
            skipped[name] = repr(exc)
            continue
        row = {"name": name, "mib": args.mib, "layers": args.layers, "bytes": nbytes, "iters": args.iters,
               **{k: summarize(nbytes, v) for k, v in times.items()}}
        if "raw" in row:
            row["engine_over_raw"] = row["engine"]["gbps"] / row["raw"]["gbps"]
        results.append(row)
        raw = f", raw {row['raw']['gbps']:.3f} GB/s, ratio {row['engine_over_raw']:.2f}" if "raw" in row else ""
        print(f"{name:13s} engine {row['engine']['gbps']:.3f} GB/s{raw}")
    out = {**headline(results, skipped), "quick": args.quick, "runs": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    if results:
        plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=None, help="total MiB per transfer (default 64, --quick 8)")
    p.add_argument("--layers", type=int, default=None, help="layers per transfer (default 16, --quick 4)")
    p.add_argument("--iters", type=int, default=None, help="measured rounds (default 5, --quick 2)")
    p.add_argument("--quick", action="store_true", help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items()))
    p.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                   "bench/results/transfer.json, with --quick .run/bench-quick/transfer.json")
    p.add_argument("--role", choices=["receiver", "sender"], default="receiver")
    p.add_argument("--backend", default="ucx")
    p.add_argument("--transport", default="tcp")
    p.add_argument("--address", default="")
    p.add_argument("--peer", default="-")
    a = p.parse_args(argv)
    for k, full in (("mib", 64), ("layers", 16), ("iters", 5)):
        if getattr(a, k) is None:
            setattr(a, k, QUICK[k] if a.quick else full)
    a.out = a.out or (QUICK_RESULTS if a.quick else RESULTS) / "transfer.json"
    return a


if __name__ == "__main__":
    cli = parse()
    asyncio.run(sender(cli) if cli.role == "sender" else main(cli))
