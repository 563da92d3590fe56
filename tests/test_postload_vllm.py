"""The post-load stage against the real vLLM 0.30.0 wheel (its MegaMoE device check runs after loading).

vLLM 0.30.0 builds MegaMoE experts on every SM and checks the device only when the model's post-load
hook finalizes their weights. Resolve mode must show that refusal (vLLM's own message and raising
function, a REFUSED verdict (at load)), must not invent one where vLLM's check passes, and must follow a
change planted in the pinned vLLM's gate.
"""
import json
from pathlib import Path

import pytest

from audit.lanevalue import identity, is_inactive, text

from audit.evidence import files as evidence
from audit.report import expectations
from audit.pins import lock
from audit.report import routing
from audit.report import verdicts
from audit.models.kimi_k3 import KIMI_K3
from audit.report.render import render_ledger
from tests.conftest import ROOT
from tests.plant import sitecustomize

pytestmark = pytest.mark.vllm

PIN = "v0.30.0"
GATE = "vllm.models.deepseek_v4.nvidia.model:DeepseekV4MegaMoEExperts._check_runtime_supported"

#: Changes planted in the pinned vLLM as it is imported. Each rewrites one module's source in memory
#: (same file name and line numbers); the wheel is untouched.
#: The MegaMoE device gate also admits SM 9.x:
GATE_PLANT = ("vllm.models.deepseek_v4.nvidia.model",
              [("if torch.cuda.get_device_capability(device)[0] != 10:",
                "if torch.cuda.get_device_capability(device)[0] not in (9, 10):")])
#: K3 finalizes its MegaMoE experts at the end of its language model's load_weights instead of in its
#: post-load hook, as vLLM 0.27.0 to 0.29.0 do:
LOAD_TAIL_PLANT = ("vllm.models.kimi_k3.nvidia.model",
                   [("        self.model.finalize_mega_moe_weights()\n", "        pass\n"),
                    ("        return loader.load_weights(weights)\n",
                     "        loaded = loader.load_weights(weights); self.model.finalize_mega_moe_weights(); return loaded\n")])



@pytest.fixture(scope="module")
def env030():
    from audit.runtimes.local import LocalRuntime

    pin = lock.load(ROOT / "images.lock").get(PIN)
    rt = LocalRuntime()
    env = rt.ensure_env(pin, lambda *a, **k: None)
    return rt, pin, env


def _run(env030, tmp_path_factory, name, cells, *, plant=None, **kw):
    from audit.runtimes import RunRequest
    from audit.systems import SYSTEMS

    from audit.models.kimi_k3 import LAYOUTS

    rt, pin, _ = env030
    run_dir = tmp_path_factory.mktemp(name)
    if plant:  # the agent's PYTHONPATH is the run directory: Python runs this at start, before vLLM
        (run_dir / "sitecustomize.py").write_text(sitecustomize([plant]), encoding="utf-8")
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in cells],
                     run_dir=run_dir, parallel=2, **kw)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    files = evidence.read_dir(result.evidence_dir)
    pin_info = {"name": PIN, "vllm_version": pin.version, "wheel": pin.wheel, "wheel_sha256": pin.wheel_sha256,
                "image": "", "platform_digests": {}, "vllm_commit": "", "python": pin.python}
    r = routing.build_routing(files, KIMI_K3, pin=pin_info, expected=list(cells))
    verdicts.attach(r, expectations.load(ROOT / "expectations" / "kimi-k3.toml"), KIMI_K3, display_path="kimi-k3.toml")
    return {"routing": r, "files": files, "cells": {(c["system"], c["layout"]): c for c in r["cells"]},
            "ledger": render_ledger(r, profile=KIMI_K3, reproduce="x")}


@pytest.fixture(scope="module")
def probed(env030, tmp_path_factory):
    return _run(env030, tmp_path_factory, "postload", [("h100_sxm", "dep8"), ("b200_sxm", "dep8")])


@pytest.fixture(scope="module")
def planted(env030, tmp_path_factory):
    return _run(env030, tmp_path_factory, "planted", [("h100_sxm", "dep8")], plant=GATE_PLANT)


@pytest.fixture(scope="module")
def load_tail(env030, tmp_path_factory):
    return _run(env030, tmp_path_factory, "load-tail", [("h100_sxm", "dep8")], plant=LOAD_TAIL_PLANT)


@pytest.fixture(scope="module")
def bare(env030, tmp_path_factory):
    """The same simulation without any probe (the post-load stage still runs)."""
    return _run(env030, tmp_path_factory, "bare", [("h100_sxm", "dep8")], probes=False)


def first_moe_layer() -> int:
    return json.loads(KIMI_K3.config_text())["text_config"]["first_k_dense_replace"]


