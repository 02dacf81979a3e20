"""SWA-aware KV cache bookkeeping (pure Python: ints, ids, dataclasses; the tensors live in the engine)."""

from libs.kvcache.cache import KVCache
from libs.kvcache.config import (
    DEFAULT_HASH_SEED,
    MIMO_V25_PRO,
    ArenaPlan,
    KVCacheConfig,
    KVLayout,
    PoolPlan,
    plan_arena,
    plan_pools,
    rebuild_span,
)
from libs.kvcache.gcache_tier import l3_checkpoint_ends, l3_checkpoints, l3_footprint, l3_hit_end
from libs.kvcache.hashing import block_hashes
from libs.kvcache.retention import POLICIES, RetentionContext, RetentionPlan, register_policy
from libs.kvcache.types import (
    AdmitResult,
    ArenaStats,
    BlockHeld,
    CacheSnapshot,
    CacheStats,
    Direction,
    EventKind,
    Group,
    HostImport,
    KVEvent,
    PageCopy,
    PoolStats,
    PoolUsage,
    PrefixHit,
    RebuildStats,
    Tier,
)

__all__ = [
    "DEFAULT_HASH_SEED", "MIMO_V25_PRO", "POLICIES", "AdmitResult", "ArenaPlan", "ArenaStats", "BlockHeld",
    "CacheSnapshot", "CacheStats", "Direction", "EventKind", "Group", "HostImport", "KVCache",
    "KVCacheConfig", "KVEvent", "KVLayout", "PageCopy", "PoolPlan", "PoolStats", "PoolUsage", "PrefixHit",
    "RebuildStats", "RetentionContext", "RetentionPlan", "Tier", "block_hashes", "l3_checkpoint_ends",
    "l3_checkpoints", "l3_footprint", "l3_hit_end", "plan_arena", "plan_pools", "rebuild_span",
    "register_policy",
]
