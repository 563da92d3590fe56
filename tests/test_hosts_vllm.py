"""The host axis on the pinned wheel: the same cell audited as a pip install with no CUDA toolkit moves K3's routed
experts on SM 10.0 off FlashInfer's TRT-LLM-Gen MXFP4 kernel (vLLM's own has_flashinfer() says no there), and the
audit writes that as a host diff against the committed report of the image's host."""
import json
import shutil
import subprocess
import sys

import pytest

from audit.errors import ExitCode
from tests.conftest import ROOT

pytestmark = pytest.mark.vllm


def test_the_pip_host_is_audited_beside_the_image_and_its_diff_names_the_host_dependent_kernels(vllm_env, tmp_path):
    reports = tmp_path / "reports"
    shutil.copytree(ROOT / "reports" / "v0.33.0", reports / "v0.33.0")
    before = {p.name: p.read_bytes() for p in (reports / "v0.33.0").iterdir()}
    r = subprocess.run([sys.executable, "-m", "audit.cli", "audit", "v0.33.0", "--host", "pip", "--systems", "b200_sxm",
                        "--layouts", "tp8", "--reports", str(reports), "--no-cache"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-3000:]
    assert {p.name: p.read_bytes() for p in (reports / "v0.33.0").iterdir()} == before  # the image's report stays
    routing = json.loads((reports / "hosts" / "pip" / "v0.33.0" / "routing.json").read_text())
    assert routing["run"]["host"]["name"] == "pip" and routing["run"]["host"]["facts"]["nvcc"] is False
    (cell,) = routing["cells"]
    assert cell["availability"]["flashinfer"] is False and cell["availability"]["flashinfer_cubin"] is False
    assert "HOST=pip" in routing["run"]["reproduce"]
    ledger = (reports / "hosts" / "pip" / "v0.33.0" / "ledger.md").read_text()
    assert "- **Host:** pip install vllm==0.33.0, no CUDA toolkit: nvcc no" in ledger
    diff = (reports / "hosts" / "pip" / "diffs" / "v0.33.0@image..v0.33.0@pip.md").read_text()
    assert diff.startswith("# Routing diff: vLLM `v0.33.0 on the image host` → `v0.33.0 on the pip host`")
    assert "**These kernels depend on the host**" in diff and "nvcc yes → no" in diff
    assert "TrtLlmMxfp4ExpertsMonolithic → DeepGemmFP4Experts" in diff
