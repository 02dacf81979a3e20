"""Messages exchanged between windserve services (see docs/foundation.md for the subject map).

The request-flow models (route, generate, token chunks, abort, KV events) are drafts: small and
typed, to be refined by the serving pipeline.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from protos.base import WireModel


class Role(StrEnum):
    GATEWAY = "gateway"
    ROUTER = "router"
    ENCODER = "encoder"
    PREFILL = "prefill"
    DECODE = "decode"
    WORKER = "worker"  # prefill + decode in one process
    CACHE = "cache"
    PLANNER = "planner"  # sizes the engine roles (services/planner)


class ErrorCode(StrEnum):
    BAD_REQUEST = "bad_request"  # the message could not be decoded / validated
    INTERNAL = "internal"  # the handler raised
    UNAVAILABLE = "unavailable"  # the service is draining or not ready
    TIMEOUT = "timeout"


class ErrorReply(WireModel):
    """Sent instead of the normal reply when a request fails (marked by a header, see libs/bus)."""

    code: ErrorCode
    message: str


# --- service discovery and health -------------------------------------------------------------


class WorkerLoad(WireModel):
    """A worker's load, refreshed in its registry entry every heartbeat (read by the router)."""

    running: int = Field(default=0, ge=0, description="requests holding KV now")
    waiting: int = Field(default=0, ge=0, description="requests queued for admission")
    kv_full_used: int = Field(default=0, ge=0, description="full-pool pages in use by requests")
    kv_full_total: int = Field(default=0, ge=0)
    kv_swa_used: int = Field(default=0, ge=0, description="SWA-pool pages in use by requests")
    kv_swa_total: int = Field(default=0, ge=0)
    kv_units_used: int = Field(default=0, ge=0, description="one KV arena (docs/kvcache.md): units in use by "
                               "requests or promised to them; with an arena the per-group totals move with the "
                               "other group's use, so room and KV share read these")
    kv_units_total: int = Field(default=0, ge=0, description="the arena's units; 0 = the two static pools")
    updated_at: float = Field(default=0.0, description="unix time of this snapshot")
    arrivals: int = Field(default=-1, ge=-1, description="requests this instance has taken on since it started, as "
                          "of this snapshot (a decode worker: its kv_prepare reservations); -1 = not reported")


class CacheUsage(WireModel):
    """A storage node's tiers, refreshed in its registry entry every heartbeat."""

    memory_used: int = Field(default=0, ge=0, description="bytes of committed values in the memory tier")
    memory_capacity: int = Field(default=0, ge=0)
    disk_used: int = Field(default=0, ge=0, description="bytes of committed values in the disk tier")
    disk_capacity: int = Field(default=0, ge=0)
    keys: int = Field(default=0, ge=0, description="committed values (both tiers)")


class RegistryEntry(WireModel):
    """One live service instance, as stored in the JetStream KV registry."""

    role: Role
    instance_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    address: str = Field(default="", description="data-transfer address (UCX/TCP), empty if none")
    capacity: int = Field(default=0, ge=0, description="role-specific capacity (e.g. KV tokens)")
    labels: dict[str, str] = Field(default_factory=dict, description="e.g. length bucket, model name")
    metrics_url: str = ""
    started_at: float = Field(default=0.0, description="unix time the instance started")
    buckets: list[int] = Field(default_factory=list, description="length buckets served; empty = all")
    max_tokens: int = Field(default=0, ge=0,
                            description="most tokens (prompt + output) one request may hold; 0 = unknown")
    max_prompt_tokens: int = Field(
        default=0, ge=0, description="most prompt tokens one request may bring (a decode worker's SWA pool holds the "
        "whole prompt while its KV arrives); 0 = only max_tokens limits it")
    load: WorkerLoad | None = None
    cache: CacheUsage | None = Field(default=None, description="a GCache storage node's tiers (role cache)")
    heartbeat_at: float = Field(default=0.0, description="unix time of the put that stored this entry; 0 = unknown")
    ttl_s: int = Field(default=0, ge=0, description="the entry is stale once heartbeat_at + ttl_s has passed")

    def fresh(self, now: float, slack_s: float = 1.0) -> bool:
        """Whether the entry's last heartbeat is within its TTL (plus `slack_s` for clock skew) at unix time
        `now`, whatever the store says (a persisted store can keep an expired entry: docs/reliability).
        An entry without a heartbeat stamp (built in code, not read from the registry) counts as fresh."""
        return self.heartbeat_at <= 0 or self.ttl_s <= 0 or now <= self.heartbeat_at + self.ttl_s + slack_s