def test_vllm_refuses_megamoe_at_load_on_sm90(probed, env030):
    cell = probed["cells"][("h100_sxm", "dep8")]
    # construction accepts it (what the committed ledgers showed) ...
    assert cell["status"] == "COMPLETE"
    assert [text(g) for g in cell["lanes"]["moe"]] == ["KimiK3MegaMoEExperts (MegaMoE)"]
    # ... and vLLM's post-load check refuses it, in the first MoE layer, from the model's own hook
    r = cell["load_refused"]
    assert r["function"] == GATE and r["type"] == "builtins:NotImplementedError"
    assert r["layer"] == first_moe_layer() and r["module"].endswith(f"layers.{first_moe_layer()}.block_sparse_moe.experts")
    assert r["step"] == "KimiK3ForConditionalGeneration.process_weights_after_loading"
    # the message and the place are vLLM's own: the recorded line of the installed wheel raises it
    rt, _, env = env030
    path, line = r["where"].rsplit(":", 1)
    source = (rt.site_packages(env) / path).read_text(encoding="utf-8").splitlines()
    assert source[int(line) - 1].strip() == f'raise NotImplementedError("{r["message"]}")'
    assert cell["postload"]["refused"] == 1 and cell["postload"]["limit"] == 0
    # one refusal, on the kind of layer refused (the block around the experts: MoE); the claims on the other
    # layers are not judged, since nothing of the deployment serves; the gate counts the refusal
    assert r["kind"] == "moe"
    rows = [v for v in probed["routing"]["verdicts"]["rows"] if (v["system"], v["layout"]) == ("h100_sxm", "dep8")]
    refused = [v for v in rows if v["verdict"] == "REFUSED"]
    assert refused and all(v["lane"] == "moe" for v in refused)
    assert all(GATE in v["why"] and r["message"] in v["why"] for v in refused)
    assert all(v["verdict"] == "UNVERIFIED" and "refused this deployment at load" in v["why"]
               for v in rows if v not in refused)
    assert "REFUSED" in verdicts.FAILING
    # the ledger says so where a reader looks first, and in the matrix
    ledger = probed["ledger"]
    assert "> **vLLM refuses to load in 1 cell(s):** h100_sxm/dep8 (`" + GATE in ledger
    assert f"REFUSED by vLLM (layer {first_moe_layer()}): NotImplementedError: {r['message']}" in ledger


def test_no_refusal_where_the_check_passes(probed):
    """On SM 10.0 the gate passes, and post-load runs to its end: DeepGEMM's scale layout transform is a
    meta kernel (a stand-in) and its MegaMoE weight transform is plain torch, so the weights are transformed
    and the rows are post-load evidence; nothing is refused."""
    cell = probed["cells"][("b200_sxm", "dep8")]
    post = cell["postload"]
    assert cell["load_refused"] is None and post["refused"] == 0
    assert post["limit"] == 0 and post["ok"] == post["steps"] and post["limits"] == []
    assert not any(v["verdict"] == "REFUSED" for v in probed["routing"]["verdicts"]["rows"]
                   if v["system"] == "b200_sxm")
    # how the MegaMoE experts dispatch and combine, read off what they hold (no prepare/finalize, no MoE config;
    # the symmetric buffer cache their class keeps) beside the EP group's all2all manager they do not reference
    kernel = cell["lanes"]["moe.kernel"]
    assert {(g["level"], identity(g["value"])) for g in kernel} == {
        ("post-load", ("KimiK3MegaMoEExperts weights transformed; dispatch/combine in kernel", False))}
    words = text(kernel[0])
    assert words.startswith("KimiK3MegaMoEExperts weights transformed; dispatch/combine in kernel (dispatch/combine "
                            "inside the experts' own kernel")
    assert "no prepare/finalize object, no MoE config" in words and "AgRsAll2AllManager" in words
    # the latent tail fusion and deferred finalize: not built, and vLLM's attribute that decided it
    decided = "vLLM's `KimiMoE.use_mega_moe is True`"
    assert {text(g).split(": the MegaMoE")[0] for g in cell["lanes"]["moe.tail_fusion"]} == {f"not built ({decided}"}
    assert all(is_inactive(g["value"]) for g in cell["lanes"]["moe.tail_fusion"])
    assert {text(g) for g in cell["lanes"]["moe.deferred_finalize"]} == {
        f"none: no MoE runner is built ({decided})"}
    assert {text(g) for g in cell["lanes"]["moe.activation"]} == {
        "situ (KimiK3MegaMoEExperts; vLLM records no kernel-support check)"}
    # the stand-in that made the transform's output exist is listed, and it ran
    assert "deep_gemm:transform_sf_into_required_layout" in cell["simulated"]


