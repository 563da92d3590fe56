"""SGLang, the second engine, against its real pinned wheel (issue 47): the environment built by the same builder,
the resolve agent running SGLang's own server-argument resolution and model construction, the fences on SGLang's
path, the stand-ins' fit, and the side-by-side comparison.

What a cell records is SGLang's answer: the server arguments are read back with SGLang's ``resolution_result`` and
attributed with SGLang's own declaration stash; the experts' kernel is read off the modules SGLang's loader built.
The expected values below are facts of SGLang's source for Kimi-K3 (``arg_groups/model_overrides/kimi_k3.py``:
FlashInfer MXFP4 experts and TRT-LLM MLA on SM 10.x, its own defaults elsewhere), checked against what the cells
recorded, never computed by the harness.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from audit.errors import ExitCode
from tests.conftest import ROOT

pytestmark = pytest.mark.sglang

PIN = "sglang-0.5.23"
CELLS = ("b200_sxm,h200_sxm", "tp8,dep8,tp8-dspark")


def _cli(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "audit.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=3000)


@pytest.fixture(scope="module")
def sglang_env():
    """The environment holding the pinned SGLang wheel (built once by the local runtime, cached across runs)."""
    from audit.pins import lock
    from audit.runtimes.local import LocalRuntime

    pin = lock.load(ROOT / "images.lock").get(PIN)
    rt = LocalRuntime()
    return rt, pin, rt.ensure_env(pin, lambda *a, **k: None)


@pytest.fixture(scope="module")
def audited(sglang_env, tmp_path_factory):
    reports = tmp_path_factory.mktemp("sglang-reports")
    res = _cli("audit", PIN, "--systems", CELLS[0], "--layouts", CELLS[1], "--reports", str(reports), "--no-cache")
    assert res.returncode in (ExitCode.OK, ExitCode.FINDINGS), res.stderr[-3000:]
    routing = json.loads((reports / "sglang" / PIN / "routing.json").read_text(encoding="utf-8"))
    run = next(line.split(": ", 1)[1] for line in res.stderr.splitlines() if line.startswith("evidence: "))
    return reports, routing, run


def _cell(routing: dict, system: str, layout: str) -> dict:
    return next(c for c in routing["cells"] if (c["system"], c["layout"]) == (system, layout))


def _value(cell: dict, lane: str) -> str:
    groups = cell["lanes"][lane]
    assert len(groups) == 1, groups
    return groups[0]["value"]["kernel"]


def test_the_environment_holds_the_pinned_wheel_and_its_declared_resolution(sglang_env):
    rt, pin, env = sglang_env
    info = json.loads((env / ".serving-truth-env.json").read_text())
    assert info["engine"] == pin.version == "0.5.23" and info["python"].startswith("3.11") and info["cuda"]
    assert env.name.startswith("sglang-0.5.23-cp311-")
    assert rt.verified[str(env)]["files"] > 1000  # every file the wheel installs matched its RECORD


def test_a_cell_records_sglangs_own_decisions_with_who_declared_them(audited):
    reports, routing, run = audited
    assert routing["pin"]["engine"] == "sglang" and routing["pin"]["sglang_version"] == "0.5.23"
    b200, h200 = _cell(routing, "b200_sxm", "tp8"), _cell(routing, "h200_sxm", "tp8")
    assert b200["status"] == h200["status"] == "COMPLETE" and b200["evidence"] == "resolved"
    # K3's own override on SM 10.x: FlashInfer MXFP4 experts (trtllm-gen entry), TRT-LLM MLA
    assert _value(b200, "moe").startswith("trtllm_sm100") and _value(b200, "mla.decode") == "trtllm_mla"
    # elsewhere SGLang's defaults: the MoE runner it built for `auto` is Triton, MLA on Hopper is FA3
    assert _value(h200, "moe") == "TRITON" and _value(h200, "mla.decode") == "fa3"
    assert b200["layer_kinds"]["moe"] == list(range(1, 93)) and len(b200["layer_kinds"]["kda"]) == 69
    # the stash says who decided: the K3 provider SGLang registers for its architecture
    evidence = next((Path(run) / "evidence" / "b200_sxm--tp8").glob("evidence-*.jsonl"))
    records = [json.loads(line) for line in evidence.read_text().splitlines()]
    runner = next(r for r in records if r.get("target") == "server_args.moe_runner_backend")
    assert runner["result"] == "flashinfer_mxfp4" and runner["raw"] == "auto"
    assert runner["declared"][-1] == ["_kimi_k3_moe_runner_overrides", "flashinfer_mxfp4"]


def test_megamoe_is_the_moe_blocks_own_decision_and_judged(audited):
    reports, routing, _ = audited
    dep8 = _cell(routing, "b200_sxm", "dep8")
    assert _value(dep8, "moe") == "KimiK3MoE._forward_mega_experts"
    rows = {(r["claim"], r["system"], r["layout"]): r for r in routing["verdicts"]["rows"]}
    assert rows[("sglang-moe-megamoe", "b200_sxm", "dep8")]["verdict"] == "MATCH"
    assert rows[("sglang-moe-w4a8-trtllm-gen", "b200_sxm", "tp8")]["verdict"] == "MATCH"
    ledger = (reports / "sglang" / PIN / "ledger.md").read_text(encoding="utf-8")
    assert "SGLang 0.5.23's own selection code ran" in ledger and "vLLM" not in ledger
    assert (reports / "sglang" / PIN / "labels.json").is_file()


def test_a_speculative_draft_is_built_and_served_by_sglangs_draft_runner_answer(audited):
    """The DSpark draft is built on meta by SGLang's loader from the draft's model config (its own stage), and its
    attention backend is what SGLang's draft runner resolution gives it: on SM 10.x K3's own override names the draft's
    backend (trtllm_mha, one backend for every draft phase); on Hopper none is named, so the draft worker takes the
    process's prefill backend (FA3)."""
    _, routing, _ = audited
    b200, h200 = _cell(routing, "b200_sxm", "tp8-dspark"), _cell(routing, "h200_sxm", "tp8-dspark")
    for cell in (b200, h200):
        assert cell["status"] == "COMPLETE" and ("construct-draft", True) in [(s["stage"], s["ok"]) for s in cell["stages"]]
        assert cell["draft"]["cls"] == "sglang.srt.models.dspark:DSparkDraftModel"
        assert cell["draft"]["layers"] == [0, 1] and cell["draft"]["layer_kinds"]["attention"] == [0, 1]
    attn = lambda cell: cell["draft"]["lanes"]["attention"][0]["value"]["kernel"]  # noqa: E731
    assert attn(b200) == "trtllm_mha / trtllm_mha" and attn(h200) == "fa3 / fa3"
    assert _cell(routing, "b200_sxm", "tp8")["draft"] is None  # no draft where the layout has none


