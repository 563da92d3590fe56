"""Post-load to the end, on the real vLLM wheel pinned in images.lock (v0.33.0): the stand-ins below vLLM,
the fast path that carries a representative layer's conversion, and refusals planted after both.

Cells, one per SM family and conversion path: SM 8.9 TP8 (Marlin, one expert at a time), SM 9.0 DP8+EP
(Humming, the all2all manager), SM 10.0 TP8+MTP (FlashInfer TRT-LLM, the MTP draft's checkpoint check),
SM 12.0 TP8 (DeepGEMM's scale transform).
"""
import json
import os
import subprocess
import textwrap

import pytest

from audit.lanevalue import text

from audit.evidence import files as evidence
from audit.report import routing
from audit.models.kimi_k3 import KIMI_K3
from audit.report.render import render_ledger
from audit.runtimes import RunRequest
from audit.systems import SYSTEMS
from audit.models.kimi_k3 import LAYOUTS
from tests.conftest import ROOT
from tests.plant import sitecustomize

pytestmark = pytest.mark.vllm

CELLS = [("l40s", "tp8"), ("h200_sxm", "dp8-ep"), ("b200_sxm", "tp8-mtp"), ("b200_sxm", "dp8-ep"),
         ("rtx_pro_6000_server", "tp8")]
#: each cell's MoE kernel once post-load has run (what vLLM 0.33.0 builds there)
KERNELS = {
    ("l40s", "tp8"): "MarlinExperts with MoEPrepareAndFinalizeNoDPEPModular",
    ("h200_sxm", "dp8-ep"): "HummingGroupedExperts with MoEPrepareAndFinalizeNaiveDPEPModular "
                            "(all2all: AgRsAll2AllManager)",
    ("b200_sxm", "tp8-mtp"): "TrtLlmMxfp4ExpertsMonolithic with MoEPrepareAndFinalizeNoDPEPMonolithic",
    ("b200_sxm", "dp8-ep"): "TrtLlmMxfp4ExpertsModular with MoEPrepareAndFinalizeNaiveDPEPModular "
                            "(all2all: AgRsAll2AllManager)",
    ("rtx_pro_6000_server", "tp8"): "DeepGemmFP4Experts with MoEPrepareAndFinalizeNoDPEPModular",
}
#: vLLM's MXFP4 quant method builds the MoE kernel, then refuses (planted): after every stand-in ran
BUILT_THEN_REFUSED = ("vllm.model_executor.layers.quantization.mxfp4", [(
    '        """Build the modular MoE kernel from the (already in-format) weights."""\n',
    '        """Build the modular MoE kernel from the (already in-format) weights."""\n'
    '        self._build_moe_kernel_planted(layer)\n'
    '        raise NotImplementedError("planted: refused once the MoE kernel is built")\n\n'
    '    def _build_moe_kernel_planted(self, layer):\n')])
#: vLLM's MXFP4 converter rejects the checkpoint on the TRT-LLM path (planted)
CONVERTER_REJECTS = ("vllm.model_executor.layers.fused_moe.oracle.mxfp4", [(
    "    sf_block_size = 32  # mxfp4 block size\n\n    if mxfp4_backend in TRTLLM_BACKENDS:\n",
    "    sf_block_size = 32  # mxfp4 block size\n\n    if mxfp4_backend in TRTLLM_BACKENDS:\n"
    "        raise ValueError(\"planted: the TRT-LLM converter does not take this checkpoint's MXFP4 scales\")\n")])


def _run(vllm_env, tmp_path_factory, name, cells, *, plants=(), **kw):
    rt, pin, _ = vllm_env
    run_dir = tmp_path_factory.mktemp(name)
    if plants:
        (run_dir / "sitecustomize.py").write_text(sitecustomize(list(plants)), encoding="utf-8")
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in cells], run_dir=run_dir,
                     parallel=2, **kw)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    files = evidence.read_dir(result.evidence_dir)
    pin_info = {"name": pin.name, "vllm_version": pin.version, "wheel": pin.wheel,
                "wheel_sha256": pin.wheel_sha256, "image": "", "platform_digests": {}, "vllm_commit": "",
                "python": pin.python}
    r = routing.build_routing(files, KIMI_K3, pin=pin_info, expected=list(cells))
    return {"routing": r, "files": {f.cell: f for f in files if f.cell},
            "cells": {(c["system"], c["layout"]): c for c in r["cells"]},
            "ledger": render_ledger(r, profile=KIMI_K3, reproduce="x")}