def test_planted_gate_change_changes_the_ledger(probed, planted):
    before, after = probed["cells"][("h100_sxm", "dep8")], planted["cells"][("h100_sxm", "dep8")]
    assert before["load_refused"] is not None
    # with the gate admitting SM 9.x, vLLM no longer refuses; post-load goes on into DeepGEMM's scale layout on
    # SM 9, which the stand-in does not simulate for MegaMoE's packed scales. No declared limit covers that place
    # (audit/limits.py), so it is a harness fault: the cell is INCOMPLETE, never a refusal and never a limit that
    # lets what lies past it read as vLLM's doing
    assert after["status"] == "INCOMPLETE" and after["failure"]["stage"] == "harness"
    [fault] = after["harness_faults"]
    assert fault["piece"] == routing.UNDECLARED and fault["where"] == "probes.resolve.standins:transform_sf_meta"
    assert not any(v["verdict"] == "REFUSED" for v in planted["routing"]["verdicts"]["rows"])
    assert "vLLM refuses to load" not in planted["ledger"]
    assert "REFUSED by vLLM" not in planted["ledger"]
    # what the evidence says itself: the refusal is gone, a stop took its place
    raw = routing.build_cell(next(f for f in planted["files"] if f.cell == ("h100_sxm", "dep8")), KIMI_K3)
    assert raw["load_refused"] is None and raw["postload"]["refused"] == 0 and raw["postload"]["limit"] >= 1
    # construction did not change: only what vLLM decides after loading moved
    assert raw["lanes"]["moe"] == before["lanes"]["moe"]


def test_postload_outcomes_do_not_depend_on_the_probes(probed, bare):
    """Every post-load step ends the same way (outcome, exception type, message, raising function)
    with and without the probes installed."""
    def steps(run):
        f = next(f for f in run["files"] if f.cell == ("h100_sxm", "dep8"))
        return [(r["step"], r["module"], r["fn"], r["outcome"], r.get("type"), r.get("message"), r.get("raised_in"))
                for r in f.of_kind("postload-step")]

    assert steps(probed) == steps(bare) and len(steps(bare)) > 100
    # the same refusal; which kind of layer refused is read from the probes' scope records, so only the
    # probed run knows it
    without_kind = lambda r: {k: v for k, v in r.items() if k != "kind"}  # noqa: E731
    bare_r, probed_r = bare["cells"][("h100_sxm", "dep8")]["load_refused"], probed["cells"][("h100_sxm", "dep8")]["load_refused"]
    assert without_kind(bare_r) == without_kind(probed_r) and bare_r["kind"] is None and probed_r["kind"] == "moe"


def test_a_refusal_at_the_end_of_load_weights_is_seen(probed, load_tail):
    """vLLM 0.27.0 to 0.29.0 run the MegaMoE device check at the end of the language model's
    load_weights. The post-load stage runs that tail (the model's load_weights fed no tensors), so the
    refusal is seen there, with the same message and raising function, and fails the audit the same way."""
    before, after = probed["cells"][("h100_sxm", "dep8")], load_tail["cells"][("h100_sxm", "dep8")]
    r = after["load_refused"]
    assert r is not None and r["step"] == "KimiLinearForCausalLM.load_weights"
    assert (r["function"], r["type"], r["message"]) == (GATE, "builtins:NotImplementedError",
                                                        before["load_refused"]["message"])
    assert r["layer"] == first_moe_layer() and r["module"].endswith(f"layers.{first_moe_layer()}.block_sparse_moe.experts")
    # the post-load hook no longer finalizes: the load tail is the only refusal
    assert after["postload"]["refused"] == 1 and after["postload"]["steps"] == before["postload"]["steps"]
    rows = [v for v in load_tail["routing"]["verdicts"]["rows"] if (v["system"], v["layout"]) == ("h100_sxm", "dep8")]
    assert rows and {v["verdict"] for v in rows if v["lane"] == "moe"} == {"REFUSED"}
    assert {v["verdict"] for v in rows if v["lane"] != "moe"} <= {"UNVERIFIED"}
    assert "during `KimiLinearForCausalLM.load_weights`" in load_tail["ledger"]
    # without the plant the tail runs too, and does nothing but load (0.30.0 finalizes in its hook)
    f = next(f for f in probed["files"] if f.cell == ("h100_sxm", "dep8"))
    tails = [(s["fn"].rsplit(":", 1)[-1], s["outcome"]) for s in f.of_kind("postload-step") if s["step"] == "model-load"
             and s["role"] == "target"]
    assert tails == [("KimiK3ForConditionalGeneration.load_weights", "ok"), ("KimiLinearForCausalLM.load_weights", "ok")]
