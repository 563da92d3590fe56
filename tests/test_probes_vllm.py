"""Probes against the real vLLM wheel pinned in images.lock (v0.33.0), in resolve mode."""
import json
import subprocess
import textwrap

import pytest

from audit.lanevalue import is_inactive, text

from audit.evidence import files as evidence
from audit.report import routing
from audit.models.kimi_k3 import KIMI_K3
from audit.report.render import render_ledger
from tests.conftest import ROOT, VLLM_CELLS

pytestmark = pytest.mark.vllm


def k3_layers():
    """What the shipped config says, in vLLM's 0-based indices (the config counts from 1)."""
    text = json.loads(KIMI_K3.config_text())["text_config"]
    lac = text["linear_attn_config"]
    return {
        "kda": sorted(i - 1 for i in lac["kda_layers"]),
        "mla": sorted(i - 1 for i in lac["full_attn_layers"]),
        "moe": list(range(text["first_k_dense_replace"], text["num_hidden_layers"])),
        "dense": list(range(text["first_k_dense_replace"])),
    }


def cells_of(run):
    req, result = run
    files = evidence.read_dir(result.evidence_dir)
    return {f.cell: f for f in files}


def test_every_cell_wrote_evidence(probed_run):
    req, result = probed_run
    assert result.missing == {}
    assert set(cells_of(probed_run)) == set(VLLM_CELLS)


@pytest.mark.parametrize("system", ["h100_sxm", "b200_sxm"])
def test_every_k3_layer_type_has_evidence(probed_run, system):
    cell = routing.build_cell(cells_of(probed_run)[(system, "tp8")], KIMI_K3)
    expected = k3_layers()
    assert cell["status"] == "COMPLETE" and cell["depth"] == "inspect"
    assert cell["layer_kinds"] == expected
    covered = {lane: sorted(l for g in groups for l in g["layers"]) for lane, groups in cell["lanes"].items()}
    for lane in ("kda.prefill", "kda.decode", "kda.spec_verify"):
        assert covered[lane] == expected["kda"], lane
    for lane in ("mla.decode", "mla.prefill"):
        assert covered[lane] == expected["mla"], lane
    assert covered["moe"] == expected["moe"]
    assert covered["dense"] == expected["dense"]
    # the oracle's walk is recorded for every MoE layer, and it ends with the class vLLM kept
    tried = cell["candidates"]["moe"]
    assert sorted(l for g in tried for l in g["layers"]) == expected["moe"]
    for g in tried:
        assert g["value"][-1]["supported"] is True
        assert all(t["reason"] for t in g["value"] if not t["supported"])
    chosen_value = cell["lanes"]["moe"][0]["value"]
    assert chosen_value["kernel"] == tried[0]["value"][-1]["cls"]
    assert cell["drift"] and {d["target"] for d in cell["drift"]} == {"test.drifted"}
    assert cell["raises"] == [] and cell["probe_errors"] == []


def test_rejections_carry_vllm_reasons_on_sm90(probed_run):
    cell = routing.build_cell(cells_of(probed_run)[("h100_sxm", "tp8")], KIMI_K3)
    rejected = [t for g in cell["candidates"]["moe"] for t in g["value"] if not t["supported"]]
    assert rejected, "on SM90 the oracle's first choice (SM100 TRT-LLM) must be rejected"
    assert cell["attention_candidates"]["rejected"]
    assert all(r["reasons"] and all(isinstance(x, str) for x in r["reasons"])
               for r in cell["attention_candidates"]["rejected"])


