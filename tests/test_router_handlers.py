"""services/router (pure parts): layout labels, the wire-to-cache event conversion, the prediction ledger."""

from __future__ import annotations

import pytest

from libs.kvcache import EventKind, KVCache, KVCacheConfig, Tier, block_hashes
from libs.worker.kv_wire import kv_events as events_of
from protos.messages import KVEventBatch, KVEventKind, KVTier, RegistryEntry, Role, WireKVEvent
from services.router.handlers import IndexLayout, Predictions, layout_of

pytestmark = pytest.mark.unit


def test_layout_labels_parse_or_say_what_is_wrong():
    labels = {"kv_page_size": "16", "kv_window": "128", "kv_rebuild_tokens": "0", "kv_hash_seed": "7"}
    assert layout_of(RegistryEntry(role=Role.WORKER, instance_id="w", labels=labels)) == IndexLayout(16, 128, 0, 7)
    assert layout_of(RegistryEntry(role=Role.WORKER, instance_id="w")) is None
    with pytest.raises(ValueError, match="bad KV layout labels"):
        layout_of(RegistryEntry(role=Role.WORKER, instance_id="w", labels={**labels, "kv_window": "wide"}))
    with pytest.raises(ValueError, match="bad KV layout labels"):
        layout_of(RegistryEntry(role=Role.WORKER, instance_id="w", labels={"kv_page_size": "16"}))


def test_events_of_gives_back_the_cache_events():
    cache = KVCache(KVCacheConfig(page_size=4, window=8, num_full_pages=16, num_swa_pages=8))
    tokens = list(range(21))
    hit = cache.match(tokens, block_hashes(tokens, 4))
    assert cache.admit("s", tokens, hit, 1).ok and cache.reserve("s", 21)
    cache.commit("s", 21, [99])
    cache.finish("s")
    events = cache.drain_events()
    assert events and events[0].kind is EventKind.STORED and events[0].tier is Tier.DEVICE
    batch = KVEventBatch(instance_id="w", epoch="e", events=[
        WireKVEvent(event_id=e.event_id, kind=KVEventKind(e.kind.value), tier=KVTier(e.tier.value),
                    block_hashes=list(e.block_hashes), parent_hash=e.parent_hash,
                    swa_checkpoint=list(e.swa_checkpoint), swa_held=list(e.swa_held)) for e in events])
    assert events_of(batch) == events


def test_predictions_are_taken_once_per_instance_bounded_and_forgotten():
    ledger = Predictions(max_entries=2, ttl_s=10.0)
    ledger.add("r1", 0.0, "p", 32, "d", 16)
    assert ledger.take("r1", "d", 1.0).tokens == 16  # type: ignore[union-attr]
    assert ledger.take("r1", "d", 1.0) is None  # once
    assert ledger.take("r1", "p", 1.0).side == "prefill"  # type: ignore[union-attr]
    ledger.add("r2", 1.0, "w", 8)
    ledger.add("r2", 2.0, "w", 12)  # routed again: replaced
    assert ledger.take("r2", "w", 2.0).tokens == 12  # type: ignore[union-attr]
    for i, t in enumerate((2.0, 2.5, 3.0)):
        ledger.add(f"b{i}", t, "w", 4)  # three > max_entries: the oldest goes
    assert len(ledger) == 2 and ledger.take("b0", "w", 3.0) is None
    assert ledger.take("b1", "w", 13.0) is None  # past its TTL
