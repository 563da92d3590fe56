"""Host side of the post-load stage: routing's lanes and levels, the load_refused finding, the
REFUSED verdict (at load) and the ledger, from evidence records shaped as probes/resolve/postload.py writes them
(tests/test_postload_vllm.py checks the same path against the real wheel)."""
from pathlib import Path

from audit.lanevalue import identity, make, text
from audit.report import routing
from audit.report import verdicts
from audit.evidence.files import EvidenceFile
from audit.report.expectations import Claim, Expectations
from audit.models.kimi_k3 import KIMI_K3
from audit.report.render import render_ledger

TRT = "vllm.model_executor.layers.fused_moe.experts.trtllm_mxfp4_moe:TrtLlmMxfp4ExpertsMonolithic"
GATE = "vllm.models.deepseek_v4.nvidia.model:DeepseekV4MegaMoEExperts._check_runtime_supported"
PIN = {"name": "v0.30.0", "vllm_version": "0.30.0", "wheel": "w.whl", "wheel_sha256": "0" * 64, "image": "",
       "platform_digests": {}, "vllm_commit": "", "python": "3.12"}


def _file(system, layout, records):
    stages = [{"kind": "stage", "stage": s, "ok": True} for s in routing.STAGE_ORDER if s != "construct-draft"]
    # what every built cell records besides (a selection, a module built): no lane here reads these two
    built = [{"kind": "select", "target": "test.selector", "scope": "", "args": {}, "result": None},
             {"kind": "construct", "target": "test.module", "scope": "", "cls": "x:Y", "attrs": {}}]
    return EvidenceFile(path=Path(f"{system}.jsonl"),
                        header={"kind": "header", "mode": "resolve", "cell": {"system": system, "layout": layout}},
                        records=stages + built + [{"kind": "stage", "stage": "post-load", "ok": True}] + records)


def _step(layer, outcome, **kw):
    name = f"language_model.model.layers.{layer}.block_sparse_moe.experts.routed_experts" if layer is not None else ""
    return {"kind": "postload-step", "role": "target", "step": "quant_method" if layer is not None else "model",
            "module": name, "layer": layer, "fn": "vllm.x:Mxfp4MoEMethod.process_weights_after_loading",
            "outcome": outcome, **kw}


def _runner(layer, **facts):
    base = {"runner": "vllm.models.kimi_k3.nvidia.latent_moe_runner:LatentMoERunner", "tail_fusion_enabled": True,
            "fused_path": True, "tail_max_tokens": 128, "defer_requested": True, "defer_effective": True,
            "defer_max_tokens": 128, "layer_activation": "MoEActivation.SITU", "experts_cls": TRT,
            "quant_method": "vllm.x:Mxfp4MoEMethod", "moe_kernel": None}
    return {"kind": "postload-module", "role": "target", "name": f"language_model.model.layers.{layer}.mlp.experts",
            "layer": layer, "what": "moe-runner", "facts": {**base, **facts}}


