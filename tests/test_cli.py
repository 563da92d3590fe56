"""The command line: bad input exits 2 with an actionable message; failures never touch old reports."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from audit.errors import ExitCode
from tests.conftest import ROOT

CLI = [sys.executable, "-m", "audit.cli"]


def run(*args, cwd=ROOT, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=cwd, **kw)


@pytest.mark.parametrize("args, fragment", [
    (["audit", "v9.9.9"], "pin 'v9.9.9' is not in images.lock"),
    (["audit", "v0.33.0", "--systems", "h100"], "unknown system 'h100'"),
    (["audit", "v0.33.0", "--layouts", "tp4"], "unknown layout 'tp4'"),
    (["audit", "v0.33.0", "--runtime", "k8s"], "unknown runtime 'k8s'"),
    (["audit", "v0.33.0", "--parallel", "0"], "--parallel must be at least 1"),
    (["audit", "k3-preview", "--runtime", "local"], "cannot be audited by the local runtime"),
    (["audit"], "the following arguments are required: pin"),
    (["render", "/nonexistent/run"], "is not a finished run directory"),
    (["audit", "k3-preview", "--runtime", "docker", "--pass-env", "ST_TEST_UNSET_VARIABLE"],
     "--pass-env names variables that are not set: ST_TEST_UNSET_VARIABLE"),
    (["audit", "v0.33.0", "--pass-env", "HOME"], "--pass-env only applies to --runtime docker"),
    (["audit", "v0.33.0", "--no-wait"], "--cluster and --no-wait only apply to --runtime slurm"),
    (["audit", "v0.33.0", "--mode", "replay"], "invalid choice: 'replay'"),
    (["audit", "v0.33.0", "--mode", "observe", "--slice", "slice3"], "unknown slice 'slice3'"),
    (["audit", "v0.33.0", "--slice", "slice4"], "only observe mode does"),
    (["lock", "resolve", "v0.33.0"], "names no registry image (image or image_tag) to resolve"),
])
def test_bad_input_exits_2(args, fragment):
    r = run(*args)
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert fragment in r.stderr


def test_bad_lock_file_exits_2_with_line(tmp_path):
    lock = tmp_path / "images.lock"
    lock.write_text('schema = 1\n\n[[pin]]\nname = "x"\nvllm_version = "1"\nimage = "repo:tag"\n')
    r = run("audit", "x", "--lock", str(lock))
    assert r.returncode == ExitCode.USAGE
    assert f"{lock}:6: pin 'x': image 'repo:tag' is a tag without a digest" in r.stderr
    assert "hint: pin the image by digest" in r.stderr


def test_pins_lists_the_lock():
    r = run("pins")
    assert r.returncode == 0
    for name in ("v0.27.0", "v0.30.0", "v0.33.0", "k3-preview"):
        assert name in r.stdout


def _agents_of(run_dir_root: Path) -> list[str]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "probes.resolve.agent" in line and str(run_dir_root) in line]


@pytest.mark.vllm
def test_audit_end_to_end_and_failures_keep_the_previous_ledger(vllm_env, tmp_path):
    reports = tmp_path / "reports"
    cache = os.environ.get("SERVING_TRUTH_CACHE")
    env = dict(os.environ)
    args = ["audit", "v0.33.0", "--systems", "b200_sxm", "--layouts", "dep8", "--reports", str(reports)]
    r = run(*args, env=env, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    ledger = reports / "v0.33.0" / "ledger.md"
    assert r.stdout.strip().endswith(str(ledger.relative_to(ROOT)) if ledger.is_relative_to(ROOT) else str(ledger))
    text = ledger.read_text()
    assert "DeepGemmMegaMoEExperts (MegaMoE)" in text and "**Evidence level: resolved" in text
    # the shipped claims hold on B200 DEP8 (exit 0); --strict also fails on lanes no claim covers
    assert "| MATCH | `moe-dep-megamoe` |" in text and "MISMATCH" not in r.stderr
    run_dir = [l.split("evidence: ", 1)[1].strip() for l in r.stderr.splitlines() if l.startswith("evidence: ")][0]
    strict = run("render", run_dir, "--reports", str(tmp_path / "strict"), "--strict")
    assert strict.returncode == ExitCode.FINDINGS and "UNVERIFIED" in strict.stderr
    bare = run("render", run_dir, "--reports", str(tmp_path / "bare"), "--strict", "--expectations", "none")
    assert bare.returncode == 0 and "## Verdicts" not in (tmp_path / "bare" / "v0.33.0" / "ledger.md").read_text()
    before = {p.name: p.read_bytes() for p in (reports / "v0.33.0").iterdir()}

    # a run that times out: non-zero, named error, previous ledger untouched, no agent left behind
    # (--no-cache: the cell's evidence is cached by now, and these steps need the agent to run)
    args = [*args, "--no-cache"]
    r = run(*args, "--timeout", "3", env=env, timeout=600)
    assert r.returncode == ExitCode.RUN_FAILED, r.stderr[-2000:]
    assert "timed out after 3s" in r.stderr
    assert {p.name: p.read_bytes() for p in (reports / "v0.33.0").iterdir()} == before

    # an interrupted run (Ctrl-C once the agent is running)
    # Ctrl-C in a terminal: SIGINT at its default disposition in the CLI, even when this suite itself runs as a
    # background job (a non-interactive shell starts those with SIGINT ignored, and children inherit that)
    proc = subprocess.Popen([*CLI, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    runs_root = Path(cache) if cache else Path.home() / ".cache" / "serving-truth"
    while time.time() < deadline and not [a for a in _agents_of(runs_root) if f"Z-{proc.pid}/" in a]:
        time.sleep(0.5)
    assert [a for a in _agents_of(runs_root) if f"Z-{proc.pid}/" in a], "the agent never started"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.INTERRUPTED, err[-2000:]
    assert "no report was written or changed" in err
    assert {p.name: p.read_bytes() for p in (reports / "v0.33.0").iterdir()} == before
    time.sleep(1)
    assert [a for a in _agents_of(runs_root) if f"Z-{proc.pid}/" in a] == []
