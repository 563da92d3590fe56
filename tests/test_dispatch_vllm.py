"""Dispatch tiers against the real vLLM wheel pinned in images.lock (v0.33.0), in resolve mode.

The session's ``probed_run`` (tests/conftest.py) is the baseline; one more run of a single cell
plants a changed dispatch threshold into the pinned vLLM (a post-import hook loaded from a
``sitecustomize`` in the run directory, the agent's PYTHONPATH: the environment itself is untouched)
and the tier table must follow it.
"""
import textwrap

import pytest

from audit.evidence import files as evidence
from audit.report import routing
from audit.models.kimi_k3 import KIMI_K3
from audit.report.render import render_ledger
from audit.runtimes import RunRequest
from audit.systems import SYSTEMS
from audit.models.kimi_k3 import LAYOUTS
from tests.test_probes_vllm import cells_of, k3_layers

pytestmark = pytest.mark.vllm

DECODES = ["decode 1", "decode 8", "decode 64", "decode 256"]
PREFILLS = ["prefill 512", "prefill 2048", "prefill 8192"]
#: the tail operator's token bound, planted lower than the wheel's (128) in the planted run
PLANTED_MAX = 8
PLANT = textwrap.dedent(f'''
    # planted by tests/test_dispatch_vllm.py: lower K3's latent-MoE tail-fusion token bound
    from probes.core.patching import PostImportHooks

    def _plant(mod):
        mod._MAX_NUM_TOKENS = {PLANTED_MAX}

    PostImportHooks().register("vllm.models.kimi_k3.nvidia.ops.latent_moe_tail", _plant)
''')


def _cell(run, system, layout):
    return routing.build_cell(cells_of(run)[(system, layout)], KIMI_K3)


def _only(rows):
    assert len(rows) == 1, rows
    return rows[0]


@pytest.fixture(scope="session")
def planted_run(vllm_env, tmp_path_factory):
    rt, pin, _ = vllm_env
    run_dir = tmp_path_factory.mktemp("planted")
    (run_dir / "sitecustomize.py").write_text(PLANT, encoding="utf-8")
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS["b200_sxm"], LAYOUTS["tp8"])], run_dir=run_dir)
    return req, rt.run(req, lambda *a, **k: None)


@pytest.fixture(scope="session")
def marlin_run(vllm_env, tmp_path_factory):
    """SM 8.9 TP8, where the routed experts are Marlin's (a cell the shared probed run lacks)."""
    rt, pin, _ = vllm_env
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS["l40s"], LAYOUTS["tp8"])],
                     run_dir=tmp_path_factory.mktemp("marlin"))
    return req, rt.run(req, lambda *a, **k: None)


def test_marlin_block_size_by_batch(marlin_run):
    """fused_marlin_moe picks block_size_m from M * top-k / experts per call; resolve mode calls it on
    the built layer's weights with meta activations and stops it at its first kernel."""
    req, result = marlin_run
    cell = routing.build_cell(evidence.read_dir(result.evidence_dir)[0], KIMI_K3)
    experts = _only(cell["dispatch"]["lanes"]["moe_experts"])
    assert experts["source"].endswith("marlin_moe:MarlinExperts") and experts["layers"] == k3_layers()["moe"]
    sizes = [int(experts["tiers"][k].removeprefix("block_size_m=")) for k in DECODES + PREFILLS]
    assert sizes == sorted(sizes) and sizes[0] == 8 and sizes[-1] == 64 and len(set(sizes)) > 2