def test_levels_follow_how_far_post_load_went():
    limit = {"raised_in": "flashinfer.utils:get_compute_capability", "type": "builtins:ValueError",
             "message": "device must be a cuda device", "rule": "raised outside vLLM"}
    f = _file("b200_sxm", "tp8", [
        _step(1, "limit", **limit), _step(2, "ok"),
        _runner(1),  # the kernel was not built: the fused path was never re-read
        _runner(2, moe_kernel="vllm.x:FusedMoEKernel", fused_experts=TRT, prepare_finalize="vllm.x:NoEP",
                fused_path=False),
        {"kind": "activation_check", "scope": "language_model.model.layers.1.mlp.experts", "cls": TRT,
         "owner": TRT, "activation": "MoEActivation.SITU", "result": True},
        {"kind": "postload-model", "role": "target", "specialized_decode_requested": False},
        {"kind": "candidate", "target": "moe.candidate", "scope": "language_model.model.layers.1.mlp.experts",
         "cls": TRT, "backend": "Mxfp4MoeBackend.TRTLLM", "supported": True, "reason": None},
    ])
    cell = routing.build_cell(f, KIMI_K3)
    assert cell["candidates"]["moe"][0]["layers"] == [1]  # construction's evidence is kept beside post-load's
    by_layer = lambda lane: {l: (text(g), g["level"]) for g in cell["lanes"][lane] for l in g["layers"]}
    tail = by_layer("moe.tail_fusion")
    assert tail[1] == ("fused tail enabled at construction (fused path not re-read: no MoE kernel was built)",
                       "construction; post-load stopped at a simulation limit")
    assert tail[2] == ("unfused tail (enabled at construction; the fused path does not hold once the MoE kernel "
                       "exists)", "post-load")
    act = by_layer("moe.activation")
    assert act[1][0] == "SITU (TrtLlmMxfp4ExpertsMonolithic; vLLM asked the kernel: supported)"
    assert act[2][0] == "SITU (TrtLlmMxfp4ExpertsMonolithic; vLLM did not ask the kernel about it)"
    # the activation is the value; which experts and how the check was recorded is a note
    assert identity(cell["lanes"]["moe.activation"][0]["value"]) == ("SITU", False)
    assert by_layer("moe.kernel")[2] == ("TrtLlmMxfp4ExpertsMonolithic with NoEP", "post-load")
    assert by_layer("moe.deferred_finalize")[2] == ("deferred up to 128 tokens", "post-load")
    assert cell["lanes"]["decode.specialized"][0]["ranges"] == "model"
    # a limit is stated, never a finding; this one no declaration covers (audit/limits.py): a harness fault, which
    # ends the cell INCOMPLETE in the routing (tests/test_limits.py)
    assert cell["load_refused"] is None
    assert [f["piece"] for f in cell["harness_faults"]] == [routing.UNDECLARED]
    assert cell["postload"]["limits"][0]["raised_in"] == limit["raised_in"] and cell["postload"]["limits"][0]["count"] == 1
    assert "_modules" not in cell["postload"]  # raw records are read into lanes, not kept in routing.json


def _refused_routing():
    refused = _file("h100_sxm", "dep8", [
        _step(1, "ok"),
        _step(None, "refused", fn="vllm.m:KimiK3ForConditionalGeneration.process_weights_after_loading",
              raised_in=GATE, raised_where="<env>/site-packages/vllm/models/deepseek_v4/nvidia/model.py:338",
              type="builtins:NotImplementedError", message="DeepGEMM MegaMoE requires SM100 GPUs.",
              in_module="language_model.model.layers.1.block_sparse_moe.experts", in_layer=1),
    ])
    fine = _file("b200_sxm", "dep8", [_step(1, "ok")])
    return routing.build_routing([refused, fine], KIMI_K3, pin=PIN, expected=[("h100_sxm", "dep8"), ("b200_sxm", "dep8")])


def test_refusal_is_a_failing_verdict_with_where():
    r = _refused_routing()
    cell = next(c for c in r["cells"] if c["system"] == "h100_sxm")
    assert cell["load_refused"] == {
        "function": GATE, "where": "vllm/models/deepseek_v4/nvidia/model.py:338",
        "type": "builtins:NotImplementedError", "message": "DeepGEMM MegaMoE requires SM100 GPUs.",
        "step": "KimiK3ForConditionalGeneration.process_weights_after_loading",
        "module": "language_model.model.layers.1.block_sparse_moe.experts", "layer": 1, "model": "target",
        "kind": None}  # this evidence has no scope records: which kind of layer refused is not known
    claim = Claim(id="moe-dep", lane="w4a8_mxfp4_mxfp8", harness_lane="moe", layouts=("dep8",),
                  systems=("h100_sxm", "b200_sxm"), backend="deepgemm", source="test")
    exp = lambda claims: Expectations(path=Path("e.toml"), model="kimi-k3", framework="vllm",
                                      architecture=KIMI_K3.architecture, claims=tuple(claims))
    for exp, claims in ((exp([claim]), ["moe-dep"]), (exp([]), [""])):
        rows = [v for v in verdicts.judge(r, exp, KIMI_K3) if v["system"] == "h100_sxm"]
        assert [(v["verdict"], v["claim"]) for v in rows] == [("REFUSED", c) for c in claims]
        assert GATE in rows[0]["why"] and "layers.1.block_sparse_moe.experts" in rows[0]["why"]
        assert rows[0]["layers"] == "1"
        assert verdicts.summary(rows)["REFUSED"] == 1 and "REFUSED" in verdicts.FAILING
        # the cell the gate passes is judged as before
        assert not any(v["verdict"] == "REFUSED" for v in verdicts.judge(r, exp, KIMI_K3) if v["system"] == "b200_sxm")


