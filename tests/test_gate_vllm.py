"""The pin-bump gate on the real pinned wheel: v0.33.0 gated against itself passes (its known findings accepted),
and builds of v0.33.0 with one realistic upstream regression each fail it with exit 6, each naming its change.

The regressed builds are the pinned wheel with a change planted as vLLM is imported (tests/plant.py): the same
files, one source line rewritten in memory, so no environment is built. Each regression is one a release owner
fears in a pin bump: a device check relaxed (a configuration vLLM refused before now builds), a support check
failing quietly, an activation check rejecting SiTU, a dispatch bound moved, a selector's support set narrowed.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from audit.core import _write_run_json
from audit.errors import ExitCode
from audit.models.kimi_k3 import KIMI_K3
from tests.conftest import ROOT
from tests.plant import sitecustomize

pytestmark = pytest.mark.vllm

PIN = "v0.33.0"
CELLS = [("h200_sxm", "dep8"), ("b200_sxm", "tp8")]

MEGA_MOE = "vllm.model_executor.layers.fused_moe.deep_gemm_mega_moe"
TRTLLM = "vllm.model_executor.layers.fused_moe.experts.trtllm_mxfp4_moe"
#: each regression: (name, plants, the cell it shows in, what the gate's rows must name)
REGRESSIONS = {
    # vLLM 0.33.0 refuses DeepGEMM MegaMoE below SM 10.x at construction; relaxed, H200 DEP8 builds
    "device check relaxed": ([(MEGA_MOE, [("    if not current_platform.is_device_capability_family(\n"
                                            "        100, device_id=device.index or 0\n    ):",
                                            "    if not current_platform.has_device_capability(\n"
                                            "        90, device_id=device.index or 0\n    ):")])],
                             ("h200_sxm", "dep8")),
    # the monolithic TRT-LLM MXFP4 experts say no to this parallel config; vLLM takes the next candidate
    "support check failing quietly": ([(TRTLLM, [("            and moe_parallel_config.dp_size <= 1\n",
                                                  "            and moe_parallel_config.dp_size < 1\n")])],
                                      ("b200_sxm", "tp8")),
    # both TRT-LLM MXFP4 experts classes reject K3's SiTU activation
    "activation check rejecting SiTU": ([(TRTLLM, [("        if activation == MoEActivation.SITU:\n"
                                                    "            return has_flashinfer_situ_activation()\n",
                                                    "        if activation == MoEActivation.SITU:\n"
                                                    "            return False\n")])],
                                        ("b200_sxm", "tp8")),
    # K3's routed down-projection overlaps the aux stream up to 256 tokens; moved to 64
    "dispatch bound moved": ([("vllm.models.kimi_k3.nvidia.model",
                               [("_ROUTED_DOWN_PROJ_STREAM_TOKEN_THRESHOLD = 256\n",
                                 "_ROUTED_DOWN_PROJ_STREAM_TOKEN_THRESHOLD = 64\n")])],
                             ("b200_sxm", "tp8")),
    # K3 KDA's fused decode kernel selector stops listing 12 heads per rank (K3 at TP8): vLLM picks the Triton
    # decode instead, with no error
    "selector support narrowed": ([("vllm.models.kimi_k3.nvidia.kda",
                                    [("        num_heads not in (12, 24, 48, 96)\n",
                                      "        num_heads not in (24, 48, 96)\n")])],
                                  ("b200_sxm", "tp8")),
}


#: the kind of serving change each regression is (the gate groups its terminal lines and the diff its tables by it)
CLASSES = {"device check relaxed": "refusal", "support check failing quietly": "experts",
           "activation check rejecting SiTU": "experts", "dispatch bound moved": "tier",
           "selector support narrowed": "kernel"}
#: an availability answer that moves while no selection in the audited cells depends on it: information. (Not every
#: answer is one: vLLM told that deep_ep is available imports it at once and the cell stops at its config.)
AVAILABILITY_ONLY = [("vllm.utils.import_utils", [('    if not _has_module_spec("tilelang"):\n        return False\n',
                                                   '    if True:  # planted: tilelang unavailable\n        return False\n')])]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "audit.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=1800)


def _run(vllm_env, tmp_path_factory, name, plants=()):
    """A run of CELLS with *plants*, its run.json written as the audit writes it: ready for `render`."""
    from audit.runtimes import RunRequest
    from audit.systems import SYSTEMS

    from audit.models.kimi_k3 import LAYOUTS

    rt, pin, _ = vllm_env
    run_dir = tmp_path_factory.mktemp(name.replace(" ", "-"))
    if plants:
        (run_dir / "sitecustomize.py").write_text(sitecustomize(list(plants)), encoding="utf-8")
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in CELLS],
                     run_dir=run_dir, parallel=2)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}, result.missing
    _write_run_json(req, KIMI_K3, {**result.info, "vllm_commit": pin.commit, "reproduce": "test"}, {})
    return run_dir


@pytest.fixture(scope="module")
def shipped(vllm_env, tmp_path_factory):
    """The shipped pin's report (the baseline) and its accepted findings."""
    base = tmp_path_factory.mktemp("gate")
    reports, accepted = base / "reports", base / "accepted.toml"
    run = _run(vllm_env, tmp_path_factory, "baseline")
    r = cli("render", str(run), "--reports", str(reports), "--baseline", "none")
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr
    r = cli("accept", PIN, "--reports", str(reports), "--accepted", str(accepted))
    assert r.returncode == ExitCode.OK, r.stderr
    return {"reports": reports, "accepted": accepted, "run": run}


