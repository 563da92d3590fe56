"""The evidence cache: a repeated audit with unchanged inputs reuses each cell's evidence, says so in the
ledger, and routes exactly as the run it came from; any change of input is a different key."""
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from audit.evidence import cache as evcache
from audit.errors import ExitCode
from tests.conftest import ROOT

CLI = [sys.executable, "-m", "audit.cli"]


def _audit(reports, cache, *extra):
    env = {**os.environ, "SERVING_TRUTH_EVIDENCE_CACHE": str(cache)}
    r = subprocess.run([*CLI, "audit", "v0.33.0", "--systems", "b200_sxm", "--layouts", "tp8", "--reports",
                        str(reports), *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-3000:]
    return json.loads((reports / "v0.33.0" / "routing.json").read_text()), \
        (reports / "v0.33.0" / "ledger.md").read_text(), r


@pytest.mark.vllm
def test_a_repeated_audit_reuses_the_evidence_and_routes_the_same(vllm_env, tmp_path):
    cache = tmp_path / "evcache"
    rt, _, env = vllm_env
    first, ledger1, r = _audit(tmp_path / "a", cache)
    # the run this audit made (its path on stderr; other audits may run beside it)
    new_runs = {Path(l.split("evidence: ", 1)[1]) for l in r.stderr.splitlines() if l.startswith("evidence: ")}
    assert first["run"]["cache"] == {"hits": [], "ran": 1, "discarded": [], "used": True} and "evidence cache |" not in ledger1
    assert len(list(cache.iterdir())) == 1
    # the agent's bytecode went to the environment's runtime cache, none into the environment (whose files stay
    # the wheel's RECORD) and none of the run's own probes copy stayed behind
    prefix = rt.root / "runtime-cache" / env.name / "pycache"
    site = rt.site_packages(env)
    assert list(prefix.joinpath(*site.parts[1:], "vllm").glob("__init__.cpython-*.pyc"))
    assert not list((site / "vllm").glob("__pycache__/*.pyc"))
    assert len(new_runs) == 1
    assert not [p for run in new_runs for p in prefix.joinpath(*run.parts[1:]).rglob("*.pyc")]

    second, ledger2, _ = _audit(tmp_path / "b", cache)
    hits = second["run"]["cache"]["hits"]
    assert second["run"]["cache"]["ran"] == 0 and [h[:2] for h in hits] == [["b200_sxm", "tp8"]]
    assert hits[0][2] != "?" and f"b200_sxm/tp8 from run `{hits[0][2]}`" in ledger2
    assert second["cells"] == first["cells"]  # the same evidence, the same routing, cell by cell
    assert second["verdicts"] == first["verdicts"]

    # editing the expectations changes verdicts, never the probes' evidence: still from the cache
    claims = tmp_path / "claims.toml"
    claims.write_text((ROOT / "expectations" / "kimi-k3.toml").read_text())
    (tmp_path / "kernel_source_backends.toml").write_text(
        (ROOT / "expectations" / "kernel_source_backends.toml").read_text())
    third, _, _ = _audit(tmp_path / "c", cache, "--expectations", str(claims))
    assert third["run"]["cache"]["ran"] == 0

    fourth, ledger4, _ = _audit(tmp_path / "d", cache, "--no-cache")
    # --no-cache looks nothing up, runs the cell and refreshes its entry
    assert fourth["run"]["cache"] == {"hits": [], "ran": 1, "discarded": [], "used": False}
    assert fourth["cells"] == first["cells"] and len(list(cache.iterdir())) == 1


def test_every_input_is_part_of_the_key():
    identity = {"runtime": "local", "wheel_sha256": "a" * 64, "env": {"torch": "2.14.0"}, "stub_sha256": "b" * 64}
    plan = {"probes": True, "extra_targets": [], "stop_after": "", "serve_args": ["--load-format", "dummy"],
            "slice": "", "observe_install": False, "harness_env": ["CUDA_HOME"], "redact_env": []}
    cell = {"system": {"name": "b200_sxm", "capability": [10, 0]}, "layout": {"name": "tp8", "args": ["-tp", "8"]}}
    base, _ = evcache.cell_key(identity, plan, cell, "m" * 64, "p" * 64)
    assert base == evcache.cell_key(copy.deepcopy(identity), dict(plan), copy.deepcopy(cell), "m" * 64, "p" * 64)[0]
    variants = [
        ({**identity, "wheel_sha256": "c" * 64}, plan, cell, "m" * 64, "p" * 64),
        ({**identity, "stub_sha256": "d" * 64}, plan, cell, "m" * 64, "p" * 64),
        ({**identity, "env": {"torch": "2.14.1"}}, plan, cell, "m" * 64, "p" * 64),
        (identity, {**plan, "serve_args": ["--load-format", "auto"]}, cell, "m" * 64, "p" * 64),
        (identity, {**plan, "extra_targets": [{"id": "x"}]}, cell, "m" * 64, "p" * 64),
        (identity, plan, {**cell, "layout": {"name": "tp8-mtp", "args": []}}, "m" * 64, "p" * 64),
        (identity, plan, {**cell, "system": {"name": "h100_sxm", "capability": [9, 0]}}, "m" * 64, "p" * 64),
        (identity, plan, cell, "n" * 64, "p" * 64),  # another model config
        (identity, plan, cell, "m" * 64, "q" * 64),  # other probes code
    ]
    keys = {evcache.cell_key(*v)[0] for v in variants}
    assert base not in keys and len(keys) == len(variants)
    # what only changes speed is not an input
    assert evcache.cell_key(identity, {**plan, "parallel": 8, "learned_imports": ["x"]}, cell, "m" * 64,
                            "p" * 64)[0] == base


def test_probes_digest_follows_the_probes_sources(tmp_path, monkeypatch):
    import probes

    import shutil

    before = evcache.probes_digest()
    copy_dir = tmp_path / "probes"
    shutil.copytree(Path(probes.__file__).parent, copy_dir, ignore=shutil.ignore_patterns("__pycache__"))
    from importlib import resources

    monkeypatch.setattr(resources, "files", lambda name: copy_dir)
    assert evcache.probes_digest() == before
    target = copy_dir / "core" / "targets.py"  # a module in a subpackage counts as much as any
    target.write_text(target.read_text() + "\n# changed\n")
    assert evcache.probes_digest() != before


def _cell(tmp_path, system="b200_sxm", layout="tp8", name="cell"):
    cell = tmp_path / name
    cell.mkdir()
    header = {"kind": "header", "schema": 1, "cell": {"system": system, "layout": layout}}
    (cell / "evidence-h-1-abc.jsonl").write_text(json.dumps(header) + "\n" + '{"kind": "x"}\n')
    (cell / "agent.log").write_text("log\n")
    (cell / "stray.tmp").write_text("x")
    return cell


def test_a_damaged_entry_is_a_miss_and_store_is_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVING_TRUTH_EVIDENCE_CACHE", str(tmp_path / "c"))
    cell = _cell(tmp_path)
    assert evcache.store(tmp_path, "k1", cell, run="r1", date="2026-12-02", inputs={}, info={"runtime": "x"})
    entry = evcache.lookup(tmp_path, "k1", ("b200_sxm", "tp8"))
    assert entry["run"] == "r1" and sorted(entry["files"]) == ["agent.log", "evidence-h-1-abc.jsonl"]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["k1"]
    dest = tmp_path / "restored"
    evcache.restore(tmp_path, "k1", dest, entry)
    assert sorted(p.name for p in dest.iterdir()) == ["agent.log", "evidence-h-1-abc.jsonl"]
    (tmp_path / "c" / "k1" / "entry.json").write_text("{truncated")
    assert evcache.lookup(tmp_path, "k1") is None
    assert not (tmp_path / "c" / "k1").exists()  # discarded: no manual delete needed
    assert evcache.lookup(tmp_path, "missing") is None


def _damage_cases(tmp_path):
    """Each breaks the seal of entry k1 in one way a hostile or unlucky hand would."""
    base = tmp_path / "c"
    entry = base / "k1"
    ev = entry / "evidence-h-1-abc.jsonl"

    def edit():  # swap a backend name inside the evidence
        ev.write_text(ev.read_text().replace('"x"', '"y"'))

    def truncate():
        ev.write_text(ev.read_text()[:10])

    def empty():
        ev.write_text("")

    def plant():  # an extra evidence file dropped in (it would win)
        (entry / "evidence-h-2-zzz.jsonl").write_text(ev.read_text())

    def file_link():  # a cached file replaced by a link out of the cache
        outside = tmp_path / "outside.jsonl"
        outside.write_text(ev.read_text())
        ev.unlink()
        ev.symlink_to(outside)

    def dir_link():  # the entry directory itself a link out of the cache
        elsewhere = tmp_path / "elsewhere"
        shutil.copytree(entry, elsewhere)
        shutil.rmtree(entry)
        entry.symlink_to(elsewhere)

    def fifo():  # entry.json a FIFO: reading it would hang
        (entry / "entry.json").unlink()
        os.mkfifo(entry / "entry.json")

    def foreign():  # another cell's entry under this key (two entries swapped)
        other = _cell(tmp_path, "h100_sxm", "tp8", name="other")
        shutil.rmtree(entry)
        evcache.store(tmp_path, "k1", other, run="r2", date="d", inputs={}, info={})

    def unsealed():  # an entry from before seals
        meta = json.loads((entry / "entry.json").read_text())
        meta.pop("files")
        (entry / "entry.json").write_text(json.dumps(meta))

    return {f.__name__: f for f in (edit, truncate, empty, plant, file_link, dir_link, fifo, foreign, unsealed)}


def test_every_broken_seal_is_a_miss_that_the_next_store_repairs(tmp_path, monkeypatch):
    import signal

    monkeypatch.setenv("SERVING_TRUTH_EVIDENCE_CACHE", str(tmp_path / "c"))
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("the cache check hung")))
    for name in _damage_cases(tmp_path):
        work = tmp_path / name
        work.mkdir()
        cell = _cell(work)
        monkeypatch.setenv("SERVING_TRUTH_EVIDENCE_CACHE", str(work / "c"))
        assert evcache.store(work, "k1", cell, run="good", date="d", inputs={}, info={})
        _damage_cases(work)[name]()
        signal.alarm(10)
        try:
            entry, why = evcache.check(work, "k1", ("b200_sxm", "tp8"))
        finally:
            signal.alarm(0)
        assert entry is None and why, name
        assert evcache.lookup(work, "k1", ("b200_sxm", "tp8")) is None, name
        assert not os.path.lexists(work / "c" / "k1"), name  # taken out of the cache
        # the cell runs again: its fresh evidence is stored and sound
        assert evcache.store(work, "k1", cell, run="fresh", date="d", inputs={}, info={})
        assert evcache.lookup(work, "k1", ("b200_sxm", "tp8"))["run"] == "fresh", name


