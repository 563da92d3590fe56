"""Resolve-mode agent: run vLLM's own selection code for a plan of (system, layout) cells.

Runs inside the pinned environment (a venv holding the pinned wheel, or the pinned image)::

    python -m probes.agent PLAN.json

Process layout (import-time state follows the GPU, so the capability never changes in a process):

* the agent loads the stub libcuda and imports torch and other platform-independent modules once;
* it forks one child per distinct SM capability, which installs the probes and the simulated
  platform, then imports vLLM (import-time constants and cached selectors see that SM only);
* that child forks one grandchild per cell, which sets the SKU and world size, builds the config
  from ``vllm serve`` arguments, initialises a fake process group, constructs the model on the meta
  device, inspects it, and writes ``<out_dir>/<system>--<layout>/evidence-*.jsonl``;
* after each cell, the SM process imports the modules that cell imported lazily (and the host passes
  those learned by earlier runs), so the next cells fork warm: a speed-up, never a change of state
  a cell could observe, since vLLM's import-time state depends on the platform, not the config.

Each stage is recorded with its outcome, so the ledger can say how deep construction went; a
failing stage is evidence, not a crash of the harness. A cell whose process dies leaves its
``agent.log`` and no evidence file; the host reports it as INCOMPLETE.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback

from .lifecycle import die_with_parent, watch_parent
from .recorder import Recorder

PLAN_SCHEMA = 1

#: packages whose presence/version changes what vLLM selects (install, not GPU)
FINGERPRINT_PACKAGES = (
    "vllm", "torch", "triton", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache",
    "deep-gemm", "deep_gemm", "nvidia-cutlass-dsl", "humming-kernels", "triton-kernels", "tilelang",
    "quack-kernels", "tokenspeed-mla", "flash-kda", "flashkda", "transformers", "compressed-tensors",
    "cuda-python", "nvidia-cuda-nvcc", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "xgrammar", "ninja",
)
FINGERPRINT_MODULES = ("deep_gemm", "flashinfer", "flash_kda", "flashkda", "triton_kernels", "humming",
                       "cutlass", "tilelang", "vllm.third_party.deep_gemm", "vllm._flashkda_C")
FINGERPRINT_TOOLS = ("nvcc", "ninja", "gcc", "c++", "cc")
FINGERPRINT_ENV_PREFIXES = ("VLLM_", "CUDA_", "TRITON_", "FLASHINFER_", "DG_", "TORCH_CUDA_ARCH", "PYTORCH_")
#: set by the harness itself; not part of the audited environment (a plan can add to this list)
_HARNESS_ENV = ("TRITON_LIBCUDA_PATH", "PYTORCH_NVML_BASED_CUDA_CHECK", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR",
                "VLLM_PLUGINS")
#: values never written into evidence, whatever the prefix
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")
REDACTED = "<redacted>"

class StageFailed(Exception):
    pass


class Stage(contextlib.AbstractContextManager):
    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, et, ev, tb):
        seconds = round(time.perf_counter() - self.t0, 3)
        if ev is None:
            self.rec.emit("stage", stage=self.name, ok=True, seconds=seconds)
            return False
        where = traceback.extract_tb(tb)[-1] if tb else None
        self.rec.emit("stage", stage=self.name, ok=False, seconds=seconds,
                      error={"type": f"{et.__module__}:{et.__qualname__}", "message": str(ev)[:4000],
                             "where": f"{where.filename}:{where.lineno} in {where.name}" if where else "",
                             "traceback": traceback.format_exception(et, ev, tb)[-12:]})
        raise StageFailed(self.name) from ev


def _module_present(dotted: str) -> bool:
    """Whether a module is installed, without importing it or its parents (no side effects)."""
    top, _, rest = dotted.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    if not rest:
        return True
    parts = rest.split(".")
    for base in spec.submodule_search_locations or ():
        folder = os.path.join(base, *parts[:-1])
        if os.path.isdir(os.path.join(folder, parts[-1])) or os.path.exists(os.path.join(folder, parts[-1] + ".py")):
            return True
        if os.path.isdir(folder) and any(n.startswith(parts[-1] + ".") and n.endswith(".so") for n in os.listdir(folder)):
            return True
    return False


def fingerprint(plan: dict | None = None) -> dict:
    """What in this process's install and environment can change vLLM's choices.

    Variables the harness set (``plan["harness_env"]``, e.g. CUDA_HOME in the local runtime, where it
    is stated in the provenance instead) are left out; values of variables the user passed through
    by name (``plan["redact_env"]``) and of anything that looks like a credential are redacted.
    """
    plan = plan or {}
    harness = set(_HARNESS_ENV) | set(plan.get("harness_env", ()))
    redact = set(plan.get("redact_env", ()))
    pkgs = {}
    for name in FINGERPRINT_PACKAGES:
        try:
            pkgs[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    env = {}
    for k, v in sorted(os.environ.items()):
        if k.startswith(FINGERPRINT_ENV_PREFIXES) and k not in harness:
            env[k] = REDACTED if k in redact or any(w in k.upper() for w in _SECRET_WORDS) else v
    return {
        "packages": pkgs,
        "modules": {mod: _module_present(mod) for mod in FINGERPRINT_MODULES},
        "tools": {t: bool(shutil.which(t)) for t in FINGERPRINT_TOOLS},
        "env": env,
        "python": sys.version.split()[0],
    }


def availability() -> dict:
    """vLLM's own "is X available" answers, asked after the model was built."""
    out = {}
    checks = (
        ("deep_gemm", "vllm.utils.deep_gemm", "has_deep_gemm"),
        ("flashinfer", "vllm.utils.flashinfer", "has_flashinfer"),
        ("flashinfer_cutlass_fused_moe", "vllm.utils.flashinfer", "has_flashinfer_cutlass_fused_moe"),
        ("flashinfer_trtllm_fused_moe", "vllm.utils.flashinfer", "has_flashinfer_trtllm_fused_moe"),
        ("triton_kernels", "vllm.utils.import_utils", "has_triton_kernels"),
    )
    for key, module, fn in checks:
        try:
            out[key] = bool(getattr(importlib.import_module(module), fn)())
        except Exception as exc:
            out[key] = f"unknown ({type(exc).__name__})"
    try:
        import torch

        out["torch.version.cuda"] = torch.version.cuda
    except Exception:
        pass
    return out