class HealthRequest(WireModel):
    pass


class ServiceState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class HealthReply(WireModel):
    role: Role
    instance_id: str
    state: ServiceState
    uptime_s: float
    in_flight: int
    details: dict[str, str] = Field(default_factory=dict)


# --- request flow (drafts) ---------------------------------------------------------------------


class RouteRequest(WireModel):
    """gateway → router: where should this request run?"""

    request_id: str
    num_tokens: int = Field(ge=0)
    block_hashes: list[int] = Field(default_factory=list, description="chained xxhash64 per full page")
    mm_hashes: list[int] = Field(default_factory=list)
    exclude_decodes: list[str] = Field(default_factory=list,
                                       description="decode workers that already refused this request (full)")
    exclude_instances: list[str] = Field(default_factory=list,
                                         description="prefill / combined workers that failed or refused this "
                                                     "request (the gateway retries elsewhere)")


class RouteReply(WireModel):
    prefill_instance: str
    decode_instance: str
    predicted_hit_tokens: int = Field(default=0, ge=0, description="prefill (or combined) worker's predicted hit")
    predicted_decode_hit_tokens: int = Field(default=0, ge=0, description="disaggregated: decode side's")


class WireGrammar(WireModel):
    """What a constrained request's output must match (#15); every engine role rebuilds the same grammar from
    it (the decode worker advances its matcher by the first token, sampled by prefill under this grammar)."""

    kind: Literal["json_object", "json_schema", "tool_calls", "structural_tag"]
    json_schema: str = Field(default="", description="JSON text: the schema (json_schema), the schema of one "
                                                     "call object {name, arguments} (tool_calls), an xgrammar "
                                                     "structural tag (structural_tag)")
    parallel: bool = Field(default=False, description="tool_calls: one or more calls (else exactly one)")
    reasoning: Literal["", "open", "detect"] = Field(
        default="", description="a reasoning model's chat: the constraint starts after `</think>` (open: the "
                                "prompt opened the reasoning; detect: the output may open it)")


class WireSamplingParams(WireModel):
    max_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="0 = disabled")
    seed: int | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    logprobs: int = Field(default=0, ge=0, description="top-k logprobs to return per token; 0 = none")
    sampled_logprob: bool = Field(
        default=False, description="return the sampled token's logprob even when logprobs == 0 (no alternatives)"
    )
    stop: list[str] = Field(default_factory=list, description="stop strings (the worker's tokenizer decodes)")
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: dict[int, float] = Field(default_factory=dict, description="token id -> bias added to its logit")
    grammar: WireGrammar | None = None

    @property
    def wants_logprobs(self) -> bool:
        return self.sampled_logprob or self.logprobs > 0


class MMKind(StrEnum):
    IMAGE = "image"
    VIDEO = "video"


class WireMMItem(WireModel):
    """One image or video of a prompt (#16). Its embedding rows fill prompt positions [offset, offset + num_tokens),
    where `token_ids` carries the pseudo tokens `libs.mm.placeholders.mm_token(mm_hash, k)`; the rows are fetched from
    `encoder_instance` by `mm_hash` (`EmbedFetchRequest`)."""

    mm_hash: int = Field(ge=0, lt=1 << 64, description="libs.mm.placeholders.content_hash of the bytes + preprocessing")
    kind: MMKind = MMKind.IMAGE
    offset: int = Field(ge=0, description="index in token_ids of the first embedding row")
    num_tokens: int = Field(ge=1)
    grid_thw: list[int] = Field(min_length=3, max_length=3, description="patch grid (t, h, w) before the merge")
    encoder_instance: str = Field(min_length=1, description="the encoder that holds the embedding")


