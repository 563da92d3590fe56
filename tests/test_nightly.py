"""Nightly and pre-release pins (issue 13): vLLM's per-commit wheel index, `lock add`, wheel-URL pins, version
order, the runtime following the pin. Every index here is a loopback server (127.0.0.1); nothing reaches the
internet (SERVING_TRUTH_WHEEL_INDEX / SERVING_TRUTH_GITHUB_API point at a closed port by default below)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from audit.pins import lock as lockmod
from audit.errors import (DownloadHashMismatch, ExitCode, NoWheelForPlatform, TruncatedDownload, WheelHashMismatch,
                          WheelSourceError)
from audit.fsutil import sha256_file
from audit.runtimes.local import LocalRuntime
from audit.pins import wheelindex
from tests.conftest import ROOT, VLLM_PIN
from tests.wheel_index_util import (IndexServer, closed_port, make_wheel, publish_commit, publish_nightly,
                                     sha256_of)

CLI = [sys.executable, "-m", "audit.cli"]
COMMIT = hashlib.sha1(b"vllm main, 2026-07-31").hexdigest()
OTHER = hashlib.sha1(b"another commit").hexdigest()
DEV = f"0.34.0rc1.dev123+g{COMMIT[:9]}"


def _nowhere() -> str:
    return f"http://127.0.0.1:{closed_port()}"


@pytest.fixture(autouse=True)
def no_network_defaults(monkeypatch):
    """Whatever a test forgets to pass, the index and the GitHub API default to a port nothing listens on."""
    monkeypatch.setenv("SERVING_TRUTH_WHEEL_INDEX", _nowhere())
    monkeypatch.setenv("SERVING_TRUTH_GITHUB_API", _nowhere())


@pytest.fixture
def cli_env(tmp_path):
    """Environment for CLI runs: a private cache, and index/API defaults that reach nothing."""
    env = dict(os.environ)
    env["SERVING_TRUTH_CACHE"] = str(tmp_path / "cache")
    env["SERVING_TRUTH_WHEEL_INDEX"] = _nowhere()
    env["SERVING_TRUTH_GITHUB_API"] = _nowhere()
    return env


def cli(*args, env, timeout=600):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


@pytest.fixture
def lock_copy(tmp_path):
    path = tmp_path / "images.lock"
    shutil.copy(ROOT / "images.lock", path)
    return path


@pytest.fixture
def index(tmp_path):
    """A per-commit index holding a synthetic dev wheel of COMMIT (default variant: x86_64 and aarch64; a
    cu130 variant), served on loopback."""
    wheels = tmp_path / "wheels-src"
    x86 = make_wheel(wheels, DEV, commit=COMMIT[:9], files={"vllm/engine.py": b"ENGINE = 1\n"})
    arm = make_wheel(wheels, DEV, commit=COMMIT[:9], plat="manylinux_2_28_aarch64")
    cu130 = make_wheel(wheels / "cu130", DEV + ".cu130", commit=COMMIT[:9])
    root = tmp_path / "index"
    publish_commit(root, COMMIT, {None: [x86, arm], "cu130": [cu130]})
    with IndexServer(root) as srv:
        srv.wheel = x86
        yield srv


# -- lock add against the loopback index ------------------------------------------------------------------
def test_lock_add_commit_picks_the_platform_wheel_and_writes_only_checked_facts(index, lock_copy, cli_env, tmp_path):
    before = lock_copy.read_text()
    r = cli("lock", "add", "nightly-0731", "--commit", COMMIT, "--arch", "x86_64", "--lock", str(lock_copy),
            "--index-url", index.url, env=cli_env)
    assert r.returncode == 0, r.stderr
    text = lock_copy.read_text()
    assert text.startswith(before.rstrip("\n"))  # appended; nothing else touched
    pin = lockmod.load(lock_copy).get("nightly-0731")
    name = f"vllm-{DEV}-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert pin.wheel == name and pin.version == DEV and pin.commit == COMMIT
    assert pin.wheel_sha256 == sha256_of(index.wheel)
    assert pin.wheel_url == f"{index.url}/{COMMIT}/vllm-0.34.0rc1.dev123%2Bg{COMMIT[:9]}-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert "default variant, x86_64" in pin.note
    # the index vLLM writes is what was read: metadata.json, and the wheel through its relative path
    assert f"/{COMMIT}/vllm/metadata.json" in index.requests
    # the wheel is cached where the local runtime looks for it, so the audit does not fetch it again
    cached = LocalRuntime(root=tmp_path / "cache").wheels.find(pin)
    assert cached is not None and sha256_file(cached) == pin.wheel_sha256
    # release order: the nightly follows v0.33.0 and precedes nothing pinned
    lk = lockmod.load(lock_copy)
    assert lockmod.previous_pin(lk, "nightly-0731").name == "v0.33.0"
    order = [p.name for p in lockmod.sorted_pins(lk)]
    assert order.index("nightly-0731") == order.index("v0.33.0") + 1 and order[-1] == "k3-preview"
    pins = cli("pins", "--lock", str(lock_copy), env=cli_env)
    assert pins.returncode == 0
    assert pins.stdout.index("v0.33.0") < pins.stdout.index("nightly-0731") < pins.stdout.index("k3-preview")


def test_lock_add_variant_and_arch(index, lock_copy, tmp_path):
    fields = wheelindex.add_pin(lock_copy, "nightly-arm", commit=COMMIT, arch="aarch64", index_url=index.url,
                                cache_root=tmp_path / "cache")
    assert fields["wheel"].endswith("_aarch64.whl")
    fields = wheelindex.add_pin(lock_copy, "nightly-cu130", commit=COMMIT, arch="x86_64", variant="cu130",
                                index_url=index.url, cache_root=tmp_path / "cache")
    assert fields["vllm_version"] == DEV + ".cu130" and "/cu130/" not in fields["wheel_url"]  # wheels sit at the top
    assert lockmod.load(lock_copy).get("nightly-cu130").wheel_url == fields["wheel_url"]


def test_lock_add_main_as_of_a_date_records_the_commit(index, lock_copy, tmp_path):
    newest = hashlib.sha1(b"newest, no wheel yet").hexdigest()
    index.commits = [{"sha": newest, "commit": {"committer": {"date": "2026-07-31T22:00:00Z"}}},
                     {"sha": COMMIT, "commit": {"committer": {"date": "2026-07-31T18:00:00Z"}}}]
    fields = wheelindex.add_pin(lock_copy, "nightly-0731", as_of="2026-07-31", arch="x86_64", index_url=index.url,
                                github=index.api, cache_root=tmp_path / "cache")
    assert fields["vllm_commit"] == COMMIT
    assert f"main as of 2026-07-31 (end of day UTC): commit {COMMIT} of 2026-07-31T18:00:00Z" in fields["note"]
    assert newest[:12] in fields["note"]  # the newer commit without a wheel is named
    api = [p for p in index.requests if p.startswith("/api/")]
    assert api and "until=2026-07-31T23%3A59%3A59Z" in api[0] and "sha=main" in api[0]


def test_lock_add_nightly_pins_the_commit_the_moving_index_points_at(index, lock_copy, tmp_path):
    publish_nightly(index.root, COMMIT, [index.wheel])
    fields = wheelindex.add_pin(lock_copy, "nightly-1202", nightly=True, arch="x86_64", index_url=index.url,
                                cache_root=tmp_path / "cache")
    assert fields["vllm_commit"] == COMMIT and f"nightly index pointed at commit {COMMIT}" in fields["note"]
    # the pin names the commit's own directory, which does not move, never nightly/
    assert fields["wheel_url"].startswith(f"{index.url}/{COMMIT}/") and "/nightly/" not in fields["wheel_url"]


def test_lock_add_short_commit_is_looked_up(index, lock_copy, tmp_path):
    index.commits = [{"sha": COMMIT, "commit": {"committer": {"date": "2026-07-31T18:00:00Z"}}}]
    fields = wheelindex.add_pin(lock_copy, "n", commit=COMMIT[:10], arch="x86_64", index_url=index.url,
                                github=index.api, cache_root=tmp_path / "cache")
    assert fields["vllm_commit"] == COMMIT


def test_lock_add_wheel_url_and_local_file(index, lock_copy, tmp_path):
    url = f"{index.url}/{COMMIT}/" + index.wheel.name.replace("+", "%2B")
    fields = wheelindex.add_pin(lock_copy, "by-url", wheel_url=url, sha256=sha256_of(index.wheel),
                                cache_root=tmp_path / "cache")
    assert fields["vllm_commit"] == "g" + COMMIT[:9]  # what the wheel reports, when no commit was given
    fields = wheelindex.add_pin(lock_copy, "by-file", wheel_url=index.wheel.resolve().as_uri(),
                                cache_root=tmp_path / "cache")
    assert fields["wheel_url"].startswith("file:///") and fields["wheel_sha256"] == sha256_of(index.wheel)
    assert lockmod.load(lock_copy).get("by-file").runtimes == ["local"]


def test_lock_add_with_an_image_tag_resolves_it_through_the_registry(index, lock_copy, tmp_path):
    """--image-tag beside --commit: the tag becomes a digest (and per-platform digests) read from the registry,
    as `lock resolve` does; the pin has both, and the audit uses the wheel unless docker is asked for."""
    from tests.registry_util import LocalRegistry

    if not shutil.which("docker-registry"):
        pytest.skip("docker-registry is not installed (.ci/run installs it)")
    (tmp_path / "registry").mkdir()
    reg = LocalRegistry(tmp_path / "registry").start()
    try:
        amd = reg.push_image("vllm/vllm-openai", f"nightly-{COMMIT}", "amd64", "nightly")
        tag = f"{reg.host}/vllm/vllm-openai:nightly-{COMMIT}"
        fields = wheelindex.add_pin(lock_copy, "nightly-0731", commit=COMMIT, arch="x86_64", image_tag=tag,
                                    index_url=index.url, cache_root=tmp_path / "cache")
        image_only = wheelindex.add_pin(lock_copy, "nightly-image", image_tag=tag, vllm_version=DEV,
                                        cache_root=tmp_path / "cache")
    finally:
        reg.stop()
    pin = lockmod.load(lock_copy).get("nightly-0731")
    assert pin.image == f"{reg.host}/vllm/vllm-openai@{amd[0]}" and pin.platform_digests == {"linux/amd64": amd[0]}
    assert pin.image_tag == tag and pin.wheel_url == fields["wheel_url"]
    assert pin.runtimes == ["local", "docker"] and lockmod.default_runtime(pin) == "local"
    only = lockmod.load(lock_copy).get("nightly-image")
    assert only.runtimes == ["docker"] and only.version == DEV and "as given to lock add" in image_only["note"]


# -- bad cases: a clear error, images.lock byte-identical, nothing left in the cache --------------------------
def _unchanged(lock_copy, before, cache):
    assert lock_copy.read_bytes() == before
    left = [p for p in (cache / "wheels").rglob("*") if p.is_file()] if (cache / "wheels").exists() else []
    assert left == []


def test_unreachable_index(lock_copy, cli_env, tmp_path):
    before = lock_copy.read_bytes()
    r = cli("lock", "add", "n", "--commit", COMMIT, "--lock", str(lock_copy), env=cli_env)  # the env default: closed
    assert r.returncode == ExitCode.ENVIRONMENT, r.stderr
    assert "cannot reach http://127.0.0.1:" in r.stderr and "--index-url" in r.stderr
    _unchanged(lock_copy, before, tmp_path / "cache")


def test_commit_not_in_index_is_404(index, lock_copy, cli_env, tmp_path):
    before = lock_copy.read_bytes()
    r = cli("lock", "add", "n", "--commit", OTHER, "--lock", str(lock_copy), "--index-url", index.url, env=cli_env)
    assert r.returncode == ExitCode.ENVIRONMENT, r.stderr
    assert f"no wheel index for commit {OTHER}" in r.stderr and "HTTP 404" in r.stderr
    _unchanged(lock_copy, before, tmp_path / "cache")


def test_hash_mismatch_announced_by_the_index(tmp_path, lock_copy):
    wheel = make_wheel(tmp_path / "src", DEV, commit=COMMIT[:9])
    publish_commit(tmp_path / "index", COMMIT, {None: [wheel]}, sha_fragment={wheel.name: "0" * 64})
    before = lock_copy.read_bytes()
    with IndexServer(tmp_path / "index") as srv, pytest.raises(DownloadHashMismatch) as e:
        wheelindex.add_pin(lock_copy, "n", commit=COMMIT, arch="x86_64", index_url=srv.url, cache_root=tmp_path / "cache")
    assert e.value.expected == "0" * 64 and e.value.found == sha256_of(wheel)
    assert "the index's #sha256= link says" in str(e.value) and e.value.exit_code == ExitCode.ENVIRONMENT
    _unchanged(lock_copy, before, tmp_path / "cache")


def test_hash_mismatch_given_by_the_user(index, lock_copy, cli_env, tmp_path):
    before = lock_copy.read_bytes()
    url = f"{index.url}/{COMMIT}/" + index.wheel.name.replace("+", "%2B")
    r = cli("lock", "add", "n", "--wheel-url", url, "--sha256", "f" * 64, "--lock", str(lock_copy), env=cli_env)
    assert r.returncode == ExitCode.ENVIRONMENT and "--sha256 says " + "f" * 64 in r.stderr, r.stderr
    _unchanged(lock_copy, before, tmp_path / "cache")


def test_truncated_download(index, lock_copy, tmp_path):
    index.truncate.add(f"/{COMMIT}/" + index.wheel.name.replace("+", "%2B"))
    before = lock_copy.read_bytes()
    with pytest.raises(TruncatedDownload) as e:
        wheelindex.add_pin(lock_copy, "n", commit=COMMIT, arch="x86_64", index_url=index.url, cache_root=tmp_path / "cache")
    size = index.wheel.stat().st_size
    assert e.value.expected_bytes == size and e.value.received_bytes == size // 2
    _unchanged(lock_copy, before, tmp_path / "cache")


def test_a_download_larger_than_its_bound_is_refused_and_a_killed_ones_partial_is_swept(index, lock_copy, tmp_path,
                                                                                          monkeypatch):
    """A server announcing 10^15 bytes is refused before a byte is read (the ceiling, SERVING_TRUTH_MAX_DOWNLOAD_BYTES);
    a body past the ceiling is stopped; a partial file a killed download left (its process gone) is swept by the next
    download, one of a live process is not."""
    import subprocess

    from audit.errors import DownloadError
    from audit.pins import fetch

    wheel_path = f"/{COMMIT}/" + index.wheel.name.replace("+", "%2B")
    index.announce[wheel_path] = 10 ** 15
    before = lock_copy.read_bytes()
    with pytest.raises(DownloadError, match="announces 1000000000000000 bytes, more than the"):
        wheelindex.add_pin(lock_copy, "n", commit=COMMIT, arch="x86_64", index_url=index.url,
                           cache_root=tmp_path / "cache")
    _unchanged(lock_copy, before, tmp_path / "cache")
    ceiling = index.wheel.stat().st_size // 2
    index.announce[wheel_path] = None  # announces no length, sends the whole file
    monkeypatch.setenv(fetch.MAX_DOWNLOAD_ENV, str(ceiling))
    with pytest.raises(DownloadError, match="sent more than the"):
        fetch.download(index.url + wheel_path, tmp_path / "dl" / index.wheel.name)
    assert not list((tmp_path / "dl").iterdir())
    monkeypatch.delenv(fetch.MAX_DOWNLOAD_ENV)
    del index.announce[wheel_path]
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / "dl" / f".partial-{dead.pid}-{index.wheel.name}"
    alive = tmp_path / "dl" / f".partial-{os.getppid()}-{index.wheel.name}"
    stale.write_bytes(b"half a wheel")
    alive.write_bytes(b"another download, running")
    fetch.download(index.url + wheel_path, tmp_path / "dl" / index.wheel.name)
    assert not stale.exists() and alive.exists() and (tmp_path / "dl" / index.wheel.name).is_file()


def test_no_wheel_for_the_platform(tmp_path, lock_copy, cli_env):
    arm = make_wheel(tmp_path / "src", DEV, commit=COMMIT[:9], plat="manylinux_2_28_aarch64")
    publish_commit(tmp_path / "index", COMMIT, {None: [arm]})
    before = lock_copy.read_bytes()
    with IndexServer(tmp_path / "index") as srv:
        r = cli("lock", "add", "n", "--commit", COMMIT, "--arch", "x86_64", "--lock", str(lock_copy),
                "--index-url", srv.url, env=cli_env)
        with pytest.raises(NoWheelForPlatform) as e:
            wheelindex.add_pin(lock_copy, "n", commit=COMMIT, arch="x86_64", index_url=srv.url,
                               cache_root=tmp_path / "cache")
    assert r.returncode == ExitCode.ENVIRONMENT
    assert f"no vLLM wheel for linux x86_64, Python 3.12 at commit {COMMIT}" in r.stderr and arm.name in r.stderr
    assert e.value.available == [arm.name]
    _unchanged(lock_copy, before, tmp_path / "cache")


def test_wheel_of_another_commit_is_refused(tmp_path, lock_copy):
    stray = make_wheel(tmp_path / "src", "0.34.0rc1.dev99", commit=OTHER[:9])  # no +g label: _version.py tells
    publish_commit(tmp_path / "index", COMMIT, {None: [stray]})
    before = lock_copy.read_bytes()
    with IndexServer(tmp_path / "index") as srv, pytest.raises(WheelSourceError) as e:
        wheelindex.add_pin(lock_copy, "n", commit=COMMIT, arch="x86_64", index_url=srv.url, cache_root=tmp_path / "cache")
    assert f"built from commit {OTHER[:9]} (its _version.py), not {COMMIT}" in str(e.value)
    _unchanged(lock_copy, before, tmp_path / "cache")


def test_index_html_only_with_fragments(tmp_path, lock_copy):
    """An index without metadata.json is read from its PEP 503 page, and a #sha256= link that agrees is fine."""
    wheel = make_wheel(tmp_path / "src", DEV, commit=COMMIT[:9])
    publish_commit(tmp_path / "index", COMMIT, {None: [wheel]}, sha_fragment={wheel.name: sha256_of(wheel)},
                   metadata=False)
    with IndexServer(tmp_path / "index") as srv:
        fields = wheelindex.add_pin(lock_copy, "n", commit=COMMIT, arch="x86_64", index_url=srv.url,
                                    cache_root=tmp_path / "cache")
    assert fields["wheel_sha256"] == sha256_of(wheel)


