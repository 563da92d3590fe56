"""Evidence files that describe themselves: written by the real recorder (probes.core.recorder), read back by
the host (audit.evidence.files), and every way a file can be cut short or changed is told from a whole one."""
import json

from audit.evidence import files as evidence
from audit.report import routing
from audit.models.kimi_k3 import KIMI_K3
from probes.core.recorder import Recorder


def _write(tmp_path, final=True, cell=("b200_sxm", "tp8")):
    rec = Recorder(str(tmp_path), role="resolve-agent", meta={"mode": "resolve", "pin": "v0.33.0",
                                                             "wheel_sha256": "a" * 64, "model": "kimi-k3",
                                                             "argv": ["vllm", "serve", "<model-dir>"]})
    rec.update_header(cell={"system": cell[0], "layout": cell[1]})
    for stage in routing.STAGE_ORDER:
        if stage != "construct-draft":
            rec.emit("stage", stage=stage, ok=True, seconds=0.1)
    rec.emit("postload-step", step="quant_method", fn="vllm.x:M.process_weights_after_loading", outcome="ok", layer=1)
    rec.emit("fence", on=True, pieces={}, calls={}, planted=[], survey=False)  # what a cell's process ends with
    return rec.flush(final=final)


def test_a_whole_file_reads_back_whole(tmp_path):
    f = evidence.read_file(_write(tmp_path))
    assert f.damage == "" and f.final and f.cell == ("b200_sxm", "tp8")
    assert f.header["pin"] == "v0.33.0" and f.header["wheel_sha256"] == "a" * 64
    assert not any(r["kind"] == "end" for r in f.records) and f.of_kind("postload-step")
    # of_kind answers from an index built once; it is the file's records in order, and follows a changed list
    assert f.of_kind("stage") == [r for r in f.records if r["kind"] == "stage"] and f.of_kind("nothing") == []
    f.records.append({"kind": "postload-step", "step": "later"})  # (the index follows the list; not read from disk)
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


# --- a file edited and resealed: the seal is a plain digest, so what protects the judgment is what the file says ---
def _reseal(path, lines):
    """*lines* (header first, no closing record) written with a closing record recomputed over them, as whoever
    edits a file can."""
    from probes.core.recorder import closing

    open(path, "w").write("\n".join([*lines, json.dumps(closing(lines, True))]) + "\n")


def test_a_resealed_file_is_refused_where_it_says_something_else_than_the_probes_wrote(tmp_path):
    import pytest

    from audit.errors import EvidenceError

    path = _write(tmp_path)
    lines = open(path).read().splitlines()[:-1]  # without the closing record
    header, body = json.loads(lines[0]), lines[1:]

    def edited(header=header, body=body):
        return [json.dumps(header), *body]

    cases = {
        "the header has no 'model'": edited({k: v for k, v in header.items() if k != "model"}),
        "the header names role 'second-story'": edited({**header, "role": "second-story"}),
        "the header has no 'argv'": edited({k: v for k, v in header.items() if k != "argv"}),
        "a 'postload-step' record has no 'outcome'": edited(body=[
            json.dumps({k: v for k, v in json.loads(line).items() if k != "outcome"}) if '"postload-step"' in line
            else line for line in body]),
        "'ok' is str, the schema declares bool": edited(body=[line.replace('"ok": true', '"ok": "yes"', 1)
                                                               for line in body]),
        "a record of kind 'verdict'": edited(body=[*body[:-1], json.dumps({"kind": "verdict", "seq": len(body)}),
                                                    body[-1]]),
        "records are missing, added or out of order": edited(body=[line for line in body
                                                                    if '"postload-step"' not in line]),
        "records were cut from its end and the file resealed": edited(body=body[:-1]),
    }
    for expected, text in cases.items():
        _reseal(path, text)
        with pytest.raises(EvidenceError) as err:
            evidence.read_file(path)
        assert expected in str(err.value) and err.value.line, (expected, str(err.value))
    _reseal(path, edited())
    assert evidence.read_file(path).damage == ""  # the resealed original reads whole: the checks are of content


def test_records_of_another_cell_or_a_planted_probes_off_record_are_refused(tmp_path):
    import pytest

    from audit.core import _check_records_against_header
    from audit.errors import EvidenceError

    f = evidence.read_file(_write(tmp_path))
    header_argv = f.header["argv"]
    good = {"kind": "job", "seq": 99, "argv": header_argv, "system": {"name": "b200_sxm"}, "layout": {"name": "tp8"}}
    f.records.append(good)
    _check_records_against_header(f, {})
    base = list(f.records[:-1])
    f.records = [*base, {**good, "layout": {"name": "tp16"}}]
    with pytest.raises(EvidenceError, match="a job record of b200_sxm/tp16"):
        _check_records_against_header(f, {})
    f.records = [*base, {"kind": "config", "seq": 99, "tensor_parallel_size": 16}]
    with pytest.raises(EvidenceError, match="tensor_parallel_size = 16 under a header"):
        _check_records_against_header(f, {})
    f.records = [*base, {"kind": "probes", "seq": 99, "installed": False}]
    with pytest.raises(EvidenceError, match="probes were not installed"):
        _check_records_against_header(f, {})
    _check_records_against_header(f, {"probes": False})  # a transparency baseline runs without them


def test_a_dropped_snapshot_leaves_the_file_numbered_in_order(tmp_path):
    """observe mode drops and re-emits its running snapshot at every flush: the records kept are numbered again, so a
    file the probes wrote always passes the schema's numbering check."""
    from audit.evidence import files as evidence
    from probes.core.recorder import Recorder

    rec = Recorder(str(tmp_path), role="vllm-process:test", meta={"mode": "observe", "model": "kimi-k3",
                                                                  "cell": {"system": "b200_sxm", "layout": "tp8"}})
    rec.emit("plugin", event="loaded")
    rec.emit("observe-status", targets={})
    rec.emit("workload", ok=True)
    rec.drop("observe-status")
    rec.emit("observe-status", targets={"x": "hit"})
    path = rec.flush(final=True)
    assert [r["seq"] for r in rec.records()[1:]] == [1, 2, 3]
    assert [r["kind"] for r in evidence.read_file(path).records] == ["plugin", "workload", "observe-status"]
