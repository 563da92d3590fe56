"""GPU acceptance: only on a host with an NVIDIA GPU and driver (skipped elsewhere, including CI)."""
import subprocess
import sys

import pytest

from audit.runtimes import cudastub
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not cudastub.real_driver_present(), reason="no NVIDIA GPU/driver on this host")
def test_selftest_gpu_every_lane_fires():
    r = subprocess.run([sys.executable, "-m", "audit.cli", "selftest-gpu"], cwd=ROOT, capture_output=True, text=True,
                       timeout=7200)
    assert r.returncode == 0, r.stderr[-4000:]
    for lane in ("kda.prefill", "kda.decode", "mla.prefill", "mla.decode", "moe"):
        assert f"{lane}: " in r.stdout


def test_selftest_gpu_refuses_without_a_gpu():
    if cudastub.real_driver_present():
        pytest.skip("this host has a GPU")
    r = subprocess.run([sys.executable, "-m", "audit.cli", "selftest-gpu"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 3 and "needs an NVIDIA GPU" in r.stderr