@pytest.mark.parametrize("piece", ["sglang draft ModelRunner (attention backend)",
                                   "wrong value: sglang draft ModelRunner (attention backend)"])
def test_a_fault_planted_in_the_draft_stand_in_exits_4(sglang_env, tmp_path, piece):
    res = _cli("audit", PIN, "--systems", "b200_sxm", "--layouts", "tp8-dspark", "--reports", str(tmp_path),
               "--no-cache", "--expectations", "none", "--plant-fault", piece)
    assert res.returncode == ExitCode.RUN_FAILED, res.stderr[-2000:]
    assert "sglang draft ModelRunner (attention backend)" in res.stderr
    assert not (tmp_path / "sglang" / PIN / "routing.json").exists()


@pytest.mark.parametrize("piece", ["torch.cuda.mem_get_info", "wrong value: torch.cuda.mem_get_info",
                                   "sglang GroupCoordinator"])
def test_a_fault_planted_in_the_sglang_path_exits_4_and_writes_no_routing(sglang_env, tmp_path, piece):
    """A raise (or a wrong value) of the harness's own code inside SGLang's process is a harness fault: exit 4,
    the piece named, no report written; never SGLang's decision (SGLang's memory probe falls back on an
    exception, so a fault there would otherwise read as a memory size SGLang chose)."""
    res = _cli("audit", PIN, "--systems", "b200_sxm", "--layouts", "tp8", "--reports", str(tmp_path),
               "--no-cache", "--expectations", "none", "--plant-fault", piece)
    assert res.returncode == ExitCode.RUN_FAILED, res.stderr[-2000:]
    assert piece.removeprefix("wrong value: ") in res.stderr
    assert not (tmp_path / "sglang" / PIN / "routing.json").exists()


def test_every_stand_in_fits_the_pinned_release(audited):
    _, routing, _ = audited
    fit = routing["standin_fit"]
    assert {"sglang GroupCoordinator", "sglang parallel runtime", "torch.cuda.mem_get_info"} <= set(fit)
    assert all(v.startswith("fits") for v in fit.values()), fit


def test_the_comparison_puts_both_engines_side_by_side(audited, tmp_path):
    reports, _, _ = audited
    shutil.copytree(ROOT / "reports" / "v0.33.0", tmp_path / "v0.33.0")
    shutil.copytree(reports / "sglang", tmp_path / "sglang")
    res = _cli("compare", "v0.33.0", PIN, "--reports", str(tmp_path))
    assert res.returncode == ExitCode.OK, res.stderr
    md = (tmp_path / "compare" / f"v0.33.0..{PIN}.md").read_text(encoding="utf-8")
    assert "## b200_sxm (SM 10.0) · tp8" in md and "| vLLM 0.33.0 | evidence | SGLang 0.5.23 | evidence |" in md
    data = json.loads((tmp_path / "compare" / f"v0.33.0..{PIN}.json").read_text(encoding="utf-8"))
    row = next(r for t in data["tables"] if (t["system"], t["layout"]) == ("b200_sxm", "tp8") for r in t["rows"]
               if r["lane"] == "mla.decode")
    assert row["right"] == "trtllm_mla" and row["right_evidence"].startswith("resolved")
    # the DSpark drafts side by side: each engine's draft lanes, marked as the draft's
    drafts = {r["lane"]: r for t in data["tables"] if (t["system"], t["layout"]) == ("b200_sxm", "tp8-dspark")
              for r in t["rows"] if r.get("draft")}
    assert drafts["attention"]["right"] == "trtllm_mha / trtllm_mha" and drafts["attention"]["title"].endswith("(draft)")
    assert "| Draft attention" in md
    again = _cli("compare", "v0.33.0", PIN, "--reports", str(tmp_path))
    assert again.returncode == 0 and (tmp_path / "compare" / f"v0.33.0..{PIN}.md").read_text(encoding="utf-8") == md


def test_verify_pins_covers_an_sglang_pin(sglang_env):
    """One cell per SM family with the fences on, every stand-in's fit, SGLang's availability answer against a plain
    import: the harness fits the pinned SGLang release."""
    res = _cli("verify-pins", "--pins", PIN)
    assert res.returncode == ExitCode.OK, res.stdout[-3000:] + res.stderr[-2000:]
    assert f"{PIN}: ok (" in res.stdout and "all 1 pin(s) passed" in res.stderr
