"""GCache (L3) benchmark: throughput against raw ucxx and Redis, a cluster simulation with and without a shared
L3, and the two engine figures (TTFT of an L3 hit, L3 bytes per cached token).

    python -m bench.gcache [--quick] [--out PATH] [--transports sm,tcp] [--skip-throughput] [--skip-engine]

Throughput: put / get GB/s of real storage nodes against raw ucxx (plain and checksummed), Redis and plain
loopback TCP, same values, same run, per UCX transport. Simulation (bench.router's simulator): hit share
of N workers with and without a pooled L3. Engine figures on a real topology, null with the reason where
the node or integration is missing. Goals in `GOALS`; writes bench/results/gcache.json (`HEADLINE_KEYS`
top-level) and gcache.png. Method and latest figures: bench/README.md, "bench.gcache".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MIB = 1 << 20
GIB = 1 << 30
SIZES_MIB = (1, 4, 16, 64)
CLIENTS = (1, 4)
ROUND_BYTES = 64 * MIB  # per client per round (one 64 MiB value, or 64 of 1 MiB)
ITERS = 5
NODES = 2
NAMESPACE = "gcbench"  # the deployment namespace of the bench's nats-server (subjects, registry)
REDIS_SERVER = "/usr/bin/redis-server"
OP_TIMEOUT_S = 120.0  # bound of one round (a 2-core CI box moving 4 x 64 MiB through Python)
HEADLINE_MIN_MIB = 4
# The storage nodes' tiers for the bench: memory only, room for more than any round writes (older keys are
# evicted LRU; a get reads the keys of its own round).
# Their memory is pre-faulted at start (WINDSERVE_PREFAULT): as the raw baseline's buffers, touched before the
# rounds; the node is ready once its arena is populated.
NODE_ENV = {"WINDSERVE_MEMORY_BYTES": str(3 * GIB), "WINDSERVE_DISK_BYTES": "0", "WINDSERVE_PREFAULT": "1"}
QUICK_NODE_MEMORY = 256 * MIB  # --quick: its rounds write 2 x 8 MiB per size; 3 GiB takes seconds to pre-fault
QUICK_RESULTS = ROOT / ".run" / "bench-quick"
GOALS = {"put_vs_raw_ucx": ">= 0.8", "get_vs_raw_ucx": ">= 0.8", "put_vs_redis": ">= 3", "get_vs_redis": ">= 3",
         "gcache_cluster_hit_share": ">= 0.95", "l3_hit_ttft_ratio": "<= 0.5", "l3_bytes_per_token_ratio": "<= 1.05"}
HASHED_KEYS = ("hashed_raw_put_vs_raw_ucx", "hashed_raw_get_vs_raw_ucx", "put_vs_hashed_raw", "get_vs_hashed_raw")
HEADLINE_KEYS = (*GOALS, "no_gcache_cluster_hit_share", "plain_tcp_put_vs_redis", *HASHED_KEYS)
THROUGHPUT_KEYS = ("put_vs_raw_ucx", "get_vs_raw_ucx", "put_vs_redis", "get_vs_redis", "plain_tcp_put_vs_redis",
                   *HASHED_KEYS)  # the headline keys the throughput part sets


def gcache_missing() -> str | None:
    """Why GCacheClient over real nodes cannot run in this checkout (None: it can)."""
    if importlib.util.find_spec("libs.gcache.client") is None:
        return "needs wave4-node: libs/gcache/client.py (GCacheClient) is not in this checkout"
    if not (ROOT / "services" / "cache" / "__main__.py").exists():
        return "needs wave4-node: services/gcache/__main__.py (the storage node) is not in this checkout"
    return None


# ============================================================================ 1. throughput: child processes


def value_key(client: int, size: int, it: int, i: int) -> str:
    """A real GCache key (namespace of a fake model, a block hash) distinct per client, size, round, value."""
    from libs.gcache.keys import full_key, model_namespace

    ns = model_namespace("bench-gcache", "bench", 64, "uint8", 0)
    return full_key(ns, xxhash.xxh64_intdigest(f"{client}:{size}:{it}:{i}".encode()))


def raw_tag(client: int, kind: int, it: int, server: int) -> int:
    """First tag of one message group; + j for the group's j-th value. kinds: 1 put data, 2 put ack,
    3 get request, 4 get data, 5 put sums, 6 get verdict (the last two: the checksummed baseline). Unique per
    receiving worker (client and server both in it)."""
    return 0x47 << 56 | client << 48 | kind << 44 | server << 36 | it << 20


PUT, ACK, REQ, GET, SUMS, VERDICT = 1, 2, 3, 4, 5, 6


def checksums(values: Sequence[np.ndarray]) -> np.ndarray:
    """The values' GCache checksums (libs.gcache.keys.value_checksum, xxh3-64), as the bytes of a uint64 array."""
    from libs.gcache.keys import value_checksum

    return np.array([value_checksum(v) for v in values], dtype=np.uint64).view(np.uint8)


def spread(client: int, n: int, servers: int) -> dict[int, list[int]]:
    """Raw baseline placement: value i of client c on server (c + i) % servers."""
    out: dict[int, list[int]] = {}
    for i in range(n):
        out.setdefault((client + i) % servers, []).append(i)
    return out


def source(seed: int) -> np.ndarray:
    """A client's value bytes: one round's worth, random (xxh64 and the wire see no pattern)."""
    return np.random.default_rng(seed).integers(0, 256, ROUND_BYTES, dtype=np.uint8)


def same_bytes(value: Any, expected: np.ndarray) -> bool:
    """A got value (any buffer) byte-equal to `expected`, compared in place: no copy of either (copies of 2 x 64
    MiB per check faulted in fresh memory between the timed rounds)."""
    return np.array_equal(np.frombuffer(memoryview(value).cast("B"), dtype=np.uint8), expected)


def landed(values: Sequence[Any], size: int) -> int:
    """How many of a get's values came back whole."""
    return sum(1 for v in values if v is not None and len(v) == size)


class KVBackend:
    """A key-value client of the bench (GCache, Redis): `start` connects, `put` / `get` move one batch."""

    def __init__(self, client: int, where: Any) -> None:
        self.client, self.where = client, where
        self.src = source(client)
        self.last: list[Any] = []


class RawClient:
    """A client of the raw ucxx baseline: values as tagged messages on a transfer engine's own UCX worker.

    `hashed` (the checksummed baseline) adds the one hash per value a GCache call must make, by the side
    holding the value at rest, while it moves: a put's client sends the sums once computed, a get's server a
    one-byte verdict; a call ends once values and sums or verdicts are in.
    """

    def __init__(self, client: int, servers: int, hashed: bool = False) -> None:
        self.client, self.servers, self.hashed = client, servers, hashed
        self.eps: list[Any] = []

    async def start(self) -> str:
        from bench.transfer import raw_address
        from libs.transfer import TransferBackend, TransferConfig, create_engine

        self.engine = create_engine(TransferConfig(), TransferBackend.UCX)  # UCX settings from the environment
        await self.engine.start()
        self.src = source(self.client)
        self.dst = np.empty(ROUND_BYTES, dtype=np.uint8)
        self.dst.fill(0)  # touched before the rounds (a GCache client's landing arena is warm after its warm-up)
        return raw_address(self.engine)

    async def peers(self, addrs: Sequence[str]) -> None:
        from bench.transfer import raw_connect

        self.eps = [await raw_connect(self.engine, a) for a in addrs]

    async def put(self, size: int, n: int, it: int) -> int:
        from bench.transfer import raw_send, raw_wait_ack

        async def one(s: int, idx: list[int]) -> None:
            values = [self.src[i * size:(i + 1) * size] for i in idx]

            async def sums() -> None:  # sent as soon as hashed, while the values may still be in flight
                if self.hashed:
                    await raw_send(self.eps[s], [await asyncio.to_thread(checksums, values)],
                                   raw_tag(self.client, SUMS, it, s))

            await asyncio.gather(sums(), raw_send(self.eps[s], values, raw_tag(self.client, PUT, it, s)))
            await raw_wait_ack(self.engine, raw_tag(self.client, ACK, it, s))

        await asyncio.gather(*(one(s, idx) for s, idx in spread(self.client, n, self.servers).items()))
        return n

    async def get(self, size: int, n: int, it: int) -> int:
        from bench.transfer import raw_ack, raw_post_recvs

        recvs = []
        plan = spread(self.client, n, self.servers)
        for s, idx in plan.items():
            recvs += raw_post_recvs(self.engine, [self.dst[i * size:(i + 1) * size] for i in idx],
                                    raw_tag(self.client, GET, it, s))
            if self.hashed:
                recvs += raw_post_recvs(self.engine, [np.empty(1, dtype=np.uint8)],
                                        raw_tag(self.client, VERDICT, it, s))
        for s in plan:
            await raw_ack(self.eps[s], raw_tag(self.client, REQ, it, s))
        await asyncio.gather(*recvs)
        return n

    async def close(self) -> None:
        await self.engine.close()


