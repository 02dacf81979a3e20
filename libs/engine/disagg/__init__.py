"""Disaggregated prefill / decode: the engine's half of the KV hand-off.

    plan.py      pure: which logical pages travel (full pages after decode's hit, SWA pages of the last
                 window) and how they are cut into segments that leave while prefill computes
    shipment.py  torch: per-layer page lists, payload specs, the sender's copies (and the engine-thread
                 `SegmentCollector` that makes them as segments complete), the receiver's destination views,
                 and `KVAccess` / `Landing`, the seam through which the services reach an engine's KV (every
                 KV head; a parallel engine's own in libs/engine/parallel/kvio.py)
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
    "PayloadSpec", "RemoteRequest", "RemoteSlot", "Segment", "SegmentCollector", "ShipPlan", "StreamPlan", "destination_views",
    "first_token_finishes", "full_kv_pages", "full_transfer_bytes", "gather_layer",
    "payload_specs", "plan_shipment", "plan_stream", "shipment_bytes", "shipment_layers", "stream_destinations",
    "stream_layers", "stream_specs",
]
