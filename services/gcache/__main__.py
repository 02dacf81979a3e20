"""`python -m services.gcache`: a GCache storage node, configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.gcache.config import CacheConfig

if __name__ == "__main__":
    raise SystemExit(main("services.gcache.service:CacheService", CacheConfig))