class GenerateRequest(WireModel):
    """gateway → worker. Large prompts are carried by the bus's large-payload path."""

    request_id: str
    token_ids: list[int]
    sampling: WireSamplingParams = Field(default_factory=WireSamplingParams)
    stream_subject: str
    decode_instance: str = Field(default="", description="disaggregated mode: where KV goes next")
    mm_items: list[WireMMItem] = Field(default_factory=list, description="images / videos, in prompt order")
    resume_token_ids: list[int] = Field(
        default_factory=list, description="a stream migrated off a failed worker: the output tokens it already "
                                          "sent; the engine continues after them and never sends them again")


class AckStatus(StrEnum):
    ACCEPTED = "accepted"
    TOO_LARGE = "too_large"  # prompt + max_tokens can never fit this worker's KV pools
    INVALID = "invalid"  # this worker cannot serve these parameters
    BUSY = "busy"  # draining or overloaded: try another worker later


class GenerateAck(WireModel):
    """worker → gateway reply to a GenerateRequest: the request is queued (tokens follow on the
    stream subject) or refused with a reason. The gateway subscribes to the stream subject before
    sending the request, so no chunk can be missed."""

    request_id: str
    instance_id: str
    status: AckStatus = AckStatus.ACCEPTED
    message: str = ""


class WireFinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class Usage(WireModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0)


class WireTokenLogprob(WireModel):
    token_id: int
    logprob: float
    top: dict[int, float] = Field(default_factory=dict)


class TokenChunk(WireModel):
    """worker → gateway on the request's stream subject. The last chunk has finish_reason set."""

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[WireTokenLogprob] = Field(default_factory=list)
    finish_reason: WireFinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    retryable: bool = Field(default=False, description="with error: out of capacity now, the client may retry")
    error_code: str = Field(default="", description="with a retryable error: the client's OpenAI error code "
                            "(empty: server_busy)")
    instance_failed: bool = Field(default=False, description="with error: the sending worker itself is failing (its "
                                  "engine died, e.g. a parallel rank was lost): treated as that worker being gone")
    instance_id: str = Field(default="", description="the worker that sent this chunk (liveness probes)")
    seq: int = Field(default=-1, ge=-1, description="this chunk's number among the chunks `instance_id` sent for "
                     "the request, from 0 without gaps (-1: unnumbered); a gap is a chunk lost in transit, fetched "
                     "again with a StreamReplayRequest")

    @model_validator(mode="after")
    def _error_means_finished(self) -> TokenChunk:
        if self.error is not None and self.finish_reason != WireFinishReason.ERROR:
            raise ValueError("a chunk carrying an error must have finish_reason='error'")
        return self


class StreamReplayRequest(WireModel):
    """gateway → the worker that streams (or is to stream) a request: the chunks it sent from `from_seq` on. Core
    NATS delivers at most once (a node that dies or hangs drops what it held), so the gateway asks when it sees a
    gap in `seq` or hears nothing for a liveness interval; an answer also proves the worker alive."""

    request_id: str
    from_seq: int = Field(default=0, ge=0)


class StreamReplayReply(WireModel):
    known: bool = Field(description="the worker holds this request's chunks (false: it sent none yet, or they "
                        "expired after the request finished)")
    first_kept: int = Field(default=0, ge=0, description="the oldest chunk still held; asking for an older one "
                            "cannot be answered (the chunks in between are lost)")
    chunks: list[TokenChunk] = Field(default_factory=list, description="held chunks with seq >= from_seq, in order")


class AbortRequest(WireModel):
    """Broadcast on windserve.abort: free everything held for this request."""

    request_id: str
    reason: str = ""


class KVEventKind(StrEnum):
    STORED = "stored"  # blocks became available in `tier` (re-sent when a tombstone is healed)
    REMOVED = "removed"  # blocks left `tier`
    SWA_REMOVED = "swa_removed"  # blocks stay in `tier`, their SWA KV was dropped


