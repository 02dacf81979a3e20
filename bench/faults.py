"""`python -m bench.faults`: SIGKILL of each role under concurrent streams, on real processes.

Faults (`--only` selects): `roles` (a decode, a prefill and a combined worker, then a router), `gcache_node`,
`encoder`, `nats_node` (the registry stream's leader of a 3-node cluster), `nats_hung` and `router_hung`
(SIGSTOP, then continue). Per fault: failed and in-flight streams, requests lost, 500s, time until the first
request sent after the fault succeeds, and failover attempts; goals: none lost, no 500, fast recovery.
Writes bench/results/faults.json and faults.png (`HEADLINE_KEYS` top-level; null with the reason under
"null_reasons" for a fault not run). `--quick` kills only the combined worker (a smoke run; JSON under
.run/bench-quick/). Faults: docs/faults.md, "The fault suite"; results: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from tests.fixtures.faults import (
    GCACHE_NODE_ENV,
    GCACHE_WORKER_ENV,
    FaultResult,
    deployment,
    hang_registry_leader_under_load,
    kill_encoder_under_load,
    kill_gcache_node_under_load,
    kill_registry_leader_under_load,
    kill_under_load,
    nats_cluster,
    probe_figures,
    stop_router_under_load,
)
from tests.fixtures.nats import start_nats_server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
QUICK_RESULTS = ROOT / ".run" / "bench-quick"


FAULTS = ("roles", "nats_node", "gcache_node", "encoder", "nats_hung", "router_hung")
QUICK_STREAMS = 4
# the headline figures (top-level keys of faults.json): totals over every fault run, and each fault's recovery
# time (kill -> the first later request served) under the name of the fault that sets it
RECOVERY_KEYS = {"nats_node_recovery_s": "nats_node", "gcache_node_recovery_s": "gcache_node",
                 "encoder_recovery_s": "encoder", "nats_hung_recovery_s": "nats_hung",
                 "router_hung_recovery_s": "router_hung"}
HEADLINE_KEYS = ("failed_requests", "requests_in_flight", "requests_lost", "status_500", "max_recovery_s",
                 "later_failed", "retried", *RECOVERY_KEYS)


async def run_all(streams: int, logs: Path, only: set[str], quick: bool = False) -> list[FaultResult]:
    nats = start_nats_server(tempfile.mkdtemp(prefix="bench-faults-nats-"))
    results: list[FaultResult] = []
    try:
        if "roles" in only:
            await role_faults(nats.url, streams, logs, results, quick)
        if "gcache_node" in only:
            results.append(await gcache_node_fault(nats.url, logs))
        if "encoder" in only:
            results.append(await encoder_fault(nats.url, logs))
        if "router_hung" in only:
            results.append(await router_hung_fault(nats.url, logs))
    finally:
        nats.stop()
    if "nats_node" in only:
        results.append(await nats_node_fault(streams, logs))
    if "nats_hung" in only:
        results.append(await nats_hung_fault(streams, logs))
    return results


async def gcache_node_fault(nats_url: str, logs: Path) -> FaultResult:
    """SIGKILL of the GCache storage node holding most keys (of 2) while 4 clients' requests (shared documents +
    a unique question) look up L3 and write back, on 2 combined workers, for 10 s."""
    dep = deployment(nats_url, logs / "gcache")
    try:
        dep.start_all({"cache": 2, "gateway": 1, "router": 1, "worker": 2},
                      {"cache": GCACHE_NODE_ENV, "worker": GCACHE_WORKER_ENV})
        return await kill_gcache_node_under_load(dep, ["cache-0", "cache-1"], clients=4, load_s=10)
    finally:
        dep.stop()


async def encoder_fault(nats_url: str, logs: Path) -> FaultResult:
    """SIGKILL of one of 2 encoders while 4 clients send image chats (a new image each) for 10 s."""
    dep = deployment(nats_url, logs / "encoder")
    try:
        dep.start_all({"encoder": 2, "gateway": 1, "router": 1, "worker": 1})
        return await kill_encoder_under_load(dep, clients=4, load_s=10, timeout_s=45)
    finally:
        dep.stop()


async def router_hung_fault(nats_url: str, logs: Path) -> FaultResult:
    """SIGSTOP of one of 2 routers (gateway, 2 routers, prefill, decode) for 6 s, then SIGCONT, while 4 clients send
    short completions for 14 s (the stop 3 s in). `retried`: routes asked again of the other router."""
    dep = deployment(nats_url, logs / "router-hung")
    try:
        dep.start_all({"gateway": 1, "router": 2, "prefill": 1, "decode": 1})
        return await stop_router_under_load(dep, "router-0", stop_s=6.0, clients=4, kill_after_s=3, load_s=14)
    finally:
        dep.stop()


async def nats_hung_fault(streams: int, logs: Path) -> FaultResult:
    """SIGSTOP of the NATS node leading the registry stream of a 3-node cluster for 6 s (3 registry TTLs), then
    SIGCONT, under streams and a client's short requests for 18 s."""
    async with nats_cluster(logs / "nats-hung") as sup:
        dep = deployment(sup.nats_url, logs / "hung", {"WINDSERVE_NATS_REPLICAS": "3"})
        try:
            dep.start_all({"gateway": 1, "router": 1, "prefill": 1, "decode": 1})
            return await hang_registry_leader_under_load(sup, dep, streams)
        finally:
            dep.stop()


