"""Each batch on the path that serves it, on the real vLLM wheel pinned in images.lock (v0.33.0): vLLM's own
CUDA-graph dispatch and K3's specialized-decode planner decide which path a step takes; per-call choices, claims
about a batch size and labels.json's by_tokens follow that path. Changes planted in the wheel (as it is imported;
the environment is untouched) must move exactly the rows they touch."""
import json

import pytest

from audit.evidence import files as evidence
from audit.report import expectations
from audit.report import routing
from audit.report import verdicts
from audit.report.perflabels import build_labels
from audit.models.kimi_k3 import KIMI_K3
from audit.runtimes import RunRequest
from audit.systems import SYSTEMS
from audit.models.kimi_k3 import LAYOUTS
from tests.conftest import ROOT
from tests.plant import sitecustomize

pytestmark = pytest.mark.vllm

CELL = ("b200_sxm", "tp8-specdec")
#: the specialized decode's planner drops batch 8 from the sizes it prepares
PLANNER_WITHOUT_8 = ("vllm.models.kimi_k3.nvidia.specialized_decode.runtime.decode", [(
    "self.batches, self.q = tuple(sorted({*BATCHES, *verify})), q",
    "self.batches, self.q = tuple(sorted({*BATCHES, *verify} - {8})), q")])
#: K3's low-latency GEMM plans start at two rows: one-row calls (the lm_head at decode 1) take the base GEMM
PLAN_FROM_2 = ("vllm.models.kimi_k3.nvidia.low_latency_gemm", [(
    "    for num_tokens in range(1, 17):\n        backend = _backend_for(spec, num_tokens, has_residual=False)",
    "    for num_tokens in range(2, 17):\n        backend = _backend_for(spec, num_tokens, has_residual=False)")])
#: K3's KDA layer takes its fused decode kernel only from 9 decode requests up; and a planted refusal right after
#: the stand-ins of the prefill path (convolutions, initial-state gather) must surface, not be hidden by them
KDA_PLANTS = ("vllm.models.kimi_k3.nvidia.kda", [
    ("            and m.num_decodes > 0\n", "            and m.num_decodes > 8\n"),
    ('                if self.kda_prefill_backend == "flashkda":',
     '                raise ValueError("planted refusal after the stand-ins")\n'
     '                if self.kda_prefill_backend == "flashkda":')])
#: a raise planted in SpecializedDecode.plan right after it read the stand-ins (forward context, capturing stream)
PLAN_RAISES = ("vllm.models.kimi_k3.nvidia.specialized_decode.runtime.decode", [(
    "        metadata = [decode_metadata(d.self_attn, context, q, b) for d in self.layers]\n",
    "        raise ValueError('planted refusal after the plan stand-ins')\n")])
CLAIM = '''schema = 1
model = "kimi-k3"
framework = "vllm"
architecture = "KimiK3ForConditionalGeneration"
label_map = "kernel_source_backends.toml"

[[claim]]
id = "moe-trtllm-decode"
lane = "w4a8_mxfp4_mxfp8"
layouts = ["tp8-specdec"]
systems = ["b200_sxm"]
backend = "flashinfer_trtllm_gen"
at = ["decode 8", "decode 256"]
source = "a perf database row: decode on b200 tp8-specdec runs TRT-LLM MoE"
'''


def _run(vllm_env, tmp_path_factory, name, cells, plants=()):
    rt, pin, _ = vllm_env
    run_dir = tmp_path_factory.mktemp(name)
    if plants:
        (run_dir / "sitecustomize.py").write_text(sitecustomize(list(plants)), encoding="utf-8")
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in cells], run_dir=run_dir)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    r = routing.build_routing(evidence.read_dir(result.evidence_dir), KIMI_K3, pin={"name": pin.name},
                              expected=list(cells))
    return {(c["system"], c["layout"]): c for c in r["cells"]}, r


@pytest.fixture(scope="module")
def stock(vllm_env, tmp_path_factory):
    return _run(vllm_env, tmp_path_factory, "path", [CELL, ("b200_sxm", "tp8"), ("h200_sxm", "tp8-mtp")])


@pytest.fixture(scope="module")
def planted(vllm_env, tmp_path_factory):
    return _run(vllm_env, tmp_path_factory, "path-planted", [CELL], plants=[PLANNER_WITHOUT_8, PLAN_FROM_2, KDA_PLANTS])


