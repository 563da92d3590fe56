"""images.lock parsing: the shipped file, and bad input with file:line errors."""
import re

import pytest

from audit.pins import lock
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
        assert pin.wheel == f"vllm-{pin.version}-cp38-abi3-manylinux_2_28_x86_64.whl"
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


WHEEL = "vllm-9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"


@pytest.mark.parametrize("key, value, fragment", [
    # issue 12 item 5: every field that becomes part of a path, or names where bytes come from
    ("vllm_version", "0.33.0-cp312-x/../../../x", "is not a PEP 440 version"),
    ("vllm_version", "9.0.0/..", "is not a PEP 440 version"),
    ("wheel", "../" + WHEEL, "is not a plain wheel file name"),
    ("wheel", "vllm-9.0.0-cp38-abi3-manylinux_2_28_x86_64/../../x.whl", "is not a plain wheel file name"),
    ("wheel", "torch-9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl", "is not vLLM 9.0.0"),
    ("wheel", "vllm-9.0.1-cp38-abi3-manylinux_2_28_x86_64.whl", "is not vLLM 9.0.0"),
    ("wheel_url", "https://user:secret@example.org/" + WHEEL, "carries credentials"),
    ("wheel_url", "https://example.org/other.whl", "does not end in the pinned wheel file name"),
    ("wheel_url", "ftp://example.org/" + WHEEL, "must be an https://"),
    ("wheel_url", "file://host/" + WHEEL, "must be file:///absolute/path"),
    ("vllm_commit", "../abc", "is not a git sha"),
    ("python", "3.12/../x", "python must look like '3.12'"),
])
def test_fields_that_become_paths_are_validated(write, key, value, fragment):
    text = GOOD.replace(f'wheel_sha256 = "{SHA}"\n', f'wheel_sha256 = "{SHA}"\n{key} = "{value}"\n') \
        if key not in ("vllm_version", "wheel", "python") else \
        GOOD.replace({"vllm_version": 'vllm_version = "9.0.0"', "wheel": f'wheel = "{WHEEL}"',
                      "python": 'vllm_version = "9.0.0"'}[key],
                     f'{key} = "{value}"' if key != "python" else f'vllm_version = "9.0.0"\npython = "{value}"')
    path = write("images.lock", text)
    with pytest.raises(LockError) as e:
        lock.load(path)
    assert fragment in str(e.value), str(e.value)
    assert e.value.line == next(i for i, l in enumerate(text.splitlines(), 1) if l.startswith(f"{key} ="))
    assert e.value.exit_code == ExitCode.USAGE


def test_image_tarball_stays_beside_the_lock(write):
    text = GOOD.replace('platform_digests = {{ "linux/amd64" = "sha256:{}" }}'.format("c" * 64), "") \
        .replace(f'image = "vllm/vllm-openai@sha256:{"b" * 64}"', f'image_config_digest = "sha256:{"b" * 64}"\n'
                 'image_tarball = "../../etc/x.tar"')
    with pytest.raises(LockError, match="leaves the directory of this lock file"):
        lock.load(write("images.lock", text))
    assert lock.load(write("images.lock", text.replace("../../etc/x.tar", "images/x.tar"))).get("img").image_tarball


def test_a_wheel_url_pin_parses_and_keeps_its_url_in_the_provenance(write):
    url = "https://wheels.vllm.ai/" + "ab" * 20 + "/vllm-9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    pin = lock.load(write("images.lock", GOOD.replace(f'wheel_sha256 = "{SHA}"\n',
                                                      f'wheel_sha256 = "{SHA}"\nwheel_url = "{url}"\n'))).get("v9.0.0")
    assert pin.wheel_url == url and pin.wheel_source == "url" and pin.runtimes == ["local"]
    assert pin.as_provenance()["wheel_url"] == url
    assert "wheel_url" not in lock.load(write("images.lock", GOOD)).get("v9.0.0").as_provenance()


VERSIONS_IN_ORDER = ["0.1.dev19262+gb6bbf29dd", "0.33.0", "0.33.0.post1", "0.34.0.dev5", "0.34.0a1", "0.34.0b2",
                     "0.34.0rc1.dev20+gdef4567", "0.34.0rc1.dev123+gabcdef012", "0.34.0rc1.dev123+gabcdef012.cu130",
                     "0.34.0rc1", "0.34.0rc2.dev1", "0.34.0", "0.34.0+cu130", "0.34.0.post1.dev2", "0.34.0.post1",
                     "0.34.1.dev0", "1.0"]


