"""Expectations files and verdicts, on the routing of real audits."""
import copy
import json

import pytest

from audit.lanevalue import make
from audit.report import expectations
from audit.errors import ExitCode
from audit.report.expectations import ExpectationsError
from audit.report.verdicts import judge, summary
from tests.conftest import ROOT
from audit.models.kimi_k3 import KIMI_K3

DATA = ROOT / "tests" / "data"
SHIPPED = ROOT / "expectations" / "kimi-k3.toml"


def routing(pin="v0.33.0"):
    r = json.loads((DATA / f"routing-{pin}.json").read_text(encoding="utf-8"))
    r.pop("verdicts", None)
    return r


def write_claims(tmp_path, claims: str, label_map: bool = True):
    (tmp_path / "kernel_source_backends.toml").write_text(
        (ROOT / "expectations" / "kernel_source_backends.toml").read_text())
    head = 'schema = 1\nmodel = "kimi-k3"\nframework = "vllm"\narchitecture = "KimiK3ForConditionalGeneration"\n'
    if label_map:
        head += 'label_map = "kernel_source_backends.toml"\n'
    path = tmp_path / "claims.toml"
    path.write_text(head + claims)
    return path


def verdict_of(rows, claim, system, layout, lane):
    got = {r["verdict"] for r in rows if (r["claim"], r["system"], r["layout"], r["lane"]) == (claim, system, layout, lane)}
    assert len(got) == 1, got
    return got.pop()


def test_shipped_expectations_load():
    exp = expectations.load(SHIPPED)
    assert exp.architecture == "KimiK3ForConditionalGeneration"
    assert {c.lane for c in exp.claims} >= {"w4a16_mxfp4", "kda.context", "kda.generation", "kda.verify",
                                            "w4a8_mxfp4_mxfp8"}
    assert exp.label_map["flashkda_fwd"] == "flashkda"


def test_verdicts_on_the_real_v0_33_audit():
    shipped = expectations.load(SHIPPED)
    rows = judge(routing(), shipped, KIMI_K3)
    at_claims = {c.id for c in shipped.claims if c.at}  # claims about a batch size: judged per batch by design
    # Marlin claim: true on SM89, false on SM90 (Humming) and SM100 (TRT-LLM) in vLLM 0.33.0
    assert verdict_of(rows, "moe-w4a16-marlin", "l40s", "tp8", "moe") == "MATCH"
    assert verdict_of(rows, "moe-w4a16-marlin", "h100_sxm", "tp8", "moe") == "MISMATCH"
    assert verdict_of(rows, "moe-w4a16-marlin", "b200_sxm", "tp8", "moe") == "MISMATCH"
    assert verdict_of(rows, "moe-dep-megamoe", "b200_sxm", "dep8", "moe") == "MATCH"
    # MegaMoE refuses SM90 at construction: one REFUSED row on the MoE lane (no claim covers MoE there), and the
    # KDA claims of that cell are not judged (they point at the refusal): no layer of it, not even layer 0 that
    # was built before the refusal, reads as MATCH
    cell = [r for r in rows if (r["system"], r["layout"]) == ("h100_sxm", "dep8")]
    refused = [r for r in cell if r["verdict"] == "REFUSED"]
    assert [(r["lane"], r["claim"]) for r in refused] == [("moe", "")]
    assert "vLLM refused at construction" in refused[0]["why"] and "DeepGEMM MegaMoE requires SM100" in refused[0]["why"]
    kda = [r for r in cell if r["claim"].startswith("kda-")]
    assert kda and all(r["verdict"] == "UNVERIFIED" and "the REFUSED row" in r["why"] for r in kda)
    assert not [r for r in cell if r["verdict"] == "MATCH"]
    # spec-verify does not happen without speculation
    assert {r["verdict"] for r in rows if r["lane"] == "kda.spec_verify" and r["layout"] == "tp8"} == {"NOT_EXERCISED"}
    # claims without a batch size are judged at construction level, except per batch where another path serves
    # some of a lane's batches: K3's specialized decode (tp8-specdec: see test_one_story_per_batch...), or the path
    # a per-call choice routes a batch to (a short prefill chunk takes MLA's decode path on some systems), or where
    # vLLM raises on some batches (K3's fp8 KV cache without an fp8 prefill query: each such batch is REFUSED)
    assert all(r["evidence"] == ("resolved (dispatch)" if r.get("at") else "resolved") for r in rows)
    split = {}
    for r in rows:
        if r.get("at") and r["claim"] not in at_claims:
            split.setdefault((r["system"], r["layout"], r["lane"]), []).append(r)
    assert {layout for _, layout, _ in split} >= {"tp8-specdec"}
    for (system, layout, lane), batch_rows in split.items():
        assert layout == "tp8-specdec" or any("batch takes" in r["why"] for r in batch_rows) or any(
            r["verdict"] == "REFUSED" and "vLLM raises on this batch" in r["why"] for r in batch_rows), (system, layout, lane)
    assert {(r["layout"], r["at"]) for r in rows if r.get("at") and r["verdict"] == "REFUSED"} >= {
        ("tp8-fp8kv", "prefill 2048")}
    counts = summary(rows)
    assert counts["MATCH"] and counts["MISMATCH"] and counts["UNVERIFIED"]


