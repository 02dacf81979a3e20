"""Storage-node settings (env prefix WINDSERVE_)."""

from __future__ import annotations

import socket

from pydantic import Field, model_validator

from libs.service import SenderServiceConfig


class CacheConfig(SenderServiceConfig):
    """A GCache storage node: a memory tier and a disk tier, each with a byte budget (docs/gcache.md)."""

    memory_bytes: int = Field(default=1 << 30, ge=0, description="byte budget of the memory tier")
    disk_bytes: int = Field(default=0, ge=0, description="byte budget of the disk tier; 0 = no disk tier")
    disk_dir: str = Field(default="", description="directory of the disk tier (needed when disk_bytes > 0); "
                          "'{hostname}' in it becomes this host's name (compose: one directory per replica)")
    memory_arena: bool = Field(default=True, description="put slots' buffers come from one mapping of "
                               "memory_bytes, reused once freed (no page faults after first use; "
                               "libs.gcache.arena); off: a fresh buffer per put")
    prefault: bool = Field(default=False, description="populate the arena's page tables at start, in the "
                           "background (the whole memory budget becomes resident: puts never fault)")
    put_timeout_s: float = Field(default=30.0, gt=0, description="an unfinished put older than this is reaped "
                                 "(its client died); also the bound of one put's transfer")
    reap_interval_s: float = Field(default=1.0, gt=0, description="how often unfinished puts are reaped")

    @model_validator(mode="after")
    def _disk_needs_dir(self) -> CacheConfig:
        if self.disk_bytes and not self.disk_dir:
            raise ValueError("disk_bytes > 0 needs disk_dir (WINDSERVE_DISK_DIR)")
        return self

    @property
    def disk_path(self) -> str:
        """`disk_dir` with `{hostname}` filled in ("" without a disk tier)."""
        return self.disk_dir.replace("{hostname}", socket.gethostname())

    @property
    def capacity_bytes(self) -> int:
        return self.memory_bytes + self.disk_bytes
