"""Evidence files that describe themselves: written by the real recorder (probes.core.recorder), read back by
the host (audit.evidence.files), and every way a file can be cut short or changed is told from a whole one."""
import json

from audit.evidence import files as evidence
from audit.report import routing
from audit.models.kimi_k3 import KIMI_K3
from probes.core.recorder import Recorder


def _write(tmp_path, final=True, cell=("b200_sxm", "tp8")):
    rec = Recorder(str(tmp_path), role="resolve-agent", meta={"mode": "resolve", "pin": "v0.33.0",
                                                             "wheel_sha256": "a" * 64})
    rec.update_header(cell={"system": cell[0], "layout": cell[1]})
    for stage in routing.STAGE_ORDER:
        if stage != "construct-draft":
            rec.emit("stage", stage=stage, ok=True, seconds=0.1)
    rec.emit("postload-step", step="quant_method", outcome="ok", layer=1)
    return rec.flush(final=final)


def test_a_whole_file_reads_back_whole(tmp_path):
    f = evidence.read_file(_write(tmp_path))
    assert f.damage == "" and f.final and f.cell == ("b200_sxm", "tp8")
    assert f.header["pin"] == "v0.33.0" and f.header["wheel_sha256"] == "a" * 64
    assert not any(r["kind"] == "end" for r in f.records) and f.of_kind("postload-step")
    # of_kind answers from an index built once; it is the file's records in order, and follows a changed list
    assert f.of_kind("stage") == [r for r in f.records if r["kind"] == "stage"] and f.of_kind("nothing") == []
    f.records.append({"kind": "postload-step", "step": "later"})
    assert f.of_kind("postload-step")[-1]["step"] == "later"
    f.records = [{"kind": "stage", "stage": "config"}]
    assert f.of_kind("postload-step") == [] and len(f.of_kind("stage")) == 1


def test_every_cut_or_change_is_damage(tmp_path):
    path = _write(tmp_path)
    lines = open(path).read().splitlines()
    cases = {
        "cut short": lines[:-1],
        "cut short:": lines[:-3],  # at a record boundary: every line still parses
        "records were added or removed": [l for l in lines if '"postload-step"' not in l],
        "the file was changed": [l.replace('"ok": true', '"ok": false') for l in lines],
    }
    for expected, text in cases.items():
        with open(path, "w") as fh:
            fh.write("\n".join(text) + "\n")
        assert expected in evidence.read_file(path).damage, expected


def test_damaged_or_unfinished_evidence_makes_the_cell_incomplete(tmp_path):
    for final, lines_kept in ((False, None), (True, -2)):
        d = tmp_path / f"case-{final}"
        d.mkdir()
        path = _write(d, final=final)
        if lines_kept:
            text = open(path).read().splitlines()[:lines_kept]
            open(path, "w").write("\n".join(text) + "\n")
        r = routing.build_routing(evidence.read_dir(d), KIMI_K3, pin={}, expected=[("b200_sxm", "tp8")])
        (cell,) = r["cells"]
        assert cell["status"] == "INCOMPLETE" and cell["failure"]["message"].startswith("evidence damaged: ")
        assert ("ended before its last write" if not final else "cut short") in cell["failure"]["message"]
