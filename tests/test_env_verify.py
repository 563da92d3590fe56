"""The pinned environment is trusted only after checking it (issue 12, items 5 and 13): lock fields never put
a path outside the cache, nothing outside it is deleted or run, and the installed files must match the
sha256s in the pinned wheel's own RECORD before an audit. A small wheel with a real RECORD stands in for
vLLM's (the real environment is shared and is never modified by a test); the last test reads the real one."""
import json
import stat
import subprocess
import time
import zipfile

import pytest

from audit.pins import lock as lockmod
from audit.errors import EnvironmentModified, ExitCode, UnsafeLockPath
from audit.runtimes.local import ENV_MARKER, LocalRuntime, find_python
from tests.conftest import ROOT
from tests.wheel_index_util import make_wheel, sha256_of

VERSION = "0.34.0rc1.dev5+gabcdef012"
NOP = lambda *a, **k: None  # noqa: E731


@pytest.fixture
def fake_env(tmp_path):
    """A cache holding a small vLLM wheel and an environment made from it the way pip lays it out (a real
    venv of the pinned Python, the wheel's files in site-packages, the build marker)."""
    root = tmp_path / "cache"
    wheel = make_wheel(root / "wheels", VERSION, commit="abcdef012",
                       files={"vllm/engine.py": b"ENGINE = 1\n", "vllm/_C.abi3.so": b"\x7fELF fake\n"})
    pin = lockmod.Pin(name="nightly", version=VERSION, wheel=wheel.name, wheel_sha256=sha256_of(wheel))
    rt = LocalRuntime(root=root)
    env = rt.env_dir(pin)
    subprocess.run([find_python(pin.python), "-m", "venv", "--without-pip", str(env)], check=True)
    site = rt.site_packages(env)
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    (env / ENV_MARKER).write_text(json.dumps({"wheel_sha256": pin.wheel_sha256, "vllm": VERSION}))
    return rt, pin, env, site


def test_an_intact_environment_is_verified_and_says_so(fake_env):
    rt, pin, env, _ = fake_env
    assert rt.ensure_env(pin, NOP) == env
    summary = rt.verified[str(env)]
    assert summary["files"] == 6 and summary["sha256"] == pin.wheel_sha256  # every RECORD row with a hash
    assert summary["text"].startswith(f"verified before the audit: the 6 files {pin.wheel} installs match")


@pytest.mark.parametrize("tamper, listed", [
    (lambda env, site: (site / "vllm" / "engine.py").write_text("ENGINE = 2\n"), "modified: vllm/engine.py"),
    (lambda env, site: (site / "vllm" / "_C.abi3.so").write_bytes(b"\x7fELF fake\n\x00"), "modified: vllm/_C.abi3.so"),
    (lambda env, site: (site / "vllm" / "engine.py").unlink(), "missing: vllm/engine.py"),
    (lambda env, site: (site / "zz-hook.pth").write_text("import os\n"), "not installed by any wheel: zz-hook.pth"),
    (lambda env, site: (site / "sitecustomize.py").write_text("x = 1\n"), "not installed by any wheel: sitecustomize.py"),
    # the same bytes under the RECORD's name but reached through a link are not the installed file
    (lambda env, site: _relink(site / "vllm" / "engine.py"), "missing: vllm/engine.py"),
    (lambda env, site: _replace_python(env), "modified: bin/python"),
])
def test_a_modified_environment_is_refused(fake_env, tamper, listed):
    rt, pin, env, site = fake_env
    tamper(env, site)
    with pytest.raises(EnvironmentModified) as e:
        rt.ensure_env(pin, NOP)
    assert listed in str(e.value), str(e.value)
    assert e.value.exit_code == ExitCode.ENVIRONMENT and f"rm -rf {env}" in str(e.value)
    # the remedy drops uv's cached copy too (the environment's files are hard links into it: a rebuild alone
    # would link the edited file again)
    assert f"uv cache clean vllm --cache-dir {rt.root / 'uv-cache'}" in str(e.value)
    assert env.exists()  # refused, not silently rebuilt


