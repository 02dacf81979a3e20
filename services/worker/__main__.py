"""`python -m services.worker`: configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.worker.config import WorkerConfig

if __name__ == "__main__":
    raise SystemExit(main("services.worker.service:WorkerService", WorkerConfig))
