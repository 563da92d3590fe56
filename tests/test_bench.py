"""The benchmark scripts run (`make bench` is never run by CI in full: it audits a pin several times over): the
counting benchmark with few calls, the audit benchmark in its smoke mode (the floor and one one-cell audit, on the
real pinned wheel). They print ratios measured in one run; this test checks only that they run and say so."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_the_counting_benchmark_runs():
    r = subprocess.run([sys.executable, "benchmarks/bench_counting.py", "--calls", "2000"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ns" in r.stdout


@pytest.mark.vllm
def test_the_audit_benchmark_runs_one_cell(vllm_env, tmp_path):
    import os

    env = {**os.environ, "SERVING_TRUTH_MEMO": str(tmp_path / "memo")}
    r = subprocess.run([sys.executable, "benchmarks/bench_audit.py", "--smoke"], cwd=ROOT, capture_output=True,
                       text=True, timeout=1800, env=env)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "one-cell audit / floor" in r.stdout and "(0 incomplete)" in r.stdout
