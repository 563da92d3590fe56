"""Fault injection: the gate never passes on a fault, never damages a report, never leaves processes.

Each test provokes one fault the way an unlucky or hostile user would (SIGKILL of each process kind,
a full disk, a read-only or immutable report, concurrent audits, a damaged run directory, hostile
input files) and asserts the exit code, the message, the report's bytes and what is left running.
The tests that need a run use one real audit of the pinned vLLM (b200_sxm x tp8, dep8), made once.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from audit.errors import ExitCode
from tests.conftest import ROOT

CLI = [sys.executable, "-m", "audit.cli"]
CELLS = ["--systems", "b200_sxm", "--layouts", "tp8,dep8"]
#: the tests that kill a process of a running audit pass --no-cache: cached cells start no process


def cli(*args, cwd=ROOT, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, **kw)


def snapshot(directory: Path) -> dict:
    """Every file under *directory* (hidden ones included) with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def pids_writing(path: Path) -> list[int]:
    """Processes that hold *path* open (a cell's process has its agent.log as stdout)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    out.append(int(pid))
                    break
        except OSError:
            continue
    return out


def agents_of(run_dir: Path | None = None) -> list[int]:
    """Processes of a probe agent (the agent, its SM processes and cells share its command line)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"probes.resolve.agent" in argv and (run_dir is None or any(str(run_dir).encode() in a for a in argv)):
            out.append(int(pid))
    return out


def wait_for(predicate, timeout: float, step: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


def newest_run(cache: Path, before: set, pid: int) -> Path | None:
    """The run directory the audit process *pid* made (its name ends in the harness's pid: another audit running
    beside this test's, from another test process, makes its own)."""
    runs = [p for p in (cache / "runs").glob(f"v0.33.0-*-{pid}") if p not in before]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


@pytest.fixture(scope="module")
def cache_root():
    from audit.fsutil import cache_root as root

    return root()


@pytest.fixture(scope="module")
def audited(vllm_env, tmp_path_factory):
    """One complete audit of two cells: its run directory and its report (the 'previous ledger')."""
    reports = tmp_path_factory.mktemp("faults") / "reports"
    r = cli("audit", "v0.33.0", *CELLS, "--reports", str(reports), timeout=1800)
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-3000:]
    run_dir = Path([l.split("evidence: ", 1)[1] for l in r.stderr.splitlines() if l.startswith("evidence: ")][0])
    kept = reports.parent / "run"  # a copy: later audits prune old run directories from the cache
    shutil.copytree(run_dir, kept, ignore=shutil.ignore_patterns("tmp", "vllm-cache"))
    return {"run_dir": kept, "original_run_dir": run_dir, "reports": reports, "code": r.returncode,
            "stderr": r.stderr}


@pytest.fixture
def report_copy(audited, tmp_path):
    reports = tmp_path / "reports"
    shutil.copytree(audited["reports"], reports)
    return reports