def test_ledger_says_where_vllm_refused():
    text = render_ledger(_refused_routing(), profile=KIMI_K3, reproduce="x")
    assert f"> **vLLM refuses to load in 1 cell(s):** h100_sxm/dep8 (`{GATE}` raised `NotImplementedError`" in text
    matrix = next(l for l in text.splitlines() if l.startswith("| Weights load (post-load) |"))
    assert "REFUSED by vLLM (layer 1): NotImplementedError: DeepGEMM MegaMoE requires SM100 GPUs." in matrix
    assert "simulated to the end: 1 steps, no refusal" in matrix
    # the refused cell's lanes show what construction built, marked: it does not serve; the other cell's are not
    r = _refused_routing()
    for c in r["cells"]:
        c["lanes"]["moe"] = [{"layers": [1], "ranges": "1", "value": make("Experts", backend="MEGA"),
                              "level": "construction"}]
    moe = next(l for l in render_ledger(r, profile=KIMI_K3, reproduce="x").splitlines()
               if l.startswith("| Routed experts |"))
    assert [c.strip() for c in moe.split("|")[2:-1]] == ["(refused at load) Experts", "Experts"]
    section = text.split("## Post-load", 1)[1].split("\n## ", 1)[0]
    assert "| h100_sxm | dep8 | 2 | 1 | 1 | 0 |" in section
    assert "during `KimiK3ForConditionalGeneration.process_weights_after_loading`" in section


# --- a stage that stopped: vLLM's own check, or the simulation running out (read from the recorded traceback) ---

def _err(type_, message, frames, chained=False):
    tb = ["Traceback (most recent call last):\n"]
    tb += [f'  File "/env/lib/python3.12/site-packages/{path}", line {line}, in {func}\n    {src}\n'
           for path, line, func, src in frames]
    tb.append(f"{type_.rsplit(':', 1)[-1]}: {message}\n")
    if chained:
        tb = ["ValueError: inner\n", "\nThe above exception was the direct cause of the following exception:\n\n", *tb]
    return {"type": type_, "message": message, "where": f"{frames[-1][0]}:{frames[-1][1]} in {frames[-1][2]}",
            "traceback": tb}


def test_a_construction_stop_says_whether_vllm_or_the_simulation_raised():
    from audit.report.routing import stop_outcome

    vllm_check = _err("builtins:NotImplementedError", "DeepGEMM MegaMoE requires SM100 GPUs.",
                      [("vllm/model_executor/layers/fused_moe/layer.py", 400, "__init__", "self._check()"),
                       ("vllm/models/x.py", 12, "_check", 'raise NotImplementedError("DeepGEMM MegaMoE requires SM100 GPUs.")')])
    assert stop_outcome(vllm_check)["outcome"] == "refused"
    torch_meta = _err("builtins:NotImplementedError", "The register_meta function for torch.nonzero() raises",
                      [("vllm/model_executor/layers/fused_moe/layer.py", 400, "__init__", "idx = torch.nonzero(m)"),
                       ("torch/__init__.py", 1750, "_check_with", "raise error_type(message_evaluated)")])
    assert stop_outcome(torch_meta) == {"outcome": "limit",
                                        "rule": "raised outside vLLM (torch, a compiled op, a library, or a stand-in)"}
    assertion = _err("builtins:AssertionError", "", [("vllm/a.py", 3, "f", "assert x.is_cuda")])
    assert stop_outcome(assertion)["outcome"] == "limit"
    reraised = _err("builtins:RuntimeError", "failed", [("vllm/a.py", 3, "f", 'raise RuntimeError("failed") from e')],
                    chained=True)
    assert stop_outcome(reraised)["outcome"] == "limit"
    words = _err("builtins:RuntimeError", "cannot run on meta tensors", [("vllm/a.py", 3, "f", 'raise RuntimeError(m)')])
    assert stop_outcome(words)["outcome"] == "limit"


