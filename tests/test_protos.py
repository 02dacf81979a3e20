"""Wire contract: encode/decode round trips and clear errors at the boundary."""

import orjson
import pytest
from pydantic import ValidationError

from protos import ProtocolError, decode, encode, subjects
from protos.messages import (
    AbortRequest,
    ErrorCode,
    ErrorReply,
    GenerateRequest,
    HealthReply,
    KVEventBatch,
    KVEventKind,
    KVHitReport,
    KVSnapshotReply,
    KVSnapshotRequest,
    KVTier,
    RegistryEntry,
    Role,
    RoutePick,
    RouteReply,
    RouteRequest,
    ServiceState,
    TokenChunk,
    Usage,
    WireFinishReason,
    WireKVEvent,
    WireSamplingParams,
    WireTokenLogprob,
)

pytestmark = pytest.mark.unit

SAMPLES = [
    ErrorReply(code=ErrorCode.BAD_REQUEST, message="nope"),
    RegistryEntry(role=Role.DECODE, instance_id="d-1", address="tcp://h:1", capacity=4096, labels={"b": "8k"}),
    HealthReply(role=Role.ROUTER, instance_id="r1", state=ServiceState.RUNNING, uptime_s=1.5, in_flight=0),
    RouteRequest(request_id="q1", num_tokens=33, block_hashes=[2**63 + 5, 7]),
    RouteReply(prefill_instance="p1", decode_instance="d1", predicted_hit_tokens=16),
    GenerateRequest(
        request_id="q1",
        token_ids=[1, 2, 3],
        sampling=WireSamplingParams(max_tokens=4, temperature=0.0, top_k=5, seed=3, stop_token_ids=[9], logprobs=2),
        stream_subject=subjects.stream("default", "q1"),
    ),
    TokenChunk(
        request_id="q1",
        token_ids=[5],
        logprobs=[WireTokenLogprob(token_id=5, logprob=-0.1, top={5: -0.1, 6: -2.5})],
        finish_reason=WireFinishReason.LENGTH,
        usage=Usage(prompt_tokens=3, completion_tokens=1, cached_tokens=2),
    ),
    AbortRequest(request_id="q1", reason="client disconnected"),
    KVEventBatch(
        instance_id="p1",
        epoch="e1",
        events=[
            WireKVEvent(event_id=4, kind=KVEventKind.STORED, tier=KVTier.HOST, block_hashes=[1, 2**64 - 1],
                        parent_hash=7, swa_checkpoint=[False, True], swa_held=[True, True]),
            WireKVEvent(event_id=5, kind=KVEventKind.SWA_REMOVED, block_hashes=[2]),
        ],
    ),
    KVSnapshotRequest(router_id="r1"),
    KVSnapshotReply(instance_id="p1", epoch="e1", last_event_id=-1, block_hashes=[3, 2**64 - 1], states=[3, 12]),
    KVHitReport(request_id="q1", instance_id="w1", prompt_tokens=40, cached_tokens=32),
    RoutePick(router_id="r1", request_id="q1", prefill_instance="p1", decode_instance="d1", prefill_tokens=8,
              at=1.5),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip_preserves_every_field(msg):
    data = encode(msg)
    assert orjson.loads(data)["schema_version"] == type(msg).SCHEMA_VERSION
    assert decode(data, type(msg)) == msg


def test_invalid_json_names_model():
    with pytest.raises(ProtocolError, match="RouteRequest: payload is not valid JSON"):
        decode(b"{not json", RouteRequest)


def test_non_object_json_rejected():
    with pytest.raises(ProtocolError, match="expected a JSON object, got list"):
        decode(b"[1,2]", RouteRequest)


def test_missing_and_wrong_fields_are_listed():
    with pytest.raises(ProtocolError) as info:
        decode(orjson.dumps({"request_id": "x", "num_tokens": -1}), RouteRequest)
    assert "num_tokens" in str(info.value)


def test_unknown_field_rejected():
    with pytest.raises(ProtocolError, match="surprise"):
        decode(orjson.dumps({"request_id": "x", "num_tokens": 1, "surprise": 1}), RouteRequest)


def test_future_schema_version_rejected():
    raw = orjson.loads(encode(AbortRequest(request_id="a")))
    raw["schema_version"] = 2
    with pytest.raises(ProtocolError, match="schema_version 2 is not supported"):
        decode(orjson.dumps(raw), AbortRequest)


def test_messages_are_frozen():
    msg = AbortRequest(request_id="a")
    with pytest.raises(ValidationError):
        msg.request_id = "b"  # type: ignore[misc]


def test_error_chunk_must_finish_with_error():
    with pytest.raises(ValidationError, match="finish_reason='error'"):
        TokenChunk(request_id="a", error="boom")
    assert TokenChunk(request_id="a", error="boom", finish_reason=WireFinishReason.ERROR).error == "boom"


def test_kv_event_ids_must_be_consecutive():
    with pytest.raises(ValidationError, match="consecutive"):
        KVEventBatch(
            instance_id="p",
            epoch="e",
            events=[
                WireKVEvent(event_id=1, kind=KVEventKind.STORED, block_hashes=[1]),
                WireKVEvent(event_id=3, kind=KVEventKind.STORED, block_hashes=[2]),
            ],
        )


def test_subject_builders():
    assert subjects.health("prod", "r-1") == "windserve.prod.health.r-1"
    assert subjects.generate("prod", "w_2") == "windserve.prod.worker.w_2.generate"
    assert subjects.stream("prod", "req9") == "windserve.prod.stream.req9"
    assert subjects.kv_events("prod", "p1") == "windserve.prod.kv_events.p1"
    assert subjects.kv_events_all("prod") == "windserve.prod.kv_events.*"
    assert subjects.kv_snapshot("prod", "p1") == "windserve.prod.worker.p1.kv_snapshot"
    assert subjects.route("a") != subjects.route("b") and subjects.abort("a") != subjects.abort("b")
    assert subjects.registry_bucket("prod") == "windserve_registry_prod"


@pytest.mark.parametrize("bad", ["a.b", "a b", "*", ">", ""])
def test_subject_tokens_reject_separators_and_wildcards(bad):
    with pytest.raises(ValueError, match="not a valid subject token"):
        subjects.stream("default", bad)
    with pytest.raises(ValueError, match="not a valid subject token"):
        subjects.route(bad)


def test_registry_entry_instance_id_must_be_a_token():
    with pytest.raises(ValidationError):
        RegistryEntry(role=Role.ROUTER, instance_id="a.b")


def test_kv_event_flags_one_per_block_and_snapshot_states_bounded():
    with pytest.raises(ValidationError, match="one entry per block"):
        WireKVEvent(event_id=0, kind=KVEventKind.STORED, block_hashes=[1, 2], swa_held=[True])
    with pytest.raises(ValidationError, match="one value in"):
        KVSnapshotReply(instance_id="p", epoch="e", last_event_id=0, block_hashes=[1], states=[16])
