"""ParallelRunner: rank 0 of a parallel engine. It is the engine's ModelRunner (the scheduler and the KV cache
run once, here); every step it sends the step's copies and inputs to the other ranks, then runs its own
shard of the forward, whose all-reduces meet theirs. Only rank 0 samples (lm_head is replicated).

The other ranks are processes it spawns (libs/engine/parallel/rank.py). A rank that exits fails the next
collective at once (`check_alive` reports it while idle); one that hangs fails it after `timeout_s`. Either
way the step loop stops with the error, its requests fail explicitly and the service leaves the registry.
Details: docs/parallel.md, "Execution" and "Failure".
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from libs.engine.host_tier import live_loads
from libs.engine.parallel.build import build_shard, shard_state
from libs.engine.parallel.comm import Comm, CommStats
from libs.engine.parallel.kvio import ShardedKV
from libs.engine.parallel.layout import ParallelLayout
from libs.engine.parallel.load import load_shard
from libs.engine.parallel.rank import RankSpec, io_bytes
from libs.engine.plan import BatchPlan
from libs.engine.runner import ModelInputs, ModelRunner, PoolSizes
from libs.kvcache.config import ArenaPlan
from libs.model.config import ModelConfig
from libs.model.loader import CheckpointError
from libs.model.model import MiMoV2Model
from libs.model.paged import arena_sub

_ROOT = str(Path(__file__).resolve().parents[2])

log = logging.getLogger(__name__)


class RankDied(RuntimeError):
    """A rank of a parallel engine is gone (names it and its exit status)."""


class ParallelRunner(ModelRunner):
    """The engine's runner over `layout.world` ranks; this process is rank 0. The weights come from a full
    in-memory `model` (each rank is sent its shard) or, with `checkpoint` (a directory; `model` None), every
    rank, this one included, reads its own shard from the checkpoint: no full model is in memory anywhere."""

    def __init__(self, model: MiMoV2Model | None, model_config: ModelConfig, sizes: PoolSizes, *,
                 layout: ParallelLayout, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
                 load_mode="sync", timeout_s: float = 30.0, startup_timeout_s: float = 300.0,
                 host: str = "127.0.0.1", checkpoint: str | None = None) -> None:
        layout.validate(model_config)
        if (model is None) == (checkpoint is None):
            raise ValueError("ParallelRunner: give exactly one of model and checkpoint")
        sizes = rank_sizes(sizes, layout, model_config)
        self.layout = layout
        self.full_config = model_config  # (self.model_config: one rank's attention and KV shapes)
        self._kv_access: ShardedKV | None = None
        world = layout.world
        comm = Comm(0, world)
        port = comm.host_store(host, startup_timeout_s)
        procs: list[subprocess.Popen] = []
        conns: list = []
        threads = max(1, (os.cpu_count() or 1) // world)
        try:
            for r in range(1, world):
                parent, child = _pipe()
                procs.append(subprocess.Popen(  # a fresh interpreter: nothing of the caller's __main__ is re-run
                    [sys.executable, "-m", "libs.engine.parallel.rank", str(child.fileno())],
                    pass_fds=(child.fileno(),),
                    cwd=_ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                        p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)}))
                child.close()
                conns.append(parent)
                state = shard_state(model, layout, r) if model is not None else {}
                spec = RankSpec(r, layout, model_config, state, sizes, dtype, rank_device(device, r), host, port,
                                timeout_s, seed, threads, checkpoint)
                parent.send_bytes(pickle.dumps(spec))
            if model is not None:
                local = build_shard(shard_state(model, layout, 0), model_config, layout, 0, comm, dtype, device)
            else:  # (the other ranks read theirs meanwhile)
                local = load_shard(str(checkpoint), model_config, layout, 0, comm, dtype, device)
            super().__init__(local, layout.local_config(model_config), sizes, dtype=dtype, device=device, seed=seed,
                             load_mode=load_mode)
            self._procs, self._conns, self.comm = procs, conns, comm
            self._stopper = weakref.finalize(self, _stop_ranks, procs, conns)
            self._wait_ready(startup_timeout_s)
            comm.connect(host, port, device=device, timeout_s=timeout_s)
        except BaseException:
            _stop_ranks(procs, conns)
            raise
        log.info("parallel engine up", extra={"layout": layout.describe()})

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for r, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), start=1):
            while not conn.poll(0.1):
                if proc.poll() is not None and not conn.poll(0):  # (gone without a word: no "failed" to read)
                    raise RankDied(f"parallel rank {r} exited with status {proc.returncode} while starting")
                if time.monotonic() > deadline:
                    raise RankDied(f"parallel rank {r} was not ready within {timeout_s:.0f}s")
            try:
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:
                try:
                    status = str(proc.wait(5.0))
                except subprocess.TimeoutExpired:
                    status = "unknown (still running)"
                raise RankDied(f"parallel rank {r} failed while starting (exit status {status}; its log has "
                               f"why)") from None
            if msg[0] == "failed":
                raise _startup_error(r, msg[1])

    # ------------------------------------------------------------------ steps
    @torch.inference_mode()
    def forward(self, plan: BatchPlan, interrupt: Callable[[], bool] | None = None, mm=None) -> torch.Tensor:
        """As ModelRunner.forward on every rank. `interrupt` is not honoured: a rank stopping between layers
        would leave the others waiting in a collective."""
        inputs = self.inputs(plan, mm)
        # (an arena: the ranks hold no unit tables, so rank 0 drops the loads made stale since they were planned)
        loads = live_loads(plan.load_copies, self.kv) if self.kv.arena is not None else plan.load_copies
        self._send(("step", tuple(plan.backup_copies), tuple(loads), None if inputs is None else tuple(inputs)))
        return self.execute(plan.backup_copies, loads, inputs)

    def execute(self, backup_copies: Sequence, load_copies: Sequence, inputs: ModelInputs | None,
                interrupt: Callable[[], bool] | None = None) -> torch.Tensor:
        try:
            return super().execute(backup_copies, load_copies, inputs, None)
        except RuntimeError as exc:  # a collective failed: say which rank is gone when one is
            self.check_alive()
            raise RankDied(f"a collective of the parallel engine failed: {exc}") from exc

    def _send(self, msg: tuple) -> None:
        self.check_alive()
        data = pickle.dumps(msg)
        for r, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError as exc:
                raise RankDied(f"parallel rank {r} is gone: {exc}") from exc

    def kv_access(self) -> ShardedKV:
        """The KV hand-off's access to every rank's KV heads (libs/engine/parallel/kvio.py)."""
        if self._kv_access is None:
            self._kv_access = ShardedKV(self.kv, self.layout, self.full_config, self.comm, self._send,
                                        self.check_alive)
        return self._kv_access

    def l3_gather(self, group: str, pages: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_access().gather_group(group, pages)

    def write_host_blocks(self, full_ids: Sequence[int], swa_ids: Sequence[int], staged, skip: int = 0) -> None:
        if self.host is None:
            raise RuntimeError("a GCache import needs the engine's host tier")
        self.kv_access().write_host(self.host, full_ids, swa_ids, staged, skip)

    def check_alive(self) -> None:
        for r, proc in enumerate(self._procs, start=1):
            if proc.poll() is not None:
                raise RankDied(f"parallel rank {r} (pid {proc.pid}) exited with status {proc.returncode}")

    @property
    def rank_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def rank_stats(self) -> list[tuple[CommStats, int]]:
        """(collective counts, bytes written by the process) of every rank, rank 0 first."""
        return [(stats, io) for stats, io, _ in self._stats()]

    def rank_pool_bytes(self) -> list[dict[str, int]]:
        """Bytes each rank's device KV pools hold ({"full": .., "swa": ..}, from its tensors), rank 0 first."""
        return [pools for _, _, pools in self._stats()]

    def _stats(self) -> list[tuple[CommStats, int, dict[str, int]]]:
        self._send(("stats",))
        out = [(self.comm.stats, io_bytes(), self.kv.pool_bytes())]
        for conn in self._conns:
            _, stats, io, pools = pickle.loads(conn.recv_bytes())
            out.append((stats, io, pools))
        return out

    def reset_stats(self) -> None:
        self._send(("reset",))
        self.comm.stats.reset()

    def close(self) -> None:
        super().close()
        self._stopper()