class RawServer:
    """The raw baseline's stand-in for a storage node: receives put values into memory, sends get values."""

    def __init__(self, index: int, servers: int, hashed: bool = False) -> None:
        self.index, self.servers, self.hashed = index, servers, hashed
        self.eps: list[Any] = []
        self.tasks: set[asyncio.Task] = set()
        self.land: dict[int, np.ndarray] = {}
        self.sums: dict[int, np.ndarray] = {}  # (hashed) the last put's sums per client, as they came

    async def start(self) -> str:
        client = RawClient(1000 + self.index, 1)
        addr = await client.start()
        self.engine, self.src = client.engine, client.src
        return addr

    async def peers(self, addrs: Sequence[str]) -> None:
        from bench.transfer import raw_connect

        self.eps = [await raw_connect(self.engine, a) for a in addrs]

    def expect(self, op: str, client: int, size: int, n: int, it: int) -> None:
        """Post what `client`'s next `op` round needs on this server, and answer it in a background task."""
        from bench.transfer import raw_ack, raw_post_recvs, raw_send

        idx = spread(client, n, self.servers).get(self.index, [])
        if not idx:
            return
        if op == "put":
            land = self.landing(client)
            recvs = raw_post_recvs(self.engine, [land[j * size:(j + 1) * size] for j in range(len(idx))],
                                   raw_tag(client, PUT, it, self.index))
            if self.hashed:
                self.sums[client] = np.zeros(8 * len(idx), dtype=np.uint8)
                recvs += raw_post_recvs(self.engine, [self.sums[client]], raw_tag(client, SUMS, it, self.index))

            async def answer() -> None:
                await asyncio.wait_for(asyncio.gather(*recvs), OP_TIMEOUT_S)
                await raw_ack(self.eps[client], raw_tag(client, ACK, it, self.index))
        else:
            (req,) = raw_post_recvs(self.engine, [np.empty(1, dtype=np.uint8)], raw_tag(client, REQ, it, self.index))

            async def answer() -> None:
                await asyncio.wait_for(req, OP_TIMEOUT_S)
                values = [self.src[i * size:(i + 1) * size] for i in idx]

                async def verdict() -> None:  # sent as soon as hashed, while the values may still be in flight
                    if self.hashed:
                        await asyncio.to_thread(checksums, values)
                        await raw_ack(self.eps[client], raw_tag(client, VERDICT, it, self.index))

                await asyncio.gather(verdict(), raw_send(self.eps[client], values,
                                                         raw_tag(client, GET, it, self.index)))
        task = asyncio.ensure_future(answer())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def landing(self, client: int) -> np.ndarray:
        """Where `client`'s put values land: one buffer per client, allocated and touched at its first expect
        (before any timing) and reused every round, as a storage node's pre-faulted arena is (a fresh np.empty
        per round paid its page faults inside the timed receive)."""
        land = self.land.get(client)
        if land is None:
            land = self.land[client] = np.empty(ROUND_BYTES, dtype=np.uint8)
            land.fill(0)
        return land

    async def close(self) -> None:
        await self.engine.close()


class GCacheBackend(KVBackend):
    """A client of the real thing: GCacheClient over the storage nodes in the bench's registry (`where`: the
    NATS URL)."""

    chunk_mib = 0  # GCacheConfig.chunk_bytes in MiB (0: its default)

    async def start(self) -> str:
        from libs.gcache import GCacheConfig

        client_cls = importlib.import_module("libs.gcache.client").GCacheClient  # wave4-node's module
        # The bench measures throughput, not failure bounds: a round on a loaded 2-core box may take seconds.
        chunk = {"chunk_bytes": self.chunk_mib * MIB} if self.chunk_mib else {}
        # Its landing memory is pre-faulted, as the raw client's get buffer is touched before the rounds: reuse
        # from the warm-up round on was not enough (the bench keeps the last get's values, so round 1 lands in
        # a second, never-touched segment: ~250 ms of page faults per 64 MiB inside the timed get). On the
        # arena's huge pages this takes tens of ms; start() does not wait for it, ready() below does (bounded).
        self.gc = client_cls(self.where, NAMESPACE, config=GCacheConfig(op_timeout_s=OP_TIMEOUT_S / 2,
                                                                        landing_prefault=True, **chunk))
        await self.gc.start()
        with contextlib.suppress(TimeoutError):  # (a kernel that refuses MADV_POPULATE_WRITE: faults as before)
            async with asyncio.timeout(30):
                while not all(w.allocate.arena is None or w.allocate.arena.prefaulted >= w.allocate.arena.capacity
                              for w in getattr(self.gc, "_workers", ())):
                    await asyncio.sleep(0.05)
        return "-"

    def _items(self, size: int, n: int, it: int) -> list[tuple[str, memoryview]]:
        view = memoryview(self.src)
        return [(value_key(self.client, size, it, i), view[i * size:(i + 1) * size]) for i in range(n)]

    async def put(self, size: int, n: int, it: int) -> int:
        return sum(await self.gc.put(self._items(size, n, it)))

    async def get(self, size: int, n: int, it: int) -> int:
        self.last = await self.gc.get([k for k, _ in self._items(size, n, it)])
        return landed(self.last, size)

    def verify(self, size: int, n: int) -> bool:
        """After a get (outside its timing): the first and last values are byte-equal to what was put."""
        return all(v is not None and same_bytes(v, self.src[i * size:(i + 1) * size])
                   for i, v in ((0, self.last[0]), (n - 1, self.last[-1])))

    async def close(self) -> None:
        await self.gc.close()


class RedisBackend(KVBackend):
    """SET / GET of the same values with redis-py, one pipeline per batch (`where`: the loopback port)."""

    async def start(self) -> str:
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=self.where, socket_timeout=OP_TIMEOUT_S)
        self.r.ping()
        return "-"

    def _keys(self, size: int, n: int, it: int) -> list[str]:
        return [f"b:{self.client}:{size}:{it}:{i}" for i in range(n)]

    async def put(self, size: int, n: int, it: int) -> int:
        pipe = self.r.pipeline(transaction=False)
        for i, k in enumerate(self._keys(size, n, it)):
            pipe.set(k, memoryview(self.src)[i * size:(i + 1) * size])
        return sum(bool(x) for x in pipe.execute())

    async def get(self, size: int, n: int, it: int) -> int:
        pipe = self.r.pipeline(transaction=False)
        for k in self._keys(size, n, it):
            pipe.get(k)
        self.last = pipe.execute()
        return landed(self.last, size)

    def verify(self, size: int, n: int) -> bool:
        ok = same_bytes(self.last[0], self.src[:size])
        self.last = []
        return ok

    def forget(self, size: int, n: int, it: int) -> None:
        self.r.delete(*self._keys(size, n, it))  # keeps redis-server's memory to one round

    async def close(self) -> None:
        self.r.close()


class TcpSink:
    """The plain-TCP system's server: one process, a thread per connection (socket calls release the GIL), no
    store. A batch is a 9-byte header (b"P" or b"G", 8-byte length): P receives that many bytes into one buffer
    (reused every round) and answers 1 byte; G sends that many bytes from its buffer."""

    def __init__(self, index: int) -> None:
        import socket

        self.index = index
        self.listener = socket.create_server(("127.0.0.1", 0))

    async def start(self) -> str:
        import threading

        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        return str(self.listener.getsockname()[1])

    def _accept(self) -> None:
        import threading

        with contextlib.suppress(OSError):  # the listener closed
            while True:
                conn, _ = self.listener.accept()
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Any) -> None:
        buf = np.zeros(ROUND_BYTES, dtype=np.uint8)
        view = memoryview(buf)
        head = bytearray(9)
        with contextlib.suppress(OSError), conn:
            while _recv_exact(conn, memoryview(head)):
                n = int.from_bytes(head[1:], "little")
                if head[:1] == b"P":
                    _recv_exact(conn, view[:n])
                    conn.sendall(b"k")
                else:
                    conn.sendall(view[:n])

    async def close(self) -> None:
        self.listener.close()