@pytest.fixture(scope="module")
def fast(vllm_env, tmp_path_factory):
    return _run(vllm_env, tmp_path_factory, "fast", CELLS)


@pytest.fixture(scope="module")
def every(vllm_env, tmp_path_factory):
    return _run(vllm_env, tmp_path_factory, "every-layer", CELLS, postload_every_layer=True)


@pytest.fixture(scope="module")
def refused(vllm_env, tmp_path_factory):
    return _run(vllm_env, tmp_path_factory, "built-then-refused",
                [("h200_sxm", "dp8-ep"), ("b200_sxm", "tp8"), ("rtx_pro_6000_server", "tp8")],
                plants=[BUILT_THEN_REFUSED])


@pytest.fixture(scope="module")
def rejected(vllm_env, tmp_path_factory):
    return _run(vllm_env, tmp_path_factory, "converter-rejects", [("b200_sxm", "tp8")], plants=[CONVERTER_REJECTS])


def test_post_load_runs_to_the_end_on_every_path(fast):
    for key, kernel in KERNELS.items():
        cell = fast["cells"][key]
        post = cell["postload"]
        assert post["ran"] and post["refused"] == 0 and post["limit"] == 0 and post["limits"] == [], key
        assert [(text(g), g["level"]) for g in cell["lanes"]["moe.kernel"]] == [(kernel, "post-load")], key
    # the MTP draft's load_weights saw the checkpoint names it checks for, and the ledger says what was fed
    mtp = fast["cells"][("b200_sxm", "tp8-mtp")]
    assert mtp["postload"]["model_worst"] == {"target": 0, "draft": 0}
    assert "model.layers.93.enorm.weight" in mtp["simulated"]["post-load: checkpoint weight names"]
    # under DP+EP on SM 10.x the runner enables the tail fusion, and its fused-path condition fails at the
    # MoE's TP size (1 under DP+EP): the ledger quotes that check, read from vLLM's own condition
    ep = fast["cells"][("b200_sxm", "dp8-ep")]
    assert {text(g) for g in ep["lanes"]["moe.tail_fusion"]} == {
        "unfused tail (enabled at construction; vLLM's fused-path condition fails at `self.moe_config.tp_size > 1`)"}
    assert {text(g) for g in fast["cells"][("h200_sxm", "dp8-ep")]["lanes"]["moe.tail_fusion"]} == {
        "unfused tail (not enabled at construction)"}


def test_every_stand_in_that_ran_is_listed(fast):
    """Each stand-in a cell reached is in its "What was simulated" list, and its entry point was called."""
    expected = {
        ("b200_sxm", "tp8-mtp"): ["flashinfer.utils:get_compute_capability(device=...)",
                                  "flashinfer.quantization.fp4_quantization: JIT kernel libraries"],
        ("h200_sxm", "dp8-ep"): ["humming device info (csrc/device_info.cpp extension)",
                                 "humming.ops (weight layout ops)", "torch.cuda.device (context manager)",
                                 "vllm.distributed.device_communicators.pynccl:PyNcclCommunicator"],
        ("rtx_pro_6000_server", "tp8"): ["deep_gemm:transform_sf_into_required_layout"],
    }
    for key, items in expected.items():
        listed = fast["cells"][key]["simulated"]
        assert all(item in listed for item in items), (key, sorted(listed))
        calls = fast["files"][key].of_kind("simulated")[-1]["kernel_calls"]
        assert calls, key
    assert any("block_scale_interleave" in k for k in fast["files"][("b200_sxm", "tp8-mtp")]
               .of_kind("simulated")[-1]["kernel_calls"])


