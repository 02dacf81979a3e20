"""`python -m services.cache`: a GCache storage node, configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.cache.config import CacheConfig
from services.cache.service import CacheService

if __name__ == "__main__":
    raise SystemExit(main(CacheService, CacheConfig))