@pytest.mark.parametrize("args, fragment", [
    (["lock", "add", "v0.33.0", "--commit", COMMIT], "pin 'v0.33.0' is already in"),
    (["lock", "add", "n"], "nothing to pin"),
    (["lock", "add", "n", "--commit", "xyz"], "is not a git sha"),
    (["lock", "add", "n", "--commit", COMMIT, "--date", "2026-07-31"], "not allowed with argument"),
    (["lock", "add", "n", "--nightly", "--commit", COMMIT], "not allowed with argument"),
    (["lock", "add", "n", "--nightly", "--wheel-url", "https://h/vllm-1.0-cp38-abi3-x.whl"], "--wheel-url pins that wheel"),
    (["lock", "add", "n", "--date", "31/07/2026"], "is not a date"),
    (["lock", "add", "n", "--image-tag", "vllm/vllm-openai:nightly"], "needs --vllm-version"),
    (["lock", "add", "n", "--commit", COMMIT, "--vllm-version", "1.0"], "--vllm-version is for image-only pins"),
    (["lock", "add", "../x", "--commit", COMMIT], "not allowed in a directory name"),
    (["lock", "add", "n", "--wheel-url", "ftp://h/vllm-1.0-cp38-abi3-x.whl"], "must be an https://"),
])
def test_lock_add_bad_input_exits_2(args, fragment, lock_copy, cli_env, tmp_path):
    before = lock_copy.read_bytes()
    r = cli(*args, "--lock", str(lock_copy), env=cli_env)
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert fragment in r.stderr
    _unchanged(lock_copy, before, tmp_path / "cache")