def test_the_fast_path_routes_exactly_as_every_layer(fast, every):
    """The carried conversion and the Humming memo give the routing running every layer gives, field by
    field; only the record of how the conversion ran differs."""
    import copy

    for key in CELLS:
        a, b = copy.deepcopy(fast["cells"][key]), copy.deepcopy(every["cells"][key])
        carried, plain = a["postload"].pop("carry"), b["postload"].pop("carry")
        # the fence is on in both; how many pieces it holds follows the path (the memo's piece exists only where
        # the memo runs): the harness's account, not routing
        assert a.pop("fence")["on"] and b.pop("fence")["on"], key
        assert a == b, key
        assert plain == [] and carried, key
    marlin = next(g for g in fast["cells"][("l40s", "tp8")]["postload"]["carry"] if g["role"] == "target")
    assert marlin["ran"] == "1,92" and marlin["carried"] == "2-91" and marlin["notes"] == []
    steps = [r for r in fast["files"][("l40s", "tp8")].of_kind("postload-step") if r.get("carry") == "carried"]
    assert len(steps) == 90 and {r["carried_from"] for r in steps} == {
        "language_model.model.layers.1.block_sparse_moe.experts.routed_experts"}
    assert "ran on layers 1,92, carried to 2-91" in fast["ledger"]


def test_a_refusal_after_the_stand_ins_is_seen(refused):
    """vLLM's quant method builds the kernel through every stand-in (FlashInfer, Humming, DeepGEMM, the all2all
    manager), then refuses (planted): the refusal is vLLM's, on every layer, and fails the cell."""
    for key in (("h200_sxm", "dp8-ep"), ("b200_sxm", "tp8"), ("rtx_pro_6000_server", "tp8")):
        cell = refused["cells"][key]
        r = cell["load_refused"]
        assert r is not None and r["message"] == "planted: refused once the MoE kernel is built", key
        assert r["function"].endswith("Mxfp4MoEMethod._build_moe_kernel") and r["type"] == "builtins:NotImplementedError"
        assert cell["postload"]["refused"] >= 92 and cell["postload"]["limit"] == 0, key
        assert {g["level"] for g in cell["lanes"]["moe.kernel"]} == {"construction; vLLM refused at load"}
    assert "vLLM refuses to load in 3 cell(s)" in refused["ledger"]


def test_a_planted_converter_change_shows_in_the_ledger(rejected):
    cell = rejected["cells"][("b200_sxm", "tp8")]
    r = cell["load_refused"]
    assert r["message"] == "planted: the TRT-LLM converter does not take this checkpoint's MXFP4 scales"
    assert r["function"].endswith("convert_weight_to_mxfp4_moe_kernel_format")
    assert {text(g) for g in cell["lanes"]["moe.kernel"]} == {"no kernel object built"}
    assert "planted: the TRT-LLM converter does not take this checkpoint" in rejected["ledger"]


# -- the stand-ins themselves, in the pinned environment's Python ------------------------------------------------