def rank_sizes(sizes: PoolSizes, layout: ParallelLayout, cfg: ModelConfig) -> PoolSizes:
    """Every rank's pool sizes: the same pages, or the same arena units (rank 0's cache addresses them all),
    each holding the rank's own KV heads with the whole model's layer-pages per plane slot (`arena_sub`).
    Where a rank's two groups hold unequal shares of the model's KV heads (e.g. the full heads replicated, the
    SWA heads split) the group with fewer pads its plane slots (`KVArena.stride`); the plan's unit bytes are the
    model's, not a rank's (unchecked: 0)."""
    if sizes.arena is None and sizes.host_arena is None:
        return sizes

    def of_rank(plan: ArenaPlan | None) -> ArenaPlan | None:
        return None if plan is None else replace(plan, unit_bytes=0)

    return replace(sizes, arena=of_rank(sizes.arena), host_arena=of_rank(sizes.host_arena), arena_sub=arena_sub(cfg))


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th GPU after the engine's own on CUDA (cuda:1 -> cuda:1, cuda:2, ...), else as is."""
    d = torch.device(device)
    if d.type != "cuda":
        return device
    return f"cuda:{(d.index or 0) + rank}"


def _startup_error(rank: int, exc: BaseException) -> Exception:
    """What a rank that failed to start reported: a bad checkpoint stays a CheckpointError (naming the tensor)."""
    if isinstance(exc, CheckpointError):
        return CheckpointError(f"parallel rank {rank}: {exc}")
    return RankDied(f"parallel rank {rank} failed while starting: {type(exc).__name__}: {exc}")


def _stop_ranks(procs: list[subprocess.Popen], conns: list[Connection], timeout_s: float = 5.0) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("close",)))
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)
    for conn in conns:
        conn.close()


def _pipe() -> tuple[Connection, Connection]:
    """A connected pair of Connections (send_bytes / recv_bytes / poll) over a Unix socket pair."""
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())