def cell_dir(plan: dict, cell: dict) -> str:
    return os.path.join(plan["out_dir"], f"{cell['system']['name']}--{cell['layout']['name']}")


def _fork(fn, *args) -> int:
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # child
        code = 1
        die_with_parent(parent)  # a killed agent or SM process takes its children with it
        try:
            code = fn(*args) or 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def describe_exit(code: int) -> str:
    """``exit 1`` / ``killed by signal 9 (SIGKILL)`` for a waitstatus_to_exitcode value."""
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        return f"killed by signal {-code} ({name})"
    return f"exit {code}"


def _note(path: str, text: str) -> None:
    """Append the harness's own line to a process's log (why it ended, when it could not say so itself)."""
    try:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"[serving-truth agent] {text}\n")
    except OSError:
        pass


def run_group(plan: dict, cells: list[dict]) -> int:
    """One SM: install probes and platform, import vLLM, then one forked process per cell."""
    from . import resolve

    rec = Recorder(None, role="resolve-agent", meta={"mode": "resolve", "pin": plan.get("pin", "")})
    first = cells[0]
    warm = resolve.prepare_group(plan, first, rec, Stage)
    failed = 0
    for cell in cells:
        out = cell_dir(plan, cell)
        os.makedirs(out, exist_ok=True)
        pid = _fork(_run_cell, plan, cell, rec, warm, out)
        code = _wait(pid)
        if code != 0:
            failed += 1
            _note(os.path.join(out, "agent.log"), f"the cell's process (pid {pid}) ended: {describe_exit(code)}")
        if warm.get("error") is None:
            warm_up(_read_imported(out))
    return 1 if failed else 0


