"""The fp8 KV-cache deployment options and K3's MLA KV-cache lane, against the real vLLM wheel pinned in images.lock
(v0.33.0), in resolve mode.

One run audits the options where their answers differ (SM 10.0, where the fp8 prefill query exists; SM 8.9, whose
Triton MLA takes no fp8 query; SM 9.0, where the DeepSeek cache layout has no backend); a second run of one cell plants
changes into the pinned vLLM (a ``sitecustomize`` in the run directory: the environment itself is untouched):
FlashInfer's MLA decode stops taking an fp8 query, which must move the KV-cache lane at every decode batch and nothing
else; and K3's prefill raises right after the lane's stand-ins, which must read ``not resolved``.
"""
import textwrap

import pytest

from audit.evidence import files as evidence
from audit.models.kimi_k3 import KIMI_K3, LAYOUTS
from audit.report import expectations, routing
from audit.report.perflabels import build_labels
from audit.report.verdicts import judge
from audit.runtimes import RunRequest
from audit.systems import SYSTEMS
from tests.conftest import ROOT
from tests.plant import sitecustomize

pytestmark = pytest.mark.vllm

CELLS = [("b200_sxm", "tp8-fp8kv"), ("b200_sxm", "tp8-fp8kv-fp8prefill"), ("l40s", "tp8-fp8kv"),
         ("h200_sxm", "tp8-fp8dsmla")]
#: a raise in K3's prefill, right after the lane's stand-ins gave it the batch's metadata and cache
RAISES = ("        has_context = prefill.chunked_context is not None\n",
          "        raise ValueError('planted refusal after the stand-ins')\n")
PLANT = sitecustomize([("vllm.models.kimi_k3.nvidia.mla", [RAISES])]) + textwrap.dedent('''
    # planted by tests/test_kv_cache_vllm.py: FlashInfer's MLA decode no longer takes an fp8 query
    from probes.core.patching import PostImportHooks

    def _plant(mod):
        init = mod.FlashInferMLAImpl.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.supports_quant_query_input = False

        mod.FlashInferMLAImpl.__init__ = __init__

    PostImportHooks().register("vllm.v1.attention.backends.mla.flashinfer_mla", _plant)
''')
DECODES = ("decode 1", "decode 8", "decode 64", "decode 256")
PREFILLS = ("prefill 512", "prefill 2048", "prefill 8192")


def _run(vllm_env, run_dir, cells):
    rt, pin, _ = vllm_env
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in cells], run_dir=run_dir,
                     parallel=2)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    return {f.cell: routing.build_cell(f, KIMI_K3) for f in evidence.read_dir(result.evidence_dir)}


@pytest.fixture(scope="module")
def fp8_cells(vllm_env, tmp_path_factory):
    return _run(vllm_env, tmp_path_factory.mktemp("fp8kv"), CELLS)