@pytest.fixture
def run_copy(audited, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(audited["run_dir"], run, ignore=shutil.ignore_patterns("tmp", "vllm-cache"))
    return run


# --- SIGKILL of each process kind ------------------------------------------------------------------
def _incomplete_routing(err: str) -> tuple[Path, bytes]:
    """The INCOMPLETE ledger a failed audit names on stderr, and the bytes of the routing.json beside it."""
    ledger = Path([l.split(": ", 1)[1] for l in err.splitlines()
                   if l.startswith("an INCOMPLETE ledger of what was observed: ")][0])
    return ledger, (ledger.parent / "routing.json").read_bytes()


def _kill_in_a_cell(argv: list[str], cache_root: Path, victims_of) -> tuple[subprocess.CompletedProcess, Path]:
    """Start an audit (no cache: cached cells start no process), wait for b200_sxm/tp8's cell process to write its
    log, SIGKILL what *victims_of* picks from its pids, and let the audit end: its result and run directory."""
    before_runs = set((cache_root / "runs").glob("*"))
    proc = subprocess.Popen([*CLI, "audit", "v0.33.0", *argv, "--no-cache"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        run = wait_for(lambda: newest_run(cache_root, before_runs, proc.pid), 120)
        assert run is not None, "the audit never created its run directory"
        log = run / "evidence" / "b200_sxm--tp8" / "agent.log"
        cells = wait_for(lambda: log.exists() and pids_writing(log), 300)
        assert cells, "the b200_sxm/tp8 cell never started"
        for pid in victims_of(cells):
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), run


@pytest.mark.vllm
def test_a_killed_cell_makes_the_run_incomplete_and_render_refuses_it(audited, report_copy, cache_root):
    """Killed twice, in two runs: both INCOMPLETE routings are the same bytes (the routing names the dead cell's log
    in the run directory; its text, with pids and timings, stays out)."""
    before = snapshot(report_copy)
    routings = []
    for _ in range(2):
        r, run = _kill_in_a_cell([*CELLS, "--reports", str(report_copy)], cache_root, lambda pids: pids)
        assert r.returncode == ExitCode.RUN_FAILED, r.stderr[-3000:]
        assert "1 cell(s) did not finish (b200_sxm/tp8)" in r.stderr and "reports/ was not changed" not in r.stdout
        assert snapshot(report_copy) == before, "a dead cell must never replace the report"
        ledger, routed = _incomplete_routing(r.stderr)
        text = ledger.read_text()
        assert ledger.is_relative_to(run) and "INCOMPLETE RUN (cells-missing)" in text
        assert "Its process's output: `evidence/b200_sxm--tp8/agent.log` under the run directory." in text
        assert (run / "evidence" / "b200_sxm--tp8" / "agent.log").is_file()
        routings.append(routed)
    assert routings[0] == routings[1], "two runs killed the same way rendered different routing.json"

    # rendering that run again refuses to touch reports/ too (it was a pass before)
    again = cli("render", str(run), "--reports", str(report_copy))
    assert again.returncode == ExitCode.RUN_FAILED, again.stderr[-2000:]
    assert snapshot(report_copy) == before
    assert agents_of(run) == []


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.vllm
def test_a_killed_sm_process_is_named_as_the_cause(audited, tmp_path, cache_root):
    """The SM process above b200_sxm/tp8's cell killed, in two runs: the cause is named and both INCOMPLETE
    routings are the same bytes."""
    routings = []
    for i in range(2):
        r, run = _kill_in_a_cell(["--systems", "h100_sxm,b200_sxm", "--layouts", "tp8", "--reports",
                                  str(tmp_path / f"r{i}")], cache_root, lambda cells: [_parent(cells[0])])
        assert r.returncode == ExitCode.RUN_FAILED, r.stderr[-3000:]
        assert "(b200_sxm/tp8)" in r.stderr
        ledger, routed = _incomplete_routing(r.stderr)
        assert "ended: killed by signal 9 (SIGKILL)" in ledger.read_text()
        assert wait_for(lambda: not agents_of(run), 20)
        routings.append(routed)
    assert routings[0] == routings[1], "two runs killed the same way rendered different routing.json"


@pytest.mark.vllm
def test_sigkill_of_the_harness_takes_every_agent_process_with_it(audited, tmp_path, cache_root):
    before_runs = set((cache_root / "runs").glob("*"))
    proc = subprocess.Popen([*CLI, "audit", "v0.33.0", *CELLS, "--reports", str(tmp_path / "r"), "--no-cache"],
                            cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = wait_for(lambda: newest_run(cache_root, before_runs, proc.pid), 120)
    assert run is not None
    started = wait_for(lambda: len(agents_of(run)) >= 2 and agents_of(run), 300)  # the agent and an SM process
    assert started, "the agent never forked"
    proc.kill()
    proc.wait()
    assert wait_for(lambda: not agents_of(run), 20), f"left running: {agents_of(run)}"
    assert not (tmp_path / "r").exists()


@pytest.mark.vllm
def test_sigkill_of_the_agent_ends_its_sm_processes_and_fails_the_run(audited, report_copy, cache_root):
    before_runs = set((cache_root / "runs").glob("*"))
    before = snapshot(report_copy)
    proc = subprocess.Popen([*CLI, "audit", "v0.33.0", *CELLS, "--reports", str(report_copy), "--no-cache"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = wait_for(lambda: newest_run(cache_root, before_runs, proc.pid), 120)
    assert run is not None
    pids = wait_for(lambda: len(agents_of(run)) >= 2 and agents_of(run), 300)
    assert pids, "the agent never forked"
    os.kill(min(pids), signal.SIGKILL)  # the agent is the oldest of them
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.RUN_FAILED, err[-2000:]
    assert wait_for(lambda: not agents_of(run), 20), f"left running: {agents_of(run)}"
    assert snapshot(report_copy) == before


# --- the report: disk full, read-only, immutable, concurrent ---------------------------------------
@pytest.fixture
def tiny_fs(tmp_path):
    """A small tmpfs of our own (root only): a disk that can fill up or be made read-only."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("needs root to mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)])


@pytest.mark.vllm
def test_read_only_reports_dir_exits_5_names_the_evidence_and_keeps_the_report(run_copy, tiny_fs):
    (tiny_fs / "v0.33.0").mkdir()
    (tiny_fs / "v0.33.0" / "ledger.md").write_text("previous ledger\n")
    before = snapshot(tiny_fs)
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    r = cli("render", str(run_copy), "--reports", str(tiny_fs))
    assert r.returncode == ExitCode.REPORT_WRITE, r.stderr[-2000:]
    assert "Read-only file system" in r.stderr and str(run_copy) in r.stderr
    assert snapshot(tiny_fs) == before


@pytest.mark.vllm
def test_a_full_disk_exits_5_and_leaves_nothing_half_written(run_copy, tiny_fs):
    (tiny_fs / "v0.33.0").mkdir()
    (tiny_fs / "v0.33.0" / "ledger.md").write_text("previous ledger\n")
    before = snapshot(tiny_fs)
    r = cli("render", str(run_copy), "--reports", str(tiny_fs))
    assert r.returncode == ExitCode.REPORT_WRITE, r.stderr[-2000:]
    assert "No space left on device" in r.stderr and str(run_copy) in r.stderr
    assert {k: v for k, v in snapshot(tiny_fs).items() if k != ".v0.33.0.lock"} == before
    assert sorted(p.name for p in tiny_fs.iterdir()) == [".v0.33.0.lock", "v0.33.0"]


@pytest.mark.vllm
def test_an_immutable_ledger_leaves_the_report_whole_and_no_stray_file(run_copy, report_copy):
    ledger = report_copy / "v0.33.0" / "ledger.md"
    if subprocess.run(["chattr", "+i", str(ledger)], capture_output=True).returncode:
        pytest.skip("this filesystem has no immutable flag")
    try:
        before = snapshot(report_copy)
        r = cli("render", str(run_copy), "--reports", str(report_copy))
        after = snapshot(report_copy)
        leftovers = sorted(p.name for p in report_copy.iterdir() if p.name.startswith(".v0.33.0.")
                           and not p.name.endswith(".lock"))
    finally:
        subprocess.run(["chattr", "-i", str(ledger)])
    assert r.returncode == ExitCode.REPORT_WRITE, r.stderr[-2000:]
    assert "immutable" in r.stderr
    assert after == before and leftovers == []


@pytest.mark.vllm
def test_concurrent_renders_of_one_pin_never_mix_their_files(run_copy, tmp_path):
    reports = tmp_path / "reports"
    procs = [subprocess.Popen([*CLI, "render", str(run_copy), "--reports", str(reports)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    codes = [p.wait(timeout=600) for p in procs]
    assert set(codes) <= {ExitCode.OK, ExitCode.FINDINGS} and len(set(codes)) == 1, [p.stderr.read() for p in procs]
    assert sorted(p.name for p in reports.iterdir()) == [".v0.33.0.lock", "v0.33.0"]
    assert sorted(p.name for p in (reports / "v0.33.0").iterdir()) == ["labels.json", "ledger.md", "routing.json"]
    alone = tmp_path / "alone"
    assert cli("render", str(run_copy), "--reports", str(alone)).returncode == codes[0]
    assert snapshot(alone / "v0.33.0") == snapshot(reports / "v0.33.0")


# --- a damaged run directory ------------------------------------------------------------------------
@pytest.mark.vllm
def test_damaged_run_directories_fail_with_their_own_code_and_a_cause(run_copy, report_copy, tmp_path):
    before = snapshot(report_copy)
    good = (run_copy / "run.json").read_text()
    (run_copy / "run.json").write_text(good[: len(good) // 2])
    r = cli("render", str(run_copy), "--reports", str(report_copy))
    assert r.returncode == ExitCode.RUN_FAILED and "run.json: unreadable run record" in r.stderr, r.stderr
    (run_copy / "run.json").write_text(json.dumps([1, 2]))
    r = cli("render", str(run_copy), "--reports", str(report_copy))
    assert r.returncode == ExitCode.RUN_FAILED and "not a run record written by this harness" in r.stderr
    (run_copy / "run.json").write_text(good)

    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    r = cli("render", str(a_file), "--reports", str(report_copy))
    assert r.returncode == ExitCode.USAGE and "is a file, not a run directory" in r.stderr

    # evidence cut at a record boundary: the file parses, the cell is incomplete; never a template error
    ev = sorted((run_copy / "evidence" / "b200_sxm--tp8").glob("evidence-*.jsonl"))[0]
    ev.write_text("\n".join(ev.read_text().splitlines()[:3]) + "\n")
    r = cli("render", str(run_copy), "--reports", str(report_copy))
    assert r.returncode in (ExitCode.FINDINGS, ExitCode.OK, ExitCode.RUN_FAILED), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr
    ev.write_text("{not json\n")
    r = cli("render", str(run_copy), "--reports", str(report_copy))
    assert r.returncode == ExitCode.RUN_FAILED and f"{ev}:1: malformed JSON" in r.stderr
    assert snapshot(report_copy) == before


@pytest.mark.vllm
def test_evidence_holds_no_machine_path(audited):
    from audit.fsutil import cache_root

    text = (audited["reports"] / "v0.33.0" / "routing.json").read_text()
    assert str(cache_root()) not in text and str(audited["original_run_dir"]) not in text
    assert "/site-packages/" not in text.replace("<env>/site-packages/", "")


@pytest.mark.vllm
def test_a_subset_audit_writes_beside_a_fuller_report_unless_asked(run_copy, tmp_path):
    reports = tmp_path / "reports"
    (reports / "v0.33.0").mkdir(parents=True)
    full = json.loads((ROOT / "reports" / "v0.33.0" / "routing.json").read_text())
    (reports / "v0.33.0" / "routing.json").write_text(json.dumps(full))
    (reports / "v0.33.0" / "ledger.md").write_text("the full ledger\n")
    before = snapshot(reports)
    r = cli("render", str(run_copy), "--reports", str(reports))
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-2000:]
    assert f"holds a fuller audit ({len(full['cells'])} cells)" in r.stderr
    assert snapshot(reports) == {**before, **{k: v for k, v in snapshot(reports).items() if k.startswith(".")}}
    assert Path(r.stdout.strip()).is_relative_to(run_copy)
    r = cli("render", str(run_copy), "--reports", str(reports), "--replace")
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS)
    assert (reports / "v0.33.0" / "ledger.md").read_text() != "the full ledger\n"


# --- hostile or careless input (no vLLM needed) -----------------------------------------------------
@pytest.mark.parametrize("args, fragment", [
    (["audit", "v0.33.0", "--systems", ""], "unknown system ''"),
    (["audit", "v0.33.0", "--layouts", ","], "unknown layout"),
    (["audit", "v0.33.0", "--timeout", "0"], "must be a positive, finite number of seconds"),
    (["audit", "v0.33.0", "--timeout", "nan"], "must be a positive, finite number of seconds"),
    (["audit", "v0.33.0", "--timeout", "-5"], "must be a positive, finite number of seconds"),
    (["diff", "v0.33.0", "../../etc"], "cannot name a report directory"),
    (["diff", "diffs", "v0.33.0"], "cannot name a report directory"),
])
def test_bad_selections_and_names_exit_2(args, fragment):
    r = cli(*args)
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert fragment in r.stderr


def test_a_routing_json_that_is_a_list_is_bad_input(tmp_path):
    for pin in ("a1", "b1"):
        (tmp_path / pin).mkdir()
        (tmp_path / pin / "routing.json").write_text("[]")
    r = cli("diff", "a1", "b1", "--reports", str(tmp_path))
    assert r.returncode == ExitCode.USAGE and "is not a routing.json written by this harness" in r.stderr


CLAIMS = """schema = 1
model = "kimi-k3"
framework = "vllm"
architecture = "KimiK3ForConditionalGeneration"

[[claim]]
id = "c1"
lane = "w4a16_mxfp4"
{field}
"""


@pytest.mark.parametrize("field, fragment, line", [
    ('backend = "marlin"\nlayouts = "tp8"', "layouts must be a list of strings", 10),
    ('backend = "marlin"\nlayouts = []', "layouts is empty, so the claim would judge nothing", 10),
    ('backend = "marlin"\nsystems = [8]', "systems must be a list of strings", 10),
    ("backend = 3", "backend must be a string", 9),
    ('claim = "x"', "'claim' must be an array of tables", 0),
])
def test_expectations_of_the_wrong_type_exit_2_with_file_and_line(tmp_path, field, fragment, line):
    from audit.report.expectations import ExpectationsError, load

    path = tmp_path / "claims.toml"
    text = CLAIMS.format(field=field)
    if field.startswith("claim ="):
        text = text.split("[[claim]]")[0] + field + "\n"
    path.write_text(text)
    with pytest.raises(ExpectationsError) as e:
        load(path)
    assert fragment in str(e.value), str(e.value)
    assert str(e.value).startswith(f"{path}:{line}:" if line else f"{path}")
    r = cli("audit", "v0.33.0", "--expectations", str(path), "--reports", str(tmp_path / "r"))
    assert r.returncode == ExitCode.USAGE and fragment in r.stderr  # before any work starts


def test_expectations_about_another_model_are_refused(tmp_path):
    from audit.core import load_expectations
    from audit.report.expectations import ExpectationsError
    from audit.models.kimi_k3 import KIMI_K3

    text = (ROOT / "expectations" / "kimi-k3.toml").read_text().replace('model = "kimi-k3"', 'model = "other"', 1)
    path = tmp_path / "claims.toml"
    path.write_text(text)
    (tmp_path / "kernel_source_backends.toml").write_text(
        (ROOT / "expectations" / "kernel_source_backends.toml").read_text())
    # a model the harness has no profile for: refused where the file says so, naming the known models
    with pytest.raises(ExpectationsError, match="claims are about model 'other', which this harness has no profile "
                                                "for") as e:
        load_expectations(str(path), lock_path=ROOT / "images.lock", profile=KIMI_K3)
    assert e.value.line == 5 and "known models: kimi-k3" in str(e.value)


def test_a_lock_outside_the_project_never_silently_judges_nothing(tmp_path, monkeypatch):
    from audit.core import load_expectations, reproduce_command
    from audit.errors import UsageError
    from audit.models.kimi_k3 import KIMI_K3
    from audit.systems import SYSTEMS

    from audit.models.kimi_k3 import LAYOUTS

    lock = tmp_path / "x" / "images.lock"
    lock.parent.mkdir()
    shutil.copy(ROOT / "images.lock", lock)
    monkeypatch.chdir(ROOT)  # run from the project: its claims are found
    exp, shown = load_expectations("auto", lock_path=lock, profile=KIMI_K3)
    assert exp is not None and shown == "expectations/kimi-k3.toml"
    from audit.systems import select

    cmd = reproduce_command("v0.33.0", list(SYSTEMS.values()), select("layout", None, LAYOUTS), "local", lock=str(lock), profile=KIMI_K3)
    assert cmd == f"make audit PIN=v0.33.0 LOCK={lock}"
    # the deployment options too: LAYOUTS=all, which a plain make audit leaves out
    cmd = reproduce_command("v0.33.0", list(SYSTEMS.values()), list(LAYOUTS.values()), "local", lock=str(lock), profile=KIMI_K3)
    assert cmd == f"make audit PIN=v0.33.0 LAYOUTS=all LOCK={lock}"
    monkeypatch.chdir(tmp_path)  # from elsewhere: a clear error, never "no claims, exit 0"
    with pytest.raises(UsageError, match="no claims to judge"):
        load_expectations("auto", lock_path=lock, profile=KIMI_K3)


def test_an_unexpected_exception_exits_70_with_the_traceback_in_a_file(monkeypatch, tmp_path, capsys):
    from audit import cli as cli_mod
    from audit import core

    def boom(*a, **k):
        raise RuntimeError("a bug in the harness")

    monkeypatch.setattr(core, "render_run", boom)
    monkeypatch.setenv("SERVING_TRUTH_CACHE", str(tmp_path))
    code = cli_mod.main(["render", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == ExitCode.INTERNAL == 70
    assert "internal error: RuntimeError: a bug in the harness" in err
    logs = list((tmp_path / "crash-logs").glob("crash-*.log"))
    assert len(logs) == 1 and str(logs[0]) in err.replace("\n", "")
    assert "Traceback" in logs[0].read_text() and "a bug in the harness" in logs[0].read_text()


def test_concurrent_learned_import_updates_never_collide(tmp_path):
    from audit.runtimes.base import learn_imports, learned_imports

    ev = tmp_path / "evidence" / "cell"
    ev.mkdir(parents=True)
    (ev / "imported-modules.json").write_text(json.dumps([f"m{i}" for i in range(200)]))
    errors = []

    def work():
        try:
            for _ in range(40):
                learn_imports(tmp_path / "cache", tmp_path / "evidence")
        except Exception as exc:  # noqa: BLE001 - any failure is the finding
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(learned_imports(tmp_path / "cache")) == 200
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["learned-imports.json"]


def test_silent_fallback_and_required_drift_fail_the_gate():
    from audit.cli import _findings_exit
    from audit.core import AuditOutcome

    class Quiet:
        def print(self, *a, **k):
            pass

    def outcome(verdicts, drift=()):
        return AuditOutcome(pin="p", report_dir=Path("."), ledger=None, routing_path=None, run_dir=Path("."),
                            cells=1, incomplete=0, partial=0, drift=len(drift), verdicts=verdicts,
                            required_drift=list(drift))

    assert _findings_exit(outcome({"MATCH": 3, "SILENT_FALLBACK": 1}), False, Quiet()) == ExitCode.FINDINGS
    assert _findings_exit(outcome({"MATCH": 3}), False, Quiet()) == ExitCode.OK
    assert _findings_exit(outcome({"MATCH": 3}, ["kda.prefill"]), False, Quiet()) == ExitCode.FINDINGS
    assert _findings_exit(outcome({"MATCH": 3, "UNVERIFIED": 1}), True, Quiet()) == ExitCode.FINDINGS


# --- evidence that checks itself (issue: a sealed cache, self-describing evidence) ---------------------------
def _evidence_of(run, cell="b200_sxm--tp8"):
    return sorted((run / "evidence" / cell).glob("evidence-*.jsonl"))[0]


@pytest.mark.vllm
def test_evidence_changed_or_cut_short_never_renders_as_a_complete_cell(run_copy, report_copy):
    """Emptied fields, records removed (post-load's, say), a cut at a record boundary: the closing record no
    longer fits, the cell is INCOMPLETE, render exits 4 and the report stays as it was."""
    before = snapshot(report_copy)
    ev = _evidence_of(run_copy)
    good = ev.read_text()
    lines = good.splitlines()
    edits = {
        "emptied": "\n".join(l.replace('"outcome": "ok"', '"outcome": ""') for l in lines) + "\n",
        "postload removed": "\n".join(l for l in lines if '"kind": "postload' not in l) + "\n",
        "cut at a record boundary": "\n".join(lines[:-3]) + "\n",
        "closing record alone dropped": "\n".join(lines[:-1]) + "\n",
    }
    for name, text in edits.items():
        ev.write_text(text)
        r = cli("render", str(run_copy), "--reports", str(report_copy))
        assert r.returncode == ExitCode.RUN_FAILED, (name, r.stderr[-2000:])
        assert "INCOMPLETE" in r.stderr or "incomplete" in r.stderr.lower(), (name, r.stderr[-2000:])
        ledger = next((run_copy / "incomplete-report").rglob("ledger.md"))
        assert "evidence damaged" in ledger.read_text(), name
        assert snapshot(report_copy) == before, name
    ev.write_text(good)


@pytest.mark.vllm
def test_a_run_record_that_does_not_match_its_evidence_is_refused(run_copy, report_copy):
    before = snapshot(report_copy)
    meta = json.loads((run_copy / "run.json").read_text())
    for name, edited, fragment in (
            ("no cell", {**meta, "cells": []}, "run.json names no cell"),
            ("another pin", {**meta, "pin": "v0.32.0"}, "evidence of pin 'v0.33.0' in a run of v0.32.0"),
            ("another cell", {**meta, "cells": [["h100_sxm", "tp8"], ["b200_sxm", "dep8"]]},
             "evidence of cell b200_sxm/tp8, which this run does not list")):
        (run_copy / "run.json").write_text(json.dumps(edited))
        r = cli("render", str(run_copy), "--reports", str(report_copy))
        assert r.returncode == ExitCode.RUN_FAILED and fragment in r.stderr, (name, r.stderr[-2000:])
    (run_copy / "run.json").write_text(json.dumps(meta))
    # evidence made from another wheel (its header names that wheel's sha256)
    ev = _evidence_of(run_copy)
    lines = ev.read_text().splitlines()
    header = json.loads(lines[0])
    header["wheel_sha256"] = "0" * 64
    ev.write_text("\n".join([json.dumps(header, sort_keys=True), *lines[1:]]) + "\n")
    r = cli("render", str(run_copy), "--reports", str(report_copy))
    assert r.returncode == ExitCode.RUN_FAILED and "evidence of wheel sha256 0000000000000000" in r.stderr
    assert snapshot(report_copy) == before


@pytest.mark.vllm
def test_a_poisoned_cache_entry_is_discarded_and_the_cell_runs_again(audited, tmp_path, monkeypatch):
    """Edit a cached cell's evidence (a backend name swapped) and audit again: the seal is broken, the entry is
    discarded, the cell runs, and the ledger says why; the next audit reuses the fresh, sound entry."""
    cache = tmp_path / "evidence-cache"
    env = {**os.environ, "SERVING_TRUTH_EVIDENCE_CACHE": str(cache)}
    args = ["audit", "v0.33.0", "--systems", "b200_sxm", "--layouts", "tp8", "--expectations", "none",
            "--baseline", "none"]
    r = subprocess.run([*CLI, *args, "--reports", str(tmp_path / "r1")], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=1800)
    assert r.returncode == ExitCode.OK, r.stderr[-2000:]
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    ev = next(entry.glob("evidence-*.jsonl"))
    ev.write_text(ev.read_text().replace("TrtLlmMxfp4ExpertsMonolithic", "MarlinExperts"))
    r = subprocess.run([*CLI, *args, "--reports", str(tmp_path / "r2")], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=1800)
    assert r.returncode == ExitCode.OK, r.stderr[-2000:]
    assert "from the evidence cache" not in r.stderr
    routing = json.loads((tmp_path / "r2" / "v0.33.0" / "routing.json").read_text())
    (discarded,) = routing["run"]["cache"]["discarded"]
    assert discarded[:2] == ["b200_sxm", "tp8"] and "does not match its recorded sha256" in discarded[2]
    assert "MarlinExperts" not in (tmp_path / "r2" / "v0.33.0" / "ledger.md").read_text()
    assert "evidence cache, discarded" in (tmp_path / "r2" / "v0.33.0" / "ledger.md").read_text()
    r = subprocess.run([*CLI, *args, "--reports", str(tmp_path / "r3")], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=1800)
    assert r.returncode == ExitCode.OK and "all 1 cell(s) from the evidence cache" in r.stderr, r.stderr[-2000:]


# --- the smaller gate holes ---------------------------------------------------------------------------------
def test_slice_is_refused_outside_observe_mode():
    r = cli("audit", "v0.33.0", "--slice", "slice4", "--systems", "b200_sxm", "--layouts", "tp8")
    assert r.returncode == ExitCode.USAGE and "only observe mode does" in r.stderr, r.stderr[-1000:]


def test_a_fifo_given_as_an_input_file_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "images.lock"
    os.mkfifo(fifo)
    for args in (["pins", "--lock", str(fifo)],
                 ["audit", "v0.33.0", "--expectations", str(fifo), "--systems", "b200_sxm", "--layouts", "tp8"]):
        r = cli(*args, timeout=60)
        assert r.returncode == ExitCode.USAGE and "is a FIFO" in r.stderr, (args, r.stderr[-1000:])


def test_make_variables_are_one_shell_word(tmp_path):
    """`make audit PIN='x; cmd; true'` audits a pin of that name (refused: not in images.lock); nothing runs."""
    marker = tmp_path / "pwned"
    r = subprocess.run(["make", "-s", "audit", f"PIN=x; touch {marker}; true", "SYSTEMS=b200_sxm"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode != 0 and not marker.exists(), r.stdout + r.stderr
    assert "not in" in r.stderr and "images.lock" in r.stderr


def test_ctrl_c_stops_a_harness_started_with_sigint_ignored(tmp_path):
    """A harness started as a background job inherits SIGINT ignored: it must still stop on Ctrl-C (130)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)  # accepts, never answers: the harness waits on it
    port = server.getsockname()[1]
    lock = tmp_path / "images.lock"
    lock.write_text((ROOT / "images.lock").read_text())
    proc = subprocess.Popen([*CLI, "lock", "add", "nightly-x", "--lock", str(lock), "--commit", "a" * 40,
                             "--index-url", f"http://127.0.0.1:{port}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    conn, _ = server.accept()  # the harness is now inside its request
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        conn.close()
        server.close()
    assert proc.returncode == ExitCode.INTERRUPTED, err[-1000:]
    assert lock.read_text() == (ROOT / "images.lock").read_text()


@pytest.mark.vllm
def test_timeout_covers_building_the_environment(vllm_env, tmp_path):
    """--timeout counts from the audit's start: an environment still being built when it runs out stops there
    (exit 4, naming the build step), not minutes later with another code."""
    rt, pin, _ = vllm_env
    cache = tmp_path / "cache"
    wheel = rt.wheels.find(pin)
    (cache / "wheels").mkdir(parents=True)
    try:
        os.link(wheel, cache / "wheels" / wheel.name)  # the pinned bytes, found by hash; no new download
    except OSError:
        shutil.copy2(wheel, cache / "wheels" / wheel.name)
    env = {**os.environ, "SERVING_TRUTH_CACHE": str(cache)}
    t0 = time.monotonic()
    r = subprocess.run([*CLI, "audit", "v0.33.0", "--systems", "b200_sxm", "--layouts", "tp8", "--reports",
                        str(tmp_path / "reports"), "--timeout", "8"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=600)
    took = time.monotonic() - t0
    assert r.returncode == ExitCode.RUN_FAILED, r.stderr[-2000:]
    assert "building the vLLM 0.33.0 environment" in r.stderr and "timed out after 8s" in r.stderr
    assert took < 90, took  # stopped at the deadline, not after a full build
    assert not (tmp_path / "reports" / "v0.33.0").exists()


@pytest.mark.vllm
def test_one_cell_one_story_and_evidence_of_another_model_are_refused(run_copy, report_copy):
    """A second evidence file for one cell (consistent on its own) is refused with both paths named, never read
    beside the real one; evidence whose header names another model is refused; the report stays as it was."""
    before = snapshot(report_copy)
    ev = _evidence_of(run_copy)
    second = ev.with_name("evidence-copied-1-abcdef.jsonl")
    shutil.copyfile(ev, second)
    r = cli("render", str(run_copy), "--reports", str(report_copy))
    assert r.returncode == ExitCode.RUN_FAILED, r.stderr[-2000:]
    assert "2 evidence files of cell b200_sxm/tp8" in r.stderr and second.name in r.stderr and ev.name in r.stderr
    second.unlink()
    header = json.loads(ev.read_text().splitlines()[0])
    assert header["model"] == "kimi-k3"  # every resolve file names its model
    good = ev.read_text()
    ev.write_text(good.replace('"model": "kimi-k3"', '"model": "gpt-oss-120b"', 1))
    r = cli("render", str(run_copy), "--reports", str(report_copy))
    assert r.returncode == ExitCode.RUN_FAILED and "evidence of the model 'gpt-oss-120b' in a run of kimi-k3" in \
        r.stderr, r.stderr[-2000:]
    ev.write_text(good)
    assert snapshot(report_copy) == before


def _rewrite(ev: Path, keep) -> None:
    """Rewrite an evidence file with only the records *keep* accepts, its closing record made consistent again
    (as a careful forger would): the file is whole, only its content is poorer."""
    from probes.core.recorder import closing

    lines = [l for l in ev.read_text().splitlines() if l]
    kept = [r for r in map(json.loads, lines[1:-1]) if keep(r)]
    body = [lines[0]] + [json.dumps({**r, "seq": i}, sort_keys=True) for i, r in enumerate(kept, 1)]  # renumbered
    ev.write_text("\n".join(body + [json.dumps(closing(body, True), sort_keys=True)]) + "\n")


@pytest.mark.vllm
def test_evidence_that_can_judge_nothing_never_passes(run_copy, report_copy):
    """Whole evidence (closing record consistent) whose selection and construction records were dropped, or that
    holds no stage record, or that is an observe-mode file in a resolve run: never rendered as a judged cell,
    never exit 0, the report untouched, the cause named."""
    before = snapshot(report_copy)
    ev = _evidence_of(run_copy)
    good = ev.read_text()
    for name, keep, fragment in (
            ("no selection", lambda r: r.get("kind") not in ("select", "candidates", "candidate"),
             "holds no select / candidates / candidate record"),
            ("no stage", lambda r: r.get("kind") != "stage", "holds no stage record")):
        _rewrite(ev, keep)
        r = cli("render", str(run_copy), "--reports", str(report_copy))
        assert r.returncode == ExitCode.RUN_FAILED, (name, r.stderr[-2000:])
        ledger = next((run_copy / "incomplete-report").rglob("ledger.md")).read_text()
        assert fragment in ledger, name
        ev.write_text(good)
    lines = good.splitlines()
    header = json.loads(lines[0])
    header["mode"] = "observe"
    ev.write_text("\n".join([json.dumps(header, sort_keys=True)] + lines[1:]) + "\n")
    r = cli("render", str(run_copy), "--reports", str(report_copy))
    assert r.returncode == ExitCode.RUN_FAILED and "evidence of observe mode in a resolve run" in r.stderr, r.stderr
    ev.write_text(good)
    assert snapshot(report_copy) == before


# --- a judgment may not shrink silently ------------------------------------------------------------
@pytest.mark.vllm
def test_a_report_whose_claims_would_become_unjudged_is_not_replaced_without_replace(run_copy, report_copy, tmp_path):
    """The same run rendered against claims that no longer judge one of the committed claims: the judged verdicts
    would go, so the report stays, the new ledger is written beside the run, and the exit is 4 naming the claims;
    --replace says to replace it anyway."""
    claims = (ROOT / "expectations" / "kimi-k3.toml").read_text()
    head, *blocks = claims.split("\n[[claim]]\n")
    kept = [b for b in blocks if 'id = "kda-context-flashkda"' not in b]
    assert len(kept) == len(blocks) - 1
    reduced = tmp_path / "kimi-k3.toml"
    reduced.write_text("\n[[claim]]\n".join([head, *kept]))
    (tmp_path / "kernel_source_backends.toml").write_text((ROOT / "expectations" / "kernel_source_backends.toml")
                                                           .read_text())
    before = snapshot(report_copy)
    r = cli("render", str(run_copy), "--reports", str(report_copy), "--expectations", str(reduced))
    assert r.returncode == ExitCode.RUN_FAILED, r.stderr[-2000:]
    assert "2 claim verdict(s)" in r.stderr and "would become UNVERIFIED: " in r.stderr and "--replace" in r.stderr
    assert all(f"kda-context-flashkda on b200_sxm/{layout} (was MATCH)" in r.stderr for layout in ("tp8", "dep8"))
    assert snapshot(report_copy) == before
    r = cli("render", str(run_copy), "--reports", str(report_copy), "--expectations", str(reduced), "--replace")
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-2000:]
    assert snapshot(report_copy) != before


def test_the_shrink_check_names_judged_claims_left_unjudged():
    import copy

    from audit.core import _judgment_shrank

    committed = json.loads((ROOT / "reports" / "v0.33.0" / "routing.json").read_text())
    assert _judgment_shrank(ROOT / "reports" / "v0.33.0", copy.deepcopy(committed)) == []
    now = copy.deepcopy(committed)
    row = next(r for r in now["verdicts"]["rows"] if r["claim"] and r["verdict"] == "MATCH")
    row["verdict"] = "UNVERIFIED"
    [shrunk] = [c for c in _judgment_shrank(ROOT / "reports" / "v0.33.0", now)
                if (c["claim"], c["system"], c["layout"]) == (row["claim"], row["system"], row["layout"])]
    assert shrunk["verdict"] == "MATCH"
    now["verdicts"] = None  # an audit that judged nothing (--expectations none) is no shrink of a judgment it skipped
    assert _judgment_shrank(ROOT / "reports" / "v0.33.0", now) == []


def test_a_fifo_given_as_a_routing_or_a_shared_imports_list_is_refused_never_waited_on(tmp_path, monkeypatch):
    """A FIFO where a routing.json (a baseline, a diff's side) or the shared-imports list should be: refused at once
    with what it is (exit 2), never a read that blocks past any timeout."""
    import os

    from audit.runtimes.base import shared_imports

    reports = tmp_path / "reports"
    for pin in ("v0.32.0", "v0.33.0"):
        (reports / pin).mkdir(parents=True)
    shutil.copy(ROOT / "reports" / "v0.33.0" / "routing.json", reports / "v0.33.0" / "routing.json")
    os.mkfifo(reports / "v0.32.0" / "routing.json")
    r = cli("diff", "v0.32.0", "v0.33.0", "--reports", str(reports), timeout=60)
    assert r.returncode == ExitCode.USAGE and "is a FIFO" in r.stderr, r.stderr[-2000:]
    fifo = tmp_path / "shared.json"
    os.mkfifo(fifo)
    monkeypatch.setenv("SERVING_TRUTH_SHARED_IMPORTS", str(fifo))
    assert shared_imports(tmp_path) == []  # no list: the SM processes import everything themselves


def test_a_baseline_of_another_model_is_refused_before_any_cell_runs(tmp_path):
    reports = tmp_path / "reports"
    (reports / "v0.32.0").mkdir(parents=True)
    other = json.loads((ROOT / "reports" / "gpt-oss-120b" / "v0.33.0" / "routing.json").read_text())
    other["pin"]["name"] = "v0.32.0"
    (reports / "v0.32.0" / "routing.json").write_text(json.dumps(other))
    r = cli("audit", "v0.33.0", "--baseline", "v0.32.0", "--reports", str(reports), "--systems", "b200_sxm",
            "--layouts", "tp8", timeout=120)
    assert r.returncode == ExitCode.USAGE, r.stderr[-2000:]
    assert "is of the model 'gpt-oss-120b', not of 'kimi-k3'" in r.stderr and "evidence:" not in r.stderr


def test_a_signal_to_verify_pins_ends_it_as_interrupted_not_as_a_pin_that_does_not_fit(monkeypatch):
    """SIGTERM while a pin's check runs: exit 130 (the user's signal), never "the harness does not fit" (exit 4)
    and never on to the next pin."""
    from audit import pincheck
    from audit.errors import Interrupted
    from audit.models.kimi_k3 import KIMI_K3

    seen = []

    def interrupted(pin, options, progress=None):
        seen.append(pin)
        raise Interrupted("interrupted by signal 15; no report was written or changed")

    monkeypatch.setattr(pincheck, "run_audit", interrupted)
    with pytest.raises(Interrupted):
        pincheck.verify_pins(KIMI_K3, lock_path=ROOT / "images.lock", pins=["v0.32.0", "v0.33.0"])
    assert seen == ["v0.32.0"] and Interrupted.exit_code == ExitCode.INTERRUPTED == 130


def test_prune_refuses_an_environment_a_running_audit_uses(tmp_path, monkeypatch):
    """`envs --prune all` while an audit's agent runs in an environment: that one is left (exit 3, named), never
    deleted from under the audit; once the audit has ended it goes."""
    from audit.errors import EnvironmentInUse
    from audit.runtimes.local import LocalRuntime

    monkeypatch.setenv("SERVING_TRUTH_CACHE", str(tmp_path / "cache"))
    rt = LocalRuntime()
    env = rt.root / "envs" / "vllm-0.0.0-cp312-000000000000"
    (env / "bin").mkdir(parents=True)
    with rt.using(env):
        with pytest.raises(EnvironmentInUse) as err:
            rt.remove_env(env.name)
        assert err.value.exit_code == ExitCode.ENVIRONMENT and env.name in str(err.value) and env.is_dir()
    rt.remove_env(env.name)
    assert not env.exists()


def test_a_run_whose_cells_all_stopped_before_construction_never_exits_0(tmp_path):
    """Cells that never got through constructing the model resolved no lane: with no claim to judge, or none
    failing, the audit still never exits 0: 7 (nothing judged) when a limit or anything but vLLM stopped them, 1 (a
    finding) when vLLM's own code refused every one. One built cell is enough to judge by the verdicts again."""
    import io
    import json as _json

    from rich.console import Console

    from audit.cli import _findings_exit
    from audit.core import AuditOutcome, unbuilt_cells

    committed = _json.loads((ROOT / "reports" / "v0.33.0" / "routing.json").read_text(encoding="utf-8"))["cells"]
    # vLLM refuses some layouts while constructing the model (DeepGEMM MegaMoE below SM 10, ...)
    refused = unbuilt_cells(committed)
    assert ["l40s/dep8", "refused"] in refused and all(why == "refused" for _, why in refused)
    cells = [c for c in committed if c["depth"] == "inspect"][:3]
    assert unbuilt_cells(cells) == []
    limit = {"outcome": "limit", "stage": "config", "message": "m", "type": "t", "where": "w"}
    stopped = [{**c, "depth": depth, "failure": limit} for c, depth in zip(cells, ("config", "imports", ""))]
    assert unbuilt_cells(stopped) == [[f"{c['system']}/{c['layout']}", "limit"] for c in cells]
    assert unbuilt_cells([{**cells[0], "depth": "construct"}]) == []
    assert unbuilt_cells([{**cells[0], "depth": "", "evidence": "observed"}]) == []  # observe mode: no stages

    def exit_of(unbuilt, verdicts):
        out = io.StringIO()
        o = AuditOutcome(pin="v0.33.0", report_dir=tmp_path, ledger=tmp_path / "l", routing_path=tmp_path / "r",
                         run_dir=tmp_path, cells=3, incomplete=0, partial=3, drift=0, verdicts=verdicts,
                         required_drift=[], unbuilt=unbuilt)
        return _findings_exit(o, False, Console(file=out, width=300)), out.getvalue()

    code, said = exit_of(unbuilt_cells(stopped), {"UNVERIFIED": 4})
    assert code == ExitCode.NOTHING_JUDGED == 7 and "nothing was built" in said and "l40s/tp8" in said
    assert exit_of(unbuilt_cells(stopped), None)[0] == 7  # --expectations none
    assert exit_of(unbuilt_cells(stopped)[:2], {"UNVERIFIED": 4})[0] == ExitCode.OK
    code, said = exit_of([[n, "refused"] for n, _ in unbuilt_cells(stopped)], None)
    assert code == ExitCode.FINDINGS and "vLLM refused every cell" in said
