"""`make bench`: run every benchmark in turn; each writes bench/results/<name>.json and a PNG.

Usage: python -m bench [name ...]   (default: all)
"""

import importlib
import sys
import time

BENCHMARKS = ("model", "kvcache", "transfer", "engine", "serving")


def main(argv: list[str]) -> int:
    names = argv or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    failed = []
    for name in names:
        try:
            module = importlib.import_module(f"bench.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"bench.{name}":
                print(f"[bench] {name}: not present, skipped")
                continue
            raise
        print(f"[bench] {name} ...", flush=True)
        start = time.perf_counter()
        rc = module.main([]) if hasattr(module, "main") else 0
        print(f"[bench] {name} done in {time.perf_counter() - start:.1f}s (rc={rc})", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"[bench] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