IMPORTED_FILE = "imported-modules.json"


def _read_imported(out: str) -> list[str]:
    try:
        with open(os.path.join(out, IMPORTED_FILE), encoding="utf-8") as fh:
            return list(json.load(fh))
    except (OSError, ValueError):
        return []


def warm_up(modules) -> tuple[int, int]:
    """Import, in this SM's process, modules a cell imported lazily, so later cells fork with them.

    Safe because import-time state in vLLM depends on the platform (the same SM here) and the
    environment, not on the VllmConfig (no vLLM module reads the current config at import time).
    A module that fails here is skipped; the cell that needs it imports it itself.
    """
    ok = failed = 0
    for name in modules:
        if name in sys.modules or name.startswith(("probes", "__main__", "__mp_main__")):
            continue
        try:
            importlib.import_module(name)
            ok += 1
        except Exception:  # an optimisation must never break the run
            failed += 1
    return ok, failed


def _run_cell(plan, cell, rec, warm, out) -> int:
    log = os.open(os.path.join(out, "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    from . import resolve

    before = set(sys.modules)
    rec.retarget(out, cell={"system": cell["system"]["name"], "layout": cell["layout"]["name"]})
    try:
        resolve.run_cell(plan, cell, rec, Stage, warm)
    except StageFailed:
        pass
    finally:
        path = rec.flush()
        print(f"evidence: {path}", flush=True)
        imported = [m for m in list(sys.modules) if m not in before]
        with open(os.path.join(out, IMPORTED_FILE), "w", encoding="utf-8") as fh:
            json.dump(imported, fh)
    return 0


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def read_plan(argv: list[str], usage: str, *, nargs: int) -> dict | None:
    """The plan named by ``argv[0]`` (the harness's plan.json), or None after saying what is wrong."""
    if len(argv) != nargs:
        print(f"usage: {usage}", file=sys.stderr)
        return None
    with open(argv[0], encoding="utf-8") as fh:
        plan = json.load(fh)
    if plan.get("schema") != PLAN_SCHEMA:
        print(f"plan schema {plan.get('schema')!r}, this agent reads {PLAN_SCHEMA}", file=sys.stderr)
        return None
    return plan


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    plan = read_plan(argv, "python -m probes.agent PLAN.json", nargs=1)
    if plan is None:
        return 2
    watch_parent()
    from . import resolve

    resolve.prepare_process(plan)
    groups: dict[tuple, list[dict]] = {}
    for cell in plan["cells"]:
        groups.setdefault(tuple(cell["system"]["capability"]), []).append(cell)
    parallel = max(1, int(plan.get("parallel", 1)))
    running: dict[int, None] = {}
    groups_of: dict[int, str] = {}
    cells_of: dict[int, list] = {}
    failed = 0

    def reap_one() -> int:
        pid, status = os.wait()  # whichever SM process finishes first
        running.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:  # killed: its cells that had not finished cannot say so themselves
            print(f"[serving-truth agent] the SM process for {groups_of.get(pid)} (pid {pid}) ended: "
                  f"{describe_exit(code)}", file=sys.stderr, flush=True)
            for cell in cells_of.get(pid, []):
                log = os.path.join(cell_dir(plan, cell), "agent.log")
                if not any(n.startswith("evidence-") for n in _listdir(cell_dir(plan, cell))):
                    _note(log, f"the SM process that runs this cell (pid {pid}) ended: {describe_exit(code)}")
        return code != 0

    # larger groups first, so the last one to start is a short one
    for cells in sorted(groups.values(), key=len, reverse=True):
        while len(running) >= parallel:
            failed += reap_one()
        pid = _fork(run_group, plan, cells)
        running[pid] = None
        groups_of[pid] = "SM " + ".".join(str(x) for x in cells[0]["system"]["capability"])
        cells_of[pid] = cells
    while running:
        failed += reap_one()
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