def test_silent_fallback_when_the_claimed_backend_was_rejected(tmp_path):
    path = write_claims(tmp_path, '''
[[claim]]
id = "trtllm-on-hopper"
lane = "w4a16_mxfp4"
layouts = ["tp8"]
systems = ["sm90"]
backend = "flashinfer_trtllm_gen"
source = "test"
''')
    rows = judge(routing(), expectations.load(path), KIMI_K3)
    r = [x for x in rows if x["claim"] == "trtllm-on-hopper" and x["system"] == "h100_sxm"][0]
    assert r["verdict"] == "SILENT_FALLBACK"
    assert "rejected TrtLlmMxfp4Experts" in r["why"] and "kernel does not support" in r["why"]


def test_silent_fallback_quotes_the_rejection_that_decided(tmp_path):
    """A build whose Humming indexed experts say no (a support check failing quietly) falls back to another
    family; the earlier Humming candidates are refused on every build and decide nothing: the row quotes the
    last one, the candidate that was next in line."""
    import copy

    path = write_claims(tmp_path, '''
[[claim]]
id = "humming-on-hopper"
lane = "w4a16_mxfp4"
layouts = ["tp8"]
systems = ["h100_sxm"]
backend = "humming"
source = "test"
''')
    r = copy.deepcopy(routing())
    cell = next(c for c in r["cells"] if (c["system"], c["layout"]) == ("h100_sxm", "tp8"))
    for g in cell["candidates"]["moe"]:
        tried = g["value"]
        indexed = next(t for t in tried if t["cls"] == "HummingIndexedExperts")
        indexed.update(supported=False, reason="planted: no")
        tried.append({"cls": "MarlinExperts", "backend": "MARLIN", "supported": True, "reason": None})
    for g in cell["lanes"]["moe"]:
        g["value"] = make("MarlinExperts", backend="MARLIN")
        g["raw"]["fields"] = ["Mxfp4MoeBackend.MARLIN", "vllm.model_executor.layers.fused_moe.fused_marlin_moe:MarlinExperts",
                              "vllm.model_executor.layers.quantization.mxfp4:Mxfp4MoEMethod"]
    rows = [x for x in judge(r, expectations.load(path), KIMI_K3) if x["claim"] == "humming-on-hopper"]
    assert rows and {x["verdict"] for x in rows} == {"SILENT_FALLBACK"}
    why = rows[0]["why"]
    assert why.startswith("vLLM rejected HummingIndexedExperts (HUMMING): planted: no"), why
    assert "2 earlier humming candidate(s): BatchedHummingGroupedExperts, HummingGroupedExperts" in why


def test_forbidden_backend_is_a_mismatch(tmp_path):
    path = write_claims(tmp_path, '''
[[claim]]
id = "no-humming"
lane = "w4a16_mxfp4"
layouts = ["tp8"]
systems = ["h100_sxm"]
backend = "humming"
forbidden = ["humming"]
''')
    rows = judge(routing(), expectations.load(path), KIMI_K3)
    assert verdict_of(rows, "no-humming", "h100_sxm", "tp8", "moe") == "MISMATCH"