class KVTier(StrEnum):
    DEVICE = "device"
    HOST = "host"


KV_LAYOUT_LABELS = ("kv_page_size", "kv_window", "kv_rebuild_tokens", "kv_hash_seed")
"""Registry labels every engine worker sets (decimal ints): what a router needs to index its events and what
the gateway needs to compute the block-hash chain (`libs.kvcache.block_hashes(tokens, page size, seed)`)."""


class WireKVEvent(WireModel):
    """One `libs.kvcache.KVEvent` on the wire (same fields; per-block flags as lists of bools)."""

    event_id: int = Field(ge=0, description="per-worker sequence number; a gap means events were lost")
    kind: KVEventKind
    tier: KVTier = KVTier.DEVICE
    block_hashes: list[int] = Field(min_length=1, description="chained xxhash64 per page (the gateway's chain)")
    parent_hash: int | None = None
    swa_checkpoint: list[bool] = Field(default_factory=list, description="per block: a hit ending here is valid")
    swa_held: list[bool] = Field(default_factory=list, description="STORED: per block, `tier` holds its SWA KV")

    @model_validator(mode="after")
    def _flags_per_block(self) -> WireKVEvent:
        n = len(self.block_hashes)
        if any(flags and len(flags) != n for flags in (self.swa_checkpoint, self.swa_held)):
            raise ValueError(f"swa_checkpoint / swa_held must be empty or have one entry per block ({n})")
        return self


class KVEventBatch(WireModel):
    """worker → routers (`windserve.<ns>.kv_events.<instance>`, plain publish: every router replica reads
    all): a bounded run of consecutive events. `epoch` is unique per process start; a restarted worker with
    the same instance id numbers from 0 again, and a router seeing a new epoch drops its old view."""

    SCHEMA_VERSION: ClassVar[int] = 2  # v1: no epoch, no tier, only swa_valid

    schema_version: int = 2
    instance_id: str
    epoch: str = Field(min_length=1)
    events: list[WireKVEvent] = Field(min_length=1)

    @model_validator(mode="after")
    def _numbered_in_order(self) -> KVEventBatch:
        ids = [e.event_id for e in self.events]
        if any(b != a + 1 for a, b in zip(ids, ids[1:], strict=False)):
            raise ValueError(f"event ids must be consecutive, got {ids}")
        return self


class KVSnapshotRequest(WireModel):
    """router → worker (`windserve.<ns>.worker.<instance>.kv_snapshot`, request/reply): dump your cached
    block set (a router that started late or saw an event gap)."""

    router_id: str = ""


class KVSnapshotReply(WireModel):
    """The worker's whole cached block set, consistent with its events up to `last_event_id` (-1: none
    published yet): block i is `block_hashes[i]` in state `states[i]` (`libs.routing.BlockState` bits).
    Events after `last_event_id` follow on the events subject as usual. Large replies travel through the
    bus's payload store."""

    instance_id: str
    epoch: str = Field(min_length=1)
    last_event_id: int = Field(ge=-1)
    block_hashes: list[int]
    states: list[int]

    @model_validator(mode="after")
    def _one_state_per_block(self) -> KVSnapshotReply:
        if len(self.states) != len(self.block_hashes) or any(not 0 <= s <= 15 for s in self.states):
            raise ValueError("states must hold one value in [0, 15] per block hash")
        return self


class KVHitReport(WireModel):
    """worker → routers (`windserve.<ns>.kv_hits`, plain publish): the prefix hit a request actually got when
    the worker admitted it, so routers compare it with their prediction (metrics, approximate mode)."""

    request_id: str
    instance_id: str
    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(ge=0)


class RoutePick(WireModel):
    """router → router replicas (`windserve.<ns>.route_picks`): a pick just made, so a burst split over
    replicas does not pile onto the worker each replica alone thinks idle."""

    router_id: str
    request_id: str
    prefill_instance: str
    decode_instance: str
    prefill_tokens: int = Field(ge=0, description="predicted tokens the prefill worker still computes")
    at: float = Field(description="unix time of the pick")
    block_hashes: list[int] = Field(default_factory=list, description="approximate mode (no KV events) only: the "
                                    "routed chain, so every replica's index of decisions records it")


