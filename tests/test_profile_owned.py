"""Issue 26: the shared report code knows no model by name; what a model brings (its dispatch lanes and their order,
titles, notes and stand-ins, its own step path, the kernels its backend-string lanes enter, its selftest) is its
profile's. The committed reports staying byte for byte what they were is checked by the gold files and
tests/test_reproduce.py."""
import copy
import json

import pytest

from audit.lanevalue import make, text

from audit import models
from audit.models.gpt_oss import GPT_OSS_120B
from audit.models.kimi_k3 import KIMI_K3
from audit.report import dispatch, expectations
from audit.report.diff import diff_routings, render_diff
from audit.report.expectations import ExpectationsError
from audit.report.labels import derive
from tests.conftest import ROOT


def test_the_shared_dispatch_lanes_are_the_shared_probes_and_a_model_titles_exactly_its_own():
    from probes import models as models_probes
    from probes.resolve import dispatch as probe_dispatch

    assert list(dispatch.LANE_TITLES) == [lane for lane, _ in probe_dispatch.LANES]
    for profile in models.PROFILES.values():
        own = {lane for lane, _ in models_probes.load(profile.probes, resolve=True).lanes}
        assert set(dispatch.lane_titles(profile)) == set(dispatch.LANE_TITLES) | own, profile.name


def test_each_model_shows_its_dispatch_lanes_in_its_own_order():
    assert list(dispatch.lane_titles(KIMI_K3)) == [
        "serving_path", "specialized_decode", "latent_tail", "shared_overlap", "moe_experts", "router",
        "moe_routing", "moe_parallel", "down_proj_overlap", "mla", "mla_kv_cache", "low_latency_gemm", "lm_head", "kda_projection_overlap",
        "kda_batch"]
    assert list(dispatch.lane_titles(GPT_OSS_120B)) == list(dispatch.LANE_TITLES)
    assert "kda_batch" not in dispatch.lane_notes(GPT_OSS_120B)
    k3 = {"dispatch": {"lanes": {"kda_batch": [], "serving_path": []}}}
    assert set(dispatch.stand_ins([k3], KIMI_K3)) == {
        "dispatch `kda_batch`: KimiK3DeltaAttention._forward's inputs and callees",
        "dispatch `serving_path`: SpecializedDecode.plan's inputs"}
    assert set(dispatch.stand_ins([k3], GPT_OSS_120B)) == set()  # no step path: its serving path needs none


def test_a_claims_dispatch_lanes_are_its_models(tmp_path):
    head = 'schema = 1\nmodel = "gpt-oss-120b"\nframework = "vllm"\narchitecture = "GptOssForCausalLM"\n'
    claim = ('[[claim]]\nid = "c"\nlane = "attention.generation"\nbackend = "triton"\nat = ["decode 1"]\n'
             'dispatch = {{ {lane} = "X" }}\n')
    path = tmp_path / "claims.toml"
    path.write_text(head + claim.format(lane="latent_tail"))  # K3's lane
    with pytest.raises(ExpectationsError, match="unknown dispatch lane 'latent_tail'") as e:
        expectations.load(path)
    assert "known: serving_path, shared_overlap, moe_experts, router, moe_routing, moe_parallel, mla" in str(e.value)
    path.write_text(head + claim.format(lane="router"))
    assert expectations.load(path).claims[0].dispatch == (("router", "X"),)


def test_labels_come_from_the_labelled_models_profile():
    kda = {"raw": {"source": "kda.decode", "fields": ["native"]}}
    assert derive(KIMI_K3, "kda.decode", kda, {})[:2] == ("fused_kda_decode", "unknown")
    assert derive(KIMI_K3, "kda.decode", kda, {"fused_kda_decode": "flashinfer"})[:2] == ("fused_kda_decode", "flashinfer")
    assert derive(GPT_OSS_120B, "kda.decode", kda, {})[:2] == ("unknown", "unknown")  # not its vocabulary
    own = {"raw": {"source": dispatch.STEP_PATH_SOURCE, "fields": ["experts"]}}
    assert derive(KIMI_K3, "moe", own, {}) == ("vllm_specialized_decode_experts", "specialized_decode",
                                               "K3's specialized decode serves this step")


def test_a_models_own_step_path_serves_only_its_steps():
    cell = {"dispatch": {"workloads": ["decode 1"], "lanes": {
        "serving_path": [{"role": "target", "layers": [], "tiers": {"decode 1": "FULL graph, 1 tokens: specialized decode"}}],
        "specialized_decode": [{"role": "target", "layers": [], "tiers": {"decode 1": "batch 1"}}]}}}
    group = {"layers": [3], "ranges": "3", "value": make("x")}
    lane, served, note = dispatch.serving_group(cell, "mla.decode", group, "decode 1", KIMI_K3)
    assert text(served) == "specialized decode mla_core batch 1" and "K3's specialized decode takes" in note
    assert dispatch.serving_group(cell, "moe", group, "decode 1", GPT_OSS_120B) == ("moe", group, "")