def _tier(cell, lane, workload, group=None):
    rows = cell["dispatch"]["lanes"][lane]
    row = next(r for r in rows if group is None or r["group"] == group)
    return row["tiers"][workload]


def test_the_specialized_decode_takes_its_prepared_full_graph_decode_steps(stock):
    cells, _ = stock
    cell = cells[CELL]
    for b in (1, 8, 64):
        assert _tier(cell, "serving_path", f"decode {b}") == f"FULL graph, {b} tokens: specialized decode"
        assert _tier(cell, "specialized_decode", f"decode {b}").startswith(f"specialized decode at batch {b}: MLA core")
    assert _tier(cell, "serving_path", "decode 256") == "FULL graph, 256 tokens: stock path (specialized decode not taken)"
    assert _tier(cell, "serving_path", "prefill 512").startswith("PIECEWISE graph")
    assert _tier(cell, "serving_path", "prefill 8192").startswith("eager")
    # vLLM's core_for: the TRT-LLM MLA core from batch 16 up, tokenspeed below
    assert "MLA core tokenspeed" in _tier(cell, "specialized_decode", "decode 8")
    assert "MLA core trtllm" in _tier(cell, "specialized_decode", "decode 64")
    # a layout without it: the same FULL graphs, served by the stock path
    tp8 = cells[("b200_sxm", "tp8")]
    assert _tier(tp8, "serving_path", "decode 8") == "FULL graph, 8 tokens"
    assert "specialized_decode" not in tp8["dispatch"]["lanes"]
    # with MTP, one-token decode steps do not match the FULL graphs' query width: piecewise; verify steps are FULL
    mtp = cells[("h200_sxm", "tp8-mtp")]
    assert _tier(mtp, "serving_path", "decode 8").startswith("PIECEWISE graph")
    assert _tier(mtp, "serving_path", "verify 32 (8x4)") == "FULL graph, 32 tokens"


def test_claims_and_labels_follow_the_serving_path(stock, tmp_path):
    """A claim that decode 8 on b200 tp8-specdec runs TRT-LLM MoE fails: the specialized decode's own experts
    serve that step; at decode 256 the stock path (TRT-LLM) serves it and the claim holds. labels.json's
    by_tokens names the same."""
    cells, r = stock
    (tmp_path / "kernel_source_backends.toml").write_text((ROOT / "expectations" / "kernel_source_backends.toml").read_text())
    (tmp_path / "claims.toml").write_text(CLAIM)
    verdicts.attach(r, expectations.load(tmp_path / "claims.toml"), KIMI_K3, display_path="claims.toml")
    rows = {v["at"]: v for v in r["verdicts"]["rows"] if v["claim"] == "moe-trtllm-decode" and v.get("at")}
    assert rows["decode 8"]["verdict"] == "MISMATCH" and "specialized decode" in rows["decode 8"]["why"]
    assert rows["decode 256"]["verdict"] == "MATCH"
    labels = build_labels(r, KIMI_K3, label_map=expectations.load(tmp_path / "claims.toml").label_map)
    moe = [row for row in labels["rows"] if (row["system"], row["layout"]) == CELL and row["harness_lane"] == "moe"]
    by = {e["tokens"]: e for e in moe[0]["by_tokens"]}
    assert by["decode 8"]["kernel_source"] == "vllm_specialized_decode_experts"
    assert by["decode 8"]["backend"] == "specialized_decode" and "latent_tail" not in by["decode 8"]["choices"]
    assert by["decode 256"]["backend"] == "flashinfer_trtllm_gen" and "latent_tail" in by["decode 256"]["choices"]


def test_a_planted_planner_change_moves_exactly_that_batch(stock, planted):
    before, after = stock[0][CELL], planted[0][CELL]
    path_b, path_a = before["dispatch"]["lanes"]["serving_path"][0]["tiers"], \
        after["dispatch"]["lanes"]["serving_path"][0]["tiers"]
    moved = {w for w in path_b if path_b[w] != path_a[w]}
    assert moved == {"decode 8"}
    assert path_a["decode 8"] == "FULL graph, 8 tokens: stock path (specialized decode not taken)"


