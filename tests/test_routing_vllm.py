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


@pytest.fixture(scope="module")
def planted(vllm_env, tmp_path_factory):
    from tests.plant import sitecustomize

    rt, pin, _ = vllm_env
    run_dir = tmp_path_factory.mktemp("routing-planted")
    (run_dir / "sitecustomize.py").write_text(sitecustomize([("vllm.models.kimi_k3.nvidia.model", [
        ("scoring_func=config.moe_router_activation_func,", 'scoring_func="softmax",')])]), encoding="utf-8")
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS["h100_sxm"], LAYOUTS["tp8"])], run_dir=run_dir)
    result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    return routing.build_cell(evidence.read_dir(result.evidence_dir)[0], KIMI_K3)


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
