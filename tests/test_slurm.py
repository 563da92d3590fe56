"""The Slurm runtime against a real single-host Slurm cluster (tests/slurm/cluster.sh): a resolve audit
split into one job per cell merges to the local runtime's evidence; failed, refused and cancelled jobs
become INCOMPLETE cells; Ctrl-C cancels exactly the run's jobs; --no-wait renders later, idempotently.
The pyxis command lines are checked as data (pyxis cannot be installed here)."""
import json
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
CLUSTER_SH = ROOT / "tests" / "slurm" / "cluster.sh"


@pytest.fixture(scope="session")
def slurm_cluster():
    r = subprocess.run(["bash", str(CLUSTER_SH), "start"], capture_output=True, text=True)
    if r.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("CI must provide Slurm:\n" + r.stdout[-2000:] + r.stderr[-2000:])
        pytest.skip("no Slurm cluster: " + (r.stdout + r.stderr)[-500:])
    return True


def profile(tmp_path: Path, extra: str = "") -> Path:
    """Every system runs the pinned venv (container = "local") from the shared cache; resolve jobs take
    one CPU each so two run at once on the 2-core test machine."""
    from audit.fsutil import cache_root

    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    path = tmp_path / "cluster.toml"
    path.write_text(
        f'schema = 1\nname = "test"\nshared_dir = "{shared}"\nenv_root = "{cache_root()}"\n'
        'time_limit = "00:30:00"\n\n[resolve]\npartition = "cpu"\ncpus = 1\n\n[defaults]\ncontainer = "local"\n'
        + extra, encoding="utf-8")
    return path


def audit(*args, **kw):
    return subprocess.run([*CLI, "audit", "v0.33.0", "--runtime", "slurm", *args], cwd=ROOT, capture_output=True,
                          text=True, **kw)


def run_dir_of(shared: Path) -> Path:
    runs = sorted((shared / "runs").glob("v0.33.0-*"))
    assert runs, "no run directory on the shared filesystem"
    return runs[-1]


def our_jobs_alive(run_dir: Path) -> list[str]:
    jobs = json.loads((run_dir / "jobs.json").read_text())
    ids = [e["job_id"] for e in jobs.values() if "job_id" in e]
    out = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[1] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")]


@pytest.mark.slurm
@pytest.mark.vllm
def test_split_audit_merges_to_the_local_runtimes_evidence(slurm_cluster, vllm_env, probed_run, tmp_path):
    from tests.compare import comparable, local_cells

    reports = tmp_path / "reports"
    r = audit("--cluster", str(profile(tmp_path)), "--systems", "h100_sxm,b200_sxm", "--layouts", "tp8,dep8",
              "--reports", str(reports), timeout=3600)
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-4000:]
    run_dir = run_dir_of(tmp_path / "shared")
    jobs = json.loads((run_dir / "jobs.json").read_text())
    assert len({e["job_id"] for e in jobs.values()}) == 4  # one job per cell
    assert all(e["state"] == "COMPLETED" for e in jobs.values())
    script = Path(jobs["b200_sxm--dep8"]["script"]).read_text()
    assert "#SBATCH --partition=cpu" in script and "--gpus" not in script  # resolve needs no GPU
    routing = json.loads((reports / "v0.33.0" / "routing.json").read_text())
    local = local_cells(probed_run)
    for cell in routing["cells"]:
        key = (cell["system"], cell["layout"])
        assert cell["status"] in ("COMPLETE", "PARTIAL"), key  # PARTIAL: MegaMoE on SM90 stops construction
        assert comparable(cell) == comparable(local[key]), key
    assert len(routing["cells"]) == 4
    assert "slurm (profile test: one job per cell)" in (reports / "v0.33.0" / "ledger.md").read_text()
    assert our_jobs_alive(run_dir) == []