def test_versions_sort_as_pep_440_orders_them():
    shuffled = VERSIONS_IN_ORDER[::2] + VERSIONS_IN_ORDER[1::2][::-1]
    assert sorted(shuffled, key=lock.version_key) == VERSIONS_IN_ORDER
    assert lock.version_key("0.34") == lock.version_key("0.34.0.0")
    with pytest.raises(ValueError):
        lock.version_key("0.33.0-cp312-x/../x")
    packaging = pytest.importorskip("packaging.version")  # the reference implementation, where installed
    assert sorted(shuffled, key=packaging.Version) == VERSIONS_IN_ORDER


def _lock_of(write, *pins):
    body = "schema = 1\n"
    for name, version in pins:
        body += f'\n[[pin]]\nname = "{name}"\nvllm_version = "{version}"\nimage_config_digest = "sha256:{"e" * 64}"\n'
    return lock.load(write("images.lock", body))


def test_previous_pin_is_the_release_ordered_predecessor(write):
    lk = _lock_of(write, ("preview", "0.1.dev19262+gb6bbf29dd"), ("v0.34.0", "0.34.0"), ("v0.33.0", "0.33.0"),
                  ("nightly-0731", "0.34.0rc1.dev123+gabcdef012"), ("v0.33.0-image", "0.33.0"),
                  ("rc1", "0.34.0rc1"), ("v0.32.0", "0.32.0"))
    prev = lambda name, **kw: getattr(lock.previous_pin(lk, name, **kw), "name", None)  # noqa: E731
    assert prev("nightly-0731") == "v0.33.0"  # of two pins of 0.33.0, the first in the file
    assert prev("rc1") == "nightly-0731" and prev("v0.34.0") == "rc1"
    assert prev("v0.34.0", releases_only=True) == "v0.33.0"
    assert prev("nightly-0731", releases_only=True) == "v0.33.0"
    assert prev("v0.33.0") == "v0.32.0" and prev("v0.32.0") is None
    assert prev("v0.33.0-image") == "v0.33.0"  # a later build of the same version replaces the earlier one
    assert prev("v0.33.0-image", releases_only=True) == "v0.32.0"
    assert prev("preview") is None  # an untagged branch build has no place in the order
    assert [p.name for p in lock.sorted_pins(lk)] == ["v0.32.0", "v0.33.0", "v0.33.0-image", "nightly-0731", "rc1",
                                                        "v0.34.0", "preview"]
    with pytest.raises(UnknownPinError):
        lock.previous_pin(lk, "v9")


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


@pytest.mark.parametrize("old, new", [('name = "v9.0.0"', 'name = "v9.0.0\\n"'),
                                      ('vllm_version = "9.0.0"', 'vllm_version = "9.0.0\\n"'),
                                      (f'wheel_sha256 = "{SHA}"', f'wheel_sha256 = "{SHA}\\n"'),
                                      (f'wheel_sha256 = "{SHA}"', f'wheel_sha256 = "{SHA}"\nvllm_commit = "gabcdef1\\n"')])
def test_a_trailing_newline_is_not_part_of_a_valid_name(write, old, new):
    """`$` also matches before a final newline: every pattern must end at the very end of the value."""
    path = write("images.lock", GOOD.replace(old, new, 1))
    with pytest.raises(LockError):
        lock.load(path)


@pytest.mark.parametrize("name,why", [("gpt-oss-120b", "the model 'gpt-oss-120b'"), ("Kimi-K3", "the model 'kimi-k3'"),
                                      ("diffs", "reports/diffs/")])
def test_a_pin_may_not_take_the_name_of_a_model_or_a_report_folder(write, name, why):
    with pytest.raises(LockError) as e:
        lock.load(write("images.lock", GOOD.replace('name = "img"', f'name = "{name}"')))
    assert e.value.line == 10 and "is reserved" in str(e.value) and why in str(e.value)
    assert e.value.exit_code == ExitCode.USAGE
