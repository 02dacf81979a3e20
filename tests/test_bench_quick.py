"""Benchmarks cannot rot: every benchmark `python -m bench` runs (bench.__main__.BENCHMARKS) runs its --quick mode
for real (tiny sizes, the code paths of the full run) as its own process, and writes a JSON (to --out, never over
bench/results/) with every headline key (the module's HEADLINE_KEYS) at the top; a null one names its reason under
"null_reasons" (what this host lacks: redis-server, the conversation trace, a fault a quick run leaves out, CUDA).
Each run takes seconds to about 40 s on a loaded 2-core box; about 3-4 minutes for the file."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import BENCHMARKS, QUICK_DIR, QUICK_ENV, command

ROOT = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 240  # one quick run (each takes <= ~45 s here; CI boxes are slower and shared)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]


@pytest.mark.unit
def test_every_benchmark_declares_its_headline_keys() -> None:
    for name in BENCHMARKS:
        keys = importlib.import_module(f"bench.{name}").HEADLINE_KEYS
        assert isinstance(keys, tuple) and keys and all(isinstance(k, str) for k in keys), name
        assert len(set(keys)) == len(keys), name


@pytest.mark.unit
def test_bench_passes_quick_and_the_output_paths(tmp_path: Path) -> None:
    assert command("model", False, None)[-1] == "bench.model"  # make bench: each module's own default
    assert command("model", True, None)[-3:] == ["--quick", "--out", str(QUICK_DIR / "model.json")]
    assert command("router", True, tmp_path)[-3:] == ["--quick", "--out", str(tmp_path / "router.json")]
    assert command("router", False, tmp_path)[-2:] == ["--out", str(tmp_path / "router.json")]


# their quick run is an e2e test of its own, which checks the same and what the run shows
ELSEWHERE = {"planner": "tests/test_e2e_planner.py"}


@pytest.mark.parametrize("name", [n for n in BENCHMARKS if n not in ELSEWHERE])
def test_quick_run_writes_every_headline_key(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.json"
    committed = ROOT / "bench" / "results" / f"{name}.json"
    before = committed.stat().st_mtime_ns if committed.exists() else None
    env = dict(os.environ, PYTHONUNBUFFERED="1", **QUICK_ENV)
    try:
        proc = subprocess.run([sys.executable, "-m", f"bench.{name}", "--quick", "--out", str(out)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        pytest.fail(f"bench.{name} --quick ran past {RUN_TIMEOUT_S} s; output tail:\n{tail[-3000:]}")
    log = (proc.stdout + proc.stderr)[-4000:]
    assert (committed.stat().st_mtime_ns if committed.exists() else None) == before, \
        f"bench.{name} --quick wrote over {committed}"
    assert proc.returncode == 0, f"bench.{name} --quick exited {proc.returncode}:\n{log}"
    assert out.exists(), f"bench.{name} --quick wrote no {out}:\n{log}"
    data = json.loads(out.read_text())
    keys = importlib.import_module(f"bench.{name}").HEADLINE_KEYS
    missing = [k for k in keys if k not in data]
    assert not missing, f"bench.{name}: headline keys missing from the JSON: {missing}"
    reasons = data.get("null_reasons") or {}
    unexplained = [k for k in keys if data[k] is None and not reasons.get(k)]
    assert not unexplained, f"bench.{name}: null headline keys without a reason in null_reasons: {unexplained}"
    if any(data[k] is not None for k in keys):  # something was measured: the plot was drawn beside the JSON
        assert out.with_suffix(".png").exists(), f"bench.{name} --quick wrote no PNG beside {out}"