def test_a_batch_route_sends_a_batch_to_the_lane_its_choice_names():
    """K3 under a draft method: a decode batch the runner built as speculative rows is served by the KDA
    spec-verify group; a plain decode choice stays with the decode lane; a model without the route never moves."""
    kda = {"layers": [0], "ranges": "0", "value": make("fused_recurrent_kda_packed_decode", backend="triton")}
    verify = {"layers": [0], "ranges": "0", "value": make("flashinfer_packed_fused_kda_decode", backend="flashinfer"),
              "raw": {"source": "kda.spec_verify"}}
    choices = {"decode 1": "speculative rows: FlashInfer packed fused KDA decode (convolution fused)",
               "decode 8": "FLA Triton fused_recurrent_kda_packed_decode (after causal_conv1d_update)"}
    cell = {"lanes": {"kda.decode": [kda], "kda.spec_verify": [verify]},
            "dispatch": {"workloads": list(choices), "lanes": {"kda_batch": [
                {"role": "target", "layers": [0], "tiers": choices, "source": "kda:KimiK3DeltaAttention._forward"}]}}}
    lane, served, note = dispatch.serving_group(cell, "kda.decode", kda, "decode 1", KIMI_K3)
    assert (lane, served) == ("kda.spec_verify", verify)
    assert note == ("a decode 1 batch takes KDA's speculative rows (kda:KimiK3DeltaAttention._forward), so "
                    "flashinfer_packed_fused_kda_decode serves it")
    assert dispatch.serving_group(cell, "kda.decode", kda, "decode 8", KIMI_K3) == ("kda.decode", kda, "")
    assert dispatch.serving_group(cell, "kda.decode", kda, "decode 1", GPT_OSS_120B) == ("kda.decode", kda, "")
    assert dispatch.serving_mark(cell, "kda.decode", KIMI_K3) == " · at decode 1: the batch takes KDA's speculative rows"
    cell["lanes"]["kda.spec_verify"] = []
    assert "this cell has no kda.spec_verify evidence" in dispatch.serving_group(cell, "kda.decode", kda, "decode 1",
                                                                                  KIMI_K3)


@pytest.mark.parametrize("profile", list(models.PROFILES.values()), ids=list(models.PROFILES))
def test_what_a_profile_brings_is_about_its_own_lanes(profile):
    lanes = {lane.id for lane in profile.lanes}
    titles = dispatch.lane_titles(profile)
    assert set(profile.dispatch.order) <= set(titles) and len(set(profile.dispatch.order)) == len(profile.dispatch.order)
    assert set(profile.dispatch.notes) | set(profile.dispatch.stand_ins) <= set(titles)
    if profile.step_path is not None:
        assert profile.step_path.lane in titles and set(profile.step_path.parts) <= lanes
    if profile.backend_labels is not None:
        assert set(profile.backend_labels.kernels) <= lanes
    assert set(profile.selftest_lanes) <= lanes
    assert not profile.selftest_slice or profile.selftest_slice in profile.slices


def test_a_diff_is_in_its_models_words():
    for model, name in ((GPT_OSS_120B, "routing-gpt-oss-120b-v0.33.0.json"), (KIMI_K3, "routing-v0.33.0.json")):
        r = json.loads((ROOT / "tests" / "data" / name).read_text(encoding="utf-8"))
        d = diff_routings(r, copy.deepcopy(r), model)
        assert d["model"] == model.name
        assert f"\n{model.title}, {len(r['cells'])} cells (system × layout) compared." in render_diff(d, model)


def test_model_hooks_are_declared_and_a_typo_is_refused_when_the_package_loads():
    """A resolve module's public functions are declared hooks or its listed lanes (as pytest checks hook
    implementations against its hookspecs): a misspelt hook is an error at load, never a hook that silently
    never runs; the shared probes can ask only for declared hooks."""
    import types

    import pytest

    from probes import models as probes_models

    for name in ("kimi_k3", "gpt_oss"):  # the shipped packages pass
        probes_models.load(name, resolve=True)

    def module(**functions):
        m = types.ModuleType("probes.models.throwaway.resolve")
        for attr, fn in functions.items():
            fn.__module__ = m.__name__
            fn.__name__ = attr
            setattr(m, attr, fn)
        return m

    ok = module(runner_facts=lambda runner: {}, _helper=lambda: None, lane_x=lambda *a: iter(()))
    ok.LANES = (("x", ok.lane_x),)
    probes_models.check_resolve_module("throwaway", ok)
    with pytest.raises(probes_models.UnknownModel, match=r"defines runner_fact\(\), which is no hook"):
        probes_models.check_resolve_module("throwaway", module(runner_fact=lambda runner: {}))
    with pytest.raises(probes_models.UnknownModel, match=r"lane_unlisted\(\)"):
        probes_models.check_resolve_module("throwaway", module(lane_unlisted=lambda *a: iter(())))
    with pytest.raises(KeyError, match="no declared model hook"):
        probes_models.ModelProbes(resolve=ok).hook("runner_fact")
    assert probes_models.ModelProbes(resolve=ok).hook("block_facts") is None