@pytest.mark.parametrize("claim, line, fragment", [
    ('id = "a"\nlane = "w4a16"\nbackend = "marlin"\n', 9, "unknown lane 'w4a16'"),
    ('id = "a"\nlane = "kda.context"\nsystems = ["h800"]\nbackend = "flashkda"\n', 10, "unknown system 'h800'"),
    ('id = "a"\nlane = "kda.context"\nkernel_source = "Flash-KDA fwd"\n', 10, "malformed kernel_source label"),
    ('id = "a"\nlane = "kda.context"\nlayouts = ["tp4"]\nbackend = "x"\n', 10, "unknown layout 'tp4'"),
    ('id = "a"\nlane = "kda.context"\n', 7, "names neither kernel_source nor backend"),
    ('id = "a"\nlane = "kda.context"\nbackend = "flashkda"\ncolour = "red"\n', 11, "unknown key 'colour'"),
])
def test_bad_claims_name_file_and_line(tmp_path, claim, line, fragment):
    path = write_claims(tmp_path, "\n[[claim]]\n" + claim)
    with pytest.raises(ExpectationsError) as e:
        expectations.load(path)
    assert fragment in str(e.value)
    assert e.value.line == line, str(e.value)
    assert str(e.value).startswith(f"{path}:{line}:")
    assert e.value.exit_code == ExitCode.USAGE


def test_duplicate_claim_ids(tmp_path):
    path = write_claims(tmp_path, '\n[[claim]]\nid = "a"\nlane = "mla.decode"\nbackend = "triton"\n'
                                  '\n[[claim]]\nid = "a"\nlane = "mla.decode"\nbackend = "triton"\n')
    with pytest.raises(ExpectationsError) as e:
        expectations.load(path)
    assert "duplicate claim id 'a' (first at line 7)" in str(e.value) and e.value.line == 13


def test_malformed_label_map(tmp_path):
    (tmp_path / "map.toml").write_text('schema = 1\n[labels]\nGood-Label = "marlin"\n')
    path = tmp_path / "c.toml"
    path.write_text('schema = 1\nmodel = "kimi-k3"\nframework = "vllm"\narchitecture = "K"\nlabel_map = "map.toml"\n'
                    '[[claim]]\nid = "a"\nlane = "mla.decode"\nbackend = "triton"\n')
    with pytest.raises(ExpectationsError) as e:
        expectations.load(path)
    assert "map.toml:3: malformed label entry 'Good-Label'" in str(e.value)


def test_verdicts_are_deterministic():
    exp = expectations.load(SHIPPED)
    assert judge(routing(), exp, KIMI_K3) == judge(copy.deepcopy(routing()), exp, KIMI_K3)


def test_a_claim_on_a_drifted_lane_stays_visible_as_unverified():
    """A renamed selector leaves its lane without evidence: the claims on it are UNVERIFIED with the drift
    named (never silently dropped), and an INCOMPLETE cell's claims are UNVERIFIED too (never a pass)."""
    exp = expectations.load(ROOT / "expectations" / "kimi-k3.toml")
    r = routing()
    cell = next(c for c in r["cells"] if c["status"] == "COMPLETE" and c["lanes"].get("kda.prefill"))
    claimed = [c.id for c in exp.claims if c.covers(cell["system"], cell["layout"], "kda.prefill")]
    assert claimed
    cell["lanes"]["kda.prefill"] = []
    cell["drift"] = [{"target": "kda.prefill_backend", "title": "KDA prefill selector", "required": True,
                      "attempts": []}]
    rows = [v for v in judge(r, exp, KIMI_K3) if (v["system"], v["layout"], v["lane"]) ==
            (cell["system"], cell["layout"], "kda.prefill")]
    assert sorted(v["claim"] for v in rows) == sorted(claimed)
    assert {v["verdict"] for v in rows} == {"UNVERIFIED"}
    assert all("probe target(s) drifted: kda.prefill_backend" in v["why"] for v in rows)

    r = routing()
    other = next(c for c in r["cells"] if c["status"] == "COMPLETE")
    other["status"] = "INCOMPLETE"
    rows = [v for v in judge(r, exp, KIMI_K3) if (v["system"], v["layout"]) == (other["system"], other["layout"])]
    assert rows and {v["verdict"] for v in rows} == {"UNVERIFIED"}
    assert summary(rows)["UNVERIFIED"] == len(rows)


# --- claims about a batch size (at = [...]): judged against the dispatch tiers of the real audit ---

def _at(rows, claim, system, layout, at):
    got = [r for r in rows if (r["claim"], r["system"], r["layout"], r.get("at")) == (claim, system, layout, at)]
    assert len(got) == 1, got
    return got[0]


