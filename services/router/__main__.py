"""`python -m services.router`: configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.router.config import RouterConfig

if __name__ == "__main__":
    raise SystemExit(main("services.router.service:RouterService", RouterConfig))