def test_the_check_reads_the_wheels_record_not_the_installed_copy(fake_env):
    """Editing the installed RECORD along with a file does not help: the wheel's own RECORD is the reference."""
    rt, pin, env, site = fake_env
    (site / "vllm" / "engine.py").write_text("ENGINE = 2\n")
    record = next(site.glob("*.dist-info/RECORD"))
    record.write_text("\n".join(r for r in record.read_text().splitlines() if not r.startswith("vllm/engine.py")))
    with pytest.raises(EnvironmentModified, match="modified: vllm/engine.py"):
        rt.ensure_env(pin, NOP)


def test_an_altered_cached_wheel_is_not_the_reference(fake_env):
    """The cached wheel is re-checked against images.lock first: one that was changed is not used (it is
    fetched again from the pin's source; here a URL where nothing listens)."""
    from dataclasses import replace

    from audit.errors import WheelSourceError
    from tests.wheel_index_util import closed_port

    rt, pin, env, _ = fake_env
    cached = rt.root / "wheels" / pin.wheel
    cached.write_bytes(cached.read_bytes() + b"\0")
    pin = replace(pin, wheel_url=f"http://127.0.0.1:{closed_port()}/{pin.wheel}")
    with pytest.raises(WheelSourceError, match="cannot reach"):
        rt.ensure_env(pin, NOP)


def _relink(path):
    data = path.read_bytes()
    other = path.with_name("elsewhere.py")
    other.write_bytes(data)
    path.unlink()
    path.symlink_to(other)


def _replace_python(env):
    exe = env / "bin" / "python"
    exe.unlink()
    exe.write_text("#!/bin/sh\necho /elsewhere\necho 3.12\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


# -- paths from lock fields --------------------------------------------------------------------------------
def test_a_hostile_version_never_deletes_or_runs_outside_the_cache(tmp_path):
    """Issue 12 item 5, reproduced with a Pin built directly (load() already refuses it with file:line): a
    directory outside the cache with a planted marker and interpreter is neither deleted nor run."""
    root = tmp_path / "cache"
    outside = tmp_path / "x"
    (outside / "bin").mkdir(parents=True)
    sentinel = tmp_path / "ran"
    (outside / "bin" / "python").write_text(f"#!/bin/sh\ntouch {sentinel}\n")
    (outside / "bin" / "python").chmod(0o755)
    sha = "a" * 64
    (outside / ENV_MARKER).write_text(json.dumps({"wheel_sha256": sha}))
    pin = lockmod.Pin(name="evil", version="0.33.0-cp312-x/../../../x", wheel="vllm-0.33.0-cp38-abi3-x.whl",
                      wheel_sha256=sha)
    rt = LocalRuntime(root=root)
    for call in (lambda: rt.ensure_env(pin, NOP), lambda: rt.wheel_path(pin, NOP)):
        with pytest.raises(UnsafeLockPath) as e:
            call()
        assert e.value.field == "vllm_version" and e.value.exit_code == ExitCode.ENVIRONMENT
    assert (outside / ENV_MARKER).exists() and not sentinel.exists()
    bad_wheel = lockmod.Pin(name="evil", version="0.33.0", wheel="../../x/vllm-0.33.0-cp38-abi3-x.whl",
                            wheel_sha256=sha)
    with pytest.raises(UnsafeLockPath, match="wheel"):
        rt.wheel_path(bad_wheel, NOP)


def test_an_environment_that_is_a_link_out_of_the_cache_is_refused(tmp_path):
    root = tmp_path / "cache"
    pin = lockmod.Pin(name="p", version="0.33.0", wheel="vllm-0.33.0-cp38-abi3-x.whl", wheel_sha256="b" * 64)
    rt = LocalRuntime(root=root)
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / ENV_MARKER).write_text(json.dumps({"wheel_sha256": "b" * 64}))
    env = root / "envs" / f"vllm-0.33.0-cp312-{'b' * 12}"
    env.parent.mkdir(parents=True)
    env.symlink_to(target)
    with pytest.raises(UnsafeLockPath, match="symbolic link"):
        rt.ensure_env(pin, NOP)
    assert (target / ENV_MARKER).exists()