def _in_env(vllm_env, code: str) -> dict:
    rt, _, env = vllm_env
    proc = subprocess.run([str(env / "bin" / "python"), "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT), "HOME": str(ROOT / "build"),
                               "PYTHONDONTWRITEBYTECODE": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_deep_gemm_meta_kernel_matches_the_upstream_torch_layout(vllm_env):
    """The meta kernel's output for K3's scale shapes has exactly the layout DeepGEMM's own pure-torch fallback
    produces (csrc/jit_kernels/impls/smxx_layout.hpp, ``..._packed_ue8m0_tensor_torch``), run here on the CPU."""
    out = _in_env(vllm_env, '''
        import json, torch
        from probes.resolve import simulate, standins
        simulate.set_simulated({"device_name": "x", "capability": [12, 0], "total_memory_gib": 1, "sm_count": 1}, 8)

        def upstream_torch(sf):  # the fallback's steps: UE8M0 bytes, padded, viewed as int32, MN-major copy
            sf3 = sf.unsqueeze(0) if sf.dim() == 2 else sf
            ue8m0 = (sf3.view(torch.int32) >> 23).to(torch.uint8)
            g, mn, k = sf3.shape
            amn, ak = (mn + 3) // 4 * 4, (k + 3) // 4 * 4
            padded = torch.zeros(g, amn, ak, dtype=torch.uint8)
            padded[:, :mn, :k] = ue8m0
            padded = padded.view(-1).view(torch.int32).view(g, amn, ak // 4)
            out = torch.empty_strided((g, amn, ak // 4), (amn * (ak // 4), 1, amn), dtype=torch.int32)
            out.copy_(padded)
            out = out[:, :mn]
            return out.squeeze(0) if sf.dim() == 2 else out

        rows = []
        for g, mn, k in ((896, 768, 3584), (896, 3584, 384), (112, 6144, 3584), (4, 130, 224)):
            sf = torch.rand(g, mn, k // 32) + 1
            ref = upstream_torch(sf)
            meta = standins.transform_sf_meta(sf.to("meta"), mn, k, (1, 1, 32), num_groups=g, is_sfa=False,
                                              archs=frozenset({10, 12}))
            rows.append([list(ref.shape), list(ref.stride()), str(ref.dtype), list(meta.shape), list(meta.stride()),
                         str(meta.dtype)])
        try:
            standins.transform_sf_meta(torch.empty(4, 128, 8, device="meta"), 128, 256, (1, 1, 32), num_groups=4,
                                       is_sfa=False, archs=frozenset({10}))
            no_code = ""
        except RuntimeError as exc:  # NoDeviceCode: the load fails on that device, as the wheel's own code would
            no_code = type(exc).__name__ + ": " + str(exc)
        try:
            standins.transform_sf_meta(torch.empty(4, 128, 9, device="meta"), 128, 256, (1, 1, 32), num_groups=4,
                                       is_sfa=False, archs=frozenset({12}))
            bad_shape = ""
        except RuntimeError as exc:
            bad_shape = str(exc)
        print(json.dumps({"rows": rows, "no_code": no_code, "bad_shape": bad_shape}))
    ''')
    for r in out["rows"]:
        assert r[:3] == r[3:], r
    assert out["no_code"].startswith("NoDeviceCode: ") and "no code for SM 12.x" in out["no_code"]
    assert "check_sf_layout" in out["bad_shape"]


def test_deep_gemm_meta_kernel_takes_upstreams_fp32_branches(vllm_env):
    """DeepGEMM's FP32 branches (SM 9.0, and any SM with the UE8M0 cast disabled): per-token scales get the
    MN-major layout aligned as vLLM's own ``get_tma_aligned_size`` says, weight scales come back as they are once
    they pass the SM 9.0 contiguity check; a scale that fails a check is refused as DeepGEMM's assertion."""
    head = '''
        import json, torch
        from probes.resolve import simulate, standins
        simulate.set_simulated({"device_name": "x", "capability": [%d, 0], "total_memory_gib": 1, "sm_count": 1}, 8)
        archs = frozenset({9, 10})
        w = torch.empty(56, 16, device="meta")
    '''
    sm90 = _in_env(vllm_env, head % 9 + '''
        from vllm.utils.deep_gemm import get_tma_aligned_size
        rows = []
        for g, mn, k in ((None, 7168, 2048), (4, 130, 384), (None, 1, 128)):
            shape = (mn, k // 128) if g is None else (g, mn, k // 128)
            sf = torch.empty(shape, device="meta")
            out = standins.transform_sf_meta(sf, mn, k, (1, 128, 128), num_groups=g, is_sfa=True, archs=archs)
            a = get_tma_aligned_size(mn, 4)
            want = (1, a) if g is None else (a * (k // 128), 1, a)
            rows.append([list(out.shape), list(out.stride()), list(shape), list(want), str(out.dtype)])
        same = standins.transform_sf_meta(w, 7168, 2048, (1, 128, 128), is_sfa=False, archs=archs) is w
        try:
            standins.transform_sf_meta(torch.empty(56, 32, device="meta")[:, :16], 7168, 2048, (1, 128, 128),
                                       is_sfa=False, archs=archs)
            strided = ""
        except RuntimeError as exc:
            strided = str(exc)
        print(json.dumps({"rows": rows, "same": same, "strided": strided}))
    ''')
    for shape, stride, want_shape, want_stride, dtype in sm90["rows"]:
        assert (shape, stride, dtype) == (want_shape, want_stride, "torch.float32")
    assert sm90["same"]
    assert "check_sf_layout" in sm90["strided"] and "transposed" in sm90["strided"]

    sm100 = _in_env(vllm_env, head % 10 + '''
        # the UE8M0 cast disabled: the FP32 branches, not the packed layout; K granularity 32 has none of those
        disabled = standins.transform_sf_meta(w, 7168, 2048, (1, 128, 128), is_sfa=False, disable_ue8m0_cast=True,
                                              archs=archs) is w
        try:
            standins.transform_sf_meta(torch.empty(128, 8, device="meta"), 128, 256, (1, 1, 32), is_sfa=False,
                                       disable_ue8m0_cast=True, archs=archs)
            no_cast = ""
        except RuntimeError as exc:
            no_cast = str(exc)
        packed = standins.transform_sf_meta(w, 7168, 2048, (1, 128, 128), is_sfa=False, archs=archs)
        print(json.dumps({"disabled": disabled, "no_cast": no_cast, "packed": [list(packed.shape), str(packed.dtype)]}))
    ''')
    assert sm100["disabled"] and "needs the UE8M0 cast" in sm100["no_cast"]
    assert sm100["packed"] == [[7168, 4], "torch.int32"]  # with the cast: one int32 per 4 scales, per row


def test_inert_flashinfer_kernels_leave_flashinfer_to_size_the_output(vllm_env):
    out = _in_env(vllm_env, '''
        import json, torch
        from probes.resolve import standins
        from probes.core.patching import PostImportHooks
        hooks = PostImportHooks()
        standins.install_inert_jit(hooks)
        from flashinfer.quantization import fp4_quantization as fq
        module = fq.get_fp4_quantization_module("100")
        sf = torch.empty(896, 768, 112, dtype=torch.uint8, device="meta")
        out = module.block_scale_interleave_sm100(sf)
        expected = 896 * fq._compute_swizzled_layout_sf_size(768, 112, 128)
        kernel = standins.InertKernels("lib").anything()
        try:
            bool(kernel)
            poisoned = False
        except RuntimeError:
            poisoned = True
        print(json.dumps({"shape": list(out.shape), "expected": expected, "poisoned": poisoned,
                          "calls": standins.KERNEL_CALLS}))
    ''')
    assert out["shape"] == [out["expected"]] and out["poisoned"]
    assert any(k.endswith("block_scale_interleave_sm100") for k in out["calls"])


def test_humming_ops_run_their_own_checks_on_fake_cuda_tensors(vllm_env):
    out = _in_env(vllm_env, '''
        import json, torch
        from probes.resolve import standins
        from humming import ops
        repack = standins.on_fake_cuda(ops.repack_weight, "humming.ops.repack_weight")
        w = torch.empty(896, 768, 3584 // 8, dtype=torch.int32, device="meta")
        out = repack(w, 4, 16, True)
        try:
            repack(torch.empty(896, 768, 448, dtype=torch.float32, device="meta"), 4, 16, True)
            rejected = False
        except AssertionError:
            rejected = True
        print(json.dumps({"shape": list(out.shape), "device": str(out.device), "dtype": str(out.dtype),
                          "rejected": rejected}))
    ''')
    # Humming's own shape rule: (E, K // (256 // activation_bits), N * pack * weight_bits // 32)
    assert out == {"shape": [896, 3584 // 16, 768 * 16 * 4 // 32], "device": "meta", "dtype": "torch.int32",
                   "rejected": True}
