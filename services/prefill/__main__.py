"""`python -m services.prefill`: configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.prefill.config import PrefillConfig

if __name__ == "__main__":
    raise SystemExit(main("services.prefill.service:PrefillService", PrefillConfig))