def _recv_exact(conn: Any, view: memoryview) -> bool:
    """Fill `view` from `conn`; False when the peer closed first."""
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


class TcpBackend(KVBackend):
    """The plain-TCP system's client (`where`: the sink's port): a batch's values sent back to back on one
    socket after a header (put, then a 1-byte answer) or received in one stream (get) -- what loopback TCP moves
    for the same bytes with no protocol, store or Python work per value beyond the socket calls."""

    async def start(self) -> str:
        import socket

        self.sock = socket.create_connection(("127.0.0.1", self.where), timeout=OP_TIMEOUT_S)
        self.dst = np.zeros(ROUND_BYTES, dtype=np.uint8)
        return "-"

    async def put(self, size: int, n: int, it: int) -> int:
        self.sock.sendall(b"P" + (n * size).to_bytes(8, "little"))
        view = memoryview(self.src)
        for i in range(n):
            self.sock.sendall(view[i * size:(i + 1) * size])
        return n if self.sock.recv(1) == b"k" else 0

    async def get(self, size: int, n: int, it: int) -> int:
        self.sock.sendall(b"G" + (n * size).to_bytes(8, "little"))
        return n if _recv_exact(self.sock, memoryview(self.dst)[:n * size]) else 0

    async def close(self) -> None:
        self.sock.close()


MARK = "@gcache-bench@"  # starts every protocol line: UCX and ucxx may print to stdout too


def reply(*words: object) -> None:
    print(MARK, *words, flush=True)


async def child_main(args: argparse.Namespace) -> None:
    """A bench child process: a line protocol on stdin / stdout (READY <addr>; peers ...; put|get size n it ->
    T <start> <end> <ok> [verified]; expect put|get client size n it -> OK)."""
    backend: Any
    if args.role == "raw-server":
        backend = RawServer(args.index, args.servers, bool(args.hashed))
    elif args.role == "raw":
        backend = RawClient(args.index, args.servers, bool(args.hashed))
    elif args.role == "gcache":
        backend = GCacheBackend(args.index, args.nats_url)
        backend.chunk_mib = args.chunk_mib
    elif args.role == "tcp-sink":
        backend = TcpSink(args.index)
    elif args.role == "tcp":
        backend = TcpBackend(args.index, args.redis_port)
    else:
        backend = RedisBackend(args.index, args.redis_port)
    ready = await asyncio.wait_for(backend.start(), 60)
    # every child's heap frozen once started, as a windserve service's (libs/service: the GCache client lives
    # in the engine workers) -- the raw and Redis clients' too, so all sides run alike
    from libs.service.service import freeze_heap

    freeze_heap()
    reply("READY", ready)
    loop = asyncio.get_running_loop()
    try:
        while words := (await loop.run_in_executor(None, sys.stdin.readline)).split():
            cmd, rest = words[0], words[1:]
            if cmd == "peers":
                await asyncio.wait_for(backend.peers(rest), 60)
                reply("OK")
            elif cmd == "expect":
                backend.expect(rest[0], *map(int, rest[1:]))
                reply("OK")
            elif cmd == "check":  # after a get round, once every client's get ended (outside any timing)
                size, n, it = map(int, rest)
                verified = backend.verify(size, n) if hasattr(backend, "verify") else "-"
                if hasattr(backend, "forget"):
                    backend.forget(size, n, it)
                reply("V", verified)
            else:
                size, n, it = map(int, rest)
                t0 = time.monotonic()
                ok = await asyncio.wait_for(getattr(backend, cmd)(size, n, it), OP_TIMEOUT_S)
                t1 = time.monotonic()
                reply("T", t0, t1, ok)
    finally:
        await backend.close()


# ============================================================================ 1. throughput: the driver


def stop_process(proc: subprocess.Popen, terminate: bool = True, grace: float = 15.0) -> None:
    """SIGTERM (or, for a child told to stop by closing its stdin, nothing) and a bounded wait, then SIGKILL."""
    if terminate and proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


