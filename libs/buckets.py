"""Length buckets (pure): classify a request by the tokens it still has to compute.

Raw prompt length is the wrong key: a 200K-token conversation whose first 199K tokens hit the
prefix cache is a short request. Buckets therefore use *uncached* tokens (after the prefix hit).
Edges (e.g. 64K, 256K) split [0, inf) into len(edges) + 1 buckets: bucket i holds counts in
[edges[i-1], edges[i]).

The engine's scheduler (which knows the hit) and the router (which does not yet: it classifies the raw
prompt length until the KV-affinity index predicts the hit) classify with the same edges, so each
service holds the one `BucketConfig` declared here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

DEFAULT_BUCKET_EDGES: tuple[int, ...] = (65536, 262144)


@dataclass(frozen=True)
class BucketConfig:
    """The length buckets every service classifies with: the engine's scheduler, the router and the gateway's
    no-router fallback must agree, so they all hold this part."""

    bucket_edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES
    """Length bucket edges over uncached tokens, a JSON list; [] = one bucket (plain FCFS)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_edges", LengthBuckets(tuple(self.bucket_edges)).edges)


@dataclass(frozen=True)
class LengthBuckets:
    edges: tuple[int, ...] = DEFAULT_BUCKET_EDGES

    def __post_init__(self) -> None:
        object.__setattr__(self, "edges", tuple(int(e) for e in self.edges))
        if any(e <= 0 for e in self.edges):
            raise ValueError(f"LengthBuckets.edges must be positive, got {self.edges}")
        if list(self.edges) != sorted(set(self.edges)):
            raise ValueError(f"LengthBuckets.edges must be strictly increasing, got {self.edges}")

    @property
    def num_buckets(self) -> int:
        return len(self.edges) + 1

    def classify(self, uncached_tokens: int) -> int:
        """Bucket index of a request that has `uncached_tokens` left to compute (0 = shortest)."""
        if uncached_tokens < 0:
            raise ValueError(f"uncached_tokens must be >= 0, got {uncached_tokens}")
        return bisect.bisect_right(self.edges, uncached_tokens)

    def bounds(self, bucket: int) -> tuple[int, int | None]:
        """[low, high) token range of a bucket; high None = unbounded."""
        if not 0 <= bucket < self.num_buckets:
            raise ValueError(f"bucket {bucket} out of range (have {self.num_buckets})")
        low = 0 if bucket == 0 else self.edges[bucket - 1]
        high = self.edges[bucket] if bucket < len(self.edges) else None
        return low, high
