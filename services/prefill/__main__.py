"""`python -m services.prefill`: configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.prefill.config import PrefillConfig
from services.prefill.service import PrefillService

if __name__ == "__main__":
    raise SystemExit(main(PrefillService, PrefillConfig))
