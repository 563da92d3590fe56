"""The docker runtime with the second engine (issue 47): an SGLang pin's image, built here from the pin's wheel and
shipped resolution (tests/images/build_image.py), audited inside the real Docker engine; and an image that holds
another engine than its pin says, refused before any cell. A file of its own, so the SGLang image's build runs beside
the vLLM docker tests rather than after them."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from audit.errors import ExitCode
from audit.pins import lock as lockmod
from audit.runtimes.docker import LABEL_RUN
from tests.conftest import ROOT
from tests.test_docker import managed, write_lock

CLI = [sys.executable, "-m", "audit.cli"]

pytestmark = pytest.mark.docker


@pytest.mark.sglang
def test_an_sglang_image_audits_as_the_committed_sglang_report(docker_client, sglang_image, tmp_path):
    """An SGLang pin's image (Python 3.11 and the pinned SGLang wheel under its shipped resolution) audited by the
    docker runtime: the inventory reads SGLang, not vLLM; the agent SGLang's engine contract names runs inside the
    image; every cell routes field by field as the committed SGLang report, which the local runtime wrote."""
    from tests.compare import comparable

    lock = tmp_path / "images.lock"
    lock.write_text(sglang_image["lock_text"])
    reports = tmp_path / "reports"
    r = subprocess.run([*CLI, "audit", sglang_image["pin"], "--runtime", "docker", "--lock", str(lock),
                        "--systems", "b200_sxm,h200_sxm", "--layouts", "tp8,dep8", "--reports", str(reports),
                        "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-4000:]
    report = reports / "sglang" / sglang_image["pin"]
    routing = json.loads((report / "routing.json").read_text())
    assert routing["pin"]["engine"] == "sglang" and routing["pin"]["sglang_version"] == "0.5.23"
    committed = {(c["system"], c["layout"]): c for c in
                 json.loads((ROOT / "reports/sglang/sglang-0.5.23/routing.json").read_text())["cells"]}
    assert sorted((c["system"], c["layout"]) for c in routing["cells"]) == [
        ("b200_sxm", "dep8"), ("b200_sxm", "tp8"), ("h200_sxm", "dep8"), ("h200_sxm", "tp8")]
    for cell in routing["cells"]:
        key = (cell["system"], cell["layout"])
        assert cell["status"] == "COMPLETE", (key, cell.get("failure"))
        assert comparable(cell) == comparable(committed[key]), key
    ledger = (report / "ledger.md").read_text()
    assert f"image ID `{sglang_image['image_id']}`" in ledger
    assert "verified against images.lock: config digest (image ID), architecture, SGLang 0.5.23 in the image" in ledger
    assert "SGLang 0.5.23 (its build recorded no commit)" in ledger and "Python 3.11" in ledger
    assert "deep_gemm external: sgl-deep-gemm" in ledger
    run_dir = Path([l.split("evidence: ", 1)[1].strip() for l in r.stderr.splitlines()
                    if l.startswith("evidence: ")][0])
    assert managed(docker_client, **{LABEL_RUN: run_dir.name}) == []


@pytest.mark.vllm
def test_an_image_holding_another_engine_is_refused_before_any_cell(docker_client, vllm_image, tmp_path):
    """A pin that says SGLang but names the vLLM image: the inventory finds no SGLang in it and the audit stops
    with the environment's exit code, naming the image and the pin; no report is written."""
    pin = lockmod.load(vllm_image["lock"]).get(vllm_image["pin"])
    lock = write_lock(tmp_path / "images.lock", f'name = "sglang-0.5.23-wrong"\nengine = "sglang"\n'
                      f'sglang_version = "0.5.23"\npython = "3.11"\nimage_config_digest = "{pin.image_config_digest}"\n')
    reports = tmp_path / "reports"
    r = subprocess.run([*CLI, "audit", "sglang-0.5.23-wrong", "--runtime", "docker", "--lock", str(lock),
                        "--systems", "b200_sxm", "--layouts", "tp8", "--reports", str(reports)],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == ExitCode.ENVIRONMENT, r.stderr[-3000:]
    assert "holds no SGLang (sglang is not importable in the image)" in r.stderr
    assert "pin sglang-0.5.23-wrong is pinned to SGLang 0.5.23" in r.stderr
    assert not (reports / "sglang" / "sglang-0.5.23-wrong" / "routing.json").exists()