def test_tail_tiers_on_sm100(probed_run):
    """SM 10.0 TP8: the fused tail with deferred finalize up to the tail operator's bound (128), the
    all-reduce overlap tier up to VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD (256), then column parallel."""
    cell = _cell(probed_run, "b200_sxm", "tp8")
    d = cell["dispatch"]
    assert d["errors"] == {}
    assert d["workloads"] == DECODES + PREFILLS
    tail = _only(d["lanes"]["latent_tail"])
    assert tail["layers"] == k3_layers()["moe"] and tail["level"] == "dispatch"
    assert tail["source"].endswith("LatentMoERunner._select_tail_tier")
    assert tail["tiers"] == {"decode 1": "TAIL_FUSION (deferred top-k finalize)",
                             "decode 8": "TAIL_FUSION (deferred top-k finalize)",
                             "decode 64": "TAIL_FUSION (deferred top-k finalize)",
                             "decode 256": "ALLREDUCE_OVERLAP", "prefill 512": "COLUMN_PARALLEL",
                             "prefill 2048": "COLUMN_PARALLEL", "prefill 8192": "COLUMN_PARALLEL"}
    experts = _only(d["lanes"]["moe_experts"])
    assert all(v.startswith("needs GPU: autotuned") for v in experts["tiers"].values())
    assert [k for k, v in experts["tiers"].items() if v.endswith("top-k finalize deferred")] == DECODES[:3]


def test_tail_tiers_without_tail_fusion_on_sm90(probed_run):
    """SM 9.0 has no tail fusion: small batches take the all-reduce overlap tier, never tier 0."""
    tail = _only(_cell(probed_run, "h100_sxm", "tp8")["dispatch"]["lanes"]["latent_tail"])
    assert {k: v for k, v in tail["tiers"].items()} == {
        **{k: "ALLREDUCE_OVERLAP" for k in DECODES}, **{k: "COLUMN_PARALLEL" for k in PREFILLS}}


def test_mla_path_by_batch(probed_run):
    """The MLA metadata builder's split decides decode kernel versus prefill backend per batch;
    FA3 MLA's builder sends prefill chunks of up to 512 tokens down the decode kernel."""
    h100 = _cell(probed_run, "h100_sxm", "tp8")["dispatch"]["lanes"]["mla"]
    row = _only([r for r in h100 if r["role"] == "target"])
    assert row["layers"] == k3_layers()["mla"]
    assert "(threshold 512)" in row["source"]
    assert all(row["tiers"][k].startswith("decode path: needs GPU: FA3 MLA decode") for k in DECODES + ["prefill 512"])
    assert all(row["tiers"][k] == "prefill path: FlashAttnPrefillBackend" for k in PREFILLS[1:])
    b200 = _only(_cell(probed_run, "b200_sxm", "tp8")["dispatch"]["lanes"]["mla"])
    assert all(b200["tiers"][k].startswith("decode path: FlashInfer MLA decode") or
               b200["tiers"][k].startswith("decode path: needs GPU: autotuned (FlashInfer MLA") for k in DECODES)
    assert all(b200["tiers"][k].startswith("prefill path: ") for k in PREFILLS)


def test_dep8_megamoe_and_full_head_count(probed_run):
    """DP8 + EP with MegaMoE: the experts' BLOCK_M is a device decision (stated, not guessed); MLA runs
    all 96 heads per rank, which trtllm-gen cannot tile, so vLLM pins FlashInfer's cute-dsl decode."""
    d = _cell(probed_run, "b200_sxm", "dep8")["dispatch"]
    assert d["errors"] == {}
    experts = _only(d["lanes"]["moe_experts"])
    assert experts["source"].endswith(":DeepGemmMegaMoEExperts") and experts["layers"] == k3_layers()["moe"]
    assert all(v.startswith("needs GPU: chosen on the device") for v in experts["tiers"].values())
    assert "latent_tail" not in d["lanes"]  # no MoE runner, so no latent tail to choose
    mla = _only(d["lanes"]["mla"])
    assert all(mla["tiers"][k] == "decode path: FlashInfer MLA decode backend=cute-dsl" for k in DECODES)