# --- disaggregated prefill -> decode hand-off ----------------------------------------------------


class KVPrepareRequest(WireModel):
    """prefill → decode (`windserve.worker.<decode>.kv_prepare`): admit this request, expect its KV.

    Sent when prefill accepts the request, before it computes anything. The decode worker reserves pages,
    expects the transfer and answers with the prefix it already holds, so prefill ships only the pages after
    it (full layers) and the pages of the last window (SWA layers), in segments of `segment_pages` full-layer
    pages that leave while prefill computes (libs/engine/disagg/plan.py). Nothing is published until prefill's
    `KVCommitRequest`.
    """

    SCHEMA_VERSION: ClassVar[int] = 2  # v1 carried the first token (sent after the prefill)

    schema_version: int = 2
    request_id: str
    token_ids: list[int] = Field(min_length=1, description="the prompt, then a migrated stream's tokens already "
                                                           "sent (their KV is what gets shipped)")
    resumed: int = Field(default=0, ge=0, description="how many of token_ids are a migrated stream's tokens "
                                                      "already sent (output, not prompt)")
    sampling: WireSamplingParams
    stream_subject: str
    page_size: int = Field(ge=1, description="KV page size of the prefill engine (must match decode)")
    kv_dtype: str = Field(description="torch dtype name of the shipped KV (must match decode)")
    segment_pages: int = Field(default=0, ge=0, description="full-layer pages per streamed segment; 0 = one segment")
    prefill_instance: str
    mm_items: list[WireMMItem] = Field(default_factory=list, description="the prompt's images (a recompute on "
                                       "decode fetches their embeddings)")


class KVPrepareReply(WireModel):
    request_id: str
    hit_tokens: int = Field(ge=0, description="decode already holds KV for prompt tokens [0, hit_tokens)")
    address: str = Field(description="transfer-engine address the KV must be sent to")


class WireHidden(WireModel):
    """Hidden-state rows of consecutive positions as raw bytes (native little-endian, row-major), base64: the
    few rows MTP in prefill hands to the decode worker (k - 1 of them, a few KiB; never KV, which goes over the
    transfer engine)."""

    first_position: int = Field(ge=0, description="position of the first row")
    rows: int = Field(ge=1, le=64)
    dtype: Literal["float32", "bfloat16", "float16"]
    data_b64: str = Field(min_length=1, max_length=4 << 20)


class KVCommitRequest(WireModel):
    """prefill → decode (`windserve.worker.<decode>.kv_commit`), once every KV layer was sent and landed.

    Either the first token (decode activates the request, publishes the token and decodes on; from here on
    the decode worker owns the stream), or `cancel` (the first token already ended the request, or prefill
    failed or was aborted: prefill publishes the final chunk itself, decode frees the reservation and
    publishes nothing).
    """

    request_id: str
    cancel: bool = False
    first_token_id: int = Field(default=-1, description="token sampled by prefill (no KV yet); -1 with cancel")
    first_logprob: WireTokenLogprob | None = None
    prefill_cached_tokens: int = Field(default=0, ge=0, description="prefix-cache hit on prefill (usage)")
    drafts: list[int] = Field(default_factory=list, max_length=64,
                              description="MTP in prefill: the prefill engine's drafts after the first token")
    draft_hidden: WireHidden | None = Field(default=None, description="MTP in prefill: the target hidden states "
                                            "of the prompt's last positions, for the decode engine's drafting")

    @model_validator(mode="after")
    def _token_unless_cancel(self) -> KVCommitRequest:
        if not self.cancel and self.first_token_id < 0:
            raise ValueError("a kv_commit that does not cancel must carry first_token_id >= 0")
        return self


class KVCommitReply(WireModel):
    request_id: str


# --- GCache (L3): storage nodes and the SDK (#12) ---------------------------------------------------
# Control goes over NATS (small messages); value bytes go directly between SDK and node over the transfer engine
# (UCX, TCP fallback), one transfer per batch, each value one or more chunk "layers" (docs/gcache.md).


