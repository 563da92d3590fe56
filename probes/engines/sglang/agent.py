"""Resolve-mode agent for SGLang: run SGLang's own server-argument resolution and model construction for a plan of
(system, layout) cells::

    python -m probes.engines.sglang.agent PLAN.json

Process layout (SGLang caches what it reads of the device, e.g. ``utils.common``'s ``lru_cache``-d probes, so one
process never sees two capabilities): the agent loads the stub driver, installs the device stand-ins and imports
torch; it forks one process per SM capability (a group of cells), which sets that SKU and imports SGLang; that
process forks one per cell, which writes ``<out_dir>/<system>--<layout>/evidence-*.jsonl`` and its ``agent.log``.
A cell whose process dies leaves no evidence; the line on why it ended goes to its ``ended.txt`` and the host
reports the cell INCOMPLETE.
"""
from __future__ import annotations

import os
import sys
import traceback

from probes.core.plan import close_cell, start_agent
from probes.core.stages import Stage, StageFailed
from probes.resolve.agent import _ended, _fork, _listdir, _wait, cell_dir, describe_exit, plan_slots, split_groups

#: packages, modules and variables whose presence or value can change what SGLang selects (the evidence's fingerprint)
FINGERPRINT_PACKAGES = ("sglang", "torch", "triton", "transformers", "sglang-kernel", "sgl-deep-gemm", "sgl-deep-ep",
                        "sgl-flash-mla", "flashinfer-python", "flashinfer-cubin", "flash-attn-4", "nvidia-cutlass-dsl",
                        "cuda-tile", "tilelang", "quack-kernels", "humming-kernels", "triton-kernels",
                        "compressed-tensors", "cuda-python", "nvidia-cuda-nvcc", "xgrammar", "ninja")
FINGERPRINT_MODULES = ("sgl_kernel", "deep_gemm", "flashinfer", "triton_kernels", "flash_mla", "cutlass", "tilelang")
FINGERPRINT_ENV_PREFIXES = ("SGLANG_", "SGL_", "CUDA_", "TRITON_", "FLASHINFER_", "DG_", "TORCH_CUDA_ARCH", "PYTORCH_")

#: what an SM process imports before forking its cells (each cell imports the rest itself)
SM_IMPORTS = ("sglang.srt.server_args", "sglang.srt.arg_groups.overrides", "sglang.srt.runtime_context")


def _recorder(plan: dict):
    from probes.core.recorder import Recorder

    return Recorder(None, role="resolve-agent", meta={"mode": "resolve", "pin": plan.get("pin", ""),
                                                      "model": plan.get("model") or None,
                                                      "wheel_sha256": plan.get("wheel_sha256", ""),
                                                      "engine": "sglang"})


def run_group(plan: dict, cells: list[dict], rec) -> int:
    """One SM process: the SKU, SGLang's imports (a failure is recorded and every cell of the group says so), then
    one forked process per cell, one at a time."""
    import importlib

    from probes.resolve import simulate

    first = cells[0]
    simulate.set_simulated(first["system"], first["layout"]["world_size"])
    error = None
    try:
        with Stage(rec, "imports"):
            for name in SM_IMPORTS:
                importlib.import_module(name)
    except StageFailed as exc:
        error = exc
    failed = 0
    for cell in cells:
        out = cell_dir(plan, cell)
        os.makedirs(out, exist_ok=True)
        pid = _fork(_run_cell, plan, cell, rec, error, out)
        code = _wait(pid)
        if code != 0 and not any(n.startswith("evidence-") for n in _listdir(out)):
            _ended(out, "the process of this cell", pid, code)
        failed += int(code != 0)
    return 0 if not failed else 1


def _run_cell(plan: dict, cell: dict, rec, error, out: str) -> int:
    log = os.open(os.path.join(out, "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    from probes.engines.sglang import cell as sglang_cell

    rec.retarget(out, cell={"system": cell["system"]["name"], "layout": cell["layout"]["name"]})
    try:
        sglang_cell.run_cell(plan, cell, rec, error)
    except StageFailed:
        pass
    finally:
        close_cell(rec)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plan = start_agent(argv, "python -m probes.engines.sglang.agent PLAN.json")
    if plan is None:
        return 2
    from probes.engines.sglang import platform
    from probes.resolve import simulate

    platform.prepare_environment()
    simulate.load_stub_libcuda(plan["stub_libcuda"])
    rec = _recorder(plan)
    try:
        platform.install()
    except Exception:  # a fault of the stand-ins (recorded by the fence): every cell ends INCOMPLETE with it
        traceback.print_exc()
    from probes.core.environment import fingerprint

    rec.emit("fingerprint", **fingerprint(plan, shared=False, packages=FINGERPRINT_PACKAGES,
                                          modules=FINGERPRINT_MODULES, env_prefixes=FINGERPRINT_ENV_PREFIXES))
    parallel = max(1, int(plan.get("parallel", 1)))
    queues = plan_slots(split_groups(plan["cells"], parallel), parallel)
    running: dict[int, tuple[int, list]] = {}
    failed = 0

    def start(slot: int) -> None:
        if queues[slot]:
            cells = queues[slot].pop(0)
            running[_fork(run_group, plan, cells, rec)] = (slot, cells)

    for slot in range(len(queues)):
        start(slot)
    while running:
        pid, status = os.wait()
        slot, cells = running.pop(pid, (None, []))
        code = os.waitstatus_to_exitcode(status)
        if code < 0:  # killed: its cells that had not finished cannot say so themselves
            print(f"[serving-truth agent] the SM process (pid {pid}) ended: {describe_exit(code)}", file=sys.stderr,
                  flush=True)
            for cell in cells:
                if not any(n.startswith("evidence-") for n in _listdir(cell_dir(plan, cell))):
                    _ended(cell_dir(plan, cell), "the SM process that runs this cell", pid, code)
        failed += int(code != 0)
        if slot is not None:
            start(slot)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
