"""`python -m services.gateway`: configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService

if __name__ == "__main__":
    raise SystemExit(main(GatewayService, GatewayConfig))