def test_a_prefill_chunk_mla_sends_down_the_decode_path_is_judged_on_that_path(tmp_path):
    """FlashAttention MLA's metadata builder treats requests of up to 512 query tokens as decodes, so on
    SM90 a 512-token prefill chunk runs the MLA decode kernel; FlashInfer MLA (SM100) starts at 1."""
    path = write_claims(tmp_path, '''
[[claim]]
id = "mla-prefill-chunks"
lane = "mla.prefill"
at = ["prefill 512", "prefill 8192"]
layouts = ["tp8"]
systems = ["h100_sxm", "b200_sxm"]
backend = "flash_attn"
kernel_source = "flashattnprefillbackend"
''')
    rows = judge(routing(), expectations.load(path), KIMI_K3)
    short = _at(rows, "mla-prefill-chunks", "h100_sxm", "tp8", "prefill 512")
    assert short["verdict"] == "MATCH" and short["label"] == "flashattnmlabackend"
    assert "takes MLA's decode path" in short["why"] and "perf-db label flashattnprefillbackend differs" in short["why"]
    assert short["evidence"] == "resolved (dispatch)"
    long = _at(rows, "mla-prefill-chunks", "h100_sxm", "tp8", "prefill 8192")
    assert long["verdict"] == "MATCH" and long["label"] == "flashattnprefillbackend" and "decode path" not in long["why"]
    assert _at(rows, "mla-prefill-chunks", "b200_sxm", "tp8", "prefill 512")["label"] == "flashattnprefillbackend"
    # the claim is judged at its workloads only: no row without a batch size
    assert all(r.get("at") for r in rows if r["claim"] == "mla-prefill-chunks")


def test_dispatch_expectations_hold_at_some_batch_sizes_and_not_others(tmp_path):
    path = write_claims(tmp_path, '''
[[claim]]
id = "tail-fusion"
lane = "w4a8_mxfp4_mxfp8"
at = ["decode 1", "decode 64", "decode 256", "verify 32"]
layouts = ["tp8", "tp8-mtp"]
systems = ["b200_sxm"]
backend = "flashinfer_trtllm_gen"
dispatch = { latent_tail = "TAIL_FUSION" }

[[claim]]
id = "trtllm-tactic"
lane = "w4a8_mxfp4_mxfp8"
at = ["decode 8"]
layouts = ["tp8"]
systems = ["b200_sxm"]
backend = "flashinfer_trtllm_gen"
dispatch = { moe_experts = "tile 8" }
''')
    rows = judge(routing(), expectations.load(path), KIMI_K3)
    assert _at(rows, "tail-fusion", "b200_sxm", "tp8", "decode 1")["verdict"] == "MATCH"
    assert _at(rows, "tail-fusion", "b200_sxm", "tp8", "decode 64")["verdict"] == "MATCH"
    big = _at(rows, "tail-fusion", "b200_sxm", "tp8", "decode 256")
    assert big["verdict"] == "MISMATCH" and "Latent MoE tail tier at decode 256 is ALLREDUCE_OVERLAP" in big["why"]
    # no speculation in tp8: no verify step; with MTP the verify width is judged like any workload
    assert _at(rows, "tail-fusion", "b200_sxm", "tp8", "verify 32")["verdict"] == "NOT_EXERCISED"
    assert _at(rows, "tail-fusion", "b200_sxm", "tp8-mtp", "verify 32")["verdict"] in ("MATCH", "MISMATCH")
    # an autotuned tactic is the GPU's choice: not judged here, and it says why
    gpu = _at(rows, "trtllm-tactic", "b200_sxm", "tp8", "decode 8")
    assert gpu["verdict"] == "UNVERIFIED" and "needs GPU: autotuned" in gpu["why"]


def _tail_fusion_at_b200_tp8(at: str) -> str:
    """One claim: K3's latent MoE tail fusion at one workload on b200_sxm tp8."""
    return ('\n[[claim]]\nid = "tail-fusion"\nlane = "w4a8_mxfp4_mxfp8"\n'
            f'at = ["{at}"]\nlayouts = ["tp8"]\nsystems = ["b200_sxm"]\nbackend = "flashinfer_trtllm_gen"\n'
            'dispatch = { latent_tail = "TAIL_FUSION" }\n')