# -- the local runtime fetches a URL pin's wheel the way it fetches a PyPI one ---------------------------------
def _url_pin(index, sha=None) -> lockmod.Pin:
    return lockmod.Pin(name="n", version=DEV, wheel=index.wheel.name, wheel_sha256=sha or sha256_of(index.wheel),
                       wheel_url=f"{index.url}/{COMMIT}/" + index.wheel.name.replace("+", "%2B"))


def test_runtime_downloads_and_verifies_a_url_pin(index, tmp_path):
    rt = LocalRuntime(root=tmp_path / "cache")
    path = rt.wheel_path(_url_pin(index), lambda *a, **k: None)
    assert path.read_bytes() == index.wheel.read_bytes() and path.is_relative_to(tmp_path / "cache" / "wheels")
    index.stop()  # cached now: no second download
    assert rt.wheel_path(_url_pin(index), lambda *a, **k: None) == path


def test_runtime_refuses_a_url_wheel_whose_hash_differs_from_the_lock(index, tmp_path):
    rt = LocalRuntime(root=tmp_path / "cache")
    with pytest.raises(WheelHashMismatch) as e:
        rt.wheel_path(_url_pin(index, sha="1" * 64), lambda *a, **k: None)
    assert e.value.found == sha256_of(index.wheel) and "images.lock pins " + "1" * 64 in str(e.value)
    assert [p for p in (tmp_path / "cache" / "wheels").rglob("*") if p.is_file()] == []