async def role_faults(nats_url: str, streams: int, logs: Path, results: list[FaultResult], quick: bool = False) -> None:
    """Decode then prefill of 2 prefill + 2 decode, a combined worker of 2, then the aggregated router (`quick`:
    the combined worker only)."""
    if not quick:
        dep = deployment(nats_url, logs / "disagg")
        try:
            dep.start_all({"gateway": 1, "router": 1, "prefill": 2, "decode": 2},
                          {"prefill": {"WINDSERVE_MAX_NUM_BATCHED_TOKENS": "16"}})
            results.append(await kill_under_load(dep, "decode", "decode", streams=streams, prompt_len=40,
                                                 max_tokens=400, before_first_token=False))
            await dep.settled([i for i in dep.procs if i.split("-")[0] in ("prefill", "decode")])
            results.append(await kill_under_load(dep, "prefill", "prefill", streams=streams, prompt_len=400,
                                                 max_tokens=8, before_first_token=True, seed=100))
        finally:
            dep.stop()
    agg = deployment(nats_url, logs / "aggregated")
    try:
        agg.start_all({"gateway": 1, "router": 1, "worker": 2})
        results.append(await kill_under_load(agg, "worker", "worker", streams=streams, prompt_len=40,
                                             max_tokens=400, before_first_token=False, seed=200))
        if quick:
            return
        await agg.settled([i for i in agg.procs if i.startswith("worker")])
        results.append(await kill_under_load(agg, "router", "router", streams=streams, prompt_len=40,
                                             max_tokens=200, before_first_token=False, seed=300,
                                             victim="router-0"))
    finally:
        agg.stop()


async def nats_node_fault(streams: int, logs: Path) -> FaultResult:
    """SIGKILL of the NATS node leading the registry stream of a 3-node cluster (gateway, router, prefill, decode
    on it, R3 buckets), under streams, while a client sends short requests one after another for 15 s; those
    requests are appended to the result's outcomes (`probes`)."""
    async with nats_cluster(logs / "nats-cluster") as sup:
        dep = deployment(sup.nats_url, logs / "cluster", {"WINDSERVE_NATS_REPLICAS": "3"})
        try:
            dep.start_all({"gateway": 1, "router": 1, "prefill": 1, "decode": 1})
            result = await kill_registry_leader_under_load(sup, dep, streams)
        finally:
            dep.stop()
    return result