def test_mtp_verify_width(probed_run):
    """With MTP (3 speculative tokens) the verify batches (B x 4 tokens) are resolved too; MLA runs
    them as multi-token decodes on the ragged FlashInfer path, and the draft's layer has its own rows."""
    d = _cell(probed_run, "b200_sxm", "tp8-mtp")["dispatch"]
    verify = ["verify 4 (1x4)", "verify 32 (8x4)", "verify 256 (64x4)", "verify 1024 (256x4)"]
    assert d["workloads"] == DECODES + PREFILLS + verify
    mla = [r for r in d["lanes"]["mla"] if r["role"] == "target"]
    assert mla and all("ragged multi-token queries" in r["tiers"][v] for r in mla for v in verify)
    assert any(r["role"] == "draft" for rows in d["lanes"].values() for r in rows)
    tail = next(r for r in d["lanes"]["latent_tail"] if r["role"] == "target")
    assert tail["tiers"]["verify 32 (8x4)"].startswith("TAIL_FUSION")
    assert tail["tiers"]["verify 256 (64x4)"] == "ALLREDUCE_OVERLAP"
    assert tail["tiers"]["verify 1024 (256x4)"] == "COLUMN_PARALLEL"


def test_mtp_batches_are_built_by_vllms_runner(probed_run):
    """Under MTP vLLM 0.33's runner makes every decode row a speculative row (MambaHybridModelState.prepare_attn,
    then K3's KDA metadata builder): on SM 10.0 a decode batch runs FlashInfer's packed spec kernel, a prefill chunk
    beside decodes runs two KDA launches (the spec rows' kernel, then the prefill's); without MTP the decode
    kernel serves decodes. The draft head's lm_head sees one row per request, never the verified tokens."""
    mtp = _cell(probed_run, "b200_sxm", "tp8-mtp")["dispatch"]["lanes"]
    kda = _only([r for r in mtp["kda_batch"] if r["role"] == "target"])
    assert all(kda["tiers"][k] == "speculative rows: FlashInfer packed fused KDA decode (convolution fused)"
               for k in DECODES)
    assert all(kda["tiers"][k] == "alone: FlashKDA prefill (after causal_conv1d_fn); with 8 decode requests: 2 launches: "
               "FLA Triton fused_recurrent_kda (after causal_conv1d_update) for the speculative rows, then FlashKDA "
               "prefill (after causal_conv1d_fn)" for k in PREFILLS)
    # decodes that drafted nothing beside a verify batch are speculative rows too: one launch
    assert kda["tiers"]["verify 32 (8x4)"] == ("FlashInfer packed fused KDA decode (convolution fused) (alone or with 8 "
                                               "decode requests in the batch)")
    plain = _only(_cell(probed_run, "b200_sxm", "tp8")["dispatch"]["lanes"]["kda_batch"])
    assert all(plain["tiers"][k] == "vLLM's fused_kda_decode CUDA op (convolution fused)" for k in DECODES)
    assert all(plain["tiers"][k].endswith("(alone or with 8 decode requests in the batch)") for k in PREFILLS)
    draft = _only([r for r in mtp["lm_head"] if r["role"] == "draft"])
    target = _only([r for r in mtp["lm_head"] if r["role"] == "target"])
    for verify, requests in (("verify 4 (1x4)", 1), ("verify 32 (8x4)", 8), ("verify 1024 (256x4)", 256)):
        assert draft["tiers"][verify].startswith(f"M={requests}: ")
        assert target["tiers"][verify].startswith(f"M={requests * 4}: ")
    # the draft's body: draft step 0 over the target step's tokens, steps 1-2 over one token per request (vLLM's
    # speculator); where the two differ the tier names both
    gate = _only([r for r in mtp["router"] if r["role"] == "draft"])["tiers"]
    assert gate["prefill 2048"] == ("step 0: cuBLAS torch.mm (out_dtype float32); steps 1–2 (M=1): CuTe ll_bf16_gemm "
                                    "(dotprod bs=128)")
    assert gate["verify 32 (8x4)"].startswith("step 0: cuBLAS torch.mm") and "steps 1–2 (M=8): CuTe" in gate["verify 32 (8x4)"]
    assert not gate["decode 8"].startswith("step 0")  # a decode step's 8 tokens are its 8 requests: one answer