def test_a_planted_lm_head_plan_change_shows(stock, planted):
    """The lm_head's plan no longer has a one-row entry: its one-row calls (decode 1, every prefill chunk's last
    token) move from the CuTe skinny GEMM to the base GEMM; its 8-row calls do not move."""
    before, after = stock[0][CELL], planted[0][CELL]
    b = before["dispatch"]["lanes"]["lm_head"][0]["tiers"]
    a = after["dispatch"]["lanes"]["lm_head"][0]["tiers"]
    assert b["decode 1"].startswith("M=1: CuTe skinny GEMM") and a["decode 1"].startswith("M=1: base linear")
    assert a["prefill 2048"].startswith("M=1: base linear")
    assert a["decode 8"] == b["decode 8"]


def test_kda_kernel_by_batch_type(stock):
    """vLLM's KDA ``_forward`` picks its kernel from the batch: the fused decode op for a pure decode batch where
    the layer resolved one (no speculation); beside MTP vLLM 0.33's runner builds decode rows as speculative rows,
    which the verify kernel serves (the conv update + Triton recurrent kernel on SM 9.0); the prefill kernel for a
    prefill chunk alone, and two launches (the speculative rows', then the prefill's) with MTP decodes beside it;
    the verify kernel the layer resolved for a verify batch."""
    cells, _ = stock
    tp8, mtp = cells[("b200_sxm", "tp8")], cells[("h200_sxm", "tp8-mtp")]
    assert _tier(tp8, "kda_batch", "decode 8").startswith("vLLM's fused_kda_decode CUDA op")
    assert _tier(tp8, "kda_batch", "prefill 2048") == \
        "FlashKDA prefill (after causal_conv1d_fn) (alone or with 8 decode requests in the batch)"
    assert _tier(mtp, "kda_batch", "decode 8") == \
        "speculative rows: FLA Triton fused_recurrent_kda (after causal_conv1d_update)"
    assert _tier(mtp, "kda_batch", "prefill 512") == (
        "alone: FlashKDA prefill (after causal_conv1d_fn); with 8 decode requests: 2 launches: FLA Triton "
        "fused_recurrent_kda (after causal_conv1d_update) for the speculative rows, then FlashKDA prefill (after "
        "causal_conv1d_fn)")
    assert _tier(mtp, "kda_batch", "verify 32 (8x4)").startswith("FLA Triton fused_recurrent_kda ")
    # every KDA layer, and no MLA layer, has the lane
    layers = {layer for g in tp8["dispatch"]["lanes"]["kda_batch"] for layer in g["layers"]}
    assert layers == set(tp8["layer_kinds"]["kda"])


def test_a_planted_kda_change_moves_exactly_those_batches(stock, planted):
    before, after = stock[0][CELL], planted[0][CELL]
    b, a = _tier(before, "kda_batch", "decode 8"), _tier(after, "kda_batch", "decode 8")
    assert b.startswith("vLLM's fused_kda_decode") and a.startswith("FLA Triton fused_recurrent_kda_packed_decode")
    assert _tier(after, "kda_batch", "decode 1") == a
    assert _tier(after, "kda_batch", "decode 64") == _tier(before, "kda_batch", "decode 64") == b
    # the planted raise after the prefill path's stand-ins is what the prefill rows say
    for w in ("prefill 512", "prefill 2048", "prefill 8192"):
        assert _tier(after, "kda_batch", w) == "not resolved: ValueError: planted refusal after the stand-ins"


def test_a_raise_after_the_planner_stand_ins_is_what_the_rows_say(vllm_env, tmp_path_factory, stock):
    cells, _ = _run(vllm_env, tmp_path_factory, "path-plan-raises", [CELL], plants=[PLAN_RAISES])
    tiers = cells[CELL]["dispatch"]["lanes"]["serving_path"][0]["tiers"]
    for b in (1, 8, 64):  # the steps that reach past the stand-ins: FULL graphs of a prepared size
        assert tiers[f"decode {b}"] == (f"FULL graph, {b} tokens; specialized decode not resolved "
                                        "(ValueError: planted refusal after the plan stand-ins)")
    # steps plan declines before reading them are unchanged
    assert tiers["decode 256"] == _tier(stock[0][CELL], "serving_path", "decode 256")