@pytest.mark.vllm
def test_the_real_environment_verifies(vllm_env):
    """The v0.33.0 environment the other tests use matches its wheel's RECORD, and the check is cheap
    relative to an audit (the whole installed vLLM is hashed)."""
    rt, pin, env = vllm_env
    t0 = time.monotonic()
    summary = rt.verify_env(env, pin, rt.wheels.find(pin), NOP)
    took = time.monotonic() - t0
    assert summary["files"] > 5000 and summary["skipped"] == 0
    assert took < 60, f"verifying took {took:.1f}s"


def test_a_hostile_lock_is_bad_input_before_anything_is_touched(tmp_path):
    """The reproduction of issue 12 item 5 through the command line: exit 2 with file:line and a hint; the
    planted directory outside the cache is still there and its interpreter never ran."""
    import os
    import sys

    from tests.conftest import ROOT

    cache = tmp_path / "cache"
    outside = tmp_path / "x"
    (outside / "bin").mkdir(parents=True)
    sentinel = tmp_path / "ran"
    (outside / "bin" / "python").write_text(f"#!/bin/sh\ntouch {sentinel}\n")
    (outside / "bin" / "python").chmod(0o755)
    (outside / ENV_MARKER).write_text(json.dumps({"wheel_sha256": "a" * 64}))
    lock = tmp_path / "images.lock"
    lock.write_text('schema = 1\n\n[[pin]]\nname = "evil"\n'
                    f'vllm_version = "0.33.0-cp312-x/../../../../{outside.name}"\n'
                    'wheel = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"\n'
                    f'wheel_sha256 = "{"a" * 64}"\n')
    for args in (["audit", "evil"], ["env", "evil"]):
        r = subprocess.run([sys.executable, "-m", "audit.cli", *args, "--lock", str(lock)], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "SERVING_TRUTH_CACHE": str(cache)})
        assert r.returncode == ExitCode.USAGE, r.stderr
        assert f"{lock}:5: pin 'evil': vllm_version" in r.stderr and "is not a PEP 440 version" in r.stderr
        assert "hint:" in r.stderr
    assert (outside / ENV_MARKER).exists() and not sentinel.exists() and not (cache / "envs").exists()


def test_unchanged_files_are_not_read_again_and_an_edit_is_still_caught(fake_env, monkeypatch):
    """The second check re-reads no file whose inode, size, mtime and ctime are unchanged since it was hashed;
    an edit that keeps the size and puts the mtime back still moves the ctime, and is refused."""
    import os

    from audit.runtimes import environment

    rt, pin, env, site = fake_env
    rt.ensure_env(pin, NOP)
    reads = []
    real = environment.hashlib.file_digest
    monkeypatch.setattr(environment.hashlib, "file_digest", lambda fh, algo: reads.append(fh.name) or real(fh, algo))
    again = LocalRuntime(root=rt.root)
    assert again.ensure_env(pin, NOP) == env and reads == []
    target = site / "vllm" / "engine.py"
    before = target.stat()
    time.sleep(0.01)
    target.write_text("ENGINE = 3\n")  # same size
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(EnvironmentModified, match="modified: vllm/engine.py"):
        LocalRuntime(root=rt.root).ensure_env(pin, NOP)
    assert str(target) in reads
    # --no-cache hashes every file, memo or not
    target.write_text("ENGINE = 1\n")
    reads.clear()
    full = LocalRuntime(root=rt.root)
    full.stat_memo = False
    full.ensure_env(pin, NOP)
    assert len(reads) == 6


