"""The model registry (audit/models): each profile complete in itself, the default model's paths unchanged,
another model's reports and runs kept apart, claims checked in their own model's vocabulary, and the gpt-oss
ledger rendered from its committed routing. The real wheel's gpt-oss cells are in tests/test_models_vllm.py."""
import json
import os
import subprocess
import sys

import pytest

from audit import models
from audit.errors import ExitCode, SelectionError
from audit.models.gpt_oss import GPT_OSS_120B
from audit.models.kimi_k3 import KIMI_K3
from audit.report import expectations
from audit.report.expectations import ExpectationsError
from tests.conftest import ROOT
from tests.goldtest import compare

GPT_ROUTING = ROOT / "tests" / "data" / "routing-gpt-oss-120b-v0.33.0.json"


def test_the_registry_names_every_model_and_refuses_an_unknown_one():
    assert models.get("kimi-k3") is KIMI_K3 and models.DEFAULT == "kimi-k3"  # the CLI's --model default
    assert models.get("gpt-oss-120b") is GPT_OSS_120B
    with pytest.raises(SelectionError) as e:
        models.get("llama")
    assert "unknown model 'llama'" in str(e.value) and e.value.known == ["kimi-k3", "gpt-oss-120b", "deepseek-v3"]
    for missing in (None, ""):  # no fallback to the default model below the CLI
        with pytest.raises(SelectionError):
            models.get(missing)


def test_a_stored_document_that_names_no_model_is_refused_never_read_as_the_default_models():
    from audit.errors import EvidenceError, RenderError
    from audit.report.perflabels import build_labels
    from audit.report.render import render_ledger

    routing = json.loads(GPT_ROUTING.read_text(encoding="utf-8"))
    assert models.named_in(routing, what="routing.json") is GPT_OSS_120B
    assert models.named_in({"profile": "deepseek-v3"}, what="run.json", key="profile").name == "deepseek-v3"
    unnamed = {k: v for k, v in routing.items() if k != "model"}
    with pytest.raises(EvidenceError, match="names no model") as e:
        models.named_in(unnamed, what="routing.json", path="reports/x/routing.json")
    assert e.value.path == "reports/x/routing.json"
    with pytest.raises(EvidenceError, match="'llama', which this harness does not have"):
        models.named_in({**routing, "model": "llama"}, what="routing.json")
    # the renderer and the labeller take the profile handed down, and only the routing's own
    with pytest.raises(RenderError, match="names no model"):
        render_ledger(unnamed, profile=KIMI_K3, reproduce="x")
    with pytest.raises(RenderError, match="of the model 'gpt-oss-120b', not of 'kimi-k3'"):
        render_ledger(routing, profile=KIMI_K3, reproduce="x")
    with pytest.raises(RenderError, match="labelled as 'kimi-k3'"):
        build_labels(routing, KIMI_K3)
    # claims are judged only against the model they are about
    from audit.report import expectations
    from audit.report.expectations import ExpectationsError
    from audit.report.verdicts import judge

    k3_claims = expectations.load(ROOT / "expectations" / "kimi-k3.toml")
    with pytest.raises(ExpectationsError, match="about the model 'kimi-k3', the audit is of 'gpt-oss-120b'"):
        judge(routing, k3_claims, GPT_OSS_120B)
    with pytest.raises(RenderError, match="judged as 'kimi-k3'"):
        judge(routing, k3_claims, KIMI_K3)


@pytest.mark.parametrize("profile", list(models.PROFILES.values()), ids=list(models.PROFILES))
def test_each_profile_is_complete_in_itself(profile):
    config = json.loads(profile.config_text())
    archs = config.get("architectures") or config.get("text_config", {}).get("architectures") or []
    assert profile.architecture in archs or profile.name == "kimi-k3"  # K3's config names its text model
    lanes = {l.id for l in profile.lanes}
    assert {j.lane for j in profile.judged} <= lanes, "every judged lane is a lane of the profile"
    assert set(profile.perf_lanes.values()) <= {j.lane for j in profile.judged}, "the vocabulary maps onto judged lanes"
    assert set(profile.perf_lane_phases) <= set(profile.perf_lanes)
    assert {j.kind for j in profile.judged} <= set(profile.kind_titles)
    assert profile.layouts and all(l.name == n for n, l in profile.layouts.items())
    assert profile.probes and (ROOT / "probes" / "models" / profile.probes / "__init__.py").is_file(), \
        "the profile names its probe-side module"
    from audit.report.routing import POSTLOAD_READINGS

    state = [profile.model_state.key] if profile.model_state else []
    readings = {*POSTLOAD_READINGS, *profile.postload_readings, *state}
    assert {s.target for l in profile.lanes for s in l.sources if s.kind == "postload"} <= readings