def test_megamoe_lane(probed_run):
    cells = cells_of(probed_run)
    b200 = routing.build_cell(cells[("b200_sxm", "dep8")], KIMI_K3)
    assert [text(g) for g in b200["lanes"]["moe"]] == ["DeepGemmMegaMoEExperts (MegaMoE)"]
    assert b200["lanes"]["moe"][0]["layers"] == k3_layers()["moe"]
    # on SM90 vLLM refuses MegaMoE at construction: the probes record it, they do not cause or hide it
    h100 = routing.build_cell(cells[("h100_sxm", "dep8")], KIMI_K3)
    assert h100["status"] == "PARTIAL" and h100["failure"]["stage"] == "construct"
    assert h100["failure"]["type"] == "builtins:NotImplementedError"
    # recorded once, where it was raised (the MegaMoE experts), with the probes it passed through
    assert [(r["target"], r["layer"], r["type"]) for r in h100["raises"]] == [
        ("moe.mega_moe_experts", 1, "builtins:NotImplementedError")]
    assert h100["raises"][0]["through"][:2] == ["scope.kimi_moe", "scope.decoder_layer"]


def test_probes_are_transparent(probed_run, bare_run):
    """Same simulation with and without probes: every constructed module chose the same things,
    and every stage ended the same way (same exception type and message)."""
    probed, bare = cells_of(probed_run), cells_of(bare_run)
    assert set(bare) == set(probed)
    for key in probed:
        p_mods = {r["name"]: (r["cls"], r["facts"]) for r in probed[key].of_kind("module")}
        b_mods = {r["name"]: (r["cls"], r["facts"]) for r in bare[key].of_kind("module")}
        assert p_mods == b_mods, key
        strip = lambda f: [(r["stage"], r["ok"], (r.get("error") or {}).get("type"),
                            (r.get("error") or {}).get("message")) for r in f.of_kind("stage")]
        assert strip(probed[key]) == strip(bare[key]), key
        assert bare[key].of_kind("probes") == [{"kind": "probes", "installed": False,
                                                "seq": bare[key].of_kind("probes")[0]["seq"]}]


def test_wrapper_contract_holds_on_real_vllm(probed_run):
    for key, f in cells_of(probed_run).items():
        checks = f.of_kind("contract")[-1]["checks"]
        assert len(checks) >= 15, key
        assert [c for c in checks if not c["ok"]] == [], key
        names = {c["target"] for c in checks}
        assert "vllm.platforms.cuda:CudaPlatformBase.get_attn_backend_cls" in names
        assert "vllm.models.kimi_k3.nvidia.kda:resolve_kda_prefill_backend" in names


IDENTITY = textwrap.dedent('''
    import inspect, json, sys
    sys.path.insert(0, sys.argv[1])
    from probes.resolve import simulate
    from probes.core.recorder import Recorder
    from probes.core.install import ProbeSet
    simulate.load_stub_libcuda(sys.argv[2])
    simulate.set_simulated({"name": "h100_sxm", "device_name": "NVIDIA H100 80GB HBM3", "capability": [9, 0],
                            "total_memory_gib": 80, "sm_count": 132, "arch": "amd64"}, 8)
    simulate.simulate_torch()
    from probes import schemes
    from probes.core.targets import TARGETS, with_model
    ps = ProbeSet(Recorder(None), targets=with_model(TARGETS, schemes.load("mxfp4").targets),
                  vllm_version="0.33.0").install()
    simulate.install_platform()
    from vllm.model_executor.layers.fused_moe.oracle import mxfp4 as oracle
    from vllm.model_executor.layers.quantization import mxfp4 as consumer
    wrapped = oracle.backend_to_kernel_cls
    original = wrapped.__wrapped__
    out = {"wrapped": hasattr(wrapped, "__serving_truth_probe__"),
           "signature": inspect.signature(wrapped) == inspect.signature(original),
           "consumer_rebound": consumer.select_deepseek_v4_mxfp4_moe_backend is oracle.select_deepseek_v4_mxfp4_moe_backend}
    same = []
    for member in oracle.Mxfp4MoeBackend:
        try:
            a = wrapped(member)
        except Exception as exc:
            a = ("raised", type(exc), str(exc))
        try:
            b = original(member)
        except Exception as exc:
            b = ("raised", type(exc), str(exc))
        same.append(a == b and (not isinstance(a, list) or all(x is y for x, y in zip(a, b))))
    out["identical_results"] = all(same) and len(same) > 5
    errs = []
    for f in (wrapped, original):
        try:
            f("not-a-backend")
        except Exception as exc:
            errs.append((type(exc).__name__, str(exc)))
    out["same_exception"] = len(errs) == 2 and errs[0] == errs[1]
    print(json.dumps(out))
''')