def test_a_profile_breaking_a_rule_the_shared_code_relies_on_is_refused_when_it_is_made():
    """Naming rules nobody wrote down, now checked at registration: the routed experts lane is `moe`, every lane
    another field names exists (the judged lanes, a batch route's lanes and paths, ...), every post-load reading a
    lane reads exists."""
    import dataclasses

    import pytest

    from audit.errors import ExitCode, ProfileError
    from audit.models.kimi_k3 import KIMI_K3
    from audit.profiles import SHARED_POSTLOAD_READINGS, BatchRoute, Source
    from audit.report.routing import POSTLOAD_READINGS

    assert set(SHARED_POSTLOAD_READINGS) == set(POSTLOAD_READINGS)

    def lanes_with(lane_id, **changes):
        return tuple(dataclasses.replace(l, **changes) if l.id == lane_id else l for l in KIMI_K3.lanes)

    cases = [
        (dict(lanes=lanes_with("moe", id="experts")), "must be named 'moe'"),
        (dict(lanes=lanes_with("mla.decode", id="mla.dec")), r"names lane\(s\) mla.decode"),
        (dict(batch_routes=(BatchRoute("kda_batch", ("kda.decode",), {"speculative rows": "kda.verify"}, "KDA"),)),
         r"batch_routes names lane\(s\) kda.verify"),
        (dict(lanes=KIMI_K3.lanes + KIMI_K3.lanes[:1]), "defined twice"),
        (dict(lanes=lanes_with("moe.kernel", sources=(Source("postload", "moe_kernels", ()),))),
         "reads the post-load reading 'moe_kernels'"),
        (dict(lanes=lanes_with("dense", layer_kind="dens")), "layer kind 'dens'"),
        (dict(selftest_lanes=("kda.prefil",)), r"selftest_lanes names lane\(s\) kda.prefil"),
        (dict(perf_lanes={**KIMI_K3.perf_lanes, "mla.decode": "mla.decod"}), r"perf_lanes names lane\(s\) mla.decod"),
        # the quantization scheme is a module of its own, selected by name; its precision lanes name the experts
        (dict(schemes=("mxfp5",)), r"no module probes/schemes/mxfp5.py"),
        (dict(perf_lanes={**KIMI_K3.perf_lanes, "w4a16_mxfp4": "mla.decode"}), "precision lane"),
        (dict(schemes=()), "none of its schemes"),
    ]
    for changes, message in cases:
        with pytest.raises(ProfileError, match=message) as e:
            dataclasses.replace(KIMI_K3, **changes)
        assert e.value.profile == "kimi-k3" and e.value.exit_code == ExitCode.INTERNAL
    assert dataclasses.replace(KIMI_K3).lanes == KIMI_K3.lanes  # the shipped profile passes


def test_a_scheme_module_with_an_undeclared_field_is_refused(tmp_path, monkeypatch):
    """A scheme's fields are declared (probes.schemes.FIELDS): a misspelt one is an error when it loads, never a
    table the shared code silently ignores."""
    import sys

    import pytest

    from probes import schemes

    pkg = tmp_path / "probes_schemes_extra"
    monkeypatch.setattr(schemes, "__path__", [*schemes.__path__, str(tmp_path)])
    (tmp_path / "typo_scheme.py").write_text("FAMILIES = ()\nPRECISION_LANE = {'w1a1': 'x'}\n")
    monkeypatch.delitem(sys.modules, "probes.schemes.typo_scheme", raising=False)
    with pytest.raises(schemes.UnknownScheme, match="PRECISION_LANE is no scheme field"):
        schemes.load("typo_scheme")
    assert not pkg.exists()
    with pytest.raises(schemes.UnknownScheme, match="no module probes/schemes/nope.py"):
        schemes.load("nope")
    mx = schemes.load("mxfp4")
    assert mx.family("MARLIN") == "marlin" and mx.family("NOT_A_MEMBER") is None
    assert mx.precision_lane("moe.quant_method", "FLASHINFER_TRTLLM_MXFP4_MXFP8") == "w4a8_mxfp4_mxfp8"
    fp8 = schemes.load("fp8_block")
    assert fp8.precision_lane("moe.quant_method", "DEEPGEMM") == "w8a8_fp8_block"
    assert fp8.precision_lane("moe.quant_method", "MARLIN") == "w8a16_fp8"
    assert fp8.precision_lane("moe.quant_method", "CPU") is None