def summary(results: list[FaultResult]) -> dict:
    per_fault = {r.fault: r.headline() for r in results}
    return {
        "failed_requests": sum(r.failed for r in results),
        "requests_in_flight": sum(r.in_flight for r in results),
        "requests_lost": sum(r.lost for r in results),
        "status_500": sum(r.status_500 for r in results),
        "max_recovery_s": max(r.recovery_s for r in results),
        "later_failed": sum(r.later_failed for r in results),
        "retried": sum(r.retried for r in results),
        **nats_node_figures(results),
        **probe_figures("gcache_node", next((r for r in results if r.fault == "gcache node"), None)),
        **probe_figures("encoder", next((r for r in results if r.fault == "encoder"), None)),
        **probe_figures("nats_hung", next((r for r in results if r.fault == "nats hung"), None)),
        **probe_figures("router_hung", next((r for r in results if r.fault == "router hung"), None)),
        "faults": per_fault,
    }


def nats_node_figures(results: list[FaultResult]) -> dict:
    """The NATS-node fault's client view across the election: requests sent, failed, slowest."""
    probes = next((r.probes for r in results if r.fault == "nats node"), [])
    return {"nats_node_recovery_s": next((r.recovery_s for r in results if r.fault == "nats node"), None),
            "nats_node_requests": len(probes), "nats_node_requests_failed": sum(not o.ok for o in probes),
            "nats_node_slowest_request_s": round(max((o.ended_at - o.sent_at for o in probes), default=0.0), 3),
            "nats_node_errors": [f"{o.status} {o.code}: {o.message[:160]}" for o in probes if not o.ok]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    faults = list(result["faults"])
    rows = [result["faults"][f] for f in faults]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(faults))
    ax1.bar([i - 0.2 for i in x], [r["in_flight"] for r in rows], width=0.4, label="in flight at the kill")
    ax1.bar([i + 0.2 for i in x], [r["failed"] for r in rows], width=0.4, label="failed (had tokens)")
    ax1.set_xticks(list(x), faults)
    ax1.set_ylabel("streams")
    ax1.set_title(f"lost {result['requests_lost']}, 500s {result['status_500']}, retried {result['retried']}")
    ax1.legend()
    ax2.bar(list(x), [r["recovery_s"] for r in rows], color="tab:green")
    ax2.axhline(1.0, color="gray", linestyle="--", label="goal 1 s")
    ax2.set_xticks(list(x), faults)
    ax2.set_ylabel("kill -> first later request served (s)")
    ax2.legend()
    fig.suptitle("SIGKILL under concurrent streams (bench.faults)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=None, help=f"concurrent streams per fault (default 8, --quick "
                    f"{QUICK_STREAMS})")
    ap.add_argument("--only", default=None,
                    help=f"comma-separated faults of {', '.join(FAULTS)} (default all, --quick roles; a subset writes "
                         "faults_<names>.json)")
    ap.add_argument("--quick", action="store_true", help="smoke run: the aggregated deployment's worker kill only")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (PNG beside it); default "
                    "bench/results/faults.json (faults_<names>.json for a subset), with --quick "
                    ".run/bench-quick/faults.json")
    args = ap.parse_args(argv)
    streams = args.streams or (QUICK_STREAMS if args.quick else 8)
    only = {f.strip() for f in (args.only or ("roles" if args.quick else ",".join(FAULTS))).split(",") if f.strip()}
    if only - set(FAULTS):
        ap.error(f"unknown faults {sorted(only - set(FAULTS))}; known: {', '.join(FAULTS)}")
    name = "faults" if only == set(FAULTS) or args.quick else "faults_" + "_".join(f for f in FAULTS if f in only)
    out = args.out or (QUICK_RESULTS if args.quick else RESULTS) / f"{name}.json"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        results = asyncio.run(run_all(streams, Path(tmp), only, args.quick))
    result = {**summary(results), "streams": streams, "quick": args.quick,
              "seconds": round(time.perf_counter() - started, 1)}
    result["null_reasons"] = {k: f"the {fault} fault was not run (--only {','.join(sorted(only))})"
                              for k, fault in RECOVERY_KEYS.items() if result[k] is None}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "faults"}, indent=2))
    for fault, row in result["faults"].items():
        print(f"{fault:11s} failed {row['failed_of_in_flight']:>5s}  lost {row['lost']}  500s {row['status_500']}  "
              f"recovery {row['recovery_s']:.3f}s  later failed {row['later_failed']}  retried {row['retried']}")
    print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
