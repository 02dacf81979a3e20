"""Settings of the engine-hosting services (env prefix WINDSERVE_).

`EngineServiceConfig` holds the engine knobs every engine role shares (combined worker, prefill, decode) and
the one mapping to `EngineConfig`; `DisaggServiceConfig` adds the KV hand-off knobs of prefill and decode.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, model_validator

from libs.engine.config import EngineConfig
from libs.engine.parallel.layout import ParallelLayout
from libs.gcache.config import GCacheConfig
from libs.routing import DEFAULT_BUCKET_EDGES
from libs.service import ServiceConfig


def _compile_default() -> bool:
    """On, unless WINDSERVE_COMPILE says 0: a config built in code (tests, benchmarks) follows the environment
    the way one read from it does (the suite runs eager: tests/conftest.py)."""
    return os.environ.get("WINDSERVE_COMPILE", "1").strip().lower() not in ("0", "false", "no", "off")


class EngineServiceConfig(ServiceConfig):
    """A service hosting one engine. `model` empty = the built-in tiny model."""

    page_size: int = Field(default=16, ge=1, description="tokens per KV page (same on prefill and decode)")
    num_full_pages: int = Field(default=2048, ge=1, description="pages of the full-attention KV pool")
    num_swa_pages: int = Field(default=512, ge=1, description="pages of the sliding-window KV pool")
    max_num_seqs: int = Field(default=64, ge=1, description="most requests holding KV at once")
    max_num_batched_tokens: int = Field(default=512, ge=1, description="token budget of one engine step")
    enable_prefix_cache: bool = Field(default=True, description="reuse KV across requests")
    kv_arena: bool = Field(default=True, description="one device KV arena for both layer groups, of the bytes "
                           "num_full_pages + num_swa_pages would take (WINDSERVE_KV_ARENA; 0 = two static pools; "
                           "with tp / ep > 1 every rank holds the same units of its own KV heads)")
    bucket_edges: list[int] = Field(
        default_factory=lambda: list(DEFAULT_BUCKET_EDGES), description="length bucket edges (uncached tokens), JSON list")
    served_buckets: list[int] = Field(
        default_factory=list, description="length buckets this worker is meant for (JSON list); empty = all")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="KV/activation dtype")
    device: str = Field(default="cpu", description="torch device of the model and KV pools")
    seed: int = Field(default=0, description="seed of the engine-wide generator (unseeded sampling)")
    speculative_tokens: int = Field(
        default=0, ge=0,
        description="MTP draft tokens per decode step (0 = off; past the model's MTP layers the last is reused)")
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
    num_host_full_pages: int = Field(default=0, ge=0, description="host-tier (L2) full-attention pages; 0 = no host "
                                     "tier (unless GCache sizes one)")
    num_host_swa_pages: int = Field(default=0, ge=0, description="host-tier (L2) SWA pages (set with the full ones)")
    gcache: bool = Field(default=False, description="use GCache (L3): prefetch L3 hits into the host tier, write "
                         "finished sequences back")
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
    tp: int = Field(default=1, ge=1, description="tensor-parallel ranks of the engine: attention heads and KV heads "
                    "split across rank processes (docs/parallel.md)")
    ep: int = Field(default=1, ge=1, description="expert-parallel ranks: MoE experts placed across rank processes "
                    "(tp and ep above 1 must be equal)")
    parallel_timeout_s: float = Field(default=30.0, gt=0, description="with tp / ep > 1: bound of one collective; a "
                                      "rank that stops answering fails the engine (and the service) after it")

    compile: bool = Field(default_factory=_compile_default, description="run the engine through the compiled step (torch.compile; a "
                          "pure decode step as one graph), warmed up before the service is ready (docs/engine.md, "
                          "Compiled step); 0 = eager. Not with tp / ep > 1")
    compile_warmup_s: float = Field(default=300.0, gt=0, description="bound of the compile warm-up; past it the engine "
                                    "serves eager")
    compile_cache_dir: str = Field(default="", description="inductor's on-disk cache of compiled code (empty: "
                                   "~/.cache/windserve/torch-compile), so a restart loads instead of compiling")
    compute_threads: int = Field(default=0, ge=0, description="torch intra-op threads of the engine (0: one per "
                                 "compute CPU when set, else all cores but one, at least one)")
    compute_cpus: str = Field(default="", description="CPUs the engine's step thread is pinned to, a Linux CPU list "
                              "('1', '2-7'); empty = not pinned")

    mm_fetch_timeout_s: float = Field(
        default=10.0, gt=0, description="multimodal models: bound of fetching one request's image / video "
        "embeddings from the encoder tier (before the request enters the engine; past it the request fails)")
    mm_transfer_host: str = Field(default="127.0.0.1", description="multimodal models, combined worker: bind address "
                                  "of the transfer engine the embeddings arrive on (prefill / decode use their KV one)")

    @model_validator(mode="after")
    def _buckets_in_range(self) -> EngineServiceConfig:
        num_buckets = len(self.bucket_edges) + 1
        bad = [b for b in self.served_buckets if not 0 <= b < num_buckets]
        if bad:
            raise ValueError(f"served_buckets {bad} outside [0, {num_buckets}) for bucket_edges {self.bucket_edges}")
        return self

    @model_validator(mode="after")
    def _host_tier_pair(self) -> EngineServiceConfig:
        if (self.num_host_full_pages == 0) != (self.num_host_swa_pages == 0):
            raise ValueError("set both num_host_full_pages and num_host_swa_pages, or neither")
        return self

    @model_validator(mode="after")
    def _checkpoint_every_pages(self) -> EngineServiceConfig:
        if self.gcache and self.gcache_checkpoint_every % self.page_size:  # (unused without GCache)
            raise ValueError(f"gcache_checkpoint_every={self.gcache_checkpoint_every} must be a multiple of "
                             f"page_size={self.page_size}")
        return self

    @model_validator(mode="after")
    def _parallel_layout(self) -> EngineServiceConfig:
        ParallelLayout(self.tp, self.ep)  # tp / ep consistency (the model's shapes are checked at engine build)
        return self

    @property
    def host_pages(self) -> tuple[int, int]:
        """(full, SWA) host-tier pages: as configured, or GCache's default when it is on and none is."""
        if self.gcache and not self.num_host_full_pages:
            return self.gcache_host_full_pages, self.gcache_host_swa_pages
        return self.num_host_full_pages, self.num_host_swa_pages

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
        return self.page_size * self.num_full_pages

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            page_size=self.page_size, num_full_pages=self.num_full_pages, num_swa_pages=self.num_swa_pages,
            num_host_full_pages=self.host_pages[0], num_host_swa_pages=self.host_pages[1],
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_cache=self.enable_prefix_cache, bucket_edges=tuple(self.bucket_edges),
            checkpoint_every_pages=self.gcache_checkpoint_every // self.page_size if self.gcache else 0,
            served_buckets=tuple(self.served_buckets) or None, dtype=self.dtype, device=self.device,
            seed=self.seed, speculative_tokens=self.speculative_tokens, tp=self.tp, ep=self.ep,
            parallel_timeout_s=self.parallel_timeout_s, kv_arena=self.kv_arena, compile=self.compile,
            compile_warmup_s=self.compile_warmup_s, compile_cache_dir=self.compile_cache_dir,
            compute_threads=self.compute_threads, compute_cpus=self.compute_cpus)


class DisaggServiceConfig(EngineServiceConfig):
    """A role of the disaggregated pipeline (prefill or decode): an engine plus a KV transfer engine.

    Prefill and decode must agree on page_size and dtype: KV moves page by page as raw bytes. Their tp / ep may
    differ: the bytes hold every KV head (a parallel engine gathers and re-splits its ranks' heads)."""

    transfer_host: str = Field(default="127.0.0.1", description="bind address of the KV transfer engine")
    advertise_host: str = Field(
        default="", description="host peers dial for KV (empty: transfer_host, or the hostname when binding 0.0.0.0)")
    prepare_timeout_s: float = Field(default=10.0, gt=0, description="decode's answer to kv_prepare")
    transfer_timeout_s: float = Field(default=60.0, gt=0, description="a whole prompt's KV transfer")
