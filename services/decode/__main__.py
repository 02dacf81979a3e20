"""`python -m services.decode`: configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.decode.config import DecodeConfig

if __name__ == "__main__":
    raise SystemExit(main("services.decode.service:DecodeService", DecodeConfig))