def test_a_tier_vllm_could_not_be_asked_for_is_unverified_never_a_mismatch(tmp_path):
    """The probes write the two unknown tiers with probes.core.tiers and the verdicts read them with it: a
    ``not resolved`` tier (vLLM's function could not be called here) is not judged, and says why."""
    from probes.core import tiers

    path = write_claims(tmp_path, _tail_fusion_at_b200_tp8("decode 1"))
    r = routing()
    cell = next(c for c in r["cells"] if (c["system"], c["layout"]) == ("b200_sxm", "tp8"))
    for entry in cell["dispatch"]["lanes"]["latent_tail"]:
        entry["tiers"]["decode 1"] = tiers.not_resolved("RuntimeError: planted")
    row = _at(judge(r, expectations.load(path), KIMI_K3), "tail-fusion", "b200_sxm", "tp8", "decode 1")
    assert row["verdict"] == "UNVERIFIED"
    assert row["why"] == "not judged: Latent MoE tail tier at decode 1: not resolved: RuntimeError: planted"
    # the parse wants the whole prefix: a choice that merely begins with the words is vLLM's choice
    assert tiers.unknown(tiers.needs_gpu("x")) == tiers.NEEDS_GPU and tiers.unknown("not resolvedish") is None


def test_tier_verdicts_fail_the_gate_and_render_with_their_batch_size(tmp_path):
    from audit.report.render import render_ledger
    from audit.report.verdicts import FAILING, attach, grouped

    path = write_claims(tmp_path, _tail_fusion_at_b200_tp8("decode 256"))
    r = attach(routing(), expectations.load(path), KIMI_K3, display_path="claims.toml")
    assert r["verdicts"]["summary"]["MISMATCH"] == 1 and "MISMATCH" in FAILING
    assert r["verdicts"]["claims"][0]["at"] == ["decode 256"]
    assert [g["at"] for g in grouped(r["verdicts"]["rows"]) if g["claim"] == "tail-fusion"] == ["decode 256"]
    text = render_ledger(r, profile=KIMI_K3, reproduce="x")
    assert "| MISMATCH | `tail-fusion` | Routed experts at decode 256 |" in text


@pytest.mark.parametrize("extra, fragment", [
    ('at = ["decode one"]', "workload 'decode one' is not '<decode|prefill|verify> <tokens>'"),
    ('at = []', "at must be a non-empty list of workloads"),
    ('at = ["decode 1", "decode 1"]', "names a workload twice"),
    ('dispatch = { latent_tail = "TAIL_FUSION" }', "dispatch expectations need the workloads they hold at"),
    ('at = ["decode 1"]\ndispatch = { tail = "TAIL_FUSION" }', "unknown dispatch lane 'tail'"),
])
def test_bad_batch_size_claims_say_what_and_where(tmp_path, extra, fragment):
    path = write_claims(tmp_path, f'\n[[claim]]\nid = "a"\nlane = "w4a16_mxfp4"\nbackend = "marlin"\n{extra}\n')
    with pytest.raises(ExpectationsError) as e:
        expectations.load(path)
    assert fragment in str(e.value) and str(e.value).startswith(f"{path}:")


def test_a_one_phase_lane_cannot_be_claimed_at_another_phase(tmp_path):
    path = write_claims(tmp_path, '\n[[claim]]\nid = "a"\nlane = "kda.context"\nbackend = "flashkda"\nat = ["decode 1"]\n')
    with pytest.raises(ExpectationsError) as e:
        expectations.load(path)
    assert "lane kda.context is measured at prefill only, not 'decode 1'" in str(e.value)


def test_a_claim_no_cell_of_the_run_can_judge_stays_in_the_table_with_why():
    """A subset run (one system) and a layout that does not exist on an SM: every claim still has rows, the ones
    this run cannot judge UNVERIFIED, saying why and which (system, layout) pairs."""
    from audit.report.verdicts import attach

    exp = expectations.load(SHIPPED)
    r = routing()
    r["cells"] = [c for c in r["cells"] if c["system"] == "b200_sxm"]
    attach(r, exp, KIMI_K3, display_path="kimi-k3.toml")
    rows = r["verdicts"]["rows"]
    assert {c.id for c in exp.claims} <= {v["claim"] for v in rows}
    apart = [v for v in rows if v["system"] == "—"]
    assert apart and {v["verdict"] for v in apart} == {"UNVERIFIED"}
    assert any("not audited in this run" in v["why"] and "h100_sxm/tp8" in v["why"] for v in apart)
    r = routing()
    attach(r, exp, KIMI_K3, display_path="kimi-k3.toml")
    assert any("the tp8-specdec layout does not exist on SM 9.0" in v["why"] for v in r["verdicts"]["rows"])


