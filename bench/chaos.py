"""`python -m bench.chaos`: a chaos soak (#36). A steady mixed load against real processes while a fault injector
kills or stops one instance at a time; every greedy answer is checked against a fault-free rerun (each distinct request
once, as many at a time as there are clients).

Deployment (plain processes on a 3-node nats-server cluster, R3 registry, the tiny model): gateway, router=2,
prefill=2, decode=2, cache=2 (GCache nodes, the workers write back and look up), encoder=2. Load: `--clients`
clients, each looping over a mix of greedy requests: short chats, long streams (150-300 tokens), JSON-schema
chats, image chats. Faults, one at a time every `--interval` seconds for `--duration` seconds: SIGKILL (then the
instance is started again under its name), then in a second round SIGSTOP for 3 s (then SIGCONT), of a random
instance of each role in turn (decode, a NATS node, prefill, cache, router, encoder); the injector waits until
every instance is back before the next one.

Headline keys: `requests_total`, `requests_failed` (goal 0), `streams_broken` (a stream that ended with an error
after its first token; goal 0), `greedy_mismatches` (answers unequal to the same request's fault-free rerun; goal
0), `migrations` (streams the gateway moved), `p99_stall_s` (p99 over streams of each stream's longest gap between
two chunks; goal <= 5 s), `kv_pages_leaked` (KV pages still in use on the workers after the load; goal 0),
`instances_crashed` (processes that exited on their own, restarted as a supervisor would; goal 0),
`migrated_prefix_loaded_share` (of the tokens moved streams continued from, the share the new workers loaded from
a cache tier, GCache included, rather than recomputed; decode workers write running sequences back every 64
tokens). Hosts in network namespaces (a link cut) are tests/test_multihost.py, not part of the soak.
`--quick`: 12 s of load, two faults. Results: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from scripts.run import Supervisor
from tests.fixtures.faults import (
    GCACHE_NODE_ENV,
    GCACHE_WORKER_ENV,
    MODEL,
    Deployment,
    deployment,
    image_uri,
    kill_nats_node,
    migrated_prefix,
    migrations,
    nats_cluster,
    prompt,
)
from tests.fixtures.nats import wait_for_port

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUICK_RESULTS = ROOT / ".run" / "bench-quick"
TOPOLOGY = {"cache": 2, "encoder": 2, "gateway": 1, "router": 2, "prefill": 2, "decode": 2}
# in this order (a restarted engine role takes ~60 s to be back on a loaded 2-core box: the default run reaches the
# first four)
FAULT_ROLES = ("decode", "nats", "prefill", "cache", "router", "encoder")
# decode workers write a running sequence back every 64 tokens (default 256): the tiny model's streams are short
WORKER_ENV = {**GCACHE_WORKER_ENV, "WINDSERVE_GCACHE_WRITEBACK_EVERY": "64"}
ROLE_ENV = {"cache": GCACHE_NODE_ENV, "prefill": WORKER_ENV, "decode": WORKER_ENV}
STOP_S = 3.0
READY_TIMEOUT_S = 90.0
GOALS = {"requests_failed": ("<=", 0), "streams_broken": ("<=", 0), "greedy_mismatches": ("<=", 0),
         "p99_stall_s": ("<=", 5.0), "kv_pages_leaked": ("<=", 0), "instances_crashed": ("<=", 0)}
HEADLINE_KEYS = ("requests_total", "requests_failed", "streams_broken", "greedy_mismatches", "migrations",
                 "migrated_prefix_loaded_share", "p99_stall_s", "kv_pages_leaked", "instances_crashed")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


@dataclass
class Answer:
    kind: str
    body: dict
    ok: bool = False
    text: str = ""
    error: str = ""
    broken: bool = False  # an error after the first chunk
    max_gap_s: float = 0.0


def request(k: int, rng: random.Random) -> tuple[str, dict]:
    """The k-th request of the mix (greedy, streamed)."""
    kind = rng.choice(("short", "long", "json", "image"))
    base = {"model": MODEL, "temperature": 0, "stream": True}
    if kind == "long":
        return kind, {**base, "prompt": prompt(k, 30 + k % 40), "max_tokens": rng.randint(150, 300),
                      "ignore_eos": True}
    if kind == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
        return kind, {**base, "messages": [{"role": "user", "content": f"item {k}"}], "max_tokens": 80,
                      "response_format": fmt}
    if kind == "image":
        content = [{"type": "image_url", "image_url": {"url": image_uri(k % 5)}}, {"type": "text", "text": f"k {k}"}]
        return kind, {**base, "messages": [{"role": "user", "content": content}], "max_tokens": 16}
    return kind, {**base, "messages": [{"role": "user", "content": f"hello {k}"}], "max_tokens": 24}


async def send(client: httpx.AsyncClient, url: str, kind: str, body: dict) -> Answer:
    out = Answer(kind, body)
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    last = first = None
    try:
        async with client.stream("POST", url + path, json=body) as resp:
            if resp.status_code != 200:
                out.error = f"{resp.status_code} {(await resp.aread())[:200]!r}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.monotonic()
                if last is not None:
                    out.max_gap_s = max(out.max_gap_s, now - last)
                last, first = now, first or now
                event = json.loads(line[6:])
                if "error" in event:
                    out.error, out.broken = json.dumps(event["error"])[:1000], True
                    return out
                for choice in event.get("choices", ()):
                    out.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        out.ok = True
        if kind == "json":
            json.loads(out.text)
    except (httpx.HTTPError, ValueError) as exc:
        out.ok, out.error = False, repr(exc)[:300]
    return out


async def load(url: str, clients: int, until: float, seed: int) -> list[Answer]:
    answers: list[Answer] = []
    counter = iter(range(10**9))

    async def client_loop(c: int) -> None:
        rng = random.Random(seed * 1000 + c)
        async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
            while time.monotonic() < until:
                kind, body = request(next(counter), rng)
                answers.append(await send(client, url, kind, body))

    await asyncio.gather(*(client_loop(c) for c in range(clients)))
    return answers


async def until_ready(dep: Deployment, instance: str = "", timeout_s: float = READY_TIMEOUT_S) -> str:
    """Until the gateway lists every instance and `instance` (started again, or continued) answers its own health
    subject (a restarted one's registry entry may still be its predecessor's). '' when so, else what is missing."""
    deadline = time.monotonic() + timeout_s
    why = ""
    while time.monotonic() < deadline:
        try:
            listed = {i for ids in (await asyncio.to_thread(dep.health))["services"].values() for i in ids}
            missing = sorted(set(dep.procs) - listed)
            why = f"not listed: {missing}" if missing else ""
            if not missing and instance:
                await dep.details(instance)
            if not missing:
                return ""
        except Exception as exc:  # noqa: BLE001 (not up yet: its health subject has no responders)
            why = f"{instance} does not answer: {exc!r}"[:200]
        await asyncio.sleep(0.5)
    return why or "timeout"


@dataclass
class Injector:
    dep: Deployment
    sup: Supervisor  # the 3-node NATS cluster
    until: float
    interval_s: float
    rng: random.Random
    faults: list[dict] = field(default_factory=list)
    crashes: list[dict] = field(default_factory=list)  # instances that exited on their own (restarted, as
    # a supervisor would)

    def restart_crashed(self) -> None:
        for name, proc in list(self.dep.procs.items()):
            if proc.poll() is not None:
                kept = self.dep.logs / f"{name}.crash{len(self.crashes)}.log"  # (the restart writes a new log)
                (self.dep.logs / f"{name}.log").rename(kept)
                tail = kept.read_text(errors="replace")[-1500:]
                self.crashes.append({"instance": name, "exit_code": proc.returncode, "log": str(kept),
                                     "log_tail": tail})
                print(f"[chaos] {name} exited with {proc.returncode} on its own; restarting it", flush=True)
                self.dep.procs.pop(name)
                role = name.rsplit("-", 1)[0]
                self.dep.start(name, role, ROLE_ENV.get(role))

    async def watch(self) -> None:
        while time.monotonic() < self.until:
            self.restart_crashed()
            await asyncio.sleep(1.0)

    async def run(self) -> None:
        watcher = asyncio.create_task(self.watch())
        try:
            await self._faults()
        finally:
            watcher.cancel()

    async def _faults(self) -> None:
        await asyncio.sleep(self.interval_s)
        plan = [(role, how) for how in ("kill", "stop") for role in FAULT_ROLES]  # every role, killed first
        for role, how in itertools.cycle(plan):
            if time.monotonic() >= self.until:
                return
            at = time.monotonic()
            victim = await (self._nats_fault(how) if role == "nats" else self._fault(role, how))
            why = await until_ready(self.dep, "" if role == "nats" else victim)
            self.faults.append({"victim": victim, "fault": how, "ready_after_s": round(time.monotonic() - at, 3),
                                **({"not_back": why} if why else {})})
            print(f"[chaos] {how} {victim}: {'NOT back: ' + why if why else 'all back'} after "
                  f"{self.faults[-1]['ready_after_s']} s", flush=True)
            await asyncio.sleep(self.interval_s)

    async def _fault(self, role: str, how: str) -> str:
        """Kill (then start again under its name) or stop for STOP_S a random instance of `role`."""
        victim = self.rng.choice(sorted(i for i in self.dep.procs if i.rsplit("-", 1)[0] == role))
        if how == "kill":
            self.dep.kill(victim)
            self.dep.start(victim, role, ROLE_ENV.get(role))
        else:
            self.dep.procs[victim].send_signal(signal.SIGSTOP)
            await asyncio.sleep(STOP_S)
            self.dep.procs[victim].send_signal(signal.SIGCONT)
        return victim

    async def _nats_fault(self, how: str) -> str:
        """Kill (then start again on its port and store) or stop for STOP_S a random node of the cluster."""
        node = self.rng.randrange(len(self.sup.nats_nodes))
        if how == "kill":
            kill_nats_node(self.sup, node)
            self.sup.nats_nodes[node] = self.sup.spawn_nats(node)
            await asyncio.to_thread(wait_for_port, self.sup.nats_ports[node], 30.0, self.sup.nats_nodes[node].popen)
        else:
            proc = self.sup.nats_nodes[node].popen
            proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(STOP_S)
            proc.send_signal(signal.SIGCONT)
        return f"nats-{node}"


async def soak(duration_s: float, interval_s: float, clients: int, seed: int, logs: Path) -> dict:
    async with nats_cluster(logs / "nats") as sup:
        return await _soak(sup, duration_s, interval_s, clients, seed, logs)


async def _soak(sup: Supervisor, duration_s: float, interval_s: float, clients: int, seed: int, logs: Path) -> dict:
    # the services' default control-plane timing (the test fixtures' is 2-2.5x faster: too harsh for 14 processes
    # on 2 cores under faults, where registry entries expired while the cluster elected a leader)
    timing = {"WINDSERVE_REGISTRY_TTL_S": "5", "WINDSERVE_HEARTBEAT_INTERVAL_S": "1.0",
              "WINDSERVE_LIVENESS_INTERVAL_S": "1.0", "WINDSERVE_LOAD_INTERVAL_S": "0.5"}
    dep = deployment(sup.nats_url, logs, {"WINDSERVE_NATS_REPLICAS": "3", **timing})
    marks = [("start", time.monotonic())]  # the run's phases, for `phases_s`
    try:
        dep.start_all(TOPOLOGY, ROLE_ENV, timeout=300)
        marks.append(("startup", time.monotonic()))  # (cold compile caches: 4 engines compile on 2 cores)
        async with httpx.AsyncClient(timeout=30) as client:
            moved_before = await migrations(client, dep.url)
            prefix_before = await migrated_prefix(client, dep.url)
        until = time.monotonic() + duration_s
        injector = Injector(dep, sup, until, interval_s, random.Random(seed))
        answers, _ = await asyncio.gather(load(dep.url, clients, until, seed), injector.run())
        marks.append(("load", time.monotonic()))
        injector.restart_crashed()
        await until_ready(dep)  # (the rerun needs the whole deployment: a fault that did not heal is in `faults`)
        marks.append(("heal", time.monotonic()))
        async with httpx.AsyncClient(timeout=httpx.Timeout(120)) as client:
            moved = await migrations(client, dep.url) - moved_before
            prefix, loaded = (b - a for a, b in zip(prefix_before, await migrated_prefix(client, dep.url), strict=True))
            mismatches = await rerun(client, dep.url, answers, clients)
        marks.append(("rerun", time.monotonic()))
        injector.restart_crashed()  # (one that crashed during the rerun: its pools are new, the others are read)
        await until_ready(dep)
        workers = [i for i in dep.procs if i.rsplit("-", 1)[0] in ("prefill", "decode")]
        details = await dep.settled(workers, timeout_s=30)
        leaked = sum(int(d.get("kv_full_used", 0)) + int(d.get("kv_swa_used", 0)) for d in details.values())
    finally:
        dep.stop()
    marks.append(("settle_and_stop", time.monotonic()))
    gaps = sorted(a.max_gap_s for a in answers if a.ok or a.broken)
    failed = [a for a in answers if not a.ok]
    return {
        "requests_total": len(answers), "requests_failed": len(failed),
        "streams_broken": sum(a.broken for a in answers), "greedy_mismatches": len(mismatches),
        "migrations": int(moved), "migrated_prefix_loaded_share": round(loaded / prefix, 3) if prefix else None,
        "migrated_prefix_tokens": int(prefix),
        "p99_stall_s": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 3) if gaps else None,
        "kv_pages_leaked": leaked, "instances_crashed": len(injector.crashes), "crashes": injector.crashes,
        **({"null_reasons": {"migrated_prefix_loaded_share": "no migrated stream finished"}} if not prefix else {}),
        "faults": injector.faults, "errors": [f"{a.kind}: {a.error}" for a in failed][:20],
        "mismatches": mismatches[:10],
        "by_kind": {k: sum(a.kind == k for a in answers) for k in ("short", "long", "json", "image")},
        "median_stall_s": round(statistics.median(gaps), 3) if gaps else None,
        "phases_s": {name: round(t - marks[i][1], 1) for i, (name, t) in enumerate(marks[1:])},
    }


async def rerun(client: httpx.AsyncClient, url: str, answers: list[Answer], concurrency: int) -> list[dict]:
    """The fault-free rerun: each distinct request that succeeded once (greedy: equal requests have equal answers),
    `concurrency` at a time as under the load; returns the answers unequal to it."""
    distinct = {json.dumps(a.body, sort_keys=True): a for a in answers if a.ok}
    gate = asyncio.Semaphore(concurrency)

    async def one(a: Answer) -> Answer:
        async with gate:
            return await send(client, url, a.kind, a.body)

    reference = dict(zip(distinct, await asyncio.gather(*(one(a) for a in distinct.values())), strict=True))
    return [{"kind": a.kind, "got": a.text[:80], "rerun": b.text[:80]} for a in answers
            if a.ok and (b := reference[json.dumps(a.body, sort_keys=True)]).ok and b.text != a.text]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["requests_failed", "streams_broken", "greedy_mismatches", "migrations", "kv_pages_leaked"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(keys, [result[k] or 0 for k in keys], color=["tab:red"] * 3 + ["tab:blue", "tab:red"])
    ax1.set_title(f"{result['requests_total']} requests, {len(result['faults'])} faults")
    ax1.tick_params(axis="x", rotation=30)
    ax2.bar(["median", "p99"], [result["median_stall_s"] or 0, result["p99_stall_s"] or 0], color="tab:green")
    ax2.axhline(5.0, color="gray", linestyle="--", label="goal p99 5 s")
    ax2.set_ylabel("longest gap between two chunks of a stream (s)")
    ax2.legend()
    fig.suptitle("Chaos soak (bench.chaos)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=None, help="seconds of load (default 240, --quick 12)")
    ap.add_argument("--interval", type=float, default=None, help="seconds between faults (default 10, --quick 4)")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke run: 12 s of load, faults every 4 s")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                                                           "bench/results/chaos.json")
    args = ap.parse_args(argv)
    duration = args.duration or (12.0 if args.quick else 240.0)
    interval = args.interval or (4.0 if args.quick else 10.0)
    out = args.out or (QUICK_RESULTS if args.quick else RESULTS) / "chaos.json"
    logs = Path(tempfile.mkdtemp(prefix="bench-chaos-logs-"))
    figures = asyncio.run(soak(duration, interval, args.clients, args.seed, logs))
    met = {k: figures[k] is not None and (figures[k] <= v if op == "<=" else figures[k] >= v)
           for k, (op, v) in GOALS.items()}
    result = {**{k: figures[k] for k in HEADLINE_KEYS}, "goals": {k: f"{op} {v}" for k, (op, v) in GOALS.items()},
              "met": met, "setup": {"topology": TOPOLOGY, "duration_s": duration, "interval_s": interval,
                                    "clients": args.clients, "seed": args.seed, "quick": args.quick,
                                    "logs": str(logs)},
              **{k: v for k, v in figures.items() if k not in HEADLINE_KEYS}}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    for k in HEADLINE_KEYS:
        print(f"{k:30s} {result[k]}" + (f"  goal {result['goals'][k]}: {'met' if met[k] else 'missed'}"
                                        if k in GOALS else ""))
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