def test_planted_threshold_changes_the_tier_table(probed_run, planted_run, tmp_path):
    """Lowering the tail operator's bound in the pinned vLLM (128 -> 8) moves decode 64 off the
    fused tail (and off deferred finalize) in the tier table, routing.json and the ledger."""
    req, result = planted_run
    assert result.missing == {}
    planted = routing.build_cell(evidence.read_dir(result.evidence_dir)[0], KIMI_K3)
    before = _only(_cell(probed_run, "b200_sxm", "tp8")["dispatch"]["lanes"]["latent_tail"])["tiers"]
    after = _only(planted["dispatch"]["lanes"]["latent_tail"])["tiers"]
    assert before["decode 64"] == "TAIL_FUSION (deferred top-k finalize)"
    assert after["decode 64"] == "ALLREDUCE_OVERLAP"
    assert after["decode 8"] == before["decode 8"] == "TAIL_FUSION (deferred top-k finalize)"
    assert {k: v for k, v in after.items() if k != "decode 64"} == {k: v for k, v in before.items() if k != "decode 64"}
    experts = _only(planted["dispatch"]["lanes"]["moe_experts"])["tiers"]
    assert not experts["decode 64"].endswith("top-k finalize deferred")
    pin = {"name": "v0.33.0", "vllm_version": "0.33.0", "wheel": "", "wheel_sha256": "", "image": "",
           "platform_digests": {}, "vllm_commit": "", "python": "3.12"}
    ledger = render_ledger(routing.build_routing(evidence.read_dir(result.evidence_dir), KIMI_K3, pin=pin,
                                                 expected=[("b200_sxm", "tp8")]),
                           profile=KIMI_K3, reproduce="x")
    section = ledger.split("### Latent MoE tail tier", 1)[1].split("\n### ", 1)[0]
    assert ("**decode 1–8**: TAIL_FUSION (deferred top-k finalize); **decode 64–256**: ALLREDUCE_OVERLAP; "
            "**prefill 512–8192**: COLUMN_PARALLEL") in section
    # a claim about decode 64 on the fused tail holds on the wheel and fails on the planted change
    from audit.report import expectations
    from audit.report.verdicts import judge

    claims = tmp_path / "claims.toml"
    claims.write_text('schema = 1\nmodel = "kimi-k3"\nframework = "vllm"\narchitecture = "KimiK3ForConditionalGeneration"\n'
                      '[[claim]]\nid = "tail-64"\nlane = "w4a8_mxfp4_mxfp8"\nat = ["decode 64"]\nlayouts = ["tp8"]\n'
                      'systems = ["b200_sxm"]\nbackend = "flashinfer_trtllm_gen"\n'
                      'dispatch = { latent_tail = "TAIL_FUSION" }\n')
    exp = expectations.load(claims)

    def verdict(cell):
        return {r["verdict"] for r in judge({"model": KIMI_K3.name, "cells": [cell]}, exp, KIMI_K3) if r["claim"] == "tail-64"}

    assert verdict(_cell(probed_run, "b200_sxm", "tp8")) == {"MATCH"}
    assert verdict(planted) == {"MISMATCH"}


def test_dispatch_tiers_are_the_same_without_probes(probed_run, bare_run):
    """The probes change nothing vLLM's dispatch functions answer: every cell's tier table is the same
    in the bare run (same simulation, no probe installed)."""
    probed, bare = cells_of(probed_run), cells_of(bare_run)
    for key in probed:
        p, b = routing.build_cell(probed[key], KIMI_K3), routing.build_cell(bare[key], KIMI_K3)
        assert p["dispatch"] == b["dispatch"], key
    assert any(routing.build_cell(f, KIMI_K3)["dispatch"] for f in probed.values())
