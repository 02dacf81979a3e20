"""Where an engine computes: torch's intra-op threads, and optionally the CPUs its step thread may run on.

A small CPU host runs the engine beside its own event loop, the bus client and other services' processes. As
many compute threads as cores would fight those for the same cores, so the automatic default leaves one core
to the rest.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def parse_cpus(spec: str) -> tuple[int, ...]:
    """A CPU list as Linux writes it ("1", "0,2", "2-7", "0-1,4") -> sorted CPU ids; "" -> ()."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"bad CPU list {spec!r}: expected e.g. '1', '0,2' or '2-7'")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cpus))


def compute_threads(threads: int, cpus: tuple[int, ...]) -> int:
    """The intra-op thread count: `threads` when set (> 0), else one per CPU of `cpus` when given, else all usable
    cores but one (at least one)."""
    if threads > 0:
        return threads
    if cpus:
        return len(cpus)
    return max(1, len(os.sched_getaffinity(0)) - 1)


def apply_threads(threads: int, cpus: tuple[int, ...]) -> int:
    """Set torch's intra-op threads for this process (see compute_threads); returns the count."""
    n = compute_threads(threads, cpus)
    import torch  # (lazy: the config that validates CPU lists stays torch-free)

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def pin_this_thread(cpus: tuple[int, ...]) -> None:
    """Restrict the calling thread (the engine's step loop) to `cpus`; () leaves it where it is. CPUs this
    process may not use are an error, named."""
    if not cpus:
        return
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(f"compute CPUs {missing} are not available to this process (it may use {sorted(allowed)})")
    os.sched_setaffinity(0, cpus)  # pid 0 on Linux: the calling thread only
    log.info("engine step thread pinned to CPUs %s", list(cpus))
