"""GCache SDK settings (the engine services fill them from WINDSERVE_GCACHE_* variables)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GCacheConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    chunk_bytes: int = Field(default=4 << 20, ge=4096, description="largest slice of a value on the wire of the "
                             "NATS path (one transfer layer per chunk)")
    message_bytes: int = Field(default=64 << 20, ge=4096, le=1 << 30, description="direct path: largest UCX "
                               "message (a value up to this size is one message; docs/gcache.md, \"Throughput\")")
    virtual_nodes: int = Field(default=64, ge=1, description="ring points per storage node")
    replication: int = Field(default=1, ge=1, le=2, description="storage nodes per key (2: write both successors, "
                             "read either)")
    op_timeout_s: float = Field(default=2.0, gt=0, description="bound of one exists / get / put call")
    write_queue: int = Field(default=64, ge=1, description="write-back batches queued at most (beyond: dropped)")
    io_threads: int = Field(default=1, ge=1, description="IO threads (each its own event loop and connections)")
    transfer_host: str = Field(default="127.0.0.1", description="bind address of the client's transfer engine")
    advertise_host: str = Field(default="", description="host nodes dial to send values (empty: transfer_host)")
    landing_bytes: int = Field(default=256 << 20, ge=0, description="per IO thread: memory gets land in, reused "
                               "once the values handed out are dropped (libs/gcache/arena.py); 0 = a fresh buffer "
                               "per value")
    landing_prefault: bool = Field(default=False, description="populate the landing memory's page tables at start "
                                   "(background): no get ever faults; it becomes resident at once")
    direct: bool = Field(default=True, description="UCX engines: puts and gets on the direct path (requests on the "
                         "transfer engine's control connection, one tagged UCX message per value; docs/gcache.md); "
                         "False, or a TCP engine: NATS request + transfer")
    landing_segment_bytes: int = Field(default=64 << 20, ge=4096, description="arena segment (a larger value gets "
                                       "its own buffer)")
