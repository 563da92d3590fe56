"""The docker runtime against the real Docker engine: image identity, the audit inside the pinned image
(same routing as the local runtime), hardening seen through `docker inspect`, and cleanup on kill,
timeout, interrupt and harness death."""
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from audit.pins import lock as lockmod
from audit.errors import ExitCode, ImageDigestMismatch, ImageError, RegistryError
from audit.runtimes.docker import LABEL_MANAGED, LABEL_OWNER, LABEL_ROLE, LABEL_RUN, DockerRuntime, sweep
from tests.conftest import ROOT

pytestmark = pytest.mark.docker
CLI = [sys.executable, "-m", "audit.cli"]
SECRET_PASSED = "st-test-secret-passed-5b1f0c"
SECRET_HOST = "st-test-secret-host-9d27e4"
noop = lambda *a, **k: None  # noqa: E731


def write_lock(path: Path, body: str) -> Path:
    path.write_text('schema = 1\n\n[[pin]]\n' + body, encoding="utf-8")
    return path


def tiny_image(client, content: str):
    """A one-file image imported into the engine (never run)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        data = content.encode()
        info = tarfile.TarInfo("hello.txt")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    out = client.api.import_image_from_data(raw.getvalue(), repository="serving-truth-test/tiny",
                                            tag=hashlib.sha256(content.encode()).hexdigest()[:12])
    image_id = json.loads(out.strip().splitlines()[-1])["status"]
    return client.images.get(image_id)


# --- image identity (tiny images, no vLLM) --------------------------------------------------------
def test_tarball_pin_is_loaded_and_verified_by_config_digest(docker_client, tmp_path):
    image = tiny_image(docker_client, f"tarball {time.time()}")
    tar = tmp_path / "tiny.tar"
    with open(tar, "wb") as fh:
        for chunk in image.save(named=False):
            fh.write(chunk)
    docker_client.images.remove(image.id, force=True)
    lock = write_lock(tmp_path / "images.lock", f'name = "t"\nvllm_version = "0"\n'
                      f'image_config_digest = "{image.id}"\nimage_tarball = "tiny.tar"\n')
    pin = lockmod.load(lock).get("t")
    assert pin.runtimes == ["docker"]
    rt = DockerRuntime(lock_dir=tmp_path, client=docker_client)
    loaded, facts = rt.ensure_image(pin, "linux/amd64", noop)
    assert loaded.id == image.id and facts["verified"] == "config digest (image ID), architecture"

    wrong = "sha256:" + "0" * 64
    lock2 = write_lock(tmp_path / "wrong.lock", f'name = "t"\nvllm_version = "0"\n'
                       f'image_config_digest = "{wrong}"\nimage_tarball = "tiny.tar"\n')
    with pytest.raises(ImageDigestMismatch) as e:
        rt.ensure_image(lockmod.load(lock2).get("t"), "linux/amd64", noop)
    assert e.value.expected == wrong and e.value.found == image.id
    assert "do not edit the lock to match" in str(e.value)

    lock3 = write_lock(tmp_path / "gone.lock", f'name = "t"\nvllm_version = "0"\n'
                       f'image_config_digest = "{wrong}"\nimage_tarball = "missing.tar"\n')
    with pytest.raises(ImageError, match="missing.tar does not exist"):
        rt.ensure_image(lockmod.load(lock3).get("t"), "linux/amd64", noop)
    docker_client.images.remove(image.id, force=True)


@pytest.fixture
def registry(tmp_path):
    from tests.registry_util import LocalRegistry

    (tmp_path / "registry").mkdir()
    reg = LocalRegistry(tmp_path / "registry").start()
    yield reg
    reg.stop()


def test_lock_resolve_fills_platform_digests_and_pulls_verify_them(docker_client, registry, tmp_path):
    name = "serving-truth/tiny"
    amd = registry.push_image(name, "amd64-only", "amd64", f"amd64 {tmp_path}")
    arm = registry.push_image(name, "arm64-only", "arm64", f"arm64 {tmp_path}")
    index = registry.push_index(name, "v1", [(amd[0], amd[1], "amd64"), (arm[0], arm[1], "arm64")])
    repo = f"{registry.host}/{name}"
    lock = write_lock(tmp_path / "images.lock",
                      f'name = "multi"\nvllm_version = "0"\nimage_tag = "{repo}:v1"\nnote = "kept"\n')
    # a tag alone cannot be audited; the error says how to pin it
    r = subprocess.run([*CLI, "audit", "multi", "--runtime", "docker", "--lock", str(lock)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == ExitCode.USAGE and "serving-truth lock resolve multi" in r.stderr

    r = subprocess.run([*CLI, "lock", "resolve", "multi", "--lock", str(lock)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr
    pin = lockmod.load(lock).get("multi")
    assert pin.image == f"{repo}@{index}"
    assert pin.platform_digests == {"linux/amd64": amd[0], "linux/arm64": arm[0]}
    assert pin.note == "kept" and pin.image_tag == f"{repo}:v1"
    again = subprocess.run([*CLI, "lock", "resolve", "multi", "--lock", str(lock)], cwd=ROOT,
                           capture_output=True, text=True)
    assert again.returncode == 0 and "already records" in again.stderr

    rt = DockerRuntime(lock_dir=tmp_path, client=docker_client)
    pulled = []
    try:
        for platform, (digest, _, config) in (("linux/amd64", amd), ("linux/arm64", arm)):
            image, facts = rt.ensure_image(pin, platform, noop)
            pulled.append(image.id)
            # each platform is checked against its own manifest digest, never the other's
            assert facts["ref"] == f"{repo}@{digest}" and f"{repo}@{digest}" in facts["repo_digests"]
            assert facts["platform"] == platform and image.id == config
        # a lock whose platform entries are swapped is caught (the false-drift case, made loud)
        swapped = lock.read_text().replace(amd[0], "AMD").replace(arm[0], amd[0]).replace("AMD", arm[0])
        (tmp_path / "swapped.lock").write_text(swapped)
        with pytest.raises(ImageError, match="is a linux/arm64 image, the cells need linux/amd64"):
            rt.ensure_image(lockmod.load(tmp_path / "swapped.lock").get("multi"), "linux/amd64", noop)
    finally:
        for image_id in pulled:
            docker_client.images.remove(image_id, force=True)


def test_lock_resolve_without_a_registry_fails_clearly(tmp_path):
    from tests.registry_util import free_port

    lock = write_lock(tmp_path / "images.lock",
                      f'name = "p"\nvllm_version = "0"\nimage_tag = "localhost:{free_port()}/x/y:v1"\n')
    before = lock.read_bytes()
    r = subprocess.run([*CLI, "lock", "resolve", "p", "--lock", str(lock)], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == ExitCode.ENVIRONMENT
    assert "cannot reach http://localhost:" in r.stderr and "image_config_digest" in r.stderr
    assert lock.read_bytes() == before


def test_registry_errors_are_typed():
    from audit.pins.registry import Registry

    with pytest.raises(RegistryError) as e:
        Registry("localhost:1").manifest("x", "latest")
    assert e.value.registry == "localhost:1"


# --- the audit inside the pinned image ------------------------------------------------------------
def managed(client, **labels):
    filters = {"label": [f"{LABEL_MANAGED}=1"] + [f"{k}={v}" for k, v in labels.items()]}
    return client.containers.list(all=True, filters=filters)


@pytest.fixture(scope="module")
def local_like_the_image(vllm_env, tmp_path_factory):
    """The docker test's cells run by the local runtime arranged as the test image is (the pin's shipped resolution:
    its own nvcc wheel, no flashinfer-cubin package, no flashinfer-cubin variable), not as the official image the
    session's runs stand for: the Docker runtime runs its image as it is, so only a local run of the same host can
    match it."""
    from audit.models.kimi_k3 import KIMI_K3, LAYOUTS
    from audit.runtimes import RunRequest
    from audit.runtimes.local import LocalRuntime
    from audit.systems import SYSTEMS

    _, pin, _ = vllm_env
    rt = LocalRuntime(with_cuda_toolkit=True, with_flashinfer_cubin=False)
    run_dir = tmp_path_factory.mktemp("local-like-image")
    req = RunRequest(pin=pin, profile=KIMI_K3, run_dir=run_dir, parallel=2,
                     cells=[(SYSTEMS[s], LAYOUTS[l]) for s in ("h100_sxm", "b200_sxm") for l in ("tp8", "dep8")])
    return req, rt.run(req, lambda *a, **k: None)


def test_docker_audit_matches_the_local_runtime_and_leaks_no_secret(docker_client, vllm_image, local_like_the_image,
                                                                    tmp_path):
    from tests.compare import comparable, local_cells

    reports = tmp_path / "reports"
    env = {**os.environ, "VLLM_TEST_API_KEY": SECRET_PASSED, "HF_TOKEN": SECRET_HOST}
    r = subprocess.run([*CLI, "audit", vllm_image["pin"], "--runtime", "docker", "--lock", str(vllm_image["lock"]),
                        "--systems", "h100_sxm,b200_sxm", "--layouts", "tp8,dep8", "--reports", str(reports),
                        "--pass-env", "VLLM_TEST_API_KEY"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=3600)
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-4000:]
    report = reports / vllm_image["pin"]
    docker_routing = json.loads((report / "routing.json").read_text())
    local = local_cells(local_like_the_image)
    compared = 0
    for cell in docker_routing["cells"]:
        key = (cell["system"], cell["layout"])
        assert cell["status"] in ("COMPLETE", "PARTIAL"), (key, cell.get("failure"))  # h100 dep8: MegaMoE needs SM100
        assert comparable(cell) == comparable(local[key]), key
        compared += 1
    assert compared == 4

    ledger = (report / "ledger.md").read_text()
    assert f"image ID `{vllm_image['image_id']}`" in ledger
    assert "verified against images.lock: config digest (image ID), architecture, vLLM 0.33.0 in the image" in ledger
    assert "vLLM 0.33.0 (`g4ba787ec9`)" in ledger and "none visible in the container (resolve mode" in ledger
    # the passed variable reached the container (it is in the evidence, redacted); the host's did not
    run_dir = Path([l.split("evidence: ", 1)[1].strip() for l in r.stderr.splitlines()
                    if l.startswith("evidence: ")][0])
    for path in [*reports.rglob("*"), *run_dir.rglob("*")]:
        if path.is_file():
            data = path.read_bytes()
            assert SECRET_PASSED.encode() not in data and SECRET_HOST.encode() not in data, path
    fingerprints = [json.loads(line) for p in (run_dir / "evidence").rglob("evidence-*.jsonl")
                    for line in p.read_text().splitlines() if '"fingerprint"' in line]
    envs = [f["env"] for f in fingerprints if f.get("kind") == "fingerprint"]
    assert envs and all(e.get("VLLM_TEST_API_KEY") == "<redacted>" for e in envs)
    assert not any("HF_TOKEN" in e for e in envs)
    assert managed(docker_client, **{LABEL_RUN: run_dir.name}) == []


def _start_audit(vllm_image, reports: Path, *extra, env=None):
    return subprocess.Popen([*CLI, "audit", vllm_image["pin"], "--runtime", "docker", "--lock",
                             str(vllm_image["lock"]), "--systems", "b200_sxm", "--layouts", "tp8", "--reports",
                             str(reports), "--expectations", "none", *extra],
                            cwd=ROOT, env=env or dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_agent(client, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [c for c in managed(client, **{LABEL_ROLE: "agent"})
                 if c.labels.get(LABEL_OWNER, "").endswith(f":{proc.pid}")]
        if found and found[0].status == "running":
            return found[0]
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.3)
    raise AssertionError("the agent container never started")


@pytest.fixture
def previous_report(tmp_path, vllm_image):
    reports = tmp_path / "reports"
    d = reports / vllm_image["pin"]
    d.mkdir(parents=True)
    (d / "ledger.md").write_text("previous ledger\n")
    (d / "routing.json").write_text("{}\n")
    return reports, {p.name: p.read_bytes() for p in d.iterdir()}


def _incomplete_ledger(stderr: str) -> Path:
    line = [l for l in stderr.splitlines() if l.startswith("an INCOMPLETE ledger of what was observed: ")]
    assert line, stderr[-3000:]
    return Path(line[0].split(": ", 1)[1].strip())


def test_container_is_hardened_and_killing_it_leaves_nothing(docker_client, vllm_image, previous_report):
    reports, before = previous_report
    env = {**os.environ, "HF_TOKEN": SECRET_HOST}
    proc = _start_audit(vllm_image, reports, env=env)
    try:
        container = _wait_for_agent(docker_client, proc)
        attrs = docker_client.api.inspect_container(container.id)
        host = attrs["HostConfig"]
        assert host["NetworkMode"] == "none"
        assert host["CapDrop"] == ["ALL"] and not host.get("CapAdd")
        assert "no-new-privileges" in host["SecurityOpt"]
        assert host["ReadonlyRootfs"] is True and not host.get("Privileged")
        assert not host.get("DeviceRequests") and not host.get("Devices")
        assert set(host["Tmpfs"]) == {"/tmp"}
        mounts = {m["Destination"]: m for m in attrs["Mounts"]}
        assert mounts["/serving-truth/run"]["RW"] is False
        assert mounts["/serving-truth/stub"]["RW"] is False
        assert mounts["/serving-truth/run/evidence"]["RW"] is True
        assert len(mounts) == 3
        assert attrs["Config"]["User"] == f"{os.getuid()}:{os.getgid()}"
        assert not any(SECRET_HOST in e for e in attrs["Config"]["Env"])
        assert attrs["Config"]["Image"] == vllm_image["image_id"]
        assert container.labels[LABEL_MANAGED] == "1" and container.labels["serving-truth.pin"] == vllm_image["pin"]
        container.kill()
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.RUN_FAILED, err[-3000:]
    assert "exited early: exit code 137 (killed by signal 9)" in err
    assert managed(docker_client, **{LABEL_RUN: container.labels[LABEL_RUN]}) == []
    d = reports / vllm_image["pin"]
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before
    text = _incomplete_ledger(err).read_text()
    assert "INCOMPLETE RUN (exited)" in text and "killed by signal 9" in text


def test_timeout_stops_the_container_and_keeps_the_previous_ledger(docker_client, vllm_image, previous_report):
    reports, before = previous_report
    proc = _start_audit(vllm_image, reports, "--timeout", "15")
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == ExitCode.RUN_FAILED, err[-3000:]
    assert "timed out after 15s and was stopped" in err and "exited early" not in err
    assert managed(docker_client, **{LABEL_OWNER: f"{os.uname().nodename}:{proc.pid}"}) == []
    assert {p.name: p.read_bytes() for p in (reports / vllm_image["pin"]).iterdir()} == before
    assert "INCOMPLETE RUN (timeout)" in _incomplete_ledger(err).read_text()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_harness_removes_its_container(docker_client, vllm_image, previous_report, sig):
    reports, before = previous_report
    proc = _start_audit(vllm_image, reports)
    container = _wait_for_agent(docker_client, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == ExitCode.INTERRUPTED, err[-3000:]
    assert managed(docker_client, **{LABEL_RUN: container.labels[LABEL_RUN]}) == []
    assert {p.name: p.read_bytes() for p in (reports / vllm_image["pin"]).iterdir()} == before


def test_sigkill_of_the_harness_stops_its_container(docker_client, vllm_image, previous_report):
    """The harness holds the container's stdin open; SIGKILL closes it and the agent ends itself."""
    reports, before = previous_report
    proc = _start_audit(vllm_image, reports)
    container = _wait_for_agent(docker_client, proc)
    assert container.attrs["Config"]["OpenStdin"] and container.attrs["Config"]["StdinOnce"]
    proc.kill()
    proc.wait()
    deadline = time.time() + 60
    while time.time() < deadline:
        container.reload()
        if container.status in ("exited", "dead"):
            break
        time.sleep(0.5)
    assert container.status in ("exited", "dead"), "the container outlived its harness"
    assert container.attrs["State"]["ExitCode"] == 137  # the agent killed its own process group
    assert {p.name: p.read_bytes() for p in (reports / vllm_image["pin"]).iterdir()} == before
    removed = sweep(docker_client)  # the dead harness's stopped container is swept as before
    assert container.name in removed


