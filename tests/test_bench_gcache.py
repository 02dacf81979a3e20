"""bench.gcache's own parts: the cluster simulation with a pooled L3, the results writer, and the plain-TCP system
over loopback sockets (seconds)."""

from __future__ import annotations

import asyncio
import json

import numpy as np

from bench import gcache
from bench.kvcache import PAGE
from bench.router import BUDGET
from bench.traces import agentic


def test_pooled_l3_hit_needs_full_blocks_up_to_a_checkpoint() -> None:
    l3 = gcache.PooledL3(capacity=100, page=PAGE, full_bytes=1, swa_bytes=1)
    chain = list(range(1, 13))  # 12 pages; the SWA checkpoint at the end (page 12) only
    l3.write(chain, [12])
    assert l3.hit(chain, 12 * PAGE + 1) == 12 * PAGE
    assert l3.hit(chain, 12 * PAGE) == 0  # one prompt token must stay to compute, and no earlier checkpoint
    l3.write(chain[:8], [8])  # a prompt that ended at page 8
    assert l3.hit(chain, 12 * PAGE) == 8 * PAGE
    assert l3.hit(chain[:5] + [99] + chain[6:], 12 * PAGE + 1) == 0  # a missing full block: no checkpoint before
    other = chain[:6] + [99] * 6  # shares pages 0..5 only: the page-8 checkpoint is out of reach
    assert l3.hit(other, 12 * PAGE) == 0
    l3.write(chain, [4, 12])  # a periodic checkpoint at page 4 (the engine's checkpoint_every_pages)
    assert l3.hit(other, 12 * PAGE) == 4 * PAGE and l3.checkpoints == 4
    small = gcache.PooledL3(capacity=3, page=PAGE, full_bytes=1, swa_bytes=1)
    small.write(chain, [12])  # LRU keeps the last 3 values: the tail, not the prefix
    assert small.hit(chain, 12 * PAGE + 1) == 0 and small.used <= 3 and small.evicted > 0


def test_cluster_share_with_gcache_at_least_without() -> None:
    grid = gcache.cluster({"agentic": agentic(60)}, 4, ("round_robin",), BUDGET, 4 * BUDGET, 512)
    cell = grid["agentic"]["round_robin"]
    assert cell["gcache_hit_share"] >= cell["no_gcache_hit_share"]
    assert cell["l3_hit_tokens"] > 0  # round robin spreads a session's turns: the next turn's prefix is in L3
    assert cell["gcache_hit_share"] >= cell["gcache_ckpt0_hit_share"] - 1e-9  # periodic checkpoints: more hits
    assert cell["gcache_ckpt0_hit_share"] >= cell["no_gcache_hit_share"]


def test_results_have_every_headline_key(tmp_path) -> None:
    rows = [{"op": op, "size_mib": mib, "clients": 1, "gcache_gbps": 2.0, "raw_ucx_gbps": g, "redis_gbps": 0.5,
             "gcache_over_raw_ucx": 2.0 / g, "gcache_over_redis": 4.0, "plain_tcp_over_redis": 1.5 if mib > 1 else 0.1,
             "raw_ucx_hashed_over_raw_ucx": 0.7 if mib == 64 else 0.9, "gcache_over_raw_ucx_hashed": 2.0 / g / 0.8}
            for op in ("put", "get") for mib, g in ((1, 10.0), (4, 2.5), (64, 2.0))]
    tp = {"by_transport": {"sm": rows}, "gcache_missing": None}
    sim = {"gcache_cluster_hit_share": 0.97, "no_gcache_cluster_hit_share": 0.6, "grid": {}, "workers": 4}
    eng = {"l3_hit_ttft_ratio": 0.4, "l3_bytes_per_token_ratio": None, "engine": {"l3_bytes_per_token_ratio": "x"}}
    out = gcache.build_results(tp, sim, eng, {"quick": True})
    gcache.write_results(out, tmp_path / "gcache.json", None)
    data = json.loads((tmp_path / "gcache.json").read_text())
    assert set(gcache.HEADLINE_KEYS) <= set(data)
    assert data["put_vs_raw_ucx"] == 0.8  # the worst over sizes >= 4 MiB (the 1 MiB row is not counted)
    assert data["get_vs_redis"] == 4.0 and data["met"]["get_vs_redis"] is True
    assert data["hashed_raw_get_vs_raw_ucx"] == 0.7 and data["put_vs_hashed_raw"] == 1.0  # same rule, no goals
    assert "hashed_raw_put_vs_raw_ucx" not in data["met"]
    assert data["plain_tcp_put_vs_redis"] == 1.5  # the plain-TCP ceiling's ratio (no goal: a bound on put_vs_redis)
    assert data["gcache_cluster_hit_share"] == 0.97 and data["met"]["gcache_cluster_hit_share"] is True
    assert data["l3_hit_ttft_ratio"] == 0.4 and data["met"]["l3_hit_ttft_ratio"] is True
    assert data["l3_bytes_per_token_ratio"] is None and data["null_reasons"]["l3_bytes_per_token_ratio"] == "x"


async def test_plain_tcp_system_moves_a_batch_both_ways() -> None:
    """bench.gcache's plain-TCP system over real loopback sockets: a put's bytes reach the sink (one buffer per
    connection), and a get of the same size brings them back byte for byte."""
    sink = gcache.TcpSink(0)
    port = int(await sink.start())
    client = gcache.TcpBackend(0, port)
    await client.start()
    try:
        size, n = 1 << 20, 3
        assert await client.put(size, n, 0) == n
        client.dst[:] = 0
        assert await client.get(size, n, 0) == n
        assert np.array_equal(client.dst[:n * size], client.src[:n * size])
    finally:
        await client.close()
        await sink.close()


async def test_checksummed_raw_baseline_moves_values_and_their_sums() -> None:
    """bench.gcache's checksummed raw-UCX baseline over real ucxx (one process, two UCX workers): a put lands the
    values and their xxh3 sums (the same as libs.gcache's value_checksum) before it is acknowledged; a get brings
    the server's values back byte for byte, and its verdict (the get waits for it: bounded here)."""
    from libs.gcache.keys import value_checksum

    server = gcache.RawServer(0, 1, hashed=True)
    client = gcache.RawClient(0, 1, hashed=True)
    addrs = [await server.start(), await client.start()]
    try:
        await client.peers(addrs[:1])
        await server.peers(addrs[1:])
        size, n = 1 << 20, 3
        server.expect("put", 0, size, n, 1)
        assert await asyncio.wait_for(client.put(size, n, 1), 30) == n
        assert np.array_equal(server.land[0][:n * size], client.src[:n * size])
        want = [value_checksum(client.src[i * size:(i + 1) * size]) for i in range(n)]
        assert server.sums[0].view(np.uint64).tolist() == want
        server.expect("get", 0, size, n, 2)
        assert await asyncio.wait_for(client.get(size, n, 2), 30) == n
        assert np.array_equal(client.dst[:n * size], server.src[:n * size])
    finally:
        await client.close()
        await server.close()
