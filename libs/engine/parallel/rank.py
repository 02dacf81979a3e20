"""A worker rank's process: builds its shard and KV pools, then executes the steps rank 0 sends.

Control comes over a pipe from rank 0 (blocking with no timeout: an idle engine sends nothing; the pipe's end
is rank 0's end), activations over the engine's process group (bounded). Any failure ends the process with a
non-zero status, which rank 0 reports (its collectives fail at once as the sockets close)."""

from __future__ import annotations

import logging
import pickle
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from libs.engine.host_tier import LoadMode
from libs.engine.parallel.build import build_shard
from libs.engine.parallel.comm import Comm
from libs.engine.parallel.kvio import GATHER, HOST_WRITE, SCATTER, RankKV
from libs.engine.parallel.layout import ParallelLayout
from libs.engine.parallel.load import load_shard
from libs.engine.runner import ModelInputs, ModelRunner, PoolSizes
from libs.model.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class RankSpec:
    """What a worker rank needs to start (sent over the pipe, pickled)."""

    rank: int
    layout: ParallelLayout
    model_config: ModelConfig
    state: dict[str, torch.Tensor]  # its shard's weights (empty when `checkpoint` is set)
    sizes: PoolSizes
    dtype: torch.dtype
    device: str
    store_host: str
    store_port: int
    timeout_s: float
    seed: int
    threads: int  # torch threads of this rank (the machine's cores shared among the ranks)
    checkpoint: str | None = None  # a checkpoint directory: the rank reads its own shard from it


# messages rank 0 sends (pickled): ("step", backup_copies, load_copies, ModelInputs fields | None), ("stats",),
# ("reset",), ("close",); the KV hand-off's (GATHER / SCATTER, layer refs), an L3 import's (HOST_WRITE, page ids, units)
# (libs/engine/parallel/kvio.py); a rank answers
# "stats" with ("stats", CommStats, io_bytes(), its KV pools' pool_bytes())


def rank_main(conn: Connection) -> None:
    """A worker rank's life: its spec from `conn`, then steps until "close" or rank 0's end of the pipe."""
    ready = False
    try:
        spec: RankSpec = pickle.loads(conn.recv_bytes())
        torch.set_num_threads(spec.threads)
        comm = Comm(spec.rank, spec.layout.world)
        if spec.checkpoint is not None:
            model = load_shard(spec.checkpoint, spec.model_config, spec.layout, spec.rank, comm, spec.dtype,
                               spec.device)
        else:
            model = build_shard(spec.state, spec.model_config, spec.layout, spec.rank, comm, spec.dtype,
                                spec.device)
        spec.state = {}  # (the model holds the weights now)
        runner = ModelRunner(model, spec.layout.local_config(spec.model_config), spec.sizes, dtype=spec.dtype,
                             device=spec.device, seed=spec.seed, load_mode=LoadMode.SYNC)
        conn.send_bytes(pickle.dumps(("ready", spec.rank)))
        ready = True
        comm.connect(spec.store_host, spec.store_port, device=spec.device, timeout_s=spec.timeout_s)
        _serve(conn, runner, comm, RankKV(runner.kv, spec.layout, spec.model_config, spec.rank, comm, runner.host))
    except EOFError:  # rank 0 is gone
        sys.exit(3)
    except BaseException as exc:
        log.exception("parallel rank failed")
        if not ready:  # (rank 0 is waiting for "ready": tell it why, e.g. the tensor a bad checkpoint lacks)
            _report_failure(conn, exc)
        sys.exit(2)


def _report_failure(conn: Connection, exc: BaseException) -> None:
    try:
        conn.send_bytes(pickle.dumps(("failed", exc)))
    except Exception:  # (an unpicklable exception: its text; a closed pipe: nothing to tell)
        try:
            conn.send_bytes(pickle.dumps(("failed", RuntimeError(f"{type(exc).__name__}: {exc}"))))
        except OSError:
            pass


def _serve(conn, runner: ModelRunner, comm: Comm, kv: RankKV) -> None:
    while True:
        msg = pickle.loads(conn.recv_bytes())
        op = msg[0]
        if op == "step":
            _, backups, loads, inputs = msg
            inputs = ModelInputs(*inputs) if inputs is not None else None
            runner.execute(backups, loads, inputs)
        elif op == "stats":
            conn.send_bytes(pickle.dumps(("stats", comm.stats, io_bytes(), runner.kv.pool_bytes())))
        elif op == "reset":
            comm.stats.reset()
        elif op == GATHER:  # the KV hand-off (libs/engine/parallel/kvio.py)
            kv.send_slices(msg[1])
        elif op == SCATTER:
            kv.receive_slices(msg[1])
        elif op == HOST_WRITE:  # an L3 import (libs/engine/parallel/kvio.py)
            kv.receive_host(msg[1], msg[2], msg[3])
        elif op == "close":
            return
        else:
            raise ValueError(f"unknown parallel rank message {op!r}")


def io_bytes() -> int:
    """Bytes this process has written through write-like syscalls (its collectives' sends; Linux only)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


if __name__ == "__main__":  # python -m libs.engine.parallel.rank <fd of its end of the control pipe>
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(levelname)s %(message)s")
    rank_main(Connection(int(sys.argv[1])))
