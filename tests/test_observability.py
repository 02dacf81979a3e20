"""The shipped dashboard and scrape config name series the services really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from services.gateway.cluster_metrics import UP, merge

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent
OBS = ROOT / "compose" / "observability"


def _defined_series() -> set[str]:
    names = set()
    for path in [*ROOT.glob("libs/**/*.py"), *ROOT.glob("services/**/*.py")]:
        names |= set(re.findall(r"(?:Counter|Gauge|Histogram|Summary)\(\s*\"(windserve_\w+)\"", path.read_text()))
    return names | {UP}


def test_the_dashboard_queries_only_exported_series():
    panels = json.loads((OBS / "grafana-dashboard.json").read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"windserve_\w+", e)}
    assert used and used <= _defined_series(), used - _defined_series()


def test_the_scrape_config_reads_the_cluster_view():
    job = yaml.safe_load((OBS / "prometheus.yml").read_text())["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics/cluster"


def test_merged_series_carry_role_and_instance():
    text = "# HELP windserve_x_total x\n# TYPE windserve_x_total counter\nwindserve_x_total{kind=\"a\"} 2.0\n"
    families = merge([("worker", "w-1", text), ("worker", "w-2", text)])
    samples = [s for s in families["windserve_x"].samples if s.name == "windserve_x_total"]
    got = [(s.labels["role"], s.labels["instance"], s.labels["kind"], s.value) for s in samples]
    assert got == [("worker", "w-1", "a", 2.0), ("worker", "w-2", "a", 2.0)]
