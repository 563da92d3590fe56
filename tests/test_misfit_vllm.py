"""A stand-in that no longer fits its release stops the audit (exit 4, the stand-in named, reports/ untouched), for
every model, on the real pinned wheel: the release is rebuilt in memory with one stand-in's target moved (the
function a stand-in expects changed its shape, as a rebuilt wheel would), and the audit of one cell is rendered.
Without the stop, what the simulation ran past the stand-in would read as a fact about vLLM (issue: a moved
``per_block_cast_to_fp8`` turned into "needs a GPU" serving rows)."""
import pytest

from audit import models
from audit.core import _write_run_json, render_run
from audit.errors import ExitCode, StandinMisfitError
from tests.plant import sitecustomize

pytestmark = pytest.mark.vllm

#: what moves in each model's audited cell: the flashinfer capability query loses its ``device`` argument (the
#: meta-device stand-in translates that argument), or vLLM's UE8M0 re-quantization is no longer torch.compile'd
#: (the eager stand-in replaces the compiled function)
FLASHINFER = ("flashinfer.utils", [("def get_compute_capability(device: torch.device) -> Tuple[int, int]:\n",
                                    "def get_compute_capability(dev: torch.device) -> Tuple[int, int]:\n"
                                    "    device = dev\n")])
DEEP_GEMM = ("vllm.utils.deep_gemm", [("@torch.compile(dynamic=True, backend=current_platform.simple_compile_backend)\n"
                                       "def per_block_cast_to_fp8(", "def per_block_cast_to_fp8(")])
CASES = {
    "kimi-k3": (("b200_sxm", "tp8"), FLASHINFER, "flashinfer.utils:get_compute_capability(device=...)"),
    "gpt-oss-120b": (("b200_sxm", "tp8"), FLASHINFER, "flashinfer.utils:get_compute_capability(device=...)"),
    "deepseek-v3": (("b200_sxm", "tp8"), DEEP_GEMM, "vllm.utils.deep_gemm:per_block_cast_to_fp8 (torch.compile)"),
}


def _planted(model: str, vllm_env, tmp_path, *, seen: list | None = None, plant: bool = True, **kw):
    """(runtime, pin, profile, the stand-in that moves, a request for the model's case cell): the moved target
    planted in the run directory unless *plant* is False; with *seen*, the audit's check before any cell
    (``audit.core._stop_on_misfit``) runs, each fit it is given kept in *seen*."""
    from audit.core import _stop_on_misfit
    from audit.runtimes import RunRequest
    from audit.systems import SYSTEMS

    rt, pin, _ = vllm_env
    profile = models.get(model)
    cell, moved, piece = CASES[model]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if plant:
        (run_dir / "sitecustomize.py").write_text(sitecustomize([moved]), encoding="utf-8")

    def check(fit: dict) -> None:
        seen.append(fit)
        _stop_on_misfit(run_dir)(fit)

    req = RunRequest(pin=pin, profile=profile, cells=[(SYSTEMS[cell[0]], profile.layouts[cell[1]])], run_dir=run_dir,
                     parallel=1, preflight=check if seen is not None else None, **kw)
    return rt, pin, profile, piece, req


@pytest.mark.parametrize("model", list(CASES))
def test_a_moved_stand_in_target_stops_the_audit_naming_it(model, vllm_env, tmp_path):
    rt, pin, profile, piece, req = _planted(model, vllm_env, tmp_path)
    result = rt.run(req, lambda *a, **k: None)
    _write_run_json(req, profile, {**result.info, "vllm_commit": pin.commit, "reproduce": "test"}, result.missing)
    reports = tmp_path / "reports"
    with pytest.raises(StandinMisfitError) as err:
        render_run(req.run_dir, reports_dir=reports, expectations="none")
    assert err.value.exit_code == ExitCode.RUN_FAILED == 4
    assert piece in err.value.misfits and err.value.misfits[piece].startswith("does not fit")
    assert piece in str(err.value) and "NOT_NEEDED" in err.value.hint
    assert not reports.exists() or not any(reports.rglob("routing.json"))  # reports/ untouched
    ledger = err.value.incomplete_ledger.read_text(encoding="utf-8")  # written beside the run, saying why
    assert "INCOMPLETE RUN (standin-misfit)" in ledger and piece in ledger


@pytest.mark.parametrize("model", list(CASES))
def test_the_audit_checks_every_stand_ins_fit_before_any_cell(model, vllm_env, tmp_path):
    """The same moved target, found before any cell runs: the runtime runs probes/resolve/fitcheck.py in the pinned
    environment (every watched module imported under the simulated platform, nothing constructed) and the audit's
    rule (audit/standinfit.py) stops it there: exit 4 naming the stand-in, no cell's evidence, no ledger. Without
    the plant the same check passes and the cell runs."""
    seen: list[dict] = []
    rt, pin, profile, piece, req = _planted(model, vllm_env, tmp_path, seen=seen)
    run_dir = req.run_dir
    with pytest.raises(StandinMisfitError) as err:
        rt.run(req, lambda *a, **k: None)
    assert err.value.exit_code == ExitCode.RUN_FAILED == 4 and err.value.before_cells
    assert piece in err.value.misfits and err.value.misfits[piece].startswith("does not fit")
    assert "before any cell ran" in str(err.value) and err.value.incomplete_ledger is None
    assert not list((run_dir / "evidence").rglob("evidence-*.jsonl"))  # no cell ran
    # every other stand-in the check met fits (only the planted one moved)
    assert [k for k, v in seen[0].items() if v.startswith("does not fit") and k != piece] == [], seen[0]
    assert len(seen[0]) >= 5, seen[0]


def test_on_the_release_as_built_the_check_passes_and_the_cells_run(vllm_env, tmp_path):
    from audit import standinfit

    seen: list[dict] = []
    rt, pin, profile, _, req = _planted("kimi-k3", vllm_env, tmp_path, seen=seen, plant=False, stop_after="config")
    run_dir = req.run_dir
    result = rt.run(req, lambda *a, **k: None)
    assert len(seen) == 1 and standinfit.stopping(seen[0]) == {} and len(seen[0]) >= 5
    assert result.missing == {} and list((run_dir / "evidence").rglob("evidence-*.jsonl"))