def test_containers_of_a_dead_harness_are_swept(docker_client, vllm_image):
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = os.uname().nodename
    made = []
    for owner, run in ((f"{host}:{dead.pid}", "sweep-dead"), (f"{host}:{os.getpid()}", "sweep-alive")):
        made.append(docker_client.containers.create(
            vllm_image["image_id"], entrypoint=["python3"], command=["-c", "import time; time.sleep(600)"],
            network_mode="none", labels={LABEL_MANAGED: "1", LABEL_RUN: run, LABEL_OWNER: owner}))
    try:
        r = subprocess.run([*CLI, "clean-containers"], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert managed(docker_client, **{LABEL_RUN: "sweep-dead"}) == []
        assert len(managed(docker_client, **{LABEL_RUN: "sweep-alive"})) == 1  # its harness is alive
        assert sweep(docker_client, run_id="sweep-alive") and managed(docker_client, **{LABEL_RUN: "sweep-alive"}) == []
    finally:
        for c in made:
            try:
                c.remove(force=True)
            except Exception:
                pass


PLUGIN_SCRIPT = r"""
import multiprocessing as mp, os, sys
from vllm.plugins import load_general_plugins

def child():
    load_general_plugins()  # what vLLM does at the start of every process it spawns

if __name__ == "__main__":
    load_general_plugins()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    p = mp.get_context("spawn").Process(target=child)
    p.start(); p.join()
    print("exit", p.exitcode)
"""


def test_vllm_loads_the_probe_plugin_in_every_process_of_the_unchanged_image(docker_client, vllm_image, tmp_path):
    """The staged entry point reaches the main process, a forked child and a spawned child, through
    vLLM's own plugin loader inside the image; each writes its own evidence file."""
    from docker.types import Mount

    from audit.runtimes.base import stage_probes

    stage = tmp_path / "stage"
    stage.mkdir()
    stage_probes(stage)
    (stage / "script.py").write_text(PLUGIN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    c = docker_client.containers.create(
        vllm_image["image_id"], entrypoint=["python3"], command=["/st/script.py"], network_mode="none",
        cap_drop=["ALL"], read_only=True, tmpfs={"/tmp": ""}, user=f"{os.getuid()}:{os.getgid()}",
        labels={LABEL_MANAGED: "1", LABEL_RUN: "plugin-test", LABEL_OWNER: f"{os.uname().nodename}:{os.getpid()}"},
        environment={"PYTHONPATH": "/st", "VLLM_PLUGINS": "serving_truth", "SERVING_TRUTH_OUT": "/out",
                     "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"},
        mounts=[Mount("/st", str(stage), type="bind", read_only=True), Mount("/out", str(out), type="bind")])
    try:
        c.start()
        code = c.wait(timeout=600)["StatusCode"]
        logs = c.logs().decode()
    finally:
        c.remove(force=True)
    assert code == 0 and "exit 0" in logs, logs[-3000:]
    files = sorted(out.glob("evidence-*.jsonl"))
    headers = [json.loads(p.read_text().splitlines()[0]) for p in files]
    events = [[json.loads(l).get("event") for l in p.read_text().splitlines()[1:]] for p in files]
    assert len(files) == 3, (files, logs[-2000:])
    assert len({h["pid"] for h in headers}) == 3
    assert sorted(e[0] for e in events) == ["forked", "loaded", "loaded"]
    forked = headers[[e[0] for e in events].index("forked")]
    assert forked["parent_pid"] in {h["pid"] for h in headers}