def test_every_pinned_wheel_ships_its_resolution_and_it_pins_every_package():
    """A pin's environment is installed under pip's resolution for its wheel (uv alone may pick another valid set:
    for v0.32.0 it picks cuda-python 12.6.2.post1 beside cuda-bindings 13.5.0, where cutlass-dsl fails to import)."""
    from audit.pins import lock as lockmod
    from audit.runtimes.environment import ENV_LOCKS

    for pin in lockmod.load(ROOT / "images.lock").pins.values():
        if not pin.wheel_sha256:
            continue
        text = (ENV_LOCKS / f"{pin.wheel_sha256[:16]}.txt").read_text(encoding="utf-8")
        assert pin.wheel in text.splitlines()[0] and pin.wheel_sha256 in text.splitlines()[0]
        pins = [l for l in text.splitlines() if l and not l.startswith("#")]
        assert pins == sorted(pins) and all("==" in l for l in pins) and len(pins) > 150, pin.name
        assert not any(l.startswith(f"{pin.engine_contract.package}==") for l in pins)
        assert any(l.startswith("torch==") for l in pins)


def test_a_resolution_is_written_from_pips_report_without_vllm_itself():
    from audit.runtimes.environment import resolution_text

    report = {"install": [{"metadata": {"name": "vllm", "version": "0.33.0"}},
                          {"metadata": {"name": "Torch", "version": "2.14.0"}},
                          {"metadata": {"name": "cuda-python", "version": "13.4.4"}}]}
    text = resolution_text(report, "vllm-0.33.0-x.whl", "ab" * 32)
    assert text.splitlines()[2:] == ["cuda-python==13.4.4", "torch==2.14.0"] and "vllm-0.33.0-x.whl" in text


def test_concurrent_audits_build_one_environment_once_and_a_dead_build_is_never_taken_for_one(fake_env, monkeypatch):
    """Two audits that need an environment nobody has built yet: the first builds it under the environment's
    lock, the second says it is waiting, then uses what the first built (one build). A build that dies leaves no
    marker, so the next audit builds again instead of using a half-made environment."""
    import threading

    rt, pin, env, site = fake_env
    marker = (env / ENV_MARKER).read_text()
    (env / ENV_MARKER).unlink()
    builds, started = [], threading.Event()

    def slow_build(self, env_, pin_, progress):
        builds.append(env_)
        started.set()
        time.sleep(1.0)
        (env_ / ENV_MARKER).write_text(marker)  # written last, as the real build does
        return env_

    monkeypatch.setattr(LocalRuntime, "_build_env", slow_build)
    said: dict[str, list] = {"first": [], "second": []}
    results = {}

    def audit(name):
        results[name] = LocalRuntime(root=rt.root).ensure_env(pin, lambda kind, **k: said[name].append(k.get("text")))

    first = threading.Thread(target=audit, args=("first",))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=audit, args=("second",))
    second.start()
    first.join(20)
    second.join(20)
    assert results == {"first": env, "second": env} and len(builds) == 1
    assert any("waiting for another audit building the vLLM" in (t or "") for t in said["second"]), said
    assert LocalRuntime(root=rt.root).ensure_env(pin, NOP) == env and len(builds) == 1  # the next audit: no build

    # a build that dies half way: no marker, so it is built again, never used as it is
    (env / ENV_MARKER).unlink()

    def dying_build(self, env_, pin_, progress):
        builds.append(env_)
        raise RuntimeError("killed during uv pip install")

    monkeypatch.setattr(LocalRuntime, "_build_env", dying_build)
    with pytest.raises(RuntimeError):
        LocalRuntime(root=rt.root).ensure_env(pin, NOP)
    monkeypatch.setattr(LocalRuntime, "_build_env", slow_build)
    assert LocalRuntime(root=rt.root).ensure_env(pin, NOP) == env and len(builds) == 3


