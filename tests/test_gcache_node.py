"""GCache with real storage-node processes (`python -m services.gcache`), a real nats-server and real ucxx
(UCX over tcp): values round-trip byte-equal, batches, immutability, write-back, a client SIGKILLed mid-put, a
node SIGKILLed during gets, a restarted node serving its disk, a corrupted file, and (in network namespaces) a
link cut."""

import asyncio
import json
import os
import random
import signal
import subprocess
import sys

import pytest

from tests.fixtures.gcache import ROOT, UCX_ENV, CacheNodes, bounded
from tests.fixtures.waits import until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
MiB = 1 << 20
HANG = 30.0  # hang detector: far above every bound of the contract (op_timeout_s)


@pytest.fixture(autouse=True)
def _ucx_env(monkeypatch):
    for k, v in UCX_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def pair(nats_server, tmp_path_factory):
    """Two storage nodes shared by the tests that kill none of them."""
    nodes = CacheNodes(nats_server.url, tmp_path_factory.mktemp("gcache-pair"))
    nodes.start("node-a")
    nodes.start("node-b")
    try:
        yield nodes
    finally:
        nodes.stop()


def _value(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


async def test_random_values_round_trip_byte_equal_with_batch_semantics_and_immutable_keys(pair):
    rng = random.Random(12)
    client = await pair.client(io_threads=2)  # calls alternate between two IO threads
    try:
        sizes = [MiB, 64 * MiB, rng.randint(MiB, 64 * MiB), 3, 0]
        values = {f"rt:{i}": _value(rng, n) for i, n in enumerate(sizes)}
        assert await bounded(client.exists(list(values)), HANG) == [False] * len(values)
        assert await bounded(client.put(list(values.items())), HANG) == [True] * len(values)
        homes = {client.home(k) for k in values}
        assert homes == {"node-a", "node-b"}  # the batch was split over both nodes (one request each)

        keys = [*values, "rt:absent"]
        assert await bounded(client.exists(keys), HANG) == [True] * len(values) + [False]
        got = await bounded(client.get(keys), HANG)
        assert got[-1] is None
        for (key, value), back in zip(values.items(), got, strict=False):
            assert back is not None and bytes(back) == value, key

        # immutable: a second put of a key is not accepted and the old value stays
        again = await bounded(client.put([("rt:3", b"new"), ("rt:fresh", b"fresh")]), HANG)
        assert again == [False, True]
        assert [bytes(v) for v in await bounded(client.get(["rt:3", "rt:fresh"]), HANG)] == [values["rt:3"], b"fresh"]
        stats = client.stats()
        assert stats.errors == 0 and stats.refused == 1 and stats.hits >= len(values) + 2
    finally:
        await client.close()


async def test_write_back_is_queued_without_blocking_and_dropped_when_the_queue_is_full(pair):
    client = await pair.client(write_queue=1)
    try:
        batches = [[(f"wb:{i}", bytes([i]) * (8 * MiB))] for i in range(3)]
        queued = [client.put_nowait(b) for b in batches]  # back to back: the first is still being written
        assert queued[0] and not all(queued)
        assert client.stats().dropped == queued.count(False)
        keys = [b[0][0] for b, q in zip(batches, queued, strict=True) if q]

        async def written() -> bool:
            return await client.exists(keys) == [True] * len(keys)
        async with asyncio.timeout(HANG):
            while not await written():
                await asyncio.sleep(0.05)
        assert [bytes(v) for v in await client.get(keys[:1])] == [batches[0][0][1]]
    finally:
        await client.close()
    assert client.put_nowait([("wb:late", b"x")]) is False  # closed: dropped, never raises


DYING_CLIENT = r"""
import asyncio, sys
from libs.bus import Bus
from libs.gcache import value_checksum, wire
from libs.transfer import create_engine
from protos import subjects
from protos.messages import CachePutItem, CachePutReply, CachePutRequest

async def main(url, ns, node, key, stage):
    value = bytes(range(256)) * (64 * 1024 * 4)  # 64 MiB
    bus = await Bus.connect(url, name="dying-client")
    engine = create_engine()
    await engine.start()
    chunk = 1 << 20
    req = CachePutRequest(transfer_id="dying-" + stage, chunk_bytes=chunk, items=[
        CachePutItem(key=key, size=len(value), checksum=value_checksum(value))])
    reply = await bus.request(subjects.cache_put(ns, node), req, CachePutReply, timeout=10)
    assert reply.accepted == [True], reply
    if stage == "mid-transfer":  # half of the value's chunks are on the node when we die
        views = wire.chunk_views(value, chunk)
        tx = await engine.begin_send(reply.address, req.transfer_id, wire.layer_specs([len(value)], chunk))
        for view in views[: len(views) // 2]:
            await tx.send_layer(view)
    print("stalled", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main(*sys.argv[1:6]))
"""


@pytest.mark.parametrize("stage", ["announced", "mid-transfer"])
async def test_a_client_killed_mid_put_leaves_no_visible_key_and_the_node_reclaims_it(pair, stage):
    client = await pair.client()
    key = f"dying:{stage}"
    node = client.home(key)
    child = subprocess.Popen([sys.executable, "-c", DYING_CLIENT, pair.nats_url, pair.namespace, node, key, stage],
                             cwd=ROOT, env={**os.environ, **UCX_ENV}, stdout=subprocess.PIPE, text=True)
    try:
        line = await bounded(asyncio.to_thread(child.stdout.readline), HANG)
        assert line.strip() == "stalled", line
        assert (await pair.details(node))["inflight_puts"] == "1"
        assert await client.exists([key]) == [False]  # not visible while unfinished
        assert await client.put([(key, b"x")]) == [False]  # being stored: nobody else may write it
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        assert await client.exists([key]) == [False] and await client.get([key]) == [None]

        async def reclaimed() -> bool:  # the slot is freed: a new put of the key is accepted
            return (await client.put([(key, b"second writer")])) == [True]
        async with asyncio.timeout(HANG):
            while not await reclaimed():
                await asyncio.sleep(0.2)
        assert [bytes(v) for v in await client.get([key])] == [b"second writer"]
        assert (await pair.details(node))["inflight_puts"] == "0"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        await client.close()


async def test_a_node_killed_during_gets_gives_misses_within_the_bound_and_replicas_keep_serving(nats_server,
                                                                                                   tmp_path):
    nodes = CacheNodes(nats_server.url, tmp_path / "logs")
    nodes.start("node-x")
    nodes.start("node-y")
    single = replicated = None
    try:
        single = await nodes.client(op_timeout_s=2.0)
        replicated = await nodes.client(op_timeout_s=2.0, replication=2)
        values = {f"kill:{i}": random.Random(i).randbytes(256 * 1024) for i in range(24)}
        assert await single.put(list(values.items())) == [True] * len(values)
        both = {f"rep:{k}": v for k, v in values.items()}
        assert await replicated.put(list(both.items())) == [True] * len(both)
        on_x = {k for k in values if single.home(k) == "node-x"}
        assert on_x and len(on_x) < len(values)

        stop = asyncio.Event()
        results: list[list[bool]] = []

        async def reader() -> None:  # gets keep going while the node dies
            while not stop.is_set():
                got = await bounded(single.get(list(values)), HANG)
                results.append([g is not None for g in got])
        task = asyncio.create_task(reader())
        await until(lambda: len(results) >= 2, HANG, "gets before the kill")
        nodes.kill("node-x")
        await until(lambda: single.nodes == {"node-y"}, HANG, "the dead node leaves the ring")
        seen = len(results)
        await until(lambda: len(results) >= seen + 2, HANG, "gets after the node left")
        stop.set()
        await bounded(task, HANG)

        last = dict(zip(values, results[-1], strict=True))
        assert all(not last[k] for k in on_x) and all(last[k] for k in values if k not in on_x)
        # replication 2: every value is still read, from the survivor
        got = await bounded(replicated.get(list(both)), HANG)
        assert [bytes(g) if g is not None else None for g in got] == list(both.values())
        assert await bounded(single.exists(list(values)), HANG) == [k not in on_x for k in values]
    finally:
        for c in (single, replicated):
            if c is not None:
                await c.close()
        nodes.stop()


# --- the disk tier at the process level ------------------------------------------------------------------


def _disk_node(nodes: CacheNodes, instance: str, disk_dir) -> None:
    # memory holds one 1 MiB value: every earlier one is demoted to disk
    nodes.start(instance, env={"WINDSERVE_MEMORY_BYTES": str(3 * MiB // 2), "WINDSERVE_DISK_BYTES": str(64 * MiB),
                               "WINDSERVE_DISK_DIR": str(disk_dir)})


def _disk_values() -> dict[str, bytes]:
    rng = random.Random(7)
    return {f"disk:{i}": rng.randbytes(MiB) for i in range(4)}


async def test_a_restarted_node_serves_its_disk_values(nats_server, tmp_path):
    nodes = CacheNodes(nats_server.url, tmp_path / "logs")
    _disk_node(nodes, "node-d", tmp_path / "disk")
    values = _disk_values()
    client = await nodes.client()
    try:
        for item in values.items():  # one at a time: a batch reserves memory for all its values at once
            assert await client.put([item]) == [True]
        assert len(list((tmp_path / "disk").glob("*.gcv"))) == 3  # the last one is in memory
        nodes.kill("node-d")
        _disk_node(nodes, "node-d", tmp_path / "disk")  # same id and directory: a restart

        async def served() -> bool:
            return (await client.exists(list(values)))[:3] == [True] * 3
        async with asyncio.timeout(60):
            while not await served():
                nodes.alive()
                await asyncio.sleep(0.2)
        got = await client.get(list(values))
        assert [bytes(g) for g in got[:3]] == list(values.values())[:3]
        assert got[3] is None  # it was only in memory: gone with the process
        assert (await nodes.details("node-d"))["keys"] == "3"
    finally:
        await client.close()
        nodes.stop()


async def test_a_corrupted_file_is_a_miss_never_wrong_bytes(nats_server, tmp_path):
    from services.gcache.disk_tier import file_name

    nodes = CacheNodes(nats_server.url, tmp_path / "logs")
    _disk_node(nodes, "node-c", tmp_path / "disk")
    values = _disk_values()
    client = await nodes.client()
    try:
        for item in values.items():
            assert await client.put([item]) == [True]
        victim = tmp_path / "disk" / file_name("disk:1")
        raw = bytearray(victim.read_bytes())
        raw[-100] ^= 0xFF  # one flipped bit pattern inside the value, header intact
        victim.write_bytes(bytes(raw))
        got = await client.get(list(values))
        assert got[1] is None
        assert [bytes(got[i]) for i in (0, 2, 3)] == [values[f"disk:{i}"] for i in (0, 2, 3)]
        assert await client.exists(["disk:1"]) == [False]  # dropped at the failed read
        assert int((await nodes.details("node-c"))["checksum_failures"]) == 1
    finally:
        await client.close()
        nodes.stop()


# --- across hosts: network namespaces ------------------------------------------------------------------


NS_CLIENT = r"""
import asyncio, json, sys, time
from libs.gcache import GCacheConfig
from libs.gcache.client import GCacheClient

async def main(url, ns, host):
    client = GCacheClient(url, ns, GCacheConfig(op_timeout_s=2.0, transfer_host=host))
    await client.start()
    loop = asyncio.get_running_loop()
    while True:
        cmd = (await loop.run_in_executor(None, sys.stdin.readline)).split()
        if not cmd:
            break
        start = time.monotonic()
        if cmd[0] == "nodes":
            out = sorted(client.nodes)
        elif cmd[0] == "put":
            out = await client.put([(cmd[1], cmd[2].encode() * 100_000)])
        else:
            out = [None if v is None else bytes(v[:len(cmd[2])]).decode() for v in await client.get([cmd[1]])]
        print(json.dumps({"out": out, "took": time.monotonic() - start}), flush=True)
    await client.close()

asyncio.run(main(*sys.argv[1:4]))
"""


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@pytest.fixture
def netns():
    """A network namespace joined to the root one by a veth pair (10.x.y.1 root side, .2 inside)."""
    tag = os.urandom(3).hex()
    name, root_if, ns_if = f"gc{tag}", f"gcr{tag}", f"gcn{tag}"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here (`ip netns add` failed: {made.stderr.strip()})")
    a, b = int(tag[:2], 16) % 200 + 20, int(tag[2:4], 16)
    root_ip, ns_ip = f"10.{a}.{b}.1", f"10.{a}.{b}.2"
    try:
        for cmd in (["link", "add", root_if, "type", "veth", "peer", "name", ns_if],
                    ["link", "set", ns_if, "netns", name],
                    ["addr", "add", f"{root_ip}/30", "dev", root_if], ["link", "set", root_if, "up"],
                    ["-n", name, "addr", "add", f"{ns_ip}/30", "dev", ns_if], ["-n", name, "link", "set", ns_if, "up"],
                    ["-n", name, "link", "set", "lo", "up"]):
            done = _ip(*cmd)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the veth pair (`ip {' '.join(cmd)}`: {done.stderr.strip()})")
        yield {"name": name, "root_if": root_if, "ns_if": ns_if, "root_ip": root_ip, "ns_ip": ns_ip}
    finally:
        _ip("link", "del", root_if)
        _ip("netns", "del", name)


async def test_across_namespaces_a_link_cut_gives_misses_within_the_bound_then_recovery(netns, tmp_path):
    from tests.fixtures.nats import free_port, nats_server_binary, wait_for_port

    port = free_port()
    nats = subprocess.Popen([nats_server_binary(), "-js", "-a", "0.0.0.0", "-p", str(port), "-sd",
                             str(tmp_path / "nats")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"nats://{netns['root_ip']}:{port}"
    nodes = CacheNodes(url, tmp_path / "logs", env={"UCX_NET_DEVICES": netns["root_if"],
                                                    "WINDSERVE_TRANSFER_HOST": netns["root_ip"]})
    client = None
    try:
        wait_for_port(port, 10.0, nats)
        nodes.start("node-root")
        env = {**os.environ, **UCX_ENV, "UCX_NET_DEVICES": netns["ns_if"]}
        client = subprocess.Popen(["ip", "netns", "exec", netns["name"], sys.executable, "-c", NS_CLIENT, url,
                                   nodes.namespace, netns["ns_ip"]], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

        async def ask(cmd: str) -> dict:
            client.stdin.write(cmd + "\n")
            client.stdin.flush()
            line = await bounded(asyncio.to_thread(client.stdout.readline), HANG)
            assert line, "the namespaced client exited"
            return json.loads(line)

        async with asyncio.timeout(60):
            while (await ask("nodes"))["out"] != ["node-root"]:
                nodes.alive()
                await asyncio.sleep(0.3)
        assert (await ask("put k1 abc"))["out"] == [True]
        assert (await ask("get k1 abc"))["out"] == ["abc"]

        assert _ip("link", "set", netns["root_if"], "down").returncode == 0
        for _ in range(3):  # misses, each within the op bound (2 s; generous slack for a loaded machine)
            answer = await ask("get k1 abc")
            assert answer["out"] == [None] and answer["took"] < 2.0 + 3.0
        assert (await ask("put k2 abc"))["out"] == [False]

        assert _ip("link", "set", netns["root_if"], "up").returncode == 0
        async with asyncio.timeout(60):  # NATS reconnects, the registry view resyncs, the node rejoins
            while (await ask("get k1 abc"))["out"] != ["abc"]:
                await asyncio.sleep(0.3)
        assert (await ask("put k2 abc"))["out"] == [True]
    finally:
        if client is not None:
            client.stdin.close()
            try:
                client.wait(15)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait(5)
        nodes.stop()
        nats.terminate()
        nats.wait(10)
