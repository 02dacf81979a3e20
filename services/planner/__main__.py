"""`python -m services.planner`: configuration from WINDSERVE_* env vars."""

from libs.service import main
from services.planner.config import PlannerConfig

if __name__ == "__main__":
    raise SystemExit(main("services.planner.service:PlannerService", PlannerConfig))
