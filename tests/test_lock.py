"""images.lock parsing: the shipped file, and bad input with file:line errors."""
import re

import pytest

from audit import lock
from audit.errors import ExitCode, LockError, RuntimeUnsupportedError, UnknownPinError
from audit.runtimes.local import LocalRuntime
from tests.conftest import ROOT

SHA = "a" * 64
GOOD = f'''schema = 1

[[pin]]
name = "v9.0.0"
vllm_version = "9.0.0"
wheel = "vllm-9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
wheel_sha256 = "{SHA}"

[[pin]]
name = "img"
vllm_version = "0.1.dev1"
image = "vllm/vllm-openai@sha256:{"b" * 64}"
platform_digests = {{ "linux/amd64" = "sha256:{"c" * 64}" }}
'''


def test_shipped_lock_has_verified_release_pins():
    lk = lock.load(ROOT / "images.lock")
    for name in ("v0.27.0", "v0.30.0", "v0.33.0"):
        pin = lk.get(name)
        assert re.fullmatch(r"[0-9a-f]{64}", pin.wheel_sha256)
        assert pin.wheel == f"vllm-{pin.vllm_version}-cp38-abi3-manylinux_2_28_x86_64.whl"
        assert pin.runtimes[0] == "local"
    preview = lk.get("k3-preview")
    assert preview.image.endswith("e90e2603b2781936651ba019804137714367c69e10a7b25a2e57b46995225616")
    assert preview.runtimes == ["docker"]


def test_good_file_parses(write):
    lk = lock.load(write("images.lock", GOOD))
    assert list(lk.pins) == ["v9.0.0", "img"]
    assert lk.get("img").platform_digests == {"linux/amd64": "sha256:" + "c" * 64}
    assert lk.get("v9.0.0").line == 3


def test_unknown_pin_lists_known(write):
    lk = lock.load(write("images.lock", GOOD))
    with pytest.raises(UnknownPinError) as e:
        lk.get("v1.2.3")
    assert "v9.0.0, img" in str(e.value) or "img, v9.0.0" in str(e.value)
    assert e.value.exit_code == ExitCode.USAGE


@pytest.mark.parametrize("mutation, line, fragment", [
    (lambda t: t.replace('name = "img"', 'name = "v9.0.0"'), 9, "duplicate pin name 'v9.0.0' (first defined at line 3)"),
    (lambda t: t.replace(f'image = "vllm/vllm-openai@sha256:{"b" * 64}"', 'image = "vllm/vllm-openai:latest"'), 12,
     "tag without a digest"),
    (lambda t: t.replace(f'wheel_sha256 = "{SHA}"', 'wheel_sha256 = "abc"'), 7, "not 64 lower-case hex"),
    (lambda t: t.replace(f'wheel_sha256 = "{SHA}"\n', ''), 6, "wheel and wheel_sha256 go together"),
    (lambda t: t.replace('vllm_version = "9.0.0"', 'vllm_version = "9.0.0"\nbogus = "x"'), 6, "unknown key 'bogus'"),
    (lambda t: t.replace('"linux/amd64"', '"linux/riscv"'), 13, "unknown platform"),
    (lambda t: t.replace("schema = 1", "schema = 7"), 1, "this harness reads schema 1"),
    (lambda t: t.replace('name = "v9.0.0"', 'name = "v9.0.0'), 4, "not valid TOML"),
])
def test_bad_input_names_file_and_line(write, mutation, line, fragment):
    path = write("images.lock", mutation(GOOD))
    with pytest.raises(LockError) as e:
        lock.load(path)
    assert fragment in str(e.value)
    assert e.value.line == line, str(e.value)
    assert str(e.value).startswith(f"{path}:{line}:")
    assert e.value.exit_code == ExitCode.USAGE


def test_missing_file(tmp_path):
    with pytest.raises(LockError) as e:
        lock.load(tmp_path / "nope.lock")
    assert "file not found" in str(e.value)


def test_docker_only_pin_names_the_runtime_that_can(write):
    pin = lock.load(write("images.lock", GOOD)).get("img")
    with pytest.raises(RuntimeUnsupportedError) as e:
        LocalRuntime().check(pin)
    assert "RUNTIME=docker" in str(e.value)
    assert e.value.supported == ["docker"]