class CacheExistsRequest(WireModel):
    keys: list[str] = Field(min_length=1, max_length=4096)


class CacheExistsReply(WireModel):
    present: list[bool] = Field(description="one per requested key: committed and readable")


class CacheGetRequest(WireModel):
    """Ask a node to send the values of `keys` it holds to the client's transfer engine at `address`, as the
    incoming transfer `transfer_id` (the client calls `expect(transfer_id, ...)` before sending this)."""

    transfer_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    keys: list[str] = Field(min_length=1, max_length=4096)
    address: str = Field(min_length=1, description="the client's transfer address (ucx://… / tcp://…)")
    chunk_bytes: int = Field(default=4 << 20, ge=4096, description="largest transfer layer (a value is sliced)")


class CacheGetReply(WireModel):
    """Sizes of the values the node will send, in key order (-1: a miss — absent, or failed its checksum). The
    transfer's layers are the found values in key order, each sliced into chunks of at most `chunk_bytes`;
    no transfer follows when every key missed."""

    sizes: list[int]


class CachePutItem(WireModel):
    key: str = Field(min_length=1, max_length=512)
    size: int = Field(ge=0)
    checksum: int = Field(ge=0, description="xxh3-64 (seed GCACHE_CHECKSUM_SEED) of the value bytes")


class CachePutRequest(WireModel):
    """Announce a batch of values the client will send as transfer `transfer_id`. The node answers which it
    accepts (not already stored or being stored, room in its tiers) and expects the transfer; the client then
    sends only the accepted values, in order, sliced into chunks of at most `chunk_bytes`. A value becomes
    visible when its bytes arrived complete and match their checksum; an unfinished transfer leaves nothing."""

    transfer_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    items: list[CachePutItem] = Field(min_length=1, max_length=4096)
    chunk_bytes: int = Field(default=4 << 20, ge=4096)


class CachePutReply(WireModel):
    accepted: list[bool] = Field(description="one per item")
    address: str = Field(default="", description="the node's transfer address to send the accepted values to")


# --- Encoder (#16): images / videos -> embeddings ----------------------------------------------------------
# The gateway sends the input bytes (base64 over NATS; large ones take the bus's large-payload path) to the
# encoder its content hash maps to; the encoder decodes, preprocesses, runs the vision tower (dynamic batches)
# and keeps the embedding in its cache; prefill fetches the rows by hash over the transfer engine (UCX / TCP).


class EncodeRequest(WireModel):
    request_id: str
    mm_hash: int = Field(ge=0, lt=1 << 64,
                         description="libs.mm.placeholders.content_hash of `data` (the encoder checks)")
    kind: MMKind = MMKind.IMAGE
    data_b64: str = Field(min_length=1, description="the image / video file bytes, base64")


class EncodeReply(WireModel):
    """The embedding is cached on the encoder (kept at least `lease_s` from now); or `error` with a client-facing
    reason (bad or oversized input: the gateway answers 400)."""

    mm_hash: int = Field(ge=0, lt=1 << 64)
    num_tokens: int = Field(default=0, ge=0)
    grid_thw: list[int] = Field(default_factory=list)
    cached: bool = Field(default=False, description="the embedding was already in the cache")
    lease_s: float = Field(default=0.0, ge=0)
    error: str = ""


class EmbedFetchRequest(WireModel):
    """prefill → encoder: send the embeddings of `mm_hashes` to the transfer engine at `address` as transfer
    `transfer_id` (one layer per item, float rows ``[num_tokens, hidden]`` in `dtype`)."""

    transfer_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    mm_hashes: list[int] = Field(min_length=1, max_length=64)
    address: str = Field(min_length=1)
    dtype: str = Field(default="float32", description="torch dtype name the rows are sent in")


class EmbedFetchReply(WireModel):
    """Bytes per item in request order (-1: not in the cache; no transfer follows when every item missed)."""

    sizes: list[int]
    hidden: int = Field(default=0, ge=0)