def test_same_wheel_bytes_share_one_environment(tmp_path):
    """Environments are keyed by the wheel's bytes (and Python), not by the pin: a nightly pin of a wheel
    already pinned elsewhere reuses that environment."""
    rt = LocalRuntime(root=tmp_path)
    a = lockmod.Pin(name="v0.33.0", version="0.33.0", wheel="vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                    wheel_sha256="4" * 64)
    b = lockmod.Pin(name="nightly-0731", version="0.33.0", wheel=a.wheel, wheel_sha256="4" * 64,
                    wheel_url="http://127.0.0.1:1/x/" + a.wheel)
    c = lockmod.Pin(name="v0.33.0", version="0.33.0", wheel=a.wheel, wheel_sha256="5" * 64)
    assert rt.env_dir(a) == rt.env_dir(b) != rt.env_dir(c)


# -- the runtime follows the pin ----------------------------------------------------------------------------
def test_default_runtime_follows_the_pin(write, cli_env):
    lk = lockmod.load(write("images.lock", f'''schema = 1

[[pin]]
name = "both"
vllm_version = "0.33.0"
wheel = "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
wheel_sha256 = "{"a" * 64}"
image = "vllm/vllm-openai@sha256:{"b" * 64}"

[[pin]]
name = "tag-only"
vllm_version = "0.34.0"
image_tag = "vllm/vllm-openai:v0.34.0"
'''))
    assert lockmod.default_runtime(lk.get("both")) == "local"
    with pytest.raises(Exception) as e:
        lockmod.default_runtime(lk.get("tag-only"))
    assert "make lock-resolve PIN=tag-only" in str(e.value)
    # an image-only pin goes to docker without being asked (docker's own check answers: the variable is unset)
    r = cli("audit", "k3-preview", "--pass-env", "ST_TEST_UNSET_VARIABLE", env=cli_env)
    assert r.returncode == ExitCode.USAGE and "--pass-env names variables that are not set" in r.stderr
    # asked for the local runtime, it says exactly what to add
    r = cli("audit", "k3-preview", "--runtime", "local", env=cli_env)
    assert r.returncode == ExitCode.USAGE
    assert "cannot be audited by the local runtime" in r.stderr and "lock add NAME --commit SHA" in r.stderr
    assert "RUNTIME=docker" in r.stderr


# -- end to end with the real v0.33.0 wheel ---------------------------------------------------------------------
@pytest.mark.vllm
def test_nightly_flow_on_the_real_wheel_ends_in_a_ledger_naming_url_hash_commit(vllm_env, tmp_path, lock_copy):
    """The wheel vLLM 0.33.0 ships, published in a loopback per-commit index: `lock add --commit` writes the
    pin, and an audit of it (one system, one layout) reuses the v0.33.0 environment (same bytes) and writes a
    ledger whose provenance names the URL, the hash and the commit, and says the environment was verified."""
    rt, pin, env = vllm_env
    wheel = rt.wheels.find(pin)
    assert wheel is not None
    reported = wheelindex.inspect_wheel(wheel)["commit"].removeprefix("g")  # the short sha the wheel reports
    commit = reported + hashlib.sha1(b"test index directory").hexdigest()[: 40 - len(reported)]
    publish_commit(tmp_path / "index", commit, {None: [wheel]})
    envs_before = sorted(p.name for p in (rt.root / "envs").iterdir())
    env_vars = dict(os.environ, SERVING_TRUTH_WHEEL_INDEX=_nowhere(), SERVING_TRUTH_GITHUB_API=_nowhere())
    with IndexServer(tmp_path / "index") as srv:
        r = cli("lock", "add", "nightly-0731", "--commit", commit, "--arch", "x86_64", "--lock", str(lock_copy),
                "--index-url", srv.url, env=env_vars)
        assert r.returncode == 0, r.stderr
        url = f"{srv.url}/{commit}/{wheel.name}"
    nightly = lockmod.load(lock_copy).get("nightly-0731")
    assert (nightly.wheel_url, nightly.wheel_sha256, nightly.commit) == (url, pin.wheel_sha256, commit)
    # the index is gone: the audit needs nothing from it (the verified wheel is cached)
    reports = tmp_path / "reports"
    r = cli("audit", "nightly-0731", "--systems", "h100_sxm", "--layouts", "tp8", "--lock", str(lock_copy),
            "--reports", str(reports), "--expectations", "none", env=env_vars, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in (rt.root / "envs").iterdir()) == envs_before  # no second 9.4 GB environment
    ledger = (reports / "nightly-0731" / "ledger.md").read_text()
    prov = ledger[ledger.index("## Provenance"):]
    assert f"sha256 `{pin.wheel_sha256}`, not from PyPI: <{url}>" in prov
    assert f"(build `{commit}`)" in prov
    assert "| environment | verified before the audit: the " in prov and f"files {wheel.name} installs match" in prov
    routing = json.loads((reports / "nightly-0731" / "routing.json").read_text())
    assert routing["pin"]["wheel_url"] == url and routing["run"]["vllm_commit"] == commit


# -- links and redirects that leave the index host ----------------------------------------------------------
def test_links_to_another_host_are_not_followed(tmp_path, lock_copy):
    """A protocol-relative link (//other-host/...) in index.html or metadata.json names another host: it is not
    this index's wheel, so the commit has none for this platform; images.lock is unchanged."""
    wheel = make_wheel(tmp_path / "src", DEV, commit=COMMIT[:9])
    root = tmp_path / "index"
    publish_commit(root, COMMIT, {None: [wheel]})
    pkg = root / COMMIT / "vllm"
    meta = json.loads((pkg / "metadata.json").read_text())
    for item in meta:
        item["path"] = f"//127.0.0.2:1/{wheel.name}"
    (pkg / "metadata.json").write_text(json.dumps(meta))
    html = (pkg / "index.html").read_text()
    (pkg / "index.html").write_text(html.replace('href="../', 'href="//127.0.0.2:1/'))
    before = lock_copy.read_bytes()
    with IndexServer(root) as srv, pytest.raises(NoWheelForPlatform):
        wheelindex.add_pin(lock_copy, "n", commit=COMMIT, arch="x86_64", index_url=srv.url,
                           cache_root=tmp_path / "cache")
    _unchanged(lock_copy, before, tmp_path / "cache")


def test_a_redirect_to_another_host_is_refused(tmp_path, lock_copy):
    import http.server
    import threading

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{closed_port()}{self.path}")
            self.end_headers()

        def log_message(self, *a):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    before = lock_copy.read_bytes()
    try:
        with pytest.raises(WheelSourceError) as e:
            wheelindex.add_pin(lock_copy, "n", commit=COMMIT, arch="x86_64",
                               index_url=f"http://127.0.0.1:{httpd.server_address[1]}", cache_root=tmp_path / "cache")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert "redirects to another host" in str(e.value)
    _unchanged(lock_copy, before, tmp_path / "cache")


def test_concurrent_lock_adds_keep_every_pin(tmp_path, lock_copy):
    """Six `lock add`s at once, each of its own wheel: every one is in images.lock afterwards, which parses."""
    import concurrent.futures

    wheels = [make_wheel(tmp_path / f"src{i}", f"0.34.0rc1.dev{100 + i}") for i in range(6)]
    with concurrent.futures.ProcessPoolExecutor(6) as pool:
        futures = [pool.submit(wheelindex.add_pin, lock_copy, f"rc-{i}", wheel_url=w.as_uri(),
                               cache_root=tmp_path / "cache") for i, w in enumerate(wheels)]
        for f in futures:
            f.result()
    pins = lockmod.load(lock_copy).pins
    assert {f"rc-{i}" for i in range(6)} <= set(pins)


def test_lock_add_warns_when_a_build_reuses_a_pinned_version_and_file_name(lock_copy, tmp_path):
    """A rebuilt wheel with the same version and file name is another build: lock add says so (and keeps it in
    the pin's note), records the wheel's own commit as unverified, and the new pin's baseline is the build it
    replaces."""
    first = make_wheel(tmp_path / "a", "0.33.0", commit=COMMIT[:9])
    second = make_wheel(tmp_path / "b", "0.33.0", commit=COMMIT[:9], files={"vllm/planted.py": b"x = 1\n"})
    assert first.name == second.name and sha256_of(first) != sha256_of(second)
    a = wheelindex.add_pin(lock_copy, "rebuild-a", wheel_url=first.resolve().as_uri(), cache_root=tmp_path / "cache")
    assert not any("rebuild-a" in w for w in a["warnings"])
    b = wheelindex.add_pin(lock_copy, "rebuild-b", wheel_url=second.resolve().as_uri(), cache_root=tmp_path / "cache")
    assert any(w.startswith("same file name and version as pin rebuild-a") and "different bytes" in w
               for w in b["warnings"]), b["warnings"]
    lk = lockmod.load(lock_copy)
    assert "different bytes" in lk.get("rebuild-b").note
    assert "not checked against any repository" in lk.get("rebuild-b").note
    assert lockmod.previous_pin(lk, "rebuild-b").name == "rebuild-a"