def test_environments_are_listed_with_their_pins_and_pruned_only_inside_the_cache(fake_env):
    """`serving-truth envs`: each environment with the pins it serves, its own and shared bytes and last use;
    pruning removes what it names (a build that died, one no pin uses) and nothing else."""
    import os

    rt, pin, env, site = fake_env
    other = lockmod.Pin(name="elsewhere", version=VERSION, wheel=pin.wheel, wheel_sha256="b" * 64)
    dead = rt.env_dir(other)  # a build that died: the directory without a marker
    (dead / "bin").mkdir(parents=True)
    (dead / "bin" / "python").write_text("x")
    twin = site / "vllm" / "engine.py"
    os.link(twin, dead / "engine-link.py")  # a file shared by two environments (uv hard-links from its cache)
    rt.ensure_env(pin, NOP)  # an audit uses the pinned one: its last use is recorded
    listing = rt.list_envs([pin])
    rows = {r["name"]: r for r in listing["envs"]}
    assert rows[env.name]["pins"] == ["nightly"] and rows[env.name]["finished"] and rows[env.name]["last_used"]
    assert rows[dead.name]["pins"] == [] and not rows[dead.name]["finished"] and rows[dead.name]["last_used"] is None
    assert rows[env.name]["shared_bytes"] == twin.stat().st_size == rows[dead.name]["shared_bytes"]
    total = sum(r["own_bytes"] + r["shared_bytes"] for r in rows.values())
    assert listing["unique_bytes"] == total - twin.stat().st_size  # the shared file once
    with pytest.raises(ValueError):
        rt.remove_env("../outside")
    (rt.root / "runtime-cache" / dead.name / "pycache").mkdir(parents=True)  # its agents' bytecode and memos
    (rt.root / "runtime-cache" / env.name / "pycache").mkdir(parents=True)
    rt.remove_env(dead.name)
    assert not dead.exists() and env.exists() and twin.read_text() == "ENGINE = 1\n"
    assert not (rt.root / "runtime-cache" / dead.name).exists() and (rt.root / "runtime-cache" / env.name).is_dir()
    assert [r["name"] for r in rt.list_envs([pin])["envs"]] == [env.name]


def test_an_edit_through_one_environment_is_refused_in_every_environment_sharing_the_file(fake_env):
    """uv hard-links a package's files from its cache into every environment: an edit made through one
    environment changes the same inode in the other. Each environment's RECORD check catches it (exit 3), even
    where the file's stat memo from an earlier check would otherwise skip re-reading it."""
    import os

    rt, pin, env, site = fake_env
    version2 = "0.34.0rc1.dev6+gfedcba987"
    wheel2 = make_wheel(rt.root / "wheels", version2, commit="fedcba987",
                        files={"vllm/engine.py": b"ENGINE = 1\n", "vllm/_C.abi3.so": b"\x7fELF fake\n"})
    pin2 = lockmod.Pin(name="other", version=version2, wheel=wheel2.name, wheel_sha256=sha256_of(wheel2))
    env2 = rt.env_dir(pin2)
    subprocess.run([find_python(pin2.python), "-m", "venv", "--without-pip", str(env2)], check=True)
    site2 = rt.site_packages(env2)
    with zipfile.ZipFile(wheel2) as zf:
        zf.extractall(site2)
    for rel in ("vllm/engine.py", "vllm/_C.abi3.so"):  # the same bytes, one inode: what uv's hard links give
        (site2 / rel).unlink()
        os.link(site / rel, site2 / rel)
    (env2 / ENV_MARKER).write_text(json.dumps({"wheel_sha256": pin2.wheel_sha256, "vllm": version2}))
    assert rt.ensure_env(pin, NOP) == env and LocalRuntime(root=rt.root).ensure_env(pin2, NOP) == env2
    time.sleep(0.01)
    (site2 / "vllm" / "engine.py").write_text("ENGINE = 9\n")  # edited through the second environment
    for p in (pin, pin2):
        with pytest.raises(EnvironmentModified, match="modified: vllm/engine.py") as e:
            LocalRuntime(root=rt.root).ensure_env(p, NOP)
        assert e.value.exit_code == ExitCode.ENVIRONMENT
