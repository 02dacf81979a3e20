"""Prometheus metrics of the planner (docs/planner.md)."""

from prometheus_client import Counter, Gauge

DESIRED = Gauge("windserve_planner_desired_instances", "Instances the planner wants per role", ["role"])
ACTUAL = Gauge("windserve_planner_actual_instances", "Live instances per role in the registry", ["role"])
NEEDED = Gauge("windserve_planner_needed_instances", "Instances the load model needs per role (fractional)",
               ["role"])
PREDICTED_RATE = Gauge("windserve_planner_predicted_rate", "Predicted arrival rate, requests/s, lead_s ahead")
OBSERVED_RATE = Gauge("windserve_planner_observed_rate", "Arrival rate over the last interval, requests/s")
STEPS = Counter("windserve_planner_steps_total", "Changes of the desired instances", ["role", "direction"])
CONNECTOR_ERRORS = Counter("windserve_planner_connector_errors_total", "Decisions the connector failed to apply")
SCRAPE_ERRORS = Counter("windserve_planner_scrape_errors_total", "Gateway /metrics reads that failed")
CORRECTION = Gauge("windserve_planner_correction", "Factor on the model's needs, raised by observed SLA misses")