def test_the_default_model_keeps_its_paths_and_another_model_gets_its_own(tmp_path):
    from audit.runtimes.base import new_run_dir, runs_of

    assert models.reports_root("reports", KIMI_K3) == models.reports_root("reports", KIMI_K3).__class__("reports")
    assert str(models.reports_root("reports", GPT_OSS_120B)) == "reports/gpt-oss-120b"

    class Pin:
        name = "v0.33.0"

    k3 = new_run_dir(Pin, root=tmp_path, prefix=models.run_prefix(KIMI_K3, "v0.33.0"))
    gpt = new_run_dir(Pin, root=tmp_path, prefix=models.run_prefix(GPT_OSS_120B, "v0.33.0"))
    assert k3.name.startswith("v0.33.0-") and gpt.name.startswith("gpt-oss-120b--v0.33.0-")
    assert runs_of(Pin, tmp_path) == [k3]
    assert runs_of(Pin, tmp_path, models.run_prefix(GPT_OSS_120B, "v0.33.0")) == [gpt]


def test_claims_are_checked_in_their_own_models_vocabulary(tmp_path):
    shipped = expectations.load(ROOT / "expectations" / "gpt-oss-120b.toml")
    assert shipped.model == "gpt-oss-120b"
    assert {c.harness_lane for c in shipped.claims} == {"moe", "attention.prefill", "attention.decode"}
    head = 'schema = 1\nmodel = "gpt-oss-120b"\nframework = "vllm"\narchitecture = "GptOssForCausalLM"\n'
    path = tmp_path / "claims.toml"
    path.write_text(head + '[[claim]]\nid = "k3-lane"\nlane = "kda.context"\nbackend = "flashkda"\n')
    with pytest.raises(ExpectationsError, match="unknown lane 'kda.context' for gpt-oss-120b") as e:
        expectations.load(path)
    assert "attention.context" in str(e.value)
    path.write_text(head + '[[claim]]\nid = "k3-layout"\nlane = "attention.generation"\nlayouts = ["tp8-mtp"]\n'
                           'backend = "flash_attn"\n')
    with pytest.raises(ExpectationsError, match="unknown layout 'tp8-mtp' for gpt-oss-120b"):
        expectations.load(path)


def test_the_gpt_oss_ledger_renders_from_its_routing_and_fits():
    from audit.report.fit import _cells
    from audit.report.render import render_ledger

    routing = json.loads(GPT_ROUTING.read_text(encoding="utf-8"))
    text = render_ledger(routing, profile=GPT_OSS_120B,
                         reproduce="make audit PIN=v0.33.0 MODEL=gpt-oss-120b",
                         changes={"unavailable": "v0.32.0"})
    compare("ledger-gpt-oss-120b-v0.33.0.md", text)
    # its own key, not K3's
    assert "| sinks |" in text and "SiTU" not in text and "KDA value" not in text
    lines = text.splitlines()
    rows = [l for l in lines if l.startswith("|") and l.rstrip().endswith("|")]
    assert max(len(l) for l in lines if l not in rows) <= 400
    # a wider table row is one of short cells only (a cell under 80 characters is never moved to a footnote)
    assert all(len(r) <= 400 or all(len(c.strip()) < 80 or "[^" in c for c in _cells(r)) for r in rows)
    assert max(len(c.strip()) for l in lines if l.startswith("|") and l.rstrip().endswith("|") for c in _cells(l)) <= 250
    # the committed report is this routing (tests/test_reproduce.py renders it, with its changes since v0.32.0)
    committed = ROOT / "reports" / "gpt-oss-120b" / "v0.33.0"
    assert (committed / "routing.json").read_text() == GPT_ROUTING.read_text()


