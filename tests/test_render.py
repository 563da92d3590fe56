"""Ledger rendering: gold files, determinism, atomic writes; routing helpers."""
import copy
import json
import os
import re

import pytest

from audit.fsutil import replace_dir
from audit.report import render
from audit.report import routing
from audit.errors import RenderError
from tests.conftest import ROOT
from tests.goldtest import compare
from audit.models.kimi_k3 import KIMI_K3

FIXTURE = ROOT / "tests" / "data" / "routing-v0.33.0.json"  # routing.json of a real v0.33.0 audit


def load():
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def ledger(r):
    return render.render_ledger(r, profile=KIMI_K3, reproduce="make audit PIN=v0.33.0")


def test_ledger_gold():
    compare("ledger-v0.33.0.md", ledger(load()))


def test_incomplete_and_drift_gold():
    r = load()
    r["cells"][0] = routing.incomplete_cell(r["cells"][0]["system"], r["cells"][0]["layout"],
                                            reason="the cell's process ended without writing evidence",
                                            log="evidence/l40s--tp8/agent.log")
    r["cells"][1]["drift"] = [{"target": "kda.prefill", "title": "KDA prefill backend", "required": True,
                               "attempts": ["vllm.models.kimi_k3.nvidia.kda:resolve_kda_prefill_backend: "
                                            "module 'vllm.models.kimi_k3.nvidia.kda' has no attribute "
                                            "'resolve_kda_prefill_backend'"]}]
    text = ledger(r)
    assert "**INCOMPLETE:** 1 cell(s) produced no evidence" in text
    # the routing names the cell's log, never its text (pids and timings differ from run to run)
    assert "Its process's output: `evidence/l40s--tp8/agent.log` under the run directory." in text
    compare("ledger-v0.33.0-incomplete-drift.md", text)


def test_every_row_names_its_evidence_level():
    text = ledger(load())
    assert "**Evidence level: resolved — on every row.**" in text
    lines = text.splitlines()
    rows, levels = 0, set()
    for i, line in enumerate(lines):
        if line == "| lane | layers | what runs | family | evidence |":
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                level = row.rsplit("|", 2)[-2].strip()
                # resolved, and how far: construction or post-load (a limit is stated, never hidden)
                assert level in ("resolved, construction", "resolved, post-load",
                                 "resolved, construction; post-load stopped at a simulation limit"), row
                levels.add(level)
                rows += 1
    assert rows > 200 and len(levels) == 3
    for line in lines:
        if "evidence: " in line and line.startswith("`vllm serve"):
            assert line.endswith("evidence: resolved"), line


def test_same_routing_same_bytes():
    r = load()
    assert ledger(r) == ledger(copy.deepcopy(r))
    assert render.routing_json(r) == render.routing_json(json.loads(render.routing_json(r)))


def test_failed_render_keeps_previous_report(tmp_path, monkeypatch):
    r = load()
    replace_dir(tmp_path, render.report_files(r, profile=KIMI_K3, reproduce="x"))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    broken = copy.deepcopy(r)
    broken["cells"][0]["lanes"] = None  # the template cannot render this
    with pytest.raises(RenderError):
        replace_dir(tmp_path, render.report_files(broken, profile=KIMI_K3, reproduce="x"))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_failed_write_keeps_previous_report(tmp_path, monkeypatch):
    r = load()
    replace_dir(tmp_path, render.report_files(r, profile=KIMI_K3, reproduce="x"))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real_fsync, calls = os.fsync, []

    def failing_fsync(fd):
        calls.append(fd)
        if len(calls) == 2:  # the second file fails after the first was staged
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_fsync)
    changed = copy.deepcopy(r)
    changed["run"]["date"] = "2099-01-01"
    with pytest.raises(OSError):
        replace_dir(tmp_path, render.report_files(changed, profile=KIMI_K3, reproduce="x"))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no temp files, nothing replaced


