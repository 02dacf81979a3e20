"""`make bench`: run every benchmark in turn; each writes bench/results/<name>.json and a PNG.

Usage: python -m bench [--quick] [--out-dir DIR] [name ...]   (default: all but the optional `peer`)

--quick runs each benchmark's smoke mode (tiny sizes, the same code paths, seconds each); its JSON and PNG go to
--out-dir (default .run/bench-quick/, ignored by git), never over the committed bench/results/. Without --quick,
--out-dir moves the full results elsewhere too.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = ("model", "kvcache", "transfer", "engine", "serving", "router", "faults", "gateway", "gcache", "encoder",
              "mtp", "parallel", "chaos", "profile", "planner")
# Run only when named (`python -m bench peer`): it installs vLLM's CPU build in its own venv on first use and takes
# ~10 minutes (bench/README.md)
OPTIONAL = ("peer",)
QUICK_DIR = Path(__file__).resolve().parent.parent / ".run" / "bench-quick"
# --quick: one torch (OpenMP) thread per process unless the caller set one. A smoke run's timings mean nothing, and
# on a shared box two intra-op threads that wait on each other's cores make tiny-model steps 10-50x slower (a quick
# bench.engine took 10 s or 2 min depending on the neighbours' load); one thread keeps every quick run seconds.
QUICK_ENV = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def command(name: str, quick: bool, out_dir: Path | None) -> list[str]:
    """The command line of one benchmark: its own process (one's threads and allocations do not skew the next)."""
    cmd = [sys.executable, "-m", f"bench.{name}"]
    if quick:
        cmd.append("--quick")
        out_dir = out_dir or QUICK_DIR
    if out_dir is not None:
        cmd += ["--out", str(out_dir / f"{name}.json")]
    return cmd


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", metavar="name",
                    help=f"benchmarks to run (default all: {', '.join(BENCHMARKS)})")
    ap.add_argument("--quick", action="store_true", help="each benchmark's smoke mode (seconds each)")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help=f"where the JSON and PNG go (default bench/results/; with --quick {QUICK_DIR})")
    args = ap.parse_intermixed_args(argv)  # names and options in any order (make bench ARGS=...)
    names = args.names or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS + OPTIONAL]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHMARKS + OPTIONAL)}",
              file=sys.stderr)
        return 2
    failed = []
    for name in names:
        if importlib.util.find_spec(f"bench.{name}") is None:
            print(f"[bench] {name}: not present, skipped")
            continue
        print(f"[bench] {name} ...", flush=True)
        start = time.perf_counter()
        rc = subprocess.call(command(name, args.quick, args.out_dir), env={**os.environ, **QUICK_ENV} if args.quick
                             else None)
        print(f"[bench] {name} done in {time.perf_counter() - start:.1f}s (rc={rc})", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