def test_a_store_replaces_an_existing_entry(tmp_path, monkeypatch):
    """--no-cache refreshes: the entry a fresh run stores replaces whatever was there."""
    monkeypatch.setenv("SERVING_TRUTH_EVIDENCE_CACHE", str(tmp_path / "c"))
    cell = _cell(tmp_path)
    assert evcache.store(tmp_path, "k1", cell, run="old", date="d", inputs={}, info={})
    assert evcache.store(tmp_path, "k1", cell, run="new", date="d", inputs={}, info={})
    assert evcache.lookup(tmp_path, "k1")["run"] == "new"
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["k1"]


def test_an_entry_of_another_model_is_a_miss_and_a_faulted_cell_is_never_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVING_TRUTH_EVIDENCE_CACHE", str(tmp_path / "c"))
    cell = _cell(tmp_path)
    ev = cell / "evidence-h-1-abc.jsonl"
    header = json.loads(ev.read_text().splitlines()[0])
    ev.write_text(json.dumps({**header, "model": "gpt-oss-120b"}) + "\n" + '{"kind": "x"}\n')
    assert evcache.store(tmp_path, "k1", cell, run="r1", date="2026-12-04", inputs={}, info={})
    entry, why = evcache.check(tmp_path, "k1", ("b200_sxm", "tp8"), "kimi-k3")
    assert entry is None and "the evidence of the model 'gpt-oss-120b', not kimi-k3" in why
    assert evcache.check(tmp_path, "k1", ("b200_sxm", "tp8"), "gpt-oss-120b")[0] is not None
    # evidence recording a harness fault is never stored: a broken harness's answer is never served again
    faulted = _cell(tmp_path, name="faulted")
    with open(faulted / "evidence-h-1-abc.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": "harness_fault", "piece": "p", "type": "t", "message": "m"}) + "\n")
    assert not evcache.store(tmp_path, "k2", faulted, run="r2", date="2026-12-04", inputs={}, info={})
    assert evcache.lookup(tmp_path, "k2") is None