@pytest.fixture(scope="module")
def planted_cells(vllm_env, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fp8kv-planted")
    (run_dir / "sitecustomize.py").write_text(PLANT, encoding="utf-8")
    return _run(vllm_env, run_dir, CELLS[:1])


def _tiers(cell, lane):
    groups = [g for g in cell["dispatch"]["lanes"][lane] if g.get("role", "target") == "target"]
    assert len(groups) == 1, groups
    return groups[0]["tiers"]


def test_fp8_cache_path_by_batch(fp8_cells):
    """vLLM's own K3 MLA forward names the fused cache-insert op and the query the core gets; with a plain fp8 cache
    and no fp8 prefill query K3's own assertion refuses every prefill batch (a server fails at its first prefill)."""
    plain = _tiers(fp8_cells[("b200_sxm", "tp8-fp8kv")], "mla_kv_cache")
    for w in DECODES:
        assert plain[w] == ("fp8 cache, fp8 query: fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert, "
                            "then FlashInferMLAImpl")
    for w in PREFILLS:
        assert plain[w].startswith("vLLM raises: AssertionError: Kimi-K3 fp8 KV cache requires an fp8 prefill query")
        assert "use_prefill_query_quantization is False" in plain[w]
    fp8q = _tiers(fp8_cells[("b200_sxm", "tp8-fp8kv-fp8prefill")], "mla_kv_cache")
    for w in PREFILLS:
        assert fp8q[w] == ("fp8 cache, fp8 query: fused_kimi_k3_mla_qkv_quant_kv_cache_fp8_insert, "
                           "then FlashInferPrefillBackend")
    triton = _tiers(fp8_cells[("l40s", "tp8-fp8kv")], "mla_kv_cache")
    assert triton["decode 8"] == ("fp8 cache, bfloat16 query (dequantized for TritonMLAImpl: its "
                                  "supports_quant_query_input is False): "
                                  "fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert, then TritonMLAImpl")


def test_refusals_are_vllms(fp8_cells):
    """fp8_ds_mla: no dense MLA backend takes it; vLLM's selector raises at construction (REFUSED, with its
    reason)."""
    ds = fp8_cells[("h200_sxm", "tp8-fp8dsmla")]
    assert ds["status"] == "PARTIAL" and ds["failure"]["outcome"] == "refused"
    assert "kv_cache_dtype=fp8_ds_mla" in ds["failure"]["message"]


def test_claims_on_a_refused_batch_are_refused(fp8_cells):
    """The shipped fp8 claims: the decode one holds; the prefill one on the plain fp8 cache is REFUSED at each batch
    (vLLM raises there), never a MATCH on the backend it was built with; labels.json gives those batches no label."""
    exp = expectations.load(ROOT / "expectations" / "kimi-k3.toml")
    rows = judge({"model": KIMI_K3.name, "cells": list(fp8_cells.values())}, exp, KIMI_K3)
    by_claim = {}
    for r in rows:
        if r["system"] == "b200_sxm":
            by_claim.setdefault(r["claim"], set()).add((r["layout"], r.get("at", ""), r["verdict"]))
    assert by_claim["mla-decode-fp8kv-flashinfer"] == {
        (l, w, "MATCH") for l in ("tp8-fp8kv", "tp8-fp8kv-fp8prefill") for w in ("decode 1", "decode 64")}
    assert by_claim["mla-prefill-fp8kv"] == {("tp8-fp8kv", w, "REFUSED") for w in ("prefill 2048", "prefill 8192")}
    assert by_claim["mla-prefill-fp8kv-fp8-query"] == {
        ("tp8-fp8kv-fp8prefill", w, "MATCH") for w in ("prefill 2048", "prefill 8192")}
    labels = build_labels({"model": KIMI_K3.name, "pin": {"name": "v0.33.0"},
                           "cells": [fp8_cells[("b200_sxm", "tp8-fp8kv")]]}, KIMI_K3, exp.label_map)
    prefill = [r for r in labels["rows"] if r["harness_lane"] == "mla.prefill"]
    assert prefill
    entries = {e["tokens"]: e for r in prefill for e in r.get("by_tokens", [])}
    assert entries["prefill 2048"]["kernel_source"] == "refused"
    assert entries["prefill 2048"]["why"].startswith("vLLM raises: AssertionError")


def test_planted_query_support_moves_only_the_kv_cache_lane(fp8_cells, planted_cells):
    """FlashInfer's MLA decode planted to take no fp8 query: K3 dequantizes the query before it, at every decode
    batch; every other lane's tiers, and the MLA backend itself, stay as they were. A raise planted in K3's prefill
    after the lane's stand-ins reads `not resolved`."""
    before, after = fp8_cells[("b200_sxm", "tp8-fp8kv")], planted_cells[("b200_sxm", "tp8-fp8kv")]
    moved = _tiers(after, "mla_kv_cache")
    for w in DECODES:
        assert moved[w] == ("fp8 cache, bfloat16 query (dequantized for FlashInferMLAImpl: its "
                            "supports_quant_query_input is False): "
                            "fused_kimi_k3_mla_decode_q_concat_kv_cache_fp8_insert, then FlashInferMLAImpl")
    # the raise planted after the stand-ins (in K3's prefill) is what the prefill rows say, never a routing
    for w in PREFILLS:
        assert moved[w] == "not resolved: ValueError: planted refusal after the stand-ins"
    lanes = set(before["dispatch"]["lanes"]) | set(after["dispatch"]["lanes"])
    assert {lane for lane in lanes
            if before["dispatch"]["lanes"].get(lane) != after["dispatch"]["lanes"].get(lane)} == {"mla_kv_cache"}
    assert before["lanes"] == after["lanes"]
