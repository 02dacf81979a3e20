"""Disaggregated prefill / decode: the engine's half of the KV hand-off.

    plan.py      pure: which logical pages travel, and in which streamed segments
    shipment.py  torch: per-layer pages, payload specs, the sender's copies (`SegmentCollector`), the
                 receiver's views, and `KVAccess` / `Landing`, the services' seam to an engine's KV
    remote.py    `DisaggEngineCore` (decode: admits a `RemoteRequest` whose KV arrives from elsewhere) and
                 `first_token_finishes` (prefill)

libs/engine imports neither protos nor libs/transfer: the services (services/prefill, services/decode and
libs/worker/kv_stream.py) own the messages and the transfer. docs/serving.md has the request lifecycle.
"""

from libs.engine.disagg.plan import (
    Segment,
    ShipPlan,
    StreamPlan,
    full_kv_pages,
    plan_shipment,
    plan_stream,
)
from libs.engine.disagg.remote import (
    DecodeFull,
    DisaggEngineCore,
    RemoteRequest,
    RemoteSlot,
    first_token_finishes,
)
from libs.engine.disagg.shipment import (
    KVAccess,
    Landing,
    LayerPages,
    Payload,
    PayloadSpec,
    SegmentCollector,
    destination_views,
    full_transfer_bytes,
    gather_layer,
    payload_specs,
    shipment_bytes,
    shipment_layers,
    stream_destinations,
    stream_layers,
    stream_specs,
)
from libs.engine.request import FinishReason

__all__ = [
    "DecodeFull", "DisaggEngineCore", "FinishReason", "KVAccess", "Landing", "LayerPages", "Payload",
    "PayloadSpec", "RemoteRequest", "RemoteSlot", "Segment", "SegmentCollector", "ShipPlan", "StreamPlan",
    "destination_views",
    "first_token_finishes", "full_kv_pages", "full_transfer_bytes", "gather_layer",
    "payload_specs", "plan_shipment", "plan_stream", "shipment_bytes", "shipment_layers", "stream_destinations",
    "stream_layers", "stream_specs",
]