def test_the_cli_lists_the_models_and_refuses_an_unknown_one_before_any_work():
    run = subprocess.run([sys.executable, "-m", "audit.cli", "models"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0 and "kimi-k3 (default)" in run.stdout and "gpt-oss-120b" in run.stdout
    run = subprocess.run([sys.executable, "-m", "audit.cli", "audit", "v0.33.0", "--model", "llama"],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == ExitCode.USAGE and "unknown model 'llama'" in run.stderr
    assert "known models: kimi-k3, gpt-oss-120b" in run.stderr


@pytest.mark.parametrize("profile", list(models.PROFILES.values()), ids=list(models.PROFILES))
def test_each_profile_names_a_probes_package_the_plan_carries(profile, tmp_path):
    """The probe side of a model is its package under probes/models, named by the profile and sent in the plan;
    what it adds to the shared targets is its own (a target with a shared id takes that target's place)."""
    from probes import models as models_probes
    from probes.core.targets import TARGETS, with_model

    own = models_probes.load(profile.probes)
    assert own.name == profile.probes and own.targets
    merged = with_model(TARGETS, own.targets)
    assert len({t.id for t in merged}) == len(merged), "one target per id"
    assert [t.id for t in merged][:len(TARGETS)] == [t.id for t in TARGETS], "shared targets keep their places"
    assert {t.id for t in own.targets} <= {t.id for t in merged}
    # every kernel path a model observes has its entry in the kernel-name map, and no other model's
    from probes.observe.kernel_names import all_names

    assert {e.path for e in own.kernel_names} == {k.path for k in own.kernels}
    assert {k.path for k in own.kernels} <= {e.path for e in all_names(own)}


def test_the_plan_names_the_models_probes_and_a_wrong_name_is_refused(tmp_path):
    from probes import models as models_probes

    assert models_probes.load("").targets == () and models_probes.load("").lanes == ()
    for bad in ("no_such_model", "../etc", "kimi-k3"):
        with pytest.raises(models_probes.UnknownModel, match="probes/models"):
            models_probes.load(bad)
    k3 = models_probes.load("kimi_k3", resolve=True)  # its resolve side imports nothing but the standard library
    assert [lane for lane, _ in k3.lanes][:1] == ["specialized_decode"] and k3.step_path.name == "specialized decode"
    assert k3.hook("postload_steps") is not None and models_probes.load("gpt_oss", resolve=True).lanes == ()


@pytest.mark.parametrize("profile", list(models.PROFILES.values()), ids=list(models.PROFILES))
def test_observe_mode_installs_the_served_models_own_probes(profile, tmp_path):
    """The observe plugin in a vLLM process reads the model's probes package from the environment the runtimes
    set (observe_env): its targets and kernel entries are installed beside the shared ones (no vLLM needed: the
    wrappers wait for their modules' import)."""
    from audit.runtimes.base import observe_env
    from probes import models as models_probes

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SERVING_TRUTH")},
           **observe_env(str(tmp_path), "b200_sxm--tp8", profile), "PYTHONPATH": str(ROOT)}
    script = ("import json, sys; from probes.observe import plugin; plugin.register(); s = plugin._state;"
              "print(json.dumps({'targets': [t.id for t in s['probes'].targets],"
              " 'kernels': [k.path for k in s['observe'].kernels]})); s['rec'].flush(); sys.stdout.flush()")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    own = models_probes.load(profile.probes, schemes=profile.schemes)
    assert {t.id for t in own.targets} <= set(got["targets"])
    # its quantization schemes' targets, and no other scheme's (an FP8 model wraps no MXFP4 oracle)
    from probes import schemes

    mine = {t.id for s in profile.scheme_parts() for t in s.targets}
    assert mine and mine <= set(got["targets"])
    others = {t.id for name in ("mxfp4", "fp8_block") if name not in profile.schemes
              for t in schemes.load(name).targets} - mine
    assert others and not others & set(got["targets"])
    assert {k.path for k in own.kernels} <= set(got["kernels"])
    header = json.loads(next(tmp_path.glob("evidence-*.jsonl")).read_text().splitlines()[0])
    assert header["model_probes"] == profile.probes


def test_deployment_options_are_left_out_by_default_and_audited_when_asked():
    """A profile's opt-in layouts (deployment options) are not in the default selection, are in ``all`` and by name;
    ``make models`` marks them; a run's job says so."""
    from audit.systems import select

    default = [l.name for l in select("layout", None, KIMI_K3.layouts)]
    assert default == [l.name for l in select("layout", "default", KIMI_K3.layouts)]
    options = [n for n, l in KIMI_K3.layouts.items() if l.opt_in]
    assert options == ["tp8-fp8kv", "tp8-fp8kv-fp8prefill", "dp2-tp4-ep", "dp4-tp2-ep", "tp8-dspark", "tp8-eagle3",
                       "tp8-fp8dsmla"]
    assert not set(options) & set(default) and "tp8" in default
    assert [l.name for l in select("layout", "all", KIMI_K3.layouts)] == list(KIMI_K3.layouts)
    assert [l.name for l in select("layout", "tp8-fp8kv,tp8", KIMI_K3.layouts)] == ["tp8", "tp8-fp8kv"]
    assert KIMI_K3.layouts["tp8-fp8kv"].as_job()["opt_in"] is True and "opt_in" not in KIMI_K3.layouts["tp8"].as_job()
    out = subprocess.run([sys.executable, "-m", "audit.cli", "models"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "tp8-fp8kv (option)" in out.stdout and "tp8 (option)" not in out.stdout


@pytest.mark.parametrize("profile", list(models.PROFILES.values()), ids=list(models.PROFILES))
def test_a_models_own_kernel_packages_join_only_its_own_fingerprint(profile):
    """The shared fingerprint names no model's kernels; K3's probes package adds FlashKDA (its KDA kernels), and
    no other model's evidence lists them."""
    from probes import models as models_probes
    from probes.core import environment

    own = models_probes.load(profile.probes, schemes=profile.schemes)
    fp = environment.fingerprint({}, packages=own.fingerprint_packages, modules=own.fingerprint_modules)
    assert set(environment.FINGERPRINT_MODULES) <= set(fp["modules"])
    kda = {"flash_kda", "flashkda", "vllm._flashkda_C"}
    assert not kda & set(environment.FINGERPRINT_MODULES) and "flash-kda" not in environment.FINGERPRINT_PACKAGES
    if profile is KIMI_K3:
        assert kda <= set(fp["modules"])
    else:
        assert not kda & set(fp["modules"])