def _gate(shipped, run: Path, reports: Path):
    """Render *run* into a copy of the shipped reports, gated against the shipped pin."""
    import shutil

    if reports.exists():
        shutil.rmtree(reports)
    shutil.copytree(shipped["reports"], reports)
    r = cli("render", str(run), "--reports", str(reports), "--baseline", PIN, "--accepted", str(shipped["accepted"]))
    diff = json.loads((reports / "diffs" / f"{PIN}..{PIN}.json").read_text())
    return r, diff


def test_the_shipped_pin_against_itself_passes_the_gate(shipped, tmp_path):
    # the baseline's own run rendered again, gated against the report it made (that a second audit routes the same
    # is tests/test_reproduce.py's and tests/test_cache.py's)
    again = shipped["run"]
    r, diff = _gate(shipped, again, tmp_path / "reports")
    assert r.returncode == ExitCode.OK, r.stderr
    assert "gate passed against v0.33.0" in r.stderr and diff["serving_changes"] == 0
    # without the accepted findings the same audit fails on them (exit 1), not on a change of serving
    r = cli("render", str(again), "--reports", str(tmp_path / "reports"), "--baseline", PIN, "--accepted", "none")
    assert r.returncode == ExitCode.FINDINGS and "0 serving change row(s)" in r.stderr


@pytest.fixture(scope="module")
def regressed(vllm_env, tmp_path_factory):
    return {name: _run(vllm_env, tmp_path_factory, name, plants) for name, (plants, _) in REGRESSIONS.items()}


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_each_regression_fails_the_gate_naming_its_change(name, shipped, regressed, tmp_path):
    r, diff = _gate(shipped, regressed[name], tmp_path / "reports")
    assert r.returncode == ExitCode.SERVING_CHANGED, (name, r.stderr[-3000:])
    cell = list(REGRESSIONS[name][1])
    rows = [c for c in diff["changes"] if c["serving"] and cell in c["cells"]]
    assert rows, (name, diff["changes"])
    ledger = (tmp_path / "reports" / PIN / "ledger.md").read_text()
    assert "**Pin-bump gate against `v0.33.0`: FAILED**" in ledger
    text = json.dumps(rows)
    expected = {
        "device check relaxed": "DeepGemmMegaMoEExperts",
        "support check failing quietly": "TrtLlmMxfp4ExpertsModular",
        # the activation lane serves SITU either way (on the fallback kernel): the rejected candidate names it
        "activation check rejecting SiTU": "kernel does not support MoEActivation.SITU activation",
        "dispatch bound moved": "sequential (no auxiliary stream at this token count)",
        "selector support narrowed": "fused_recurrent_kda_packed_decode",
    }[name]
    assert expected in text, (name, rows)
    # the row is of its kind, the terminal groups it under that kind with a count, the PR summary says the gate fails
    from audit.report.changes import KINDS

    klass = CLASSES[name]
    assert any(c["class"] == klass for c in rows), (name, [(c["class"], c["title"]) for c in rows])
    assert f"  {KINDS[klass].word} (" in r.stderr, r.stderr[-3000:]
    assert "**The pin-bump gate fails**" in diff["summary"], diff["summary"]


def test_an_availability_answer_that_decides_nothing_is_information(shipped, vllm_env, tmp_path_factory, tmp_path):
    """vLLM now says tilelang is unavailable; neither audited cell selects anything by it (K3 has no layer that asks):
    the diff shows the answer as information with its reason, and the gate passes."""
    run = _run(vllm_env, tmp_path_factory, "availability-only", AVAILABILITY_ONLY)
    r, diff = _gate(shipped, run, tmp_path / "reports")
    rows = [c for c in diff["changes"] if c["field"] == "vLLM availability: tilelang"]
    assert rows and all(not c["serving"] and c["class"] == "information" for c in rows), diff["changes"]
    assert rows[0]["before"] == "True" and rows[0]["after"] == "False"
    assert "changed no selection" in rows[0]["information"]
    assert r.returncode == ExitCode.OK, r.stderr[-3000:]
    assert diff["serving_changes"] == 0 and "**No serving change**" in diff["summary"]