def test_what_the_agent_left_running_is_ended_before_its_bytecode_is_dropped(tmp_path):
    # a child the agent did not wait for (here: a shell's background sleep) would keep writing bytecode of the
    # run's probes copy after the run dropped it; the runtime ends the agent's whole process group first
    import signal
    import time

    from audit.runtimes.local import _end_group

    pidfile = tmp_path / "child.pid"
    proc = subprocess.Popen(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; exit 0"], start_new_session=True)
    proc.wait(timeout=30)
    child = int(pidfile.read_text())
    os.kill(child, 0)  # still running after the agent (the shell) exited
    _end_group(proc)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        try:  # reaped by init or a subreaper; a zombie no longer runs
            if open(f"/proc/{child}/stat").read().split(")")[-1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        raise AssertionError("the agent's leftover child is still running")


def _with_header(cell: Path, **fields) -> None:
    ev = cell / "evidence-h-1-abc.jsonl"
    lines = ev.read_text().splitlines()
    ev.write_text("\n".join([json.dumps({**json.loads(lines[0]), **fields}), *lines[1:]]) + "\n")


def test_an_entry_of_another_pin_or_wheel_is_discarded_not_refused_at_every_audit(tmp_path, monkeypatch):
    """An entry whose evidence names another pin or wheel would be refused later by the evidence identity check
    (exit 4) at every audit that found it; the cache check discards it instead, so the cell just runs again."""
    monkeypatch.setenv("SERVING_TRUTH_EVIDENCE_CACHE", str(tmp_path / "c"))
    cell = _cell(tmp_path)
    _with_header(cell, pin="v0.32.0", wheel_sha256="a" * 64, model="kimi-k3")
    assert evcache.store(tmp_path, "k1", cell, run="r1", date="d", inputs={}, info={})
    ours = {"pin": "v0.32.0", "wheel_sha256": "a" * 64}
    assert evcache.check(tmp_path, "k1", ("b200_sxm", "tp8"), "kimi-k3", expect=ours)[0] is not None
    entry, why = evcache.check(tmp_path, "k1", ("b200_sxm", "tp8"), "kimi-k3", expect={**ours, "pin": "v0.33.0"})
    assert entry is None and "says pin 'v0.32.0', this audit's is 'v0.33.0'" in why
    entry, why = evcache.check(tmp_path, "k1", ("b200_sxm", "tp8"), "kimi-k3", expect={**ours, "wheel_sha256": "b" * 64})
    assert entry is None and "says wheel_sha256" in why
    assert evcache.lookup(tmp_path, "k1", ("b200_sxm", "tp8"), "kimi-k3", expect={**ours, "pin": "v0.33.0"}) is None
    assert not os.path.lexists(tmp_path / "c" / "k1")


def test_an_entry_replaced_while_it_is_checked_is_not_judged_damaged(tmp_path, monkeypatch):
    """Two audits of the same cell: one stores (old entry renamed aside, new renamed in) while the other checks.
    The checker may read the old seal and the new files; that torn reading is taken again, and the sound new
    entry is reused, never discarded."""
    monkeypatch.setenv("SERVING_TRUTH_EVIDENCE_CACHE", str(tmp_path / "c"))
    old, new = _cell(tmp_path, name="old"), _cell(tmp_path, name="new")
    (new / "agent.log").write_text("another run's log\n")
    assert evcache.store(tmp_path, "k1", old, run="old", date="d", inputs={}, info={})
    real = evcache.sha256_file
    swapped = []

    def digest_while_another_audit_stores(path):
        if not swapped:
            swapped.append(True)
            assert evcache.store(tmp_path, "k1", new, run="new", date="d", inputs={}, info={})
        return real(path)

    monkeypatch.setattr(evcache, "sha256_file", digest_while_another_audit_stores)
    entry, why = evcache.check(tmp_path, "k1", ("b200_sxm", "tp8"))
    assert swapped and why == "" and entry["run"] == "new"
    assert evcache.lookup(tmp_path, "k1", ("b200_sxm", "tp8"))["run"] == "new"