@pytest.mark.slurm
@pytest.mark.vllm
def test_refused_and_cancelled_jobs_become_incomplete_and_no_wait_renders_later(slurm_cluster, vllm_env, tmp_path):
    extra = '\n[systems.h100_sxm]\nconstraint = "no-such-feature"\n'
    reports = tmp_path / "reports"
    r = audit("--cluster", str(profile(tmp_path, extra)), "--systems", "h100_sxm,b200_sxm", "--layouts", "tp8,dep8",
              "--reports", str(reports), "--no-wait", "--expectations", "none", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = run_dir_of(tmp_path / "shared")
    assert r.stdout.strip().endswith(run_dir.name) and "serving-truth render" in r.stderr
    jobs = json.loads((run_dir / "jobs.json").read_text())
    refused = [c for c, e in jobs.items() if "job_id" not in e]
    assert sorted(refused) == ["h100_sxm--dep8", "h100_sxm--tp8"]
    assert "Invalid feature specification" in jobs["h100_sxm--tp8"]["submit_error"]

    # rendering before the jobs end is refused, and changes nothing
    early = subprocess.run([*CLI, "render", str(run_dir), "--reports", str(reports), "--expectations", "none"],
                           cwd=ROOT, capture_output=True, text=True)
    assert early.returncode == ExitCode.USAGE and "have not ended" in early.stderr
    assert not (reports / "v0.33.0").exists()

    victim = jobs["b200_sxm--dep8"]["job_id"]
    subprocess.run(["scancel", victim], check=True)
    deadline = time.time() + 1200
    while our_jobs_alive(run_dir) and time.time() < deadline:
        time.sleep(3)
    assert our_jobs_alive(run_dir) == []

    # three cells left no evidence: the run is INCOMPLETE (exit 4); its ledger goes beside the run,
    # never into reports/, however often it is rendered
    first = subprocess.run([*CLI, "render", str(run_dir), "--reports", str(reports), "--expectations", "none"],
                           cwd=ROOT, capture_output=True, text=True)
    assert first.returncode == ExitCode.RUN_FAILED, first.stderr[-3000:]
    assert "3 cell(s) did not finish" in first.stderr and not (reports / "v0.33.0").exists()
    beside = Path([l.split(": ", 1)[1] for l in first.stderr.splitlines()
                   if l.startswith("an INCOMPLETE ledger of what was observed: ")][0])
    assert beside.is_relative_to(run_dir)
    ledger = beside.read_bytes()
    text = ledger.decode()
    assert "**INCOMPLETE:** 3 cell(s)" in text and "INCOMPLETE RUN (cells-missing)" in text
    # the job's id stays in jobs.json: the routing names no run's own numbers
    assert "its Slurm job (jobs.json names it) ended CANCELLED" in text and f"job {victim}" not in text
    assert "sbatch refused the job" in text and "Invalid feature specification" in text
    routing = json.loads((beside.parent / "routing.json").read_text())
    status = {(c["system"], c["layout"]): c["status"] for c in routing["cells"]}
    assert status[("b200_sxm", "tp8")] == "COMPLETE"
    second = subprocess.run([*CLI, "render", str(run_dir), "--reports", str(reports), "--expectations", "none"],
                            cwd=ROOT, capture_output=True, text=True)
    assert second.returncode == ExitCode.RUN_FAILED and beside.read_bytes() == ledger
    assert not (reports / "v0.33.0").exists()


@pytest.mark.slurm
@pytest.mark.vllm
def test_ctrl_c_cancels_exactly_the_runs_jobs(slurm_cluster, vllm_env, tmp_path):
    bystander = subprocess.run(["sbatch", "--parsable", "--wrap", "sleep 120", "-o", "/dev/null"],
                               capture_output=True, text=True, check=True).stdout.strip()
    try:
        proc = subprocess.Popen([*CLI, "audit", "v0.33.0", "--runtime", "slurm", "--cluster", str(profile(tmp_path)),
                                 "--systems", "b200_sxm", "--layouts", "tp8,dep8", "--reports", str(tmp_path / "r")],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                # Ctrl-C as in a terminal, even if this suite runs as a background job
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 300
        run_dir = None
        while time.time() < deadline:
            runs = sorted((tmp_path / "shared" / "runs").glob("v0.33.0-*")) if (tmp_path / "shared" / "runs").exists() else []
            if runs and (runs[-1] / "jobs.json").exists() and len(json.loads((runs[-1] / "jobs.json").read_text())) == 2:
                run_dir = runs[-1]
                break
            time.sleep(0.5)
        assert run_dir is not None, proc.communicate(timeout=60)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == ExitCode.INTERRUPTED, err[-3000:]
        time.sleep(2)
        assert our_jobs_alive(run_dir) == []
        state = subprocess.run(["squeue", "-h", "-j", bystander, "-o", "%T"], capture_output=True, text=True).stdout
        assert state.strip() in ("RUNNING", "PENDING"), state  # someone else's job is untouched
        assert not (tmp_path / "r" / "v0.33.0").exists()
    finally:
        subprocess.run(["scancel", bystander])


@pytest.mark.slurm
@pytest.mark.vllm
def test_jobs_of_a_killed_harness_end_themselves(slurm_cluster, vllm_env, tmp_path):
    """SIGKILL leaves no handler to scancel: the jobs watch the harness's heartbeat and end themselves."""
    env = {**os.environ, "SERVING_TRUTH_HEARTBEAT_S": "8"}
    proc = subprocess.Popen([*CLI, "audit", "v0.33.0", "--runtime", "slurm", "--cluster", str(profile(tmp_path)),
                             "--systems", "b200_sxm", "--layouts", "tp8,dep8", "--reports", str(tmp_path / "r")],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        run_dir = None
        while time.time() < deadline and run_dir is None:
            runs = sorted((tmp_path / "shared" / "runs").glob("v0.33.0-*")) if (tmp_path / "shared" / "runs").exists() else []
            if runs and (runs[-1] / "jobs.json").exists() and \
                    any("RUNNING" in line for line in our_jobs_alive(runs[-1])):
                run_dir = runs[-1]
            time.sleep(0.5)
        assert run_dir is not None, "no job started"
        script = next((run_dir / "jobs").glob("*.sbatch")).read_text()
        assert f"SERVING_TRUTH_WATCHDOG=heartbeat:8:{run_dir / 'heartbeat'}" in script
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 120
    while time.time() < deadline and our_jobs_alive(run_dir):
        time.sleep(2)
    assert our_jobs_alive(run_dir) == []
    logs = " ".join(p.read_text(errors="replace") for p in (run_dir / "jobs").glob("*.log"))
    assert "the harness stopped its heartbeat" in logs
    assert not (tmp_path / "r").exists()


# --- data: profiles and pyxis command lines ------------------------------------------------------
def test_pyxis_command_lines_for_a_digest_and_a_squashfs(tmp_path):
    from audit.pins import lock
    from audit.runtimes.cluster import load
    from audit.runtimes.slurm import enroot_uri, pyxis_srun_args

    pin = lock.load(ROOT / "images.lock").get("k3-preview")
    digest = pin.image.split("@", 1)[1]
    assert enroot_uri(pin.image) == f"registry-1.docker.io#vllm/vllm-openai:{digest}"
    assert enroot_uri("nvcr.io/nvidia/vllm@" + digest) == f"nvcr.io#nvidia/vllm:{digest}"
    sqsh = tmp_path / "img.sqsh"
    sqsh.write_bytes(b"squashfs")
    path = tmp_path / "c.toml"
    path.write_text(f'schema = 1\nshared_dir = "/shared"\n[defaults]\ncontainer = "pyxis"\n'
                    f'[systems.gb200]\npartition = "gb200"\ngpus = 4\nsquashfs = "{sqsh}"\n'
                    f'squashfs_sha256 = "{"a" * 64}"\n')
    prof = load(path)
    run_dir = Path("/shared/runs/r1")
    env = {"HF_HUB_OFFLINE": "1", "LD_LIBRARY_PATH": "/shared/stub"}
    h100 = pyxis_srun_args(pin=pin, placement=prof.placement("h100_sxm"), run_dir=run_dir, plan="/shared/runs/r1/p.json",
                           env=env)
    assert h100 == [
        "srun", "--ntasks=1", f"--container-image=registry-1.docker.io#vllm/vllm-openai:{digest}",
        "--container-mounts=/shared/runs/r1:/shared/runs/r1:ro,/shared/runs/r1/evidence:/shared/runs/r1/evidence:rw",
        "--no-container-mount-home", "--no-container-remap-root", "--no-container-entrypoint",
        "--container-workdir=/tmp", "--export=HF_HUB_OFFLINE,LD_LIBRARY_PATH",
        "python3", "-m", "probes.resolve.agent", "/shared/runs/r1/p.json"]
    gb200 = pyxis_srun_args(pin=pin, placement=prof.placement("gb200"), run_dir=run_dir, plan="p.json", env=env)
    assert gb200[2] == f"--container-image={sqsh}"
    # with per-platform digests, an arm64 system pulls its own manifest
    arm = "sha256:" + "b" * 64
    multi = lock.Pin(name="m", version="0", image=pin.image, platform_digests={"linux/arm64": arm})
    assert enroot_uri(multi.image_for("linux/arm64")) == f"registry-1.docker.io#vllm/vllm-openai:{arm}"
    assert enroot_uri(multi.image_for("linux/amd64")) == f"registry-1.docker.io#vllm/vllm-openai:{digest}"


def test_sbatch_headers_request_gpus_only_for_observe_cells(tmp_path):
    from audit.pins import lock
    from audit.runtimes.cluster import load
    from audit.models.kimi_k3 import KIMI_K3
    from audit.runtimes.base import RunRequest
    from audit.runtimes.slurm import SlurmRuntime
    from audit.systems import SYSTEMS

    from audit.models.kimi_k3 import LAYOUTS

    prof = load(ROOT / "clusters" / "example.toml")
    rt = SlurmRuntime(prof)
    pin = lock.load(ROOT / "images.lock").get("v0.33.0")
    log = Path("/x.log")
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[], run_dir=tmp_path)
    resolve = rt.sbatch_header(req, SYSTEMS["gb200"], LAYOUTS["tp16"], log)
    assert "--partition=grace" in resolve and not any("gpu" in a for a in resolve)
    req.mode = "observe"
    observe = rt.sbatch_header(req, SYSTEMS["gb200"], LAYOUTS["tp16"], log)
    assert {"--partition=gb200", "--nodes=4", "--gpus-per-node=4"} <= set(observe)
    observe8 = rt.sbatch_header(req, SYSTEMS["b200_sxm"], LAYOUTS["dep8"], log)
    assert {"--partition=b200", "--nodes=1", "--gpus-per-node=8"} <= set(observe8)


@pytest.mark.parametrize("body, fragment", [
    ('[systems.h100]\npartition = "x"\n', "unknown system 'h100'"),
    ('[systems.gb200]\narch = "amd64"\n', "gb200 is arm64, the profile says arch = 'amd64'"),
    ('[systems.b200_sxm]\nsquashfs = "/x.sqsh"\n', "squashfs needs squashfs_sha256"),
    ('[defaults]\ncontainer = "docker"\n', "container must be one of local, pyxis"),
    ('[systems.b200_sxm]\ngpu = 8\n', "unknown key 'gpu' in [systems.b200_sxm]"),
])
def test_bad_cluster_profiles_fail_with_file_and_line(tmp_path, body, fragment):
    path = tmp_path / "c.toml"
    path.write_text('schema = 1\nshared_dir = "/shared"\n\n' + body)
    r = subprocess.run([*CLI, "audit", "v0.33.0", "--runtime", "slurm", "--cluster", str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert fragment in r.stderr and f"{path}:" in r.stderr


def test_observe_job_scripts_ask_for_gpus_and_run_the_observe_agent(tmp_path):
    from audit.pins import lock
    from audit.runtimes.cluster import load
    from audit.models.kimi_k3 import KIMI_K3
    from audit.runtimes.base import RunRequest
    from audit.runtimes.slurm import SlurmRuntime
    from audit.systems import SYSTEMS

    from audit.models.kimi_k3 import LAYOUTS

    path = tmp_path / "c.toml"
    path.write_text('schema = 1\nshared_dir = "/shared"\n[defaults]\ncontainer = "local"\n'
                    '[systems.b200_sxm]\npartition = "b200"\ngpus = 8\n')
    rt = SlurmRuntime(load(path))
    pin = lock.load(ROOT / "images.lock").get("v0.33.0")
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[], run_dir=Path("/shared/runs/r1"), mode="observe")
    env = {"SERVING_TRUTH_MODE": "observe", "SERVING_TRUTH_OUT": "/shared/runs/r1/evidence/b200_sxm--dep8"}
    script = rt.job_script(req, SYSTEMS["b200_sxm"], LAYOUTS["dep8"], plan=Path("/shared/runs/r1/p.json"),
                           log=Path("/shared/runs/r1/jobs/x.log"), env=env, python="/env/bin/python")
    assert "#SBATCH --partition=b200" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --nodes=1" in script
    assert script.rstrip().endswith("/env/bin/python -m probes.observe.agent /shared/runs/r1/p.json 0")
    assert "SERVING_TRUTH_MODE=observe" in script
    req.mode = "resolve"
    resolve = rt.job_script(req, SYSTEMS["b200_sxm"], LAYOUTS["dep8"], plan=Path("/p.json"), log=Path("/x.log"),
                            env={}, python="/env/bin/python")
    assert "gpus" not in resolve and resolve.rstrip().endswith("-m probes.resolve.agent /p.json")


@pytest.mark.slurm
@pytest.mark.sglang
def test_an_sglang_pin_runs_one_job_per_cell_and_routes_as_the_committed_report(slurm_cluster, tmp_path):
    """The second engine on the cluster: each job runs the agent SGLang's engine contract names, in the SGLang
    environment the submit host built, and the merged cells route field by field as the committed SGLang report."""
    from tests.compare import comparable

    from audit.pins import lock
    from audit.runtimes.local import LocalRuntime

    pin = lock.load(ROOT / "images.lock").get("sglang-0.5.23")
    LocalRuntime().ensure_env(pin, lambda *a, **k: None)
    reports = tmp_path / "reports"
    r = subprocess.run([*CLI, "audit", pin.name, "--runtime", "slurm", "--cluster", str(profile(tmp_path)),
                        "--systems", "b200_sxm,h200_sxm", "--layouts", "tp8", "--reports", str(reports), "--no-cache"],
                       cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-4000:]
    run_dir = sorted((tmp_path / "shared" / "runs").glob(f"{pin.name}-*"))[-1]
    jobs = json.loads((run_dir / "jobs.json").read_text())
    assert len({e["job_id"] for e in jobs.values()}) == 2 and all(e["state"] == "COMPLETED" for e in jobs.values())
    script = Path(jobs["b200_sxm--tp8"]["script"]).read_text()
    assert "-m probes.engines.sglang.agent" in script and "sglang-0.5.23-cp311-" in script
    routing = json.loads((reports / "sglang" / pin.name / "routing.json").read_text())
    committed = {(c["system"], c["layout"]): c for c in
                 json.loads((ROOT / "reports/sglang/sglang-0.5.23/routing.json").read_text())["cells"]}
    assert len(routing["cells"]) == 2
    for cell in routing["cells"]:
        key = (cell["system"], cell["layout"])
        assert cell["status"] == "COMPLETE", (key, cell.get("failure"))
        assert comparable(cell) == comparable(committed[key]), key
    assert our_jobs_alive(run_dir) == []