@pytest.mark.parametrize("layers, text", [
    ([1, 2, 3, 5, 7, 8], "1-3,5,7-8"), ([4], "4"), ([], ""), ([3, 1, 2, 2], "1-3"),
])
def test_format_ranges(layers, text):
    assert routing.format_ranges(layers) == text


def test_collapse_groups_by_value_in_layer_order():
    got = routing.collapse({0: "a", 1: "a", 2: "b", 3: "a", 5: "b"})
    assert [(g["ranges"], g["value"]) for g in got] == [("0-1,3", "a"), ("2,5", "b")]


@pytest.mark.parametrize("value, text", [
    ("Mxfp4MoeBackend.MARLIN", "MARLIN"),
    ("vllm.model_executor.layers.fused_moe.experts.marlin_moe:MarlinExperts", "MarlinExperts"),
    ("vllm.v1.attention.backends.mla.flashinfer_mla.FlashInferMLABackend", "FlashInferMLABackend"),
    ("flashkda", "flashkda"), (None, "none"), (True, "yes"), (["Enum.MEMBER", "x:Y"], "MEMBER / Y"),
])
def test_short(value, text):
    assert routing.short(value) == text


def test_a_claim_the_audit_could_not_judge_stays_in_the_verdicts_table():
    """UNVERIFIED claims (the simulation stopped, no evidence) are listed with their claim in the main table,
    with the reason; only lane paths no claim covers go into the collapsed list."""
    r = json.loads((ROOT / "tests" / "data" / "routing-v0.30.0.json").read_text(encoding="utf-8"))
    unjudged = [v for v in r["verdicts"]["rows"] if v["claim"] and v["verdict"] == "UNVERIFIED"]
    assert unjudged  # v0.30.0's DP8+EP cells stop at a simulation limit
    text = render.render_ledger(r, profile=KIMI_K3, reproduce="x")
    verdicts_section = text[text.index("## Verdicts against"):]
    main, _, rest = verdicts_section.partition("<details><summary>")
    collapsed = rest.partition("</details>")[0]
    total = r["verdicts"]["summary"]["UNVERIFIED"]
    assert f"**UNVERIFIED** {total} (counted per claim, cell and layer group" in main
    assert f"{len(unjudged)} of the UNVERIFIED are claims the audit could not judge" in main
    for v in unjudged:
        assert any(line.startswith(f"| UNVERIFIED | `{v['claim']}` | ") and f"{v['layout']}" in line
                   for line in main.splitlines()), v
    assert "| `` |" not in main  # no row without its claim in the claims table
    # a refusal no claim covers is a failing verdict: in the main table, never folded away
    assert "| REFUSED | (no claim) | Routed experts |" in main and "| REFUSED |" not in collapsed
    assert "lane path(s) no claim covers" in collapsed
    rows = [line for line in collapsed.splitlines() if line.startswith("| ") and not line.startswith("| verdict |")]
    assert rows
    for line in rows:
        assert line.startswith(("| UNVERIFIED | ", "| NOT_EXERCISED | ")) and "`kda-" not in line.split("|")[2], line