def test_a_refusal_at_load_is_one_event_on_the_layer_kind_vllm_refused():
    """v0.30.0 refuses MegaMoE on SM 9.0 at load (in a MoE layer): as at construction, the refusal is one REFUSED
    row on the MoE lane (no shipped claim covers dep8's MoE), and the KDA claims covering the cell are not judged,
    since nothing of the deployment serves."""
    r = routing("v0.30.0")
    cell = next(c for c in r["cells"] if (c["system"], c["layout"]) == ("h200_sxm", "dep8"))
    assert cell["load_refused"]["kind"] == "moe"
    rows = [v for v in judge(r, expectations.load(SHIPPED), KIMI_K3) if (v["system"], v["layout"]) == ("h200_sxm", "dep8")]
    refused = [v for v in rows if v["verdict"] == "REFUSED"]
    assert [(v["claim"], v["lane"]) for v in refused] == [("", "moe")]
    assert "refused at load" in refused[0]["why"] and "SM100" in refused[0]["why"]
    kda = [v for v in rows if v["lane"].startswith("kda")]
    assert kda and all(v["verdict"] == "UNVERIFIED" and "refused this deployment at load in its MOE layer 1"
                       in v["why"] for v in kda)
    # without a known layer kind, every claim covering the cell carries the refusal (nothing is dropped)
    unknown = copy.deepcopy(r)
    for c in unknown["cells"]:
        if c.get("load_refused"):
            c["load_refused"]["kind"] = None
    rows = [v for v in judge(unknown, expectations.load(SHIPPED), KIMI_K3) if (v["system"], v["layout"]) == ("h200_sxm", "dep8")]
    assert rows and all(v["verdict"] == "REFUSED" for v in rows)


def test_a_moe_claim_at_another_activation_precision_is_a_mismatch(tmp_path):
    """The MoE perf-db lane is the activation precision: a claim that B200 TP8 runs TRT-LLM-gen experts with
    BF16 activations (w4a16_mxfp4) fails where vLLM 0.33.0 chose them with MXFP8 activations, although the
    kernel family is the claimed one; the same family claimed at MXFP8 matches."""
    path = write_claims(tmp_path, '''
[[claim]]
id = "trtllm-bf16"
lane = "w4a16_mxfp4"
layouts = ["tp8"]
systems = ["b200_sxm"]
backend = "flashinfer_trtllm_gen"

[[claim]]
id = "trtllm-mxfp8"
lane = "w4a8_mxfp4_mxfp8"
layouts = ["tp8"]
systems = ["b200_sxm"]
backend = "flashinfer_trtllm_gen"
''', label_map=False)
    rows = judge(routing(), expectations.load(path), KIMI_K3)
    bf16 = [r for r in rows if r["claim"] == "trtllm-bf16"]
    assert {r["verdict"] for r in bf16} == {"MISMATCH"}
    assert "the claim's lane is w4a16_mxfp4" in bf16[0]["why"] and "lane w4a8_mxfp4_mxfp8" in bf16[0]["why"]
    assert verdict_of(rows, "trtllm-mxfp8", "b200_sxm", "tp8", "moe") == "MATCH"


def test_one_story_per_batch_where_the_specialized_decode_takes_some_batches():
    """tp8-specdec: K3's specialized decode takes decode 1-64 (vLLM's own plan), the stock path decode 256 and every
    prefill. A claim about the KDA decode lane is judged per batch against what serves it: never a MATCH from the
    stock kernel at a batch the specialized decode serves; the KDA prefill claim (a phase the stock path serves)
    stays one row."""
    exp = expectations.load(SHIPPED)
    rows = judge(routing(), exp, KIMI_K3)
    decode = {r.get("at"): r for r in rows if (r["claim"], r["system"], r["layout"]) ==
              ("kda-generation-fused", "b200_sxm", "tp8-specdec")}
    assert set(decode) == {"decode 1", "decode 8", "decode 64", "decode 256"}
    for at in ("decode 1", "decode 8", "decode 64"):
        assert decode[at]["verdict"] != "MATCH" and decode[at]["actual"] == "specialized_decode", at
        assert "K3's specialized decode takes" in decode[at]["why"] and decode[at]["evidence"].endswith("(dispatch)")
    assert decode["decode 256"]["verdict"] == "MATCH" and decode["decode 256"]["actual"] == "vllm_kernel"
    prefill = [r for r in rows if (r["claim"], r["system"], r["layout"]) == ("kda-context-flashkda", "b200_sxm",
                                                                              "tp8-specdec")]
    assert [(r.get("at"), r["verdict"]) for r in prefill] == [(None, "MATCH")]
    # where no step path takes a batch (tp8), the claim stays one row about the lane
    assert [r.get("at") for r in rows if (r["claim"], r["system"], r["layout"]) ==
            ("kda-generation-fused", "b200_sxm", "tp8")] == [None]
