"""`make bench`: run every benchmark in turn; each writes bench/results/<name>.json and a PNG.

Usage: python -m bench [name ...]   (default: all)
"""

import importlib.util
import subprocess
import sys
import time

BENCHMARKS = ("model", "kvcache", "transfer", "engine", "serving", "router", "faults", "gateway", "gcache", "encoder",
              "mtp", "parallel")


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        if importlib.util.find_spec(f"bench.{name}") is None:
            print(f"[bench] {name}: not present, skipped")
            continue
        print(f"[bench] {name} ...", flush=True)
        start = time.perf_counter()
        # Each benchmark runs in its own process so one's threads/allocations do not skew the next.
        rc = subprocess.call([sys.executable, "-m", f"bench.{name}"])
        print(f"[bench] {name} done in {time.perf_counter() - start:.1f}s (rc={rc})", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
