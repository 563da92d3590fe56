"""Engines as a declared contract (issue 47): pins name their engine, each engine's keys are its own, models are
profiled per engine, reports and release order stay within an engine. No environment needed."""
import pytest

from audit import engines, models
from audit.errors import LockError, SelectionError, UsageError
from audit.pins import lock
from tests.conftest import ROOT

SHA = "a" * 64
TWO = f'''schema = 1

[[pin]]
name = "v9.0.0"
vllm_version = "9.0.0"
wheel = "vllm-9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
wheel_sha256 = "{SHA}"

[[pin]]
name = "sg-1.0"
engine = "sglang"
sglang_version = "1.0"
python = "3.11"
wheel = "sglang-1.0-cp311-cp311-manylinux_2_34_x86_64.whl"
wheel_sha256 = "{"b" * 64}"

[[pin]]
name = "sg-1.1"
engine = "sglang"
sglang_version = "1.1"
wheel = "sglang-1.1-cp311-cp311-manylinux_2_34_x86_64.whl"
wheel_sha256 = "{"c" * 64}"
overrides = ["cuda-tile==1.6.0rc7"]
overrides_why = "the declared version has no wheel on PyPI"
'''


def test_a_pin_names_its_engine_and_states_its_version_under_the_engines_key(write):
    lk = lock.load(write("images.lock", TWO))
    v, s, o = lk.get("v9.0.0"), lk.get("sg-1.0"), lk.get("sg-1.1")
    assert (v.engine, s.engine) == ("vllm", "sglang") and s.version == "1.0" and s.python == "3.11"
    assert o.python == engines.SGLANG.python  # the engine's Python where the pin names none
    assert o.overrides == ("cuda-tile==1.6.0rc7",)
    # the first engine's provenance is what it always was; another engine's names its keys and the engine
    assert "engine" not in v.as_provenance() and v.as_provenance()["vllm_version"] == "9.0.0"
    prov = o.as_provenance()
    assert prov["sglang_version"] == "1.1" and prov["engine"] == "sglang" and "vllm_version" not in prov
    assert prov["overrides"] == ["cuda-tile==1.6.0rc7"] and prov["overrides_why"]


@pytest.mark.parametrize("edit,fragment", [
    (('engine = "sglang"', 'engine = "tgi"'), "unknown engine 'tgi'"),
    (('sglang_version = "1.0"', 'vllm_version = "1.0"'), "unknown key 'vllm_version' in [[pin]] of the engine 'sglang'"),
    (('wheel = "sglang-1.0-', 'wheel = "vllm-1.0-'), "is not SGLang 1.0"),
    (('overrides_why = "the declared version has no wheel on PyPI"\n', ''), "overrides need overrides_why"),
    (('overrides = ["cuda-tile==1.6.0rc7"]', 'overrides = ["cuda-tile>=1.6"]'), "exact requirements"),
])
def test_an_engine_pin_that_mixes_words_is_refused_with_its_line(write, edit, fragment):
    with pytest.raises(LockError) as e:
        lock.load(write("images.lock", TWO.replace(*edit)))
    assert fragment in str(e.value) and e.value.line


def test_release_order_stays_within_an_engine(write):
    lk = lock.load(write("images.lock", TWO))
    assert lock.previous_pin(lk, "sg-1.1").name == "sg-1.0"
    assert lock.previous_pin(lk, "sg-1.0") is None  # v9.0.0 is another engine's release, never its predecessor
    shipped = lock.load(ROOT / "images.lock")
    assert lock.previous_pin(shipped, "sglang-0.5.23").name == "sglang-0.5.21"
    assert lock.previous_pin(shipped, "v0.27.1").name == "v0.27.0"


def test_models_are_profiled_per_engine_and_report_in_the_engines_folder():
    k3 = models.get("kimi-k3", "sglang")
    assert k3.engine == "sglang" and k3 is not models.get("kimi-k3")
    assert str(models.reports_root("reports", k3)) == "reports/sglang"
    assert str(models.reports_root("reports", models.get("kimi-k3"))) == "reports"
    assert str(models.reports_root("reports", models.get("deepseek-v3"))) == "reports/deepseek-v3"
    with pytest.raises(SelectionError, match="unknown model on SGLang 'deepseek-v3'"):
        models.get("deepseek-v3", "sglang")
    with pytest.raises(SelectionError, match="unknown engine"):
        models.get("kimi-k3", "tgi")
    # a stored document is read as the engine it names, the first one where it names none
    assert models.named_in({"model": "kimi-k3", "engine": "sglang"}, what="x") is k3
    assert models.named_in({"model": "kimi-k3"}, what="x") is models.get("kimi-k3")


def test_the_engine_folder_is_no_pin_name(write):
    with pytest.raises(LockError, match="reserved"):
        lock.load(write("images.lock", TWO.replace('name = "sg-1.0"', 'name = "sglang"')))


def test_an_audit_of_one_engines_pin_with_anothers_profile_is_bad_input(write):
    from audit.core import AuditOptions, run_audit

    path = write("images.lock", TWO)
    with pytest.raises(UsageError, match="is a SGLang pin"):
        run_audit("sg-1.0", AuditOptions(lock_path=path, profile=models.get("kimi-k3")))


def test_every_engine_declares_what_the_shared_code_reads():
    for e in engines.ENGINES.values():
        assert e.package and e.version_key.endswith("_version") and e.commit_key.endswith("_commit")
        assert e.resolve_agent.startswith("probes.") and e.fit_agent.startswith("probes.")
        assert e.env_probe and e.serve and e.command and e.host_reads and e.framework
    assert engines.get(None) is engines.VLLM and engines.of_doc({"engine": "sglang"}) is engines.SGLANG
