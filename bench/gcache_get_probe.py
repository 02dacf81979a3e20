"""Probe (not part of the product): one client's put / get of one value against real storage nodes, timed.

    python -m bench.gcache_get_probe [--transport sm] [--mib 64] [--reps 10] [--keep-header-timers] [--nats-path]

Starts bench.gcache's nats-server + storage nodes, puts `--values` values of `--mib` MiB with one GCacheClient
in this process and gets them again and again (gets are repeatable), printing each get's and put's time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.gcache import MIB, NAMESPACE, cache_nodes, child_env, value_key


async def run(args: argparse.Namespace) -> None:
    from libs.gcache import GCacheConfig
    from libs.gcache.client import GCacheClient

    if args.keep_header_timers:  # the old transfer registry, in this (client) process only: A/B of the fix
        from libs.transfer.registry import TransferRegistry

        TransferRegistry._cancel_header_timer = lambda self, request_id: None  # type: ignore[method-assign]

    with tempfile.TemporaryDirectory() as tmp:
        async with cache_nodes(args.transport, Path(tmp)) as url:
            os.environ.update(child_env(args.transport))
            gc = GCacheClient(url, NAMESPACE, GCacheConfig(op_timeout_s=60, direct=not args.nats_path))
            await gc.start()
            size = args.mib * MIB
            src = np.random.default_rng(0).integers(0, 256, size * args.values, dtype=np.uint8)
            view = memoryview(src)
            puts, gets = [], []
            for r in range(args.reps + 1):
                items = [(value_key(0, size, r, i), view[i * size:(i + 1) * size]) for i in range(args.values)]
                t0 = time.perf_counter()
                ok = await gc.put(items)
                t1 = time.perf_counter()
                assert all(ok), ok
                got = await gc.get([k for k, _ in items])
                t2 = time.perf_counter()
                assert all(g is not None and bytes(g) == bytes(v) for g, (_, v) in zip(got, items, strict=True))
                del got
                if r:
                    puts.append((t1 - t0) * 1e3)
                    gets.append((t2 - t1) * 1e3)
                arena = gc._workers[0].allocate.arena
                print(f"round {r}: put {(t1 - t0) * 1e3:7.1f} ms  get {(t2 - t1) * 1e3:7.1f} ms  landing arena: "
                      f"{arena.free_segments() if arena else '-'} free segments, "
                      f"{arena.fallbacks if arena else '-'} fallbacks", flush=True)
            print(f"median put {statistics.median(puts):.1f} ms ({args.values * size / statistics.median(puts) / 1e6:.2f}"
                  f" GB/s), get {statistics.median(gets):.1f} ms "
                  f"({args.values * size / statistics.median(gets) / 1e6:.2f} GB/s); load {os.getloadavg()}")
            await gc.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--transport", default="sm")
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--values", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--keep-header-timers", action="store_true",
                   help="the client's transfer registry as before the fix (a finished transfer's header timer "
                        "keeps its landing buffers for 60 s)")
    p.add_argument("--nats-path", action="store_true",
                   help="the NATS request + transfer path instead of the direct one (A/B)")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