def test_ledger_lines_and_cells_fit_and_nothing_is_lost():
    """No line wider than 400 characters but a table row whose every cell is short (under 80 characters: such a
    cell is never moved to a footnote), no table cell longer than 250 (issue: a ledger a reviewer can read); a cell
    moved into a footnote keeps its full text there."""
    import json

    from audit.report.fit import _cells, fit
    from audit.report.render import render_ledger

    routing = json.loads((ROOT / "tests" / "data" / "routing-v0.33.0.json").read_text())
    text = render_ledger(routing, profile=KIMI_K3, reproduce="make audit PIN=v0.33.0")
    lines = text.splitlines()
    rows = [l for l in lines if l.startswith("|") and l.rstrip().endswith("|")]
    assert max(len(l) for l in lines if l not in rows) <= 400
    for row in rows:  # a wide row has nothing left to move: each cell is short or already a footnote's head
        assert len(row) <= 400 or all(len(c.strip()) < 80 or "[^" in c for c in _cells(row)), row
    cells = [c.strip() for l in rows for c in _cells(l)]
    assert max(map(len, cells)) <= 250
    notes = dict(re.findall(r"^\[\^(\d+)\]: (.*)$", text, re.M))
    assert notes and min(map(len, notes.values())) >= 80
    long_cell = "word " * 120 + "`code span with spaces` end"
    out = fit(f"| a | b |\n|---|---|\n| x | {long_cell.strip()} |\ntext after\n")
    row, notes = out.splitlines()[2], out.split("\n\n", 1)[1]
    assert "[^1]" in row and len(row) < 120 and notes.startswith("[^1]: word")
    definition = " ".join(l.strip() for l in notes.split("\ntext after")[0].splitlines()).removeprefix("[^1]: ")
    assert definition == long_cell.strip() and out.endswith("text after\n")
    assert fit(out) != "" and fit("| a |\n|---|\n| short |\n") == "| a |\n|---|\n| short |\n"


def test_cell_lists_collapse_to_layouts_and_whole_sms():
    from audit.report.render import collapse_cells

    K3_ORDER = list(KIMI_K3.layouts)
    audited = [f"{s}/{l}" for s in ("h100_sxm", "h200_sxm", "b200_sxm", "gb200", "l40s") for l in ("tp8", "dep8")]
    assert collapse_cells(audited, audited, K3_ORDER) == "tp8, dep8: every audited system"
    assert collapse_cells(["h100_sxm/tp8", "h200_sxm/tp8", "b200_sxm/tp8", "h100_sxm/dep8", "h200_sxm/dep8",
                           "b200_sxm/dep8"], audited, K3_ORDER) == "tp8, dep8: SM 9.0, b200_sxm"
    assert collapse_cells(["l40s/dep8", "gb200/tp8"], audited, K3_ORDER) == "tp8: gb200; dep8: l40s"
    assert collapse_cells(["—/—"], audited, K3_ORDER) == "—"


def test_the_dispatch_stand_ins_are_listed_under_what_was_simulated():
    r = json.loads((ROOT / "tests" / "data" / "routing-v0.33.0.json").read_text(encoding="utf-8"))
    text = render.render_ledger(r, profile=KIMI_K3, reproduce="x")
    simulated = text[text.index("## What was simulated"):]
    simulated = simulated[:simulated.index("Simulated device per system")]
    assert "kda_batch" in simulated and "KimiK3DeltaAttention._forward's inputs and callees" in simulated
    assert "SpecializedDecode.plan's inputs" in simulated and "gather_initial_states" in simulated


def test_tables_mark_the_batches_the_models_step_path_takes():
    """tp8-specdec: K3's specialized decode serves decode 1-64 (vLLM's graph dispatch and the path's prepared batch
    sizes decide); the stock lanes it replaces say so in the summary and per-system tables, a lane that serves no
    batch there (spec-verify without speculative decoding) does not."""
    import json

    from audit.report.render import render_ledger

    from tests.conftest import ROOT

    r = json.loads((ROOT / "tests" / "data" / "routing-v0.33.0.json").read_text(encoding="utf-8"))
    text = render_ledger(r, profile=KIMI_K3, reproduce="x")
    marked = [line for line in text.split("\n") if "K3's specialized decode serves instead" in line]
    assert any(line.startswith("| KDA decode |") and "| fused_kda_decode · at decode 1–64: K3's "
               "specialized decode serves instead |" in line for line in marked)
    assert any("FlashInferMLABackend · at decode 1–64" in line for line in marked)
    assert not any("not exercised" in line for line in marked)
    # no other layout's row is marked: the path is requested in tp8-specdec only
    tp8 = text.split("### ")[1]
    assert "serves instead" not in tp8
