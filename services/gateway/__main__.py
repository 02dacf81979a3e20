"""`python -m services.gateway`: configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.gateway.config import GatewayConfig

if __name__ == "__main__":
    raise SystemExit(main("services.gateway.service:GatewayService", GatewayConfig))