def test_identity_and_exceptions_on_real_functions(vllm_env, tmp_path):
    rt, pin, env = vllm_env
    stub = rt.ensure_stub(env)
    out = subprocess.run([str(env / "bin" / "python"), "-c", IDENTITY, str(ROOT), str(stub)],
                         capture_output=True, text=True, env=rt._env(env, stub, run_dir=tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "wrapped": True, "signature": True, "consumer_rebound": True, "identical_results": True,
        "same_exception": True}


def test_drift_reaches_the_ledger(probed_run):
    req, result = probed_run
    files = evidence.read_dir(result.evidence_dir)
    r = routing.build_routing(files, KIMI_K3, pin={"name": "v0.33.0", "vllm_version": "0.33.0", "wheel": "",
                                                   "wheel_sha256": "", "image": "", "platform_digests": {},
                                                   "vllm_commit": "", "python": "3.12"},
                              expected=list(VLLM_CELLS), run={"reproduce": "x"})
    drift = [d for c in r["cells"] for d in c["drift"]]
    assert {d["target"] for d in drift} == {"test.drifted"}
    assert "has no attribute 'resolve_kda_prefill_backend_renamed'" in drift[0]["attempts"][0]
    ledger = render_ledger(r, profile=KIMI_K3, reproduce="x")
    section = ledger.split("## Probe drift", 1)[1].split("\n## ", 1)[0]
    assert "`test.drifted`" in section and "a selector renamed upstream" in section


def test_routing_is_deterministic(probed_run):
    req, result = probed_run
    render = lambda: json.dumps(routing.build_routing(evidence.read_dir(result.evidence_dir), KIMI_K3,
                                                      pin={"name": "p"}, expected=list(VLLM_CELLS)), sort_keys=True)
    assert render() == render()


def test_mtp_draft_layer_and_spec_verify(probed_run):
    """With MTP, vLLM builds a draft model whose layer sits after the target's last layer, and the
    target's KDA layers resolve their verify path for num_spec > 0 (and decode changes with it)."""
    cells = cells_of(probed_run)
    mtp = routing.build_cell(cells[("b200_sxm", "tp8-mtp")], KIMI_K3)
    plain = routing.build_cell(cells[("b200_sxm", "tp8")], KIMI_K3)
    last = k3_layers()["moe"][-1]
    assert mtp["status"] == "COMPLETE"
    assert [s["stage"] for s in mtp["stages"]][-2:] == ["construct-draft", "inspect"]
    # the draft's layer is its own: its class named, its rows apart from the target's (never "MoE 1-93")
    draft = mtp["draft"]
    assert draft["cls"] == "vllm.models.kimi_k3.nvidia.mtp:KimiK3MTP" and draft["layers"] == [last + 1]
    assert draft["layer_kinds"]["mtp"] == [last + 1] and draft["numbering"] == {}
    assert last + 1 in draft["layer_kinds"]["mla"] and last + 1 in draft["layer_kinds"]["moe"]
    assert "mtp" not in mtp["layer_kinds"] and max(mtp["layer_kinds"]["moe"]) == last
    covered = lambda lanes, lane: sorted(l for g in lanes[lane] for l in g["layers"])
    assert covered(mtp["lanes"], "moe") == k3_layers()["moe"] and covered(draft["lanes"], "moe") == [last + 1]
    spec = [g["value"] for g in mtp["lanes"]["kda.spec_verify"]]
    assert spec and not any(is_inactive(v) for v in spec)
    assert all(is_inactive(g["value"]) and text(g).startswith("not exercised")
               for g in plain["lanes"]["kda.spec_verify"])
    assert mtp["config"]["speculative"] == "mtp"
