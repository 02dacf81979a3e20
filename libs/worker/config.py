"""Settings of the engine-hosting services (env prefix WINDSERVE_).

`EngineServiceConfig` holds the engine knobs every engine role shares (combined worker, prefill, decode) and
the one mapping to `EngineConfig`; `DisaggServiceConfig` adds the KV hand-off knobs of prefill and decode.
"""

from __future__ import annotations

import os
from dataclasses import replace

from pydantic import Field, model_validator

from libs.engine.config import EngineConfig
from libs.gcache.config import GCacheConfig
from libs.service import ServiceConfig, TransferServiceConfig


def _compile_default() -> bool:
    """On, unless WINDSERVE_COMPILE says 0: a config built in code (tests, benchmarks) follows the environment
    the way one read from it does (the suite runs eager: tests/conftest.py)."""
    return os.environ.get("WINDSERVE_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


class EngineServiceConfig(ServiceConfig):
    """A service hosting one engine. `model` empty = the built-in tiny model."""

    engine: EngineConfig = Field(default_factory=lambda: EngineConfig(compile=_compile_default()),
                                 description="the engine's own settings (libs/engine/config.py), read flat")
    tiny_weights: str = Field(
        default="", description="without a model directory: a safetensors file of the built-in tiny model's trained "
        "weights (make run passes models/windserve-tiny/weights.safetensors); empty = random weights, fixed seed")
    output_timeout_s: float = Field(
        default=300.0, gt=0, description="longest wait for a request's next engine output before it fails")
    engine_stall_s: float = Field(
        default=30.0, ge=0, description="a step loop stuck this long in one round (a dead lock, a kernel that never "
        "returns) fails the worker: in-flight requests get an error that says it is gone (the gateway retries those "
        "not yet streamed), it deregisters and exits with code 70; 0 = off")
    load_interval_s: float = Field(
        default=0.5, gt=0, description="how often the load snapshot (registry entry, health, metrics) is refreshed")
    recent_aborts: int = Field(
        default=4096, ge=1, description="aborted request ids remembered (an abort may overtake its request)")
    kv_events: bool = Field(
        default=True, description="publish the cache's KV events on kv_events.<instance> and answer kv_snapshot")
    kv_hit_reports: bool = Field(default=True, description="publish each request's prefix hit on kv_hits")
    kv_events_interval_s: float = Field(
        default=0.005, ge=0, description="most time between KV event batches while the engine is busy")
    kv_events_max_blocks: int = Field(default=1024, ge=1, description="block hashes per KV event batch at most")
    gcache: bool = Field(default=False, description="use GCache (L3): prefetch L3 hits into the host tier, write "
                         "sequences back")
    gcache_lookup_timeout_s: float = Field(
        default=0.5, gt=0, description="bound of one request's L3 lookup and fetch (slower: a miss)")
    gcache_write_queue: int = Field(default=64, ge=1, description="finished sequences' write-back batches queued at "
                                    "most (beyond: dropped, never waited for)")
    gcache_write_queue_mib: int = Field(default=256, ge=1, description="bytes the write-back queue holds at most, MiB")
    gcache_host_full_pages: int = Field(default=1024, ge=1, description="host-tier full pages GCache sizes when no "
                                        "host tier is configured (L3 hits are imported there)")
    gcache_host_swa_pages: int = Field(default=256, ge=1, description="host-tier SWA pages GCache sizes then")
    gcache_checkpoint_every: int = Field(
        default=512, ge=0, description="tokens; GCache (L3) also stores an SWA checkpoint every this many tokens (the "
        "prefix cache keeps those windows, best effort), so a later prompt sharing only a mid-prompt prefix hits; "
        "0 = only where a written sequence ends. A multiple of page_size")
    gcache_writeback_every: int = Field(
        default=256, ge=0, description="tokens; a generating sequence's new KV is also written back every this many "
        "(a migrated stream loads its prefix from L3); 0 = at its end only")
    gcache_op_timeout_s: float = Field(default=2.0, gt=0, description="bound of one GCache SDK exists / get / put")
    gcache_replication: int = Field(default=1, ge=1, le=2, description="storage nodes per key (2: both successors)")
    gcache_chunk_mib: int = Field(default=4, ge=1, le=1024, description="largest slice of a GCache value on the "
                                  "NATS path's wire, MiB (one transfer layer each)")
    gcache_message_mib: int = Field(default=64, ge=1, le=1024, description="largest UCX message of GCache's direct "
                                    "path, MiB (a value up to this size is one message; docs/gcache.md, Throughput)")
    gcache_transfer_host: str = Field(default="127.0.0.1", description="bind address of the GCache SDK's transfer "
                                      "engine")
    gcache_advertise_host: str = Field(default="", description="host storage nodes dial to send values (empty: "
                                       "gcache_transfer_host)")


    mm_fetch_timeout_s: float = Field(
        default=10.0, gt=0, description="multimodal models: bound of fetching one request's image / video "
        "embeddings from the encoder tier (before the request enters the engine; past it the request fails)")
    mm_transfer_host: str = Field(default="127.0.0.1", description="multimodal models, combined worker: bind address "
                                  "of the transfer engine the embeddings arrive on (prefill / decode use their KV one)")

    @model_validator(mode="after")
    def _checkpoint_every_pages(self) -> EngineServiceConfig:
        if self.gcache and self.gcache_checkpoint_every % self.engine.page_size:  # (unused without GCache)
            raise ValueError(f"gcache_checkpoint_every={self.gcache_checkpoint_every} must be a multiple of "
                             f"page_size={self.engine.page_size}")
        return self

    def gcache_config(self) -> GCacheConfig:
        return GCacheConfig(op_timeout_s=self.gcache_op_timeout_s, replication=self.gcache_replication,
                            write_queue=self.gcache_write_queue, transfer_host=self.gcache_transfer_host,
                            advertise_host=self.gcache_advertise_host, chunk_bytes=self.gcache_chunk_mib << 20,
                            message_bytes=self.gcache_message_mib << 20)

    @property
    def max_request_tokens(self) -> int:
        """Prompt + output tokens that one request can ever hold on the static pools (the whole full pool); the
        service reads the engine's own bound once it is built (`EngineCore.max_request_tokens`: on one arena,
        what its units hold beside one window)."""
        return self.engine.page_size * self.engine.num_full_pages

    def engine_config(self) -> EngineConfig:
        """The engine as it runs: `engine` plus what GCache adds (a host tier when none is configured, and its
        periodic SWA checkpoints)."""
        engine = self.engine
        if not self.gcache:
            return engine
        host = {} if engine.has_host_tier else {"num_host_full_pages": self.gcache_host_full_pages,
                                                "num_host_swa_pages": self.gcache_host_swa_pages}
        return replace(engine, checkpoint_every_pages=self.gcache_checkpoint_every // engine.page_size, **host)


class DisaggServiceConfig(EngineServiceConfig, TransferServiceConfig):
    """A role of the disaggregated pipeline (prefill or decode): an engine plus a KV transfer engine.

    Prefill and decode must agree on page_size and dtype: KV moves page by page as raw bytes. Their tp / ep may
    differ: the bytes hold every KV head (a parallel engine gathers and re-splits its ranks' heads)."""

    prepare_timeout_s: float = Field(default=10.0, gt=0, description="decode's answer to kv_prepare")
    transfer_timeout_s: float = Field(default=60.0, gt=0, description="a whole prompt's KV transfer")