LOADER_SOURCE = '''
def load_weights(weights):
    loaded = set(name for name, _ in weights)
    if "model.layers.93.eh_proj.weight" not in loaded:
        raise ValueError("MTP layer 93 weights missing from checkpoint")
    return loaded


def _check_device():
    raise NotImplementedError("this kernel requires SM100 GPUs.")


def finalize():
    _check_device()


def load_weights_and_finalize(weights):
    loaded = set(name for name, _ in weights)
    finalize()
    return loaded
'''


def _raised(tmp_path, fn_name):
    """The exception a function of a throwaway module raises, the module placed where a vLLM file lives."""
    import importlib.util

    path = tmp_path / "site-packages" / "vllm" / "throwaway_loader.py"
    path.parent.mkdir(parents=True)
    path.write_text(LOADER_SOURCE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("throwaway_loader", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        getattr(mod, fn_name)(iter(()))
    except Exception as exc:
        return exc
    raise AssertionError(f"{fn_name} did not raise")


def test_a_load_weights_fed_nothing_is_never_refused_for_what_it_did_not_get(tmp_path):
    """The post-load stage runs load_weights on an empty stream. A check on which tensors arrived is the
    simulation's doing (a limit); a check that loading calls besides (a finalize's device gate) is vLLM's
    refusal, as in any other step."""
    from probes.resolve.postload import classify

    exc = _raised(tmp_path, "load_weights")
    assert classify(exc)["outcome"] == "refused"  # as any other step would see an explicit raise in vLLM
    fed = classify(exc, fed_no_weights=True)
    assert fed["outcome"] == "limit" and "feeds none" in fed["rule"]
    gate = classify(_raised(tmp_path / "b", "load_weights_and_finalize"), fed_no_weights=True)
    assert gate["outcome"] == "refused" and gate["raised_in"].endswith("_check_device")
    assert gate["message"] == "this kernel requires SM100 GPUs."


def test_the_host_decides_refused_or_limit_by_the_rule_not_the_record():
    """A record's outcome is decided again from what it says was raised: "refused" for an exception raised in
    torch is a limit; "limit" for an explicit raise in vLLM's own code is a refusal."""
    f = _file("b200_sxm", "tp8", [
        _step(1, "refused", raised_in="torch._ops:OpOverloadPacket.__call__", raised_where="torch/_ops.py:1350",
              type="builtins:NotImplementedError", message="no meta kernel", raise_line=True, cause=None),
        _step(2, "limit", raised_in=GATE, raised_where="vllm/models/deepseek_v4/nvidia/model.py:338",
              type="builtins:NotImplementedError", message="DeepGEMM MegaMoE requires SM100 GPUs.", raise_line=True,
              cause=None),
        {"kind": "postload-model", "role": "target", "specialized_decode_requested": False},
    ])
    post = routing.build_cell(f, KIMI_K3)["postload"]
    assert (post["refused"], post["limit"]) == (1, 1)
    assert post["refused_at"]["function"] == GATE and post["refused_at"]["layer"] == 2
    (limit,) = post["limits"]
    assert limit["raised_in"] == "torch._ops:OpOverloadPacket.__call__"
    assert limit["rule"].startswith("raised outside vLLM") and "(the record said refused; the rule decided)" in limit["rule"]
