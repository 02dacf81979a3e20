"""GCache (L3): the SDK of the distributed KV cache (docs/gcache.md).

`BlockStore` is what the engine side types against; `GCacheClient` is the real one (storage nodes found in
the registry, a consistent-hash ring, bytes over UCX / TCP on its own IO thread); keys come from `keys.py`.
"""

from .api import BlockStore, Buffer
from .config import GCacheConfig
from .keys import GCACHE_CHECKSUM_SEED, full_key, model_namespace, swa_key, value_checksum

__all__ = ["GCACHE_CHECKSUM_SEED", "BlockStore", "Buffer", "GCacheConfig", "full_key", "model_namespace", "swa_key",
           "value_checksum"]
