"""Probe (not part of the product): what makes a GCache get's node -> client UCX data phase slow?

Two processes on one transfer engine's UCX worker each (the product's UCX settings): a "node" that holds 64 MiB
in several kinds of memory and a "client" that lands them. Every case moves 64 MiB node -> client (a get) or
client -> node (a put) as tagged ucxx messages; the variants are interleaved round by round, so a loaded
machine's noise spreads over all of them.

    python -m bench.ucx_send_probe [--tls sm,self] [--reps 8] [--cases default|all]

Memory kinds (both sides):
  np       numpy array (numpy madvises >= 4 MiB allocations MADV_HUGEPAGE: 2 MiB transparent huge pages)
  bytes    a bytes object, sent through a read-only memoryview (the product's NodeStore.get view) via torch
  mmap     an anonymous mmap (the product's SegmentArena), writable, 4 KiB pages
  mmap_ro  the same, through a read-only memoryview via torch (the product's path for arena values)
  thp      an anonymous mmap madvised MADV_HUGEPAGE
Dispatch: c16 = 16 x 4 MiB sends at once (the product's send_layers), s16 = one after another, one = 1 x 64 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np
import torch

MIB = 1 << 20
TOTAL = 64 * MIB
CTRL_TAG = 0x5150 << 40
DATA_TAG = 0x5151 << 40
ACK_TAG = 0x5152 << 40
KINDS = ("np", "bytes", "mmap", "mmap_ro", "thp")


def make(kind: str, fill: np.ndarray | None) -> tuple[object, object]:
    """(keep-alive owner, a flat uint8 numpy view ucxx accepts, as the product hands it) of TOTAL bytes."""
    if kind == "np":
        a = np.empty(TOTAL, dtype=np.uint8)
        a[:] = 0 if fill is None else fill
        return a, a
    if kind == "bytes":
        b = bytes(TOTAL) if fill is None else fill.tobytes()
        view = memoryview(b).toreadonly()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return b, torch.frombuffer(view, dtype=torch.uint8).numpy()
    m = mmap.mmap(-1, TOTAL, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if kind == "thp":
        m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    a[:] = 0 if fill is None else fill
    if kind == "mmap_ro":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return (m, a), torch.frombuffer(memoryview(m).toreadonly(), dtype=torch.uint8).numpy()
    return (m, a), a


def chunks(arr: np.ndarray, dispatch: str) -> list[np.ndarray]:
    n = 1 if dispatch == "one" else 16
    size = TOTAL // n
    return [arr[i * size:(i + 1) * size] for i in range(n)]


async def send_all(ep, bufs: list[np.ndarray], dispatch: str, tag0: int) -> None:
    if dispatch == "s16":
        for i, b in enumerate(bufs):
            await ep.send(b, tag=tag0 + i, force_tag=True)
    else:
        await asyncio.gather(*(ep.send(b, tag=tag0 + i, force_tag=True) for i, b in enumerate(bufs)))


def post(engine, bufs: list[np.ndarray], tag0: int) -> list[asyncio.Future]:
    return [asyncio.ensure_future(engine.ucx_context.recv(b, tag=tag0 + i)) for i, b in enumerate(bufs)]


async def open_engine():
    from bench.transfer import raw_address
    from libs.transfer import TransferBackend, TransferConfig, create_engine

    engine = create_engine(TransferConfig(), TransferBackend.UCX)
    await engine.start()
    return engine, raw_address(engine)


def anon_huge_kib() -> int:
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages"):
            return int(line.split()[1])
    return -1


# ---------------------------------------------------------------------------------------------- node (child)


async def node_main() -> None:
    from bench.transfer import raw_connect

    engine, addr = await open_engine()
    print("ADDR", addr, flush=True)
    peer = sys.stdin.readline().split()[1]
    ep = await raw_connect(engine, peer)
    fill = np.random.default_rng(1).integers(0, 256, TOTAL, dtype=np.uint8)
    mem = {k: make(k, fill) for k in KINDS}
    print("HUGE", anon_huge_kib(), flush=True)
    ctrl = np.zeros(4, dtype=np.int64)
    while True:
        await engine.ucx_context.recv(ctrl, tag=CTRL_TAG)
        op, kind_i, disp_i, rep = (int(x) for x in ctrl)
        if op == 0:
            break
        kind, dispatch = KINDS[kind_i], ("c16", "s16", "one")[disp_i]
        bufs = chunks(mem[kind][1], dispatch)
        tag0 = DATA_TAG + (rep << 8)
        if op == 1:  # get: node -> client
            await send_all(ep, bufs, dispatch, tag0)
        else:  # put: client -> node, into this kind of memory, then an ack
            await asyncio.gather(*post(engine, bufs, tag0))
            await ep.send(np.ones(1, dtype=np.uint8), tag=ACK_TAG + rep, force_tag=True)
    await engine.close()


# ---------------------------------------------------------------------------------------------- client (main)


async def client_main(args: argparse.Namespace) -> dict:
    from bench.transfer import raw_connect, ucx_env

    env = {**os.environ, **ucx_env(args.transport)}
    os.environ.update(ucx_env(args.transport))
    child = subprocess.Popen([sys.executable, "-m", "bench.ucx_send_probe", "--role", "node"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=os.getcwd())
    try:
        engine, addr = await open_engine()
        assert child.stdout is not None and child.stdin is not None
        line = ""
        while not line.startswith("ADDR"):
            line = child.stdout.readline()
            if not line:
                raise RuntimeError("node child died")
        child.stdin.write(f"ADDR {addr}\n")
        child.stdin.flush()
        ep = await raw_connect(engine, line.split()[1])
        huge_node = int(child.stdout.readline().split()[1])
        fill = np.random.default_rng(2).integers(0, 256, TOTAL, dtype=np.uint8)
        mine = {k: make(k, fill) for k in ("np", "mmap", "thp")}
        # (node kind, client kind, dispatch, op) cases
        if args.cases == "all":
            cases = [(nk, ck, d, op) for op in ("get", "put") for nk in KINDS for ck in ("np", "mmap", "thp")
                     for d in ("c16", "s16", "one")]
        else:
            cases = ([(nk, "np", "c16", "get") for nk in KINDS]
                     + [("mmap_ro", ck, "c16", "get") for ck in ("mmap", "thp")]
                     + [("thp", ck, "c16", "get") for ck in ("mmap", "thp")]
                     + [("mmap_ro", "mmap", d, "get") for d in ("s16", "one")]
                     + [("thp", "thp", d, "get") for d in ("s16", "one")]
                     + [(nk, ck, "c16", "put") for nk, ck in (("mmap", "np"), ("mmap", "mmap"), ("thp", "thp"),
                                                               ("np", "np"))])
        times: dict[str, list[float]] = {f"{op} node={nk} client={ck} {d}": [] for nk, ck, d, op in cases}
        rep = 0
        for r in range(args.reps + 1):  # round 0: warm-up (not counted)
            for nk, ck, d, op in (cases if r % 2 else list(reversed(cases))):
                rep += 1
                bufs = chunks(mine[ck][1], d)
                ctrl = np.array([1 if op == "get" else 2, KINDS.index(nk), ("c16", "s16", "one").index(d), rep],
                                dtype=np.int64)
                tag0 = DATA_TAG + (rep << 8)
                t0 = time.perf_counter()
                if op == "get":
                    recvs = post(engine, bufs, tag0)
                    await ep.send(ctrl, tag=CTRL_TAG, force_tag=True)
                    await asyncio.gather(*recvs)
                else:
                    ack = asyncio.ensure_future(engine.ucx_context.recv(np.zeros(1, dtype=np.uint8),
                                                                        tag=ACK_TAG + rep))
                    await ep.send(ctrl, tag=CTRL_TAG, force_tag=True)
                    await send_all(ep, bufs, d, tag0)
                    await ack
                dt = time.perf_counter() - t0
                if r:
                    times[f"{op} node={nk} client={ck} {d}"].append(dt * 1e3)
        await ep.send(np.zeros(4, dtype=np.int64), tag=CTRL_TAG, force_tag=True)
        out = {"transport": args.transport, "reps": args.reps, "load_avg": os.getloadavg(),
               "anon_huge_kib": {"node": huge_node, "client": anon_huge_kib()},
               "ms": {k: {"median": round(statistics.median(v), 1), "min": round(min(v), 1),
                          "max": round(max(v), 1)} for k, v in times.items()}}
        child.wait(timeout=30)
        await engine.close()
        return out
    finally:
        if child.poll() is None:
            child.kill()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=["client", "node"], default="client")
    p.add_argument("--transport", default="sm", help="bench.transfer's transport name (sm, tcp)")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--cases", choices=["default", "all"], default="default")
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args()
    if args.role == "node":
        asyncio.run(node_main())
        return
    out = asyncio.run(client_main(args))
    print(f"{out['transport']} load {out['load_avg']} anon huge KiB {out['anon_huge_kib']}")
    print(f"{'case':48s} {'median':>7s} {'min':>7s} {'max':>7s}  (ms per 64 MiB)")
    for k, v in out["ms"].items():
        print(f"{k:48s} {v['median']:7.1f} {v['min']:7.1f} {v['max']:7.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
