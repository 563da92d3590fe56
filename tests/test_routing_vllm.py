"""The MoE routing lane against the real vLLM wheel pinned in images.lock (v0.33.0), in resolve mode.

The session's ``probed_run`` (tests/conftest.py) is the baseline; one more run of a single cell plants a change into the
pinned vLLM (a post-import hook from a ``sitecustomize`` in the run directory): K3's MoE block builds its router with
softmax scores instead of the config's sigmoid. That must move the routing lane, and nothing else.
"""
import pytest

from audit.evidence import files as evidence
from audit.models.kimi_k3 import KIMI_K3, LAYOUTS
from audit.report import routing
from audit.runtimes import RunRequest
from audit.systems import SYSTEMS
from tests.test_probes_vllm import cells_of

pytestmark = pytest.mark.vllm

def _routing(cell):
    groups = [g for g in cell["dispatch"]["lanes"]["moe_routing"] if g.get("role", "target") == "target"]
    assert len(groups) == 1, groups
    return groups[0]


def _one_cell(vllm_env, run_dir, cell):
    rt, pin, _ = vllm_env
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[cell[0]], LAYOUTS[cell[1]])], run_dir=run_dir)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    return routing.build_cell(evidence.read_dir(result.evidence_dir)[0], KIMI_K3)


@pytest.fixture(scope="module")
def planted(vllm_env, tmp_path_factory):
    from tests.plant import sitecustomize

    run_dir = tmp_path_factory.mktemp("routing-planted")
    (run_dir / "sitecustomize.py").write_text(sitecustomize([("vllm.models.kimi_k3.nvidia.model", [
        ("scoring_func=config.moe_router_activation_func,", 'scoring_func="softmax",')])]), encoding="utf-8")
    return _one_cell(vllm_env, run_dir, ("h100_sxm", "tp8"))


def test_routing_lane_names_router_method_and_where_it_runs(probed_run):
    """K3's routed experts: vLLM's GroupedTopKRouter with DeepSeek-V3 routing (sigmoid scores and a correction bias,
    16 of 896 experts). On SM 10.0 TP8 the TRT-LLM-Gen experts are monolithic and route inside the kernel; on SM 9.0
    the router selects the experts first."""
    cells = cells_of(probed_run)
    b200 = _routing(routing.build_cell(cells[("b200_sxm", "tp8")], KIMI_K3))
    h100 = _routing(routing.build_cell(cells[("h100_sxm", "tp8")], KIMI_K3))
    what = ("GroupedTopKRouter (DeepSeekV3 routing: 16 of 896 experts, sigmoid scores + correction bias, 1 of 1 "
            "expert groups)")
    assert set(b200["tiers"].values()) == {f"inside the experts kernel (monolithic Mxfp4MoEMethod): {what}"}
    assert set(h100["tiers"].values()) == {
        f"separate router (GroupedTopKRouter.select_experts), then the experts kernel: {what}"}
    assert len(b200["layers"]) == len(h100["layers"]) > 80


def test_planted_scoring_moves_only_the_routing_lane(probed_run, planted):
    """Softmax scores planted into K3's router: vLLM's routing method and the scoring in the routing lane change;
    every other dispatch lane and every construction lane stay as they were."""
    before = routing.build_cell(cells_of(probed_run)[("h100_sxm", "tp8")], KIMI_K3)
    moved = _routing(planted)
    assert all("softmax scores + correction bias" in t for t in moved["tiers"].values())
    assert moved["tiers"] != _routing(before)["tiers"]
    lanes = set(before["dispatch"]["lanes"]) | set(planted["dispatch"]["lanes"])
    assert {lane for lane in lanes
            if before["dispatch"]["lanes"].get(lane) != planted["dispatch"]["lanes"].get(lane)} == {"moe_routing"}
    assert before["lanes"] == planted["lanes"]


SP_PLANT = '''
# planted by tests/test_routing_vllm.py: vLLM no longer runs a DP x TP MoE sequence-parallel
from probes.core.patching import PostImportHooks


def _plant(mod):
    mod.ParallelConfig.use_sequence_parallel_moe = property(lambda self: False)


PostImportHooks().register("vllm.config.parallel", _plant)
'''
DPTP = ("h200_sxm", "dp2-tp4-ep")


@pytest.fixture(scope="module")
def dptp(vllm_env, tmp_path_factory):
    """DP2 x TP4 + EP on SM 9.0, as shipped and with sequence-parallel MoE planted off."""
    stock = _one_cell(vllm_env, tmp_path_factory.mktemp("dptp"), DPTP)
    run_dir = tmp_path_factory.mktemp("dptp-planted")
    (run_dir / "sitecustomize.py").write_text(SP_PLANT, encoding="utf-8")
    return stock, _one_cell(vllm_env, run_dir, DPTP)


def _only(cell, lane):
    groups = [g for g in cell["dispatch"]["lanes"][lane] if g.get("role", "target") == "target"]
    assert len(groups) == 1, groups
    return set(groups[0]["tiers"].values())


def test_dp_tp_ep_moe_split_and_its_tail_decision(dptp):
    """DP2 x TP4 + EP: vLLM runs the MoE sequence-parallel (each of the 4 TP ranks on its slice of the tokens, the
    experts over 8 EP ranks, MoE tp_size 1), and the latent tail is not fused, at vLLM's own check."""
    stock, _ = dptp
    assert _only(stock, "moe_parallel") == {
        "MoE tp_size 1, ep_size 8, dp_size 2, sp_size 4; expert parallel on, all2all allgather_reducescatter; "
        "sequence-parallel MoE on"}
    assert _only(stock, "latent_tail") == {
        "native runner path (no fused tail: _use_fused_path() is False, at `self.moe_config.tp_size > 1`)"}


def test_planted_sequence_parallel_moves_only_the_parallel_lane(dptp):
    """use_sequence_parallel_moe planted False: the MoE split reads it (sp_size back to 1, sequence-parallel off);
    no other dispatch lane and no construction lane moves."""
    stock, planted = dptp
    moved = _only(planted, "moe_parallel")
    assert len(moved) == 1 and next(iter(moved)).endswith("sequence-parallel MoE off")
    lanes = set(stock["dispatch"]["lanes"]) | set(planted["dispatch"]["lanes"])
    assert {lane for lane in lanes
            if stock["dispatch"]["lanes"].get(lane) != planted["dispatch"]["lanes"].get(lane)} == {"moe_parallel"}
    assert stock["lanes"] == planted["lanes"]
