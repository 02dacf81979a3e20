"""Storage-node settings (env prefix WINDSERVE_)."""

from __future__ import annotations

import socket

from pydantic import Field, model_validator

from libs.service import ServiceConfig


class CacheConfig(ServiceConfig):
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
    send_timeout_s: float = Field(default=30.0, gt=0, description="bound of sending one get's values")
    transfer_host: str = Field(default="127.0.0.1", description="bind address of the transfer engine")
    advertise_host: str = Field(default="", description="host clients dial for values (empty: transfer_host, "
                                "or this host's IP when binding 0.0.0.0)")
    transfer_port: int = Field(default=0, ge=0, le=65535, description="port of the transfer engine; 0 = any free")

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