class Child:
    """A bench child process driven line by line; every read is bounded."""

    def __init__(self, role: str, index: int, env: dict[str, str], log_dir: Path, **kw: Any) -> None:
        cmd = [sys.executable, "-m", "bench.gcache", "--role", role, "--index", str(index)]
        for k, v in kw.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        self.name = f"{role}-{index}"
        self.log = open(log_dir / f"{self.name}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True)
        self.addr = ""

    async def read(self, timeout: float = OP_TIMEOUT_S) -> list[str]:
        """The next protocol line's words (other output is passed on to stderr), within `timeout`."""
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout):
            while True:
                line = await asyncio.to_thread(self.proc.stdout.readline)
                if not line:
                    self.log.flush()
                    tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-3:]
                    raise RuntimeError(f"{self.name} exited (rc {self.proc.poll()}): {' | '.join(tail)}")
                words = line.split()
                if words and words[0] == MARK:
                    return words[1:]
                print(f"[{self.name}] {line.rstrip()}", file=sys.stderr, flush=True)

    def order(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    async def ask(self, line: str) -> list[str]:
        self.order(line)
        return await self.read()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # type: ignore[union-attr]
        stop_process(self.proc, terminate=False)
        self.log.close()


async def start_children(role: str, n: int, env: dict[str, str], log_dir: Path, **kw: Any) -> list[Child]:
    kids: list[Child] = []
    try:
        for i in range(n):
            kids.append(Child(role, i, env, log_dir, **kw))
        for k in kids:
            _, k.addr = await k.read(90)
    except BaseException:
        for k in kids:
            k.stop()
        raise
    return kids


def gbps(nbytes: int, marks: list[list[str]]) -> float:
    """Aggregate GB/s of one round: all clients' bytes over first start to last end (one host, one clock)."""
    start, end = min(float(m[1]) for m in marks), max(float(m[2]) for m in marks)
    return nbytes / max(end - start, 1e-9) / 1e9


System = tuple[list["Child"], list["Child"]]  # a system's clients, and the servers that take `expect` orders


BLOCKS = 2  # with several systems: each system's rounds of a size come in this many blocks (A B C C B A)


async def run_rounds(systems: dict[str, System], sizes: Sequence[int], iters: int,
                     round_bytes: int) -> dict[str, dict[tuple[str, int], dict[str, Any]]]:
    """For each size: `iters` rounds (with several systems, rounded up to whole blocks) of put then get of fresh
    keys by every client, after one warm-up round (not counted), for every system. With several systems the
    rounds come in blocks, A B B A: within a block a system's rounds run back to back, as a baseline is measured
    on its own, and a slow spell of this machine (its second core has them) falls on both systems instead of on
    whichever was being measured then. (Alternating round by round would slow raw UCX against its own
    back-to-back rounds.)"""
    out: dict[str, dict[tuple[str, int], dict[str, Any]]] = {name: {} for name in systems}
    names = list(systems)
    blocks = BLOCKS if len(names) > 1 else 1
    per_block = -(-iters // blocks)
    for si, mib in enumerate(sizes):
        n = max(1, round_bytes // (mib * MIB))
        done = dict.fromkeys(names, 0)  # rounds run per system (the first is the warm-up)
        for b in range(blocks):
            for name in names if b % 2 == 0 else names[::-1]:
                clients, servers = systems[name]
                for _ in range(per_block + (done[name] == 0)):
                    for op in ("put", "get"):
                        await one_round(out[name], clients, servers, op, si, mib, n, done[name])
                    done[name] += 1
    for res in out.values():
        for row in res.values():
            row["gbps"] = statistics.median(row["rounds_gbps"])
    return out


async def one_round(out: dict[tuple[str, int], dict[str, Any]], clients: list[Child], servers: list[Child],
                    op: str, si: int, mib: int, n: int, it: int) -> None:
    """One timed put or get of `n` values of `mib` MiB by every client at once (round `it`; 0 is not counted)."""
    size = mib * MIB
    # Keys are immutable and the nodes serve every client count in turn: the round id carries the client count,
    # or client 0 of the 4-client run would put the 1-client run's keys again (refused: a quarter of its values
    # "short", though the get finds the bytes the first run stored).
    rnd = len(clients) * 10_000 + si * 1000 + it
    for s in servers:
        for c in range(len(clients)):
            await s.ask(f"expect {op} {c} {size} {n} {rnd}")
    for c in clients:
        c.order(f"{op} {size} {n} {rnd}")
    marks = [await c.read() for c in clients]
    row = out.setdefault((op, mib), {"values_per_client": n, "rounds_gbps": [], "short": 0, "verify_failed": 0})
    row["short"] += sum(n - int(m[3]) for m in marks)
    if op == "get":  # verified once every client's get ended: a client's check never overlaps another's timed get
        for c, m in zip(clients, marks, strict=True):
            if int(m[3]) == n:
                c.order(f"check {size} {n} {rnd}")
                row["verify_failed"] += (await c.read())[1] == "False"
    if it:
        row["rounds_gbps"].append(gbps(len(clients) * n * size, marks))


def child_env(transport: str | None) -> dict[str, str]:
    """This environment with the transport's UCX settings in place of any UCX_TLS / UCX_NET_DEVICES."""
    from bench.transfer import ucx_env

    env = {k: v for k, v in os.environ.items() if k not in ("UCX_TLS", "UCX_NET_DEVICES")}
    env.update(ucx_env(transport) if transport else {})
    env.update(UCX_WARN_UNUSED_ENV_VARS="n", UCX_LOG_LEVEL="error", PYTHONUNBUFFERED="1")
    return env


async def measure_side_by_side(transport: str, n_clients: int, sizes: Sequence[int], iters: int, round_bytes: int,
                               log_dir: Path, nats_url: str | None, chunk_mib: int = 0) -> dict[str, dict]:
    """Raw UCX and checksummed raw UCX (each NODES raw servers and `n_clients` raw clients) and, with `nats_url`
    (the running storage nodes), GCache (`n_clients` GCache clients), their rounds in alternating blocks
    (`run_rounds`); {"raw_ucx": .., "raw_ucx_hashed": .., "gcache": ..}."""
    env = child_env(transport)
    kids: list[Child] = []

    async def raw_system(hashed: int) -> System:
        """NODES raw servers and `n_clients` raw clients, each side dialled to the other."""
        servers = await start_children("raw-server", NODES, env, log_dir, servers=NODES, hashed=hashed)
        kids.extend(servers)
        clients = await start_children("raw", n_clients, env, log_dir, servers=NODES, hashed=hashed)
        kids.extend(clients)
        for c in clients:
            await c.ask("peers " + " ".join(s.addr for s in servers))
        for s in servers:
            await s.ask("peers " + " ".join(c.addr for c in clients))
        return clients, servers

    try:
        systems: dict[str, System] = {"raw_ucx": await raw_system(0), "raw_ucx_hashed": await raw_system(1)}
        if nats_url is not None:
            gc = await start_children("gcache", n_clients, env, log_dir, nats_url=nats_url, chunk_mib=chunk_mib)
            kids += gc
            systems["gcache"] = (gc, [])
        return await run_rounds(systems, sizes, iters, round_bytes)
    finally:
        for k in kids:
            k.stop()


@contextlib.asynccontextmanager
async def cache_nodes(transport: str, run_dir: Path) -> AsyncIterator[str]:
    """nats-server + NODES storage nodes as processes (scripts.run's supervisor, driven from a thread: without a
    gateway its readiness check runs its own event loop); yields the NATS URL."""
    from scripts.run import RunConfig, StopFlag, Supervisor

    saved, env = dict(os.environ), child_env(transport)  # child_env reads this environment: before the clear
    os.environ.clear()
    os.environ.update(env, **NODE_ENV, WINDSERVE_NAMESPACE=NAMESPACE)
    sup = Supervisor(RunConfig(services=(("cache", NODES),), http_port=0, run_dir=run_dir, ready_timeout_s=90))
    try:
        sup.start_nats()
        sup.start_services()
        await asyncio.to_thread(sup.wait_ready, StopFlag())
        yield sup.nats_url
    finally:
        await asyncio.to_thread(sup.stop_all)
        os.environ.clear()
        os.environ.update(saved)


async def measure_clients(role: str, env: dict[str, str], n_clients: int, sizes: Sequence[int], iters: int,
                          round_bytes: int, log_dir: Path, **where: Any) -> dict:
    """The rounds of `n_clients` client processes of one key-value system (redis: redis_port=)."""
    clients = await start_children(role, n_clients, env, log_dir, **where)
    try:
        return (await run_rounds({role: (clients, [])}, sizes, iters, round_bytes))[role]
    finally:
        for k in clients:
            k.stop()


@contextlib.contextmanager
def redis_server(work: Path) -> Iterator[int]:
    """/usr/bin/redis-server on a free loopback port, no persistence; yields its port; always stopped."""
    import redis

    from scripts.run import free_port

    port = free_port()
    proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--protected-mode", "no", "--dir", str(work)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}")
            try:
                redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise TimeoutError("redis-server did not answer within 15 s") from None
                time.sleep(0.1)
        yield port
    finally:
        stop_process(proc)


def table(results: dict[str, dict[tuple[str, int], dict]], clients: int) -> list[dict[str, Any]]:
    """Per-size rows of one client count: each system's GB/s and GCache's ratios."""
    rows = []
    keys = sorted({k for r in results.values() for k in r}, key=lambda k: (k[0] != "put", k[1]))
    for op, mib in keys:
        row: dict[str, Any] = {"op": op, "size_mib": mib, "clients": clients}
        for system, res in results.items():
            cell = res.get((op, mib))
            row[f"{system}_gbps"] = cell["gbps"] if cell else None
            if cell and (cell["short"] or cell["verify_failed"]):
                row[f"{system}_errors"] = {"short": cell["short"], "verify_failed": cell["verify_failed"]}
        g, raw, red = row.get("gcache_gbps"), row.get("raw_ucx_gbps"), row.get("redis_gbps")
        row["gcache_over_raw_ucx"] = g / raw if g and raw else None
        row["gcache_over_redis"] = g / red if g and red else None
        tcp = row.get("plain_tcp_gbps")
        row["plain_tcp_over_redis"] = tcp / red if tcp and red else None
        hashed = row.get("raw_ucx_hashed_gbps")
        row["raw_ucx_hashed_over_raw_ucx"] = hashed / raw if hashed and raw else None
        row["gcache_over_raw_ucx_hashed"] = g / hashed if g and hashed else None
        rows.append(row)
    return rows


async def throughput(transports: Sequence[str], sizes: Sequence[int], clients: Sequence[int], iters: int,
                     round_bytes: int, work: Path, chunk_mib: int = 0) -> dict[str, Any]:
    """Every system, transport and client count; {"by_transport": {t: [rows]}, "gcache_missing": reason}."""
    missing = gcache_missing()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}

    async def attempt(label: str, run: Any) -> dict:
        """One system's measurement; a failure is recorded (its rows stay empty), not fatal to the bench."""
        try:
            res = await run
        except Exception as exc:
            errors[label] = repr(exc)
            print(f"[gcache] {label}: FAILED {exc!r}", flush=True)
            return {}
        print(f"[gcache] {label}: {_brief(res)}", flush=True)
        return res

    redis_res: dict[int, dict] = {}
    try:
        with redis_server(work) as port:
            for n in clients:
                redis_res[n] = await attempt(f"redis clients={n}", measure_clients(
                    "redis", child_env(None), n, sizes, iters, round_bytes, logs, redis_port=port))
    except Exception as exc:
        errors["redis-server"] = repr(exc)
    tcp_res: dict[int, dict] = {}  # plain TCP (TcpSink / TcpBackend)
    try:
        (sink,) = await start_children("tcp-sink", 1, child_env(None), logs)
        try:
            for n in clients:
                tcp_res[n] = await attempt(f"plain tcp clients={n}", measure_clients(
                    "tcp", child_env(None), n, sizes, iters, round_bytes, logs, redis_port=sink.addr))
        finally:
            sink.stop()
    except Exception as exc:
        errors["plain tcp"] = repr(exc)
    async def side_by_side(t: str, url: str | None) -> dict[int, dict]:
        return {n: await attempt(f"raw ucx{'' if url is None else ' + gcache'} {t} clients={n}",
                                 measure_side_by_side(t, n, sizes, iters, round_bytes, logs, url, chunk_mib))
                for n in clients}

    by_transport: dict[str, list[dict]] = {}
    for t in transports:
        res: dict[int, dict] = {}
        if missing is None:
            try:
                async with cache_nodes(t, work / f"run-{t}") as url:
                    res = await side_by_side(t, url)
            except Exception as exc:
                errors[f"cache nodes {t}"] = repr(exc)
        if not res:  # no GCache here (missing, or its nodes did not start): the raw baseline alone
            res = await side_by_side(t, None)
        by_transport[t] = [row for n in clients for row in table(
            {"gcache": res[n].get("gcache", {}), "raw_ucx": res[n].get("raw_ucx", {}),
             "raw_ucx_hashed": res[n].get("raw_ucx_hashed", {}),
             "redis": redis_res.get(n, {}), "plain_tcp": tcp_res.get(n, {})}, n)]
    return {"by_transport": by_transport, "gcache_missing": missing, "errors": errors,
            "ucx_tls": {t: child_env(t).get("UCX_TLS") for t in transports}}


def _brief(res: dict) -> str:
    """One line of a measurement's medians: {(op, mib): cell} or {system: {(op, mib): cell}}."""
    if any(isinstance(k, str) for k in res):
        return "; ".join(f"{name}: {_brief(r)}" for name, r in res.items())
    return ", ".join(f"{op} {mib}MiB {cell['gbps']:.2f}" for (op, mib), cell in sorted(res.items()))


def worst_ratio(by_transport: dict[str, list[dict]], op: str, field: str) -> float | None:
    """The worst GCache ratio of `op` over sizes >= HEADLINE_MIN_MIB, every client count and transport."""
    vals = [r.get(field) for rows in by_transport.values() for r in rows
            if r["op"] == op and r["size_mib"] >= HEADLINE_MIN_MIB]
    if not vals or any(v is None for v in vals):
        return None
    return min(vals)


# ============================================================================ 2. cluster simulation (pure)


L3_GBPS = 2.0  # timing model: L3 bytes per second into a worker (below what the throughput part measures)


def default_checkpoint_every() -> int:
    """The engines' default `WINDSERVE_GCACHE_CHECKPOINT_EVERY` (tokens): the headline simulates it."""
    from libs.worker.config import EngineServiceConfig

    return int(EngineServiceConfig.model_fields["gcache_checkpoint_every"].default)


class PooledL3:
    """The simulation's GCache: one pooled LRU store of `capacity` bytes. A written sequence (a prompt at the end
    of its prefill, prompt + output when it finishes) stores one full value per page-aligned block and the SWA
    checkpoints (one window of SWA pages each) the engine's write-back stores (libs/engine/gcache_tier.py: the end, and
    every `checkpoint_every_pages` pages whose window the worker's cache kept, `libs.kvcache.l3_checkpoints`);
    keys are immutable (a write of a stored key only refreshes it)."""

    def __init__(self, capacity: int, page: int, full_bytes: int, swa_bytes: int) -> None:
        self.capacity, self.page, self.full_bytes, self.swa_bytes = capacity, page, full_bytes, swa_bytes
        self.used = 0
        self.lru: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.evicted = 0
        self.checkpoints = 0  # checkpoint writes (stored or refreshed)

    def _put(self, key: tuple[str, int], nbytes: int) -> None:
        if key in self.lru:
            self.lru.move_to_end(key)
            return
        self.lru[key] = nbytes
        self.used += nbytes
        while self.used > self.capacity:
            _, b = self.lru.popitem(last=False)
            self.used -= b
            self.evicted += 1

    def write(self, hashes: Sequence[int], ends: Sequence[int]) -> None:
        """Full values of `hashes` (the written blocks), checkpoints ending at the pages `ends` (exclusive)."""
        for h in hashes:
            self._put(("F", h), self.full_bytes)
        for e in ends:
            self._put(("S", hashes[e - 1]), self.swa_bytes)
        self.checkpoints += len(ends)

    def hit(self, hashes: Sequence[int], prompt_len: int) -> int:
        """Tokens of the longest valid hit: every full block up to a block with an SWA checkpoint, leaving at
        least one prompt token to compute; the keys used are refreshed."""
        best = 0
        for i, h in enumerate(hashes):
            if ("F", h) not in self.lru or (i + 1) * self.page > prompt_len - 1:
                break
            if ("S", h) in self.lru:
                best = i + 1
        for i in range(best):
            self.lru.move_to_end(("F", hashes[i]))
        if best:
            self.lru.move_to_end(("S", hashes[best - 1]))
        return best * self.page


def l3_sim_class():
    """bench.router's Sim with a PooledL3 beside the workers (imported late: the simulator pulls in the KV
    cache and routing libraries). Its workers' caches keep a checkpoint every `every_pages` pages (the engine's
    `checkpoint_every_pages` under GCache) and write back what the engine's L3Export would."""
    from bench.router import Job, Sim, Worker
    from libs.kvcache import block_hashes, l3_checkpoints

    class L3Sim(Sim):
        def __init__(self, n: int, lanes: int, budget: int, pick, l3: PooledL3, every_pages: int) -> None:
            super().__init__(n, lanes, budget, pick, checkpoint_every_pages=every_pages)
            self.l3 = l3
            self.every_pages = every_pages
            self.l3_tokens = 0

        def remote_hit(self, w: Worker, job: Job, local_tokens: int) -> tuple[int, float]:
            extra = max(0, self.l3.hit(job.hashes, len(job.req.prompt)) - local_tokens)
            self.l3_tokens += extra
            nbytes = extra // self.l3.page * self.l3.full_bytes + (self.l3.swa_bytes if extra else 0)
            return extra, nbytes / (L3_GBPS * 1e9)

        def _write(self, w: Worker, job: Job, hashes: list[int], pages: int) -> None:
            cfg = w.cache.cfg
            _, swa = w.cache.page_tables(f"r{job.rid}")
            # The simulated sequence computed its output too before this (bench.kvcache.compute): its window at
            # the prompt's end may be gone here, but a prefill worker always still holds it when it writes.
            ends = sorted({*l3_checkpoints(swa, pages, cfg.window_pages, self.every_pages), pages})
            self.l3.write(hashes[:pages], ends)

        def on_prefilled(self, w: Worker, job: Job) -> None:  # a prefill worker's write: the prompt's pages
            self._write(w, job, job.hashes, len(job.req.prompt) // self.l3.page)

        def on_finished(self, w: Worker, job: Job) -> None:  # prompt + output: (len - 1) tokens computed
            seq = job.req.prompt + job.req.output
            self._write(w, job, block_hashes(seq, self.l3.page), (len(seq) - 1) // self.l3.page)

    return L3Sim


def cluster(traces: dict[str, list], n: int, policies: Sequence[str], budget: int, l3_bytes: int,
            checkpoint_every: int, compare_every: int = 0) -> dict:
    """Per trace and policy: hit tokens with and without the pooled L3, each over the pooled oracle's; the L3
    (and the workers' retention) with a checkpoint every `checkpoint_every` tokens besides the ends (the
    headline), and beside it with `compare_every` (`gcache_ckpt<k>_hit_share`; 0 = only the ends)."""
    from bench.kvcache import FULL_PAGE_B, PAGE, SWA_PAGE_B, WINDOW
    from bench.router import Job, Sim, jobs_for, policy

    swa_ckpt = -(-WINDOW // PAGE) * SWA_PAGE_B  # one window of SWA pages
    L3Sim = l3_sim_class()
    out: dict[str, dict] = {}
    for tname, reqs in traces.items():
        jobs = jobs_for(reqs)

        def fresh(jobs: list[Job] = jobs) -> list[Job]:  # a run consumes its jobs (predictions are written)
            return [Job(j.rid, j.req, j.hashes, j.arrival) for j in jobs]

        oracle = Sim(1, n, n * budget, lambda s, j: s.workers[0]).run(fresh())
        row: dict[str, Any] = {"pooled_oracle_hit_tokens": oracle.hit,
                               "pooled_oracle_hit_rate": oracle.hit / max(oracle.prompt, 1)}
        for p in policies:
            plain = Sim(n, 1, budget, policy(p)).run(fresh())
            l3 = PooledL3(l3_bytes, PAGE, FULL_PAGE_B, swa_ckpt)
            sim = L3Sim(n, 1, budget, policy(p), l3, checkpoint_every // PAGE)
            shared = sim.run(fresh())
            other = L3Sim(n, 1, budget, policy(p), PooledL3(l3_bytes, PAGE, FULL_PAGE_B, swa_ckpt),
                          compare_every // PAGE).run(fresh())
            row[p] = {"no_gcache_hit_share": plain.hit / max(oracle.hit, 1),
                      "gcache_hit_share": shared.hit / max(oracle.hit, 1),
                      f"gcache_ckpt{compare_every}_hit_share": other.hit / max(oracle.hit, 1),
                      "no_gcache_hit_rate": plain.hit / max(plain.prompt, 1),
                      "gcache_hit_rate": shared.hit / max(shared.prompt, 1),
                      "l3_hit_tokens": sim.l3_tokens, "l3_used_gib": l3.used / GIB, "l3_evicted_values": l3.evicted,
                      "l3_checkpoint_writes": l3.checkpoints,
                      "gcache_ttft_p50_s": statistics.median(shared.ttft),
                      "no_gcache_ttft_p50_s": statistics.median(plain.ttft)}
            print(f"[gcache] sim {tname} N={n} {p}: share {row[p]['no_gcache_hit_share']:.3f} -> "
                  f"{row[p]['gcache_hit_share']:.3f} (checkpoints every {checkpoint_every}; every "
                  f"{compare_every}: {row[p][f'gcache_ckpt{compare_every}_hit_share']:.3f})", flush=True)
        out[tname] = row
    return out


def cluster_headline(grid: dict, head_policy: str) -> tuple[float, float, str]:
    """(with, without, trace): the trace where the shared L3 gets the smallest share, under `head_policy`."""
    worst = min(grid, key=lambda t: grid[t][head_policy]["gcache_hit_share"])
    cell = grid[worst][head_policy]
    return cell["gcache_hit_share"], cell["no_gcache_hit_share"], worst


def simulate(n_requests: int, n: int, policies: Sequence[str], l3_bytes: int | None = None,
             checkpoint_every: int | None = None) -> dict:
    from bench.router import BUDGET, agentic_like
    from bench.traces import conversation

    conv = conversation(n_requests)
    traces = {"conversation": conv, "agentic": agentic_like(conv, n_requests)}
    l3_bytes = l3_bytes if l3_bytes is not None else n * BUDGET
    every = default_checkpoint_every() if checkpoint_every is None else checkpoint_every
    grid = cluster(traces, n, policies, BUDGET, l3_bytes, every, 0)
    with_l3, without, trace = cluster_headline(grid, policies[0])
    return {"gcache_cluster_hit_share": with_l3, "no_gcache_cluster_hit_share": without, "headline_trace": trace,
            "headline_policy": policies[0], "workers": n, "requests_per_trace": n_requests,
            "budget_gib_per_worker": BUDGET / GIB, "l3_capacity_gib": l3_bytes / GIB,
            "checkpoint_every_tokens": every,
            "l3_values": f"full value per block, SWA checkpoint at the end of each written prompt and sequence and "
                         f"every {every} tokens where the worker's cache kept the window (as the engine writes)",
            "l3_gbps_model": L3_GBPS, "grid": grid}


# ============================================================================ 3. engine figures (real topology)

ENGINE_REASON = "needs wave4-engine/wave4-node"
ENGINE_SERVICES = "gateway,router,worker,cache=2"
ENGINE_ENV = {"WINDSERVE_GCACHE": "1", "WINDSERVE_MEMORY_BYTES": str(1 * GIB), "WINDSERVE_DISK_BYTES": "0",
              "WINDSERVE_GCACHE_LOOKUP_TIMEOUT_S": "5", "WINDSERVE_GCACHE_OP_TIMEOUT_S": "10"}
ENGINE_OUTPUT = 4  # output tokens of each long request (ignore_eos)


def engine_missing() -> str | None:
    """Why the engine figures cannot run here: the node and client (wave4-node) and the engine's L3 wiring and
    its stored-bytes helper (wave4-engine) must all be in this checkout."""
    if (why := gcache_missing()) is not None:
        return f"{ENGINE_REASON}: {why}"
    for mod in ("libs.engine.gcache_tier", "libs.kvcache.gcache_tier", "libs.worker.gcache"):
        if importlib.util.find_spec(mod) is None:
            return f"{ENGINE_REASON}: the engine's L3 integration ({mod}) is not in this checkout"
    return None


def engine_figures(quick: bool) -> dict[str, Any]:
    """l3_hit_ttft_ratio and l3_bytes_per_token_ratio, or null with the reason."""
    why = engine_missing()
    if why is None:
        try:
            return asyncio.run(_engine_run(quick))
        except Exception as exc:  # a topology that does not come up is a reported figure, not a crash of the bench
            why = f"engine topology failed: {exc!r}"
    return {"l3_hit_ttft_ratio": None, "l3_bytes_per_token_ratio": None,
            "engine": {"l3_hit_ttft_ratio": why, "l3_bytes_per_token_ratio": why}}


async def _stream(client: Any, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """TTFT of one streamed completion and its usage's cached_tokens."""
    from bench.serving import MODEL

    start = time.perf_counter()
    first, cached, ids = None, -1, []
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    async for ev in stream:
        for c in ev.choices:
            got = getattr(c, "token_ids", None) or []
            if got and first is None:
                first = time.perf_counter()
            ids += got
        if ev.usage is not None and ev.usage.prompt_tokens_details is not None:
            cached = ev.usage.prompt_tokens_details.cached_tokens or 0
    return {"ttft_s": (first or time.perf_counter()) - start, "cached_tokens": cached, "output": ids}


async def _worker_gcache_details(nats_url: str) -> dict[str, str]:
    """The combined worker's GCache counters from its health details (gcache_*)."""
    from libs.bus import Bus, Registry
    from protos import subjects
    from protos.messages import HealthReply, HealthRequest
    from scripts.run import namespace

    ns = namespace()
    bus = await Bus.connect(nats_url, name="bench-gcache", timeout=5)
    try:
        for e in await (await Registry.open(bus, subjects.registry_bucket(ns))).list(timeout=5):
            if e.role.value == "worker":
                reply = await bus.request(subjects.health(ns, e.instance_id), HealthRequest(), HealthReply, 5)
                return {k: v for k, v in reply.details.items() if k.startswith("gcache") or "hit" in k}
        return {}
    finally:
        await bus.close()


async def _cache_usage(nats_url: str) -> tuple[int, int]:
    """(bytes, keys) the storage nodes hold, from their registry entries."""
    from libs.bus import Bus, Registry
    from protos import subjects
    from scripts.run import namespace

    bus = await Bus.connect(nats_url, name="bench-gcache", timeout=5)
    try:
        entries = await (await Registry.open(bus, subjects.registry_bucket(namespace()))).list(timeout=5)
        usage = [e.cache for e in entries if e.cache is not None]
        return sum(u.memory_used + u.disk_used for u in usage), sum(u.keys for u in usage)
    finally:
        await bus.close()


async def _settled_usage(nats_url: str, expect_keys: int, timeout: float = 60.0) -> tuple[int, int]:
    """Node usage once the write-back landed: the expected key count, or no change for 5 s (bounded)."""
    deadline = time.monotonic() + timeout
    last, since = (-1, -1), time.monotonic()
    while time.monotonic() < deadline:
        now = await _cache_usage(nats_url)
        if now[1] >= expect_keys:
            return now
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 5.0 and now[1] > 0:
            return now
        await asyncio.sleep(0.5)
    return last


async def _restart_worker(system: Any, timeout: float = 120.0) -> None:
    """SIGKILL the worker; the supervisor starts a fresh one (empty L1 and L2); back when it serves again."""
    import signal

    sup = system.sup
    (child,) = [c for c in sup.children if c.service == "worker"]
    os.killpg(child.popen.pid, signal.SIGKILL)
    child.popen.wait(30)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sup.supervise(time.monotonic())
        if child not in sup.children and sup.serving_again():
            return
        await asyncio.sleep(0.3)
    raise TimeoutError(f"the worker did not serve again within {timeout:.0f} s")


async def _engine_run(quick: bool) -> dict[str, Any]:
    """A second turn whose prefix (the first turn's long prompt + output) is only in L3 — the first turn computed
    and written back, then the worker restarted — vs a prompt of the same length computed from scratch on the
    same fresh worker, alternated; and the bytes the nodes hold per cached token over the dual-layout limit
    (libs.kvcache.gcache_tier.l3_footprint) of what the first turns wrote (one window of SWA KV per stored checkpoint).
    The engine stores an SWA checkpoint where a sequence ended (and every WINDSERVE_GCACHE_CHECKPOINT_EVERY
    tokens), so the L3 hit is a continuation's prefix (a repeat of the same prompt would resume at the last
    periodic checkpoint before its end: one prompt token must stay to compute)."""
    import torch

    from bench.serving import ENGINE_ENV as SERVING_ENV
    from bench.serving import LONG_CHUNKS, System, block_tokens
    from libs.model import ModelConfig
    from libs.worker.config import EngineServiceConfig

    kv_layout = importlib.import_module("libs.engine.gcache_tier").kv_layout  # wave4-engine's
    l3_footprint = importlib.import_module("libs.kvcache.gcache_tier").l3_footprint
    l3_checkpoint_ends = importlib.import_module("libs.kvcache.gcache_tier").l3_checkpoint_ends
    page = int(SERVING_ENV["WINDSERVE_PAGE_SIZE"])
    n_tok = LONG_CHUNKS * int(SERVING_ENV["WINDSERVE_MAX_NUM_BATCHED_TOKENS"])
    count = 2 if quick else 4
    turn1 = [block_tokens(950_000 + i, n_tok) for i in range(count)]
    saved = dict(os.environ)
    os.environ.update(child_env("tcp"), **ENGINE_ENV)
    try:
        with tempfile.TemporaryDirectory(prefix="windserve-gcache-e2e-") as tmp, \
                System(Path(tmp) / "run", ENGINE_SERVICES) as system:
            client = system.client()
            url = system.sup.nats_url
            await _stream(client, block_tokens(940_000, 8), 2)  # warm-up below one page: nothing stored
            first = [await _stream(client, p, ENGINE_OUTPUT) for p in turn1]
            blocks_each = (n_tok + ENGINE_OUTPUT - 1) // page  # KV of prompt + output but the last token
            # (at most: the periodic ones where the worker's cache kept the window, and the end)
            ckpts_each = len(l3_checkpoint_ends(blocks_each, default_checkpoint_every() // page))
            stored, keys = await _settled_usage(url, count * (blocks_each + ckpts_each))
            details_before = await _worker_gcache_details(url)
            await _restart_worker(system)
            await _stream(client, block_tokens(940_001, 8), 2)
            l3_rows, fresh_rows = [], []
            for i, (p, r) in enumerate(zip(turn1, first, strict=True)):
                turn2 = p + r["output"] + block_tokens(970_000 + i, 64)
                fresh_rows.append(await _stream(client, block_tokens(960_000 + i, len(turn2)), ENGINE_OUTPUT))
                l3_rows.append(await _stream(client, turn2, ENGINE_OUTPUT))
            details_after = await _worker_gcache_details(url)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    cfg = ModelConfig.tiny()
    dtype = os.environ.get("WINDSERVE_DTYPE", EngineServiceConfig().engine.dtype)
    layout = kv_layout(cfg, getattr(torch, dtype))
    full_values = count * blocks_each
    ckpts = max(0, keys - full_values)  # every other stored value is an SWA checkpoint
    _, limit = l3_footprint(layout, page, cfg.sliding_window, full_values, [1 << 30] * ckpts)
    ttft_l3 = statistics.median(r["ttft_s"] for r in l3_rows)
    ttft_fresh = statistics.median(r["ttft_s"] for r in fresh_rows)
    hit = all(r["cached_tokens"] > 0 for r in l3_rows)
    for r in (*first, *l3_rows, *fresh_rows):
        r.pop("output")
    return {"l3_hit_ttft_ratio": ttft_l3 / ttft_fresh if hit else None,
            "l3_bytes_per_token_ratio": stored / limit if stored and limit else None,
            "engine": {"services": ENGINE_SERVICES, "prompt_tokens": n_tok, "prompts": count, "page": page,
                       "dtype": dtype, "first_turns": first, "after_restart_l3": l3_rows,
                       "after_restart_recomputed": fresh_rows, "ttft_l3_s": ttft_l3, "ttft_recomputed_s": ttft_fresh,
                       "nodes_bytes": stored, "nodes_keys": keys, "full_values_expected": full_values,
                       "checkpoints_inferred": ckpts, "dual_layout_limit_bytes": limit,
                       "worker_gcache_before_restart": details_before, "worker_gcache_after": details_after,
                       **({} if hit else {"l3_hit_ttft_ratio": "no L3 hit after the restart (cached_tokens 0)"}),
                       **({} if stored else {"l3_bytes_per_token_ratio": "the nodes hold nothing"})}}


# ============================================================================ results


def build_results(tp: dict[str, Any] | None, sim: dict[str, Any] | None, eng: dict[str, Any] | None,
                  setup: dict[str, Any]) -> dict[str, Any]:
    """The JSON: every headline key at the top (null where not measured, with the reason under "null_reasons"),
    the goals, and the tables behind them."""
    out: dict[str, Any] = {k: None for k in HEADLINE_KEYS}
    reasons: dict[str, str] = {}
    if tp is not None:
        bt = tp["by_transport"]
        for op in ("put", "get"):
            out[f"{op}_vs_raw_ucx"] = worst_ratio(bt, op, "gcache_over_raw_ucx")
            out[f"{op}_vs_redis"] = worst_ratio(bt, op, "gcache_over_redis")
            out[f"hashed_raw_{op}_vs_raw_ucx"] = worst_ratio(bt, op, "raw_ucx_hashed_over_raw_ucx")
            out[f"{op}_vs_hashed_raw"] = worst_ratio(bt, op, "gcache_over_raw_ucx_hashed")
        out["plain_tcp_put_vs_redis"] = worst_ratio(bt, "put", "plain_tcp_over_redis")
        out["headline_by_transport"] = {
            t: {f"{op}_vs_{base}": worst_ratio({t: rows}, op, f"gcache_over_{base}")
                for op in ("put", "get") for base in ("raw_ucx", "raw_ucx_hashed", "redis")} for t, rows in bt.items()}
        for k in ("put_vs_raw_ucx", "get_vs_raw_ucx", "put_vs_redis", "get_vs_redis", *HASHED_KEYS):
            if out[k] is None:
                base = "redis-server" if k.endswith("redis") else "raw ucx"
                failed = [name for name in tp.get("errors", {}) if name.startswith(base)]
                reasons[k] = (tp.get("gcache_missing")
                              or (f"{failed[0]} failed: {tp['errors'][failed[0]]} (throughput.errors)" if failed
                                  else "a GCache round failed (see throughput)"))
        if out["plain_tcp_put_vs_redis"] is None:
            failed = [name for name in tp.get("errors", {}) if name.startswith(("plain tcp", "redis-server"))]
            reasons["plain_tcp_put_vs_redis"] = (f"{failed[0]} failed: {tp['errors'][failed[0]]}" if failed
                                                 else "a plain TCP or Redis round failed (see throughput)")
    else:
        reasons.update(dict.fromkeys(THROUGHPUT_KEYS, "throughput not run (--skip-throughput)"))
    if sim is not None:
        out["gcache_cluster_hit_share"] = sim["gcache_cluster_hit_share"]
        out["no_gcache_cluster_hit_share"] = sim["no_gcache_cluster_hit_share"]
    else:
        reasons["gcache_cluster_hit_share"] = reasons["no_gcache_cluster_hit_share"] = "simulation not run"
    if eng is not None:
        for k in ("l3_hit_ttft_ratio", "l3_bytes_per_token_ratio"):
            out[k] = eng.get(k)
            if out[k] is None:
                reasons[k] = eng.get("engine", {}).get(k, ENGINE_REASON)
    else:
        reasons["l3_hit_ttft_ratio"] = reasons["l3_bytes_per_token_ratio"] = "engine figures not run (--skip-engine)"
    out["goals"] = GOALS
    out["met"] = {k: _met(out[k], g) for k, g in GOALS.items()}
    out["null_reasons"] = reasons
    out["setup"] = setup
    out["throughput"] = tp
    out["cluster"] = sim
    out["engine"] = eng
    return out


def _met(value: float | None, goal: str) -> bool | None:
    if value is None:
        return None
    op, bound = goal.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


def write_results(out: dict[str, Any], json_path: Path, png_path: Path | None) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=1))
    if png_path is not None:
        plot(out, png_path)


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    tp = out.get("throughput") or {"by_transport": {}}
    # a colour per system, a line per UCX transport (solid sm, dashed tcp), a marker per client count
    colors = {"gcache": "C0", "raw_ucx": "C1", "raw_ucx_hashed": "C2", "redis": "C3", "plain_tcp": "C4"}
    lines = {"sm": "-", "tcp": "--"}
    once = ("redis", "plain_tcp")  # (do not depend on the UCX transport: drawn once)
    for ax, op in zip(axes[:2], ("put", "get"), strict=True):
        for t, rows in tp["by_transport"].items():
            for clients in sorted({r["clients"] for r in rows}):
                sel = [r for r in rows if r["op"] == op and r["clients"] == clients]
                for system, color in colors.items():
                    if system in once and t != next(iter(tp["by_transport"])):
                        continue
                    pts = [(r["size_mib"], r[f"{system}_gbps"]) for r in sel if r.get(f"{system}_gbps")]
                    if pts:
                        label = f"{system} x{clients}" + ("" if system in once else f" ({t})")
                        ax.plot(*zip(*pts, strict=True), color=color, ls=":" if system in once else lines.get(t, "-."),
                                marker="o" if clients == 1 else "s", label=label)
        ax.set(title=f"{op}: aggregate GB/s", xlabel="value size (MiB)", xscale="log")
        ax.set_xscale("log", base=2)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    ax = axes[2]
    sim = out.get("cluster")
    if sim:
        names, with_l3, without = [], [], []
        for tname, row in sim["grid"].items():
            for p, cell in row.items():
                if isinstance(cell, dict):
                    names.append(f"{tname[:4]}/{p}")
                    with_l3.append(cell["gcache_hit_share"])
                    without.append(cell["no_gcache_hit_share"])
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], without, 0.4, label="no GCache")
        ax.bar([x + 0.2 for x in xs], with_l3, 0.4, label="GCache (pooled L3)")
        ax.axhline(0.95, ls="--", c="grey", lw=0.8)
        ax.set_xticks(list(xs), names, fontsize=7)
        ax.set(title=f"cluster N={sim['workers']}: hit tokens / pooled oracle", ylim=(0, 1.1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ main


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke test: 4 MiB, 1 client, tcp, 1 round of 8 MiB, "
                   "nodes of 256 MiB; simulation on 200 requests at N = 8; 2 engine prompts")
    p.add_argument("--transports", default="sm,tcp", help="UCX transports (bench.transfer.TRANSPORTS)")
    p.add_argument("--sizes", default="", help="value sizes in MiB, comma list (default 1,4,16,64)")
    p.add_argument("--clients", default="", help="concurrent client processes, comma list (default 1,4)")
    p.add_argument("--chunk-mib", type=int, default=0, help="GCacheConfig.chunk_bytes in MiB (0: its default)")
    p.add_argument("--iters", type=int, default=ITERS)
    p.add_argument("--requests", type=int, default=1500, help="simulation: requests per trace")
    p.add_argument("--workers", type=int, default=16, help="simulation: prefill workers N")
    p.add_argument("--l3-gib", type=float, default=None, help="simulation: pooled L3 capacity (default N x the "
                   "per-worker budget)")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-sim", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                   "bench/results/gcache.json, with --quick .run/bench-quick/gcache.json")
    # child processes
    p.add_argument("--role", choices=["main", "raw", "raw-server", "gcache", "redis", "tcp-sink", "tcp"],
                   default="main")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--servers", type=int, default=NODES)
    p.add_argument("--nats-url", default="")
    p.add_argument("--redis-port", type=int, default=0, help="(redis, tcp: the server's loopback port)")
    p.add_argument("--hashed", type=int, default=0, help="(raw, raw-server: 1 = the checksummed baseline)")
    a = p.parse_args(argv)
    a.out = a.out or (QUICK_RESULTS if a.quick else RESULTS) / "gcache.json"
    return a


def _ints(csv: str) -> tuple[int, ...]:
    return tuple(int(x) for x in csv.split(",") if x)


def main(a: argparse.Namespace) -> dict[str, Any]:
    global NODE_ENV
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    if a.quick:
        NODE_ENV = {**NODE_ENV, "WINDSERVE_MEMORY_BYTES": str(QUICK_NODE_MEMORY)}
    sizes = _ints(a.sizes) or ((HEADLINE_MIN_MIB,) if a.quick else SIZES_MIB)
    clients = _ints(a.clients) or ((1,) if a.quick else CLIENTS)
    transports = ("tcp",) if a.quick else tuple(t for t in a.transports.split(",") if t)
    iters = 1 if a.quick else a.iters
    round_bytes = 8 * MIB if a.quick else ROUND_BYTES
    tp = sim = eng = None
    failed: dict[str, str] = {}  # a part that raised: its figures stay null, the other parts still run

    def part(name: str, run: Any) -> Any:
        try:
            return run()
        except Exception as exc:
            failed[name] = f"{name} failed: {exc!r}"
            print(f"[gcache] {failed[name]}", flush=True)
            return None

    def run_throughput() -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="windserve-gcache-") as tmp:
            return asyncio.run(throughput(transports, sizes, clients, iters, round_bytes, Path(tmp), a.chunk_mib))

    if not a.skip_throughput:
        tp = part("throughput", run_throughput)
    from bench.traces import TRACE

    if not a.skip_sim and a.quick and not TRACE.exists():  # a smoke run where the trace is not checked out (CI)
        failed["simulation"] = f"simulation not run: the conversation trace is not here ({TRACE})"
    elif not a.skip_sim:
        sim = part("simulation", lambda: simulate(200 if a.quick else a.requests, 8 if a.quick else a.workers,
                                                  ("windserve", "round_robin"),
                                                  None if a.l3_gib is None else int(a.l3_gib * GIB)))
    if not a.skip_engine:
        eng = engine_figures(a.quick)
    from libs.gcache import GCacheConfig

    setup = {"quick": a.quick, "sizes_mib": list(sizes), "clients": list(clients), "transports": list(transports),
             "iters": iters, "round_bytes_per_client": round_bytes, "gcache_chunk_mib": a.chunk_mib or None,
             "gcache_message_mib": GCacheConfig().message_bytes // MIB,  # (the direct path's UCX messages)
             "nodes": NODES, "node_env": NODE_ENV,
             "headline": f"worst ratio over sizes >= {HEADLINE_MIN_MIB} MiB, every client count and transport",
             "cpus": os.cpu_count(), "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]]}
    out = build_results(tp, sim, eng, setup)
    for name, keys in (("throughput", THROUGHPUT_KEYS),
                       ("simulation", ("gcache_cluster_hit_share", "no_gcache_cluster_hit_share"))):
        if name in failed:
            out["null_reasons"].update(dict.fromkeys(keys, failed[name]))
    out["runtime_s"] = time.perf_counter() - t0
    write_results(out, a.out, a.out.with_suffix(".png"))
    print(json.dumps({k: out[k] for k in (*HEADLINE_KEYS, "null_reasons")}, indent=1))
    return out


if __name__ == "__main__":
    cli = parse()
    if cli.role == "main":
        main(cli)
    else:
        try:
            asyncio.run(child_main(cli))
        except BaseException:  # a child that failed must exit (a started UCX worker's threads would keep it up)
            import traceback

            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
