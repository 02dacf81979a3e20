"""Parallel engines in the real service stack (#18): gateway + router + two combined workers, each a tp=2 + ep=2
engine (a worker process and one rank process), on a real nats-server over plain HTTP.

- their greedy completions equal one in-process, single-rank engine's;
- SIGKILL of one worker's rank mid-stream: the streams on that worker move to the other one (#36) (no hang, no
  500), later requests are served by the other worker, and the worker whose rank died leaves the registry
  (its process stops) within a bound.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from libs.engine import EngineConfig, EngineCore, Request
from libs.model import load_model
from tests.fixtures.faults import BASE_ENV, MODEL, Deployment, kill_under_load, migrations, prompt
from tests.test_engine import drain, greedy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PARALLEL_ENV = {"WINDSERVE_TP": "2", "WINDSERVE_EP": "2", "WINDSERVE_PARALLEL_TIMEOUT_S": "20"}


class RankKill(Deployment):
    """kill(instance) SIGKILLs the instance's rank process, not the instance: the worker must notice by itself."""

    def kill(self, instance: str) -> float:
        ranks = rank_pids(self.procs[instance].pid)
        assert ranks, f"{instance} has no rank process"
        os.kill(ranks[0], signal.SIGKILL)
        return time.monotonic()


def rank_pids(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"libs.engine.parallel.rank" in cmd:
            found.append(int(entry))
    return found


@pytest.fixture(scope="module")
def dep(nats_server, tmp_path_factory):
    d = RankKill(nats_server.url, tmp_path_factory.mktemp("parallel-serving"), env=dict(BASE_ENV))
    try:
        d.start_all({"gateway": 1, "router": 1, "worker": 2}, {"worker": PARALLEL_ENV}, timeout=180)
        yield d
    finally:
        d.stop()


async def test_parallel_workers_equal_one_process(dep):
    model, cfg = load_model(None, progress=False)
    ref = EngineCore(EngineConfig(page_size=4, bucket_edges=()), model, cfg)
    prompts = [prompt(s, 20 + 9 * s) for s in range(4)]
    for i, p in enumerate(prompts):
        ref.add_request(Request(f"r{i}", p, greedy(12)))
    want = drain(ref)
    ref.close()
    async with httpx.AsyncClient(timeout=120) as client:
        for i, p in enumerate(prompts):
            resp = await client.post(f"{dep.url}/v1/completions", json={
                "model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["token_ids"] == want[f"r{i}"], f"prompt {i}"
    details = await dep.details("worker-0")
    assert details["parallel"] == "tp=2 ep=2 (2 ranks)", details


async def test_killed_rank_errors_explicitly_and_the_worker_leaves(dep):
    result = await kill_under_load(dep, "rank-sigkill", "worker", streams=4, prompt_len=24, max_tokens=400,
                                   before_first_token=False, recover_s=60, settle_s=120)
    victim = dep.procs[result.victim]
    failed = [o for o in result.outcomes[:result.in_flight] if not o.ok]
    assert result.status_500 == 0 and result.lost == 0, result.headline()
    # #36: the streams of the worker whose engine died moved to the other worker and finished
    assert not failed and result.victim_streams >= 1, result.headline()
    async with httpx.AsyncClient(timeout=30) as client:
        assert await migrations(client, dep.url) >= 1
    assert result.later_failed == 0 or result.recovery_s < 60, result.headline()
    victim.wait(60)  # the worker stopped by itself: its engine is dead
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        listed = {i for ids in dep.health()["services"].values() for i in ids}
        if result.victim not in listed:
            break
        time.sleep(0.2)
    assert result.victim not in listed, listed
    assert not rank_pids(victim.pid)
