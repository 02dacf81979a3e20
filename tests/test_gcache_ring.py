"""GCache's pure parts: the consistent-hash ring (balance, minimal movement, replicas) and value slicing."""

import pytest
import torch

from libs.gcache import wire
from libs.gcache.ring import HashRing

pytestmark = pytest.mark.unit

KEYS = [f"ns-0123:F:{i:016x}" for i in range(12_000)]


def _homes(ring: HashRing) -> dict[str, str]:
    return {k: ring.home(k) for k in KEYS}


@pytest.mark.parametrize("n", [3, 4, 8])
def test_every_node_holds_its_share_within_ten_percent_at_64_virtual_nodes(n):
    ring = HashRing([f"cache-{i}-{n}" for i in range(n)], virtual_nodes=64)
    ring.check_invariants()
    counts: dict[str, int] = {}
    for home in _homes(ring).values():
        counts[home] = counts.get(home, 0) + 1
    fair = len(KEYS) / n
    assert set(counts) == ring.nodes
    assert max(abs(c - fair) / fair for c in counts.values()) <= 0.10, counts


def test_a_join_moves_only_keys_to_the_new_node_and_a_leave_only_the_leavers_keys():
    ring = HashRing([f"cache-{i}" for i in range(4)])
    before = _homes(ring)
    ring.add("cache-new")
    after = _homes(ring)
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved and all(after[k] == "cache-new" for k in moved)
    assert len(moved) / len(KEYS) < 0.3  # about 1/5
    ring.remove("cache-new")
    assert _homes(ring) == before  # deterministic: the same ring again
    ring.remove("cache-1")
    gone = _homes(ring)
    assert {k for k in KEYS if before[k] != gone[k]} == {k for k in KEYS if before[k] == "cache-1"}


def test_successors_are_distinct_nearest_first_and_the_replica_takes_over_when_the_home_leaves():
    ring = HashRing(["a", "b", "c"])
    for key in KEYS[:500]:
        two = ring.successors(key, 2)
        assert len(set(two)) == 2 and two[0] == ring.home(key)
        assert ring.successors(key, 5) == ring.successors(key, 3) and len(ring.successors(key, 5)) == 3
    key = KEYS[0]
    home, replica = ring.successors(key, 2)
    ring.remove(home)
    assert ring.home(key) == replica
    assert HashRing().successors(key, 2) == [] and HashRing().home(key) is None


def test_every_client_builds_the_same_ring_whatever_the_join_order():
    a, b = HashRing(["x", "y", "z"]), HashRing(["z", "x", "y"])
    assert all(a.successors(k, 2) == b.successors(k, 2) for k in KEYS[:300])


@pytest.mark.parametrize("size, chunk, expected", [(0, 4096, []), (10, 4096, [10]), (8192, 4096, [4096, 4096]),
                                                    (9000, 4096, [4096, 4096, 808])])
def test_a_value_is_sliced_into_full_chunks_and_a_remainder(size, chunk, expected):
    assert wire.chunk_sizes(size, chunk) == expected


def test_layers_name_their_value_and_chunk_and_the_header_gives_back_the_sizes():
    specs = wire.layer_specs([9000, 0, 5], 4096, positions=[3, 4, 7])
    assert [(s.layer_index, s.page_count, s.nbytes) for s in specs] == [(3, 0, 4096), (3, 1, 4096), (3, 2, 808),
                                                                          (7, 0, 5)]
    assert wire.value_sizes(specs) == {3: 9000, 7: 5}
    with pytest.raises(ValueError, match="out of order"):
        wire.value_sizes([specs[1], specs[0]])


def test_chunk_views_share_the_buffer():
    buf = bytearray(9000)
    views = wire.chunk_views(buf, 4096)
    assert [v.numel() for v in views] == [4096, 4096, 808]
    views[2].fill_(7)
    assert buf[-808:] == b"\x07" * 808 and buf[:8192] == bytes(8192)
    ro = wire.chunk_views(bytes(range(200)) * 30, 4096)
    assert torch.cat(ro).tolist() == list(range(200)) * 30
