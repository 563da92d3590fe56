"""Resolve-mode agent: run vLLM's own selection code for a plan of (system, layout) cells.

Runs inside the pinned environment (a venv holding the pinned wheel, or the pinned image)::

    python -m probes.resolve.agent PLAN.json

Process layout (import-time state follows the GPU, so the capability never changes in a process):

* the agent loads the stub libcuda and imports torch and other platform-independent modules once;
  when the plan lists shared imports (modules earlier runs saw every SM process import before the first
  module whose import reads the simulated device), it also installs the probes and the simulated platform
  with no SKU set and imports those modules once. Every stand-in reads the SKU at call time, and a read with
  none set raises and is recorded even if swallowed: the agent then starts again without sharing;
* it forks one child per distinct SM capability, which sets that SKU, installs the probes and the simulated
  platform (unless the parent did), then imports vLLM (import-time constants and cached selectors see that
  SM only), noting the order it starts importing modules and which imports read the device, for the host;
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

import json
import os
import sys
import traceback

from probes.core.lifecycle import die_with_parent
from probes.core.plan import close_cell, start_agent
from probes.core.stages import Stage, StageFailed
from probes.resolve.warmup import IMPORTED_FILE, _read_imported, warm_up

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


#: a cell directory's one line on why its process ended without evidence, written by the process that saw it end
#: (no pid or time in it: the host names it in the INCOMPLETE routing, which two runs of the same fault render alike)
ENDED_FILE = "ended.txt"


def _ended(out: str, who: str, pid: int, code: int) -> None:
    """Say why a cell's process ended: a line in its log (with the pid) and the cell's ``ended.txt`` (without)."""
    _note(os.path.join(out, "agent.log"), f"{who} (pid {pid}) ended: {describe_exit(code)}")
    try:
        with open(os.path.join(out, ENDED_FILE), "w", encoding="utf-8") as fh:
            fh.write(f"{who} ended: {describe_exit(code)}\n")
    except OSError:
        pass


def run_group(plan: dict, cells: list[dict], shared: dict) -> int:
    """One SM: set its SKU, install probes and platform (unless the shared parent did), import vLLM, then one
    forked process per cell."""
    from probes.resolve import cell as resolve

    first = cells[0]
    warm = resolve.prepare_group(plan, first, shared, Stage)
    rec = warm["rec"]
    _freeze()
    write_learned(plan, first, shared)
    failed = 0
    for cell in cells:
        out = cell_dir(plan, cell)
        os.makedirs(out, exist_ok=True)
        pid = _fork(_run_cell, plan, cell, rec, warm, out)
        code = _wait(pid)
        if code != 0:
            failed += 1
            _ended(out, "the cell's process", pid, code)
        if warm.get("error") is None:
            warm_up(_read_imported(out))
            _freeze()
            write_learned(plan, first, shared)
    return 1 if failed else 0


#: where SM processes leave what the host learns for shared imports (under the plan's out_dir)
LEARN_DIR = ".shared-imports"


def write_learned(plan: dict, first_cell: dict, shared: dict) -> None:
    """The order in which this SM process started importing modules (after those the shared parent imported),
    and those whose import read the simulated device (``readers``): the host shares the prefix before the
    first reader in later runs. Speed only: a failure to write is ignored."""
    from probes.resolve import simulate

    sm = ".".join(str(x) for x in first_cell["system"]["capability"])
    path = os.path.join(plan["out_dir"], LEARN_DIR, f"sm{sm}-{os.getpid()}.json")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            # imported under their own names (not an alias another module put in sys.modules, which only that
            # module's code makes importable)
            order = [m for m in (*shared["imported"], *simulate.ImportOrder.order)
                     if getattr(sys.modules.get(m), "__name__", None) == m]
            json.dump({"order": order, "readers": sorted(simulate._State.readers)}, fh)
        os.replace(path + ".tmp", path)
    except OSError:
        pass


def _freeze() -> None:
    """Move every object alive now out of the garbage collector's reach: what vLLM's imports built lives as
    long as the process, and a full collection walking a million of them again and again costs a third of a
    cell's construction. Only when the collector runs changes, never what any code computes."""
    import gc

    gc.freeze()


def _run_cell(plan, cell, rec, warm, out) -> int:
    log = os.open(os.path.join(out, "agent.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    from probes.resolve import cell as resolve
    from probes.resolve import simulate

    simulate._State.learning = False  # only the SM process's own imports are learned from

    before = set(sys.modules)
    rec.retarget(out, cell={"system": cell["system"]["name"], "layout": cell["layout"]["name"]})
    try:
        resolve.run_cell(plan, cell, rec, Stage, warm)
    except StageFailed:
        pass
    finally:
        close_cell(rec)
        imported = [m for m in list(sys.modules) if m not in before]
        with open(os.path.join(out, IMPORTED_FILE), "w", encoding="utf-8") as fh:
            json.dump(imported, fh)
    return 0


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def split_groups(cells: list[dict], slots: int) -> list[list[dict]]:
    """The cells of one SM capability share one process that imports vLLM (import-time state follows the
    device). With more slots than capabilities, the largest groups are split in halves (each half imports vLLM
    for itself) until every slot has a group or every group is one cell: more cores, shorter critical path."""
    by_sm: dict[tuple, list[dict]] = {}
    for cell in cells:
        by_sm.setdefault(tuple(cell["system"]["capability"]), []).append(cell)
    groups = list(by_sm.values())
    while len(groups) < slots:
        largest = max(groups, key=len)
        if len(largest) < 2:
            break
        groups.remove(largest)
        half = (len(largest) + 1) // 2
        groups += [largest[:half], largest[half:]]
    return groups


#: what one SM process's vLLM import costs, in cells: the import and platform stages of one SM process take
#: about six cells' worth of construction, post-load and dispatch (benchmarks/bench_audit.py, v0.33.0: 14-18 s
#: against 2.5-3 s per cell). Only the order of work depends on it, never what a cell records.
IMPORT_COST_CELLS = 6
_EXHAUSTIVE_LIMIT = 50_000


def plan_slots(groups: list[list[dict]], slots: int) -> list[list[list[dict]]]:
    """The SM processes each slot runs, one after another, so that the slot that finishes last finishes as
    early as the cost model allows (one import plus one unit per cell). Every assignment is tried when there
    are few (a handful of capabilities on a few cores); otherwise the largest group goes to the least loaded
    slot. Deterministic: ties keep the groups' order."""
    slots = max(1, min(slots, len(groups))) if groups else 1
    costs = [IMPORT_COST_CELLS + len(g) for g in groups]
    order = sorted(range(len(groups)), key=lambda i: -costs[i])
    best: list[int] | None = None
    if slots ** len(groups) <= _EXHAUSTIVE_LIMIT:
        best_load = None

        def place(k: int, loads: list[int], chosen: list[int]) -> None:
            nonlocal best, best_load
            if best_load is not None and max(loads) >= best_load:
                return
            if k == len(order):
                best, best_load = list(chosen), max(loads)
                return
            seen = set()
            for s in range(slots):
                if loads[s] in seen:  # slots with equal load are interchangeable
                    continue
                seen.add(loads[s])
                loads[s] += costs[order[k]]
                chosen.append(s)
                place(k + 1, loads, chosen)
                chosen.pop()
                loads[s] -= costs[order[k]]

        place(0, [0] * slots, [])
    if best is None:
        loads = [0] * slots
        best = []
        for i in order:
            s = loads.index(min(loads))
            loads[s] += costs[i]
            best.append(s)
    plan: list[list[list[dict]]] = [[] for _ in range(slots)]
    for i, s in zip(order, best):
        plan[s].append(groups[i])
    return [p for p in plan if p]


#: the agent's environment as it started (before any import could set a variable)
_STARTED_WITH: dict[str, str] = {}


def main(argv: list[str] | None = None) -> int:
    _STARTED_WITH.update(os.environ)
    argv = sys.argv[1:] if argv is None else argv
    plan = start_agent(argv, "python -m probes.resolve.agent PLAN.json")
    if plan is None:
        return 2
    # humming (imported by vLLM) starts two background Python processes at import to pre-build its JIT
    # launcher and NVRTC compiler; resolve mode launches no kernel, so they only cost each SM process
    # ~25 s of CPU. The variable only switches those builds (and JIT build parallelism) off; no choice
    # vLLM makes reads it. Observe mode, which serves, never sets it.
    os.environ.setdefault("HUMMING_DISABLE_PARALLEL_BUILD", "1")
    from probes.resolve import cell as resolve

    shared = resolve.prepare_process(plan, Stage)
    if shared["retry"]:
        return _start_again(plan, shared["retry"], argv)
    _freeze()
    parallel = max(1, int(plan.get("parallel", 1)))
    groups = split_groups(plan["cells"], parallel)
    running: dict[int, None] = {}
    groups_of: dict[int, str] = {}
    cells_of: dict[int, list] = {}
    failed = 0

    def reap_one() -> tuple[int, int]:
        pid, status = os.wait()  # whichever SM process finishes first
        running.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code < 0:  # killed: its cells that had not finished cannot say so themselves
            print(f"[serving-truth agent] the SM process for {groups_of.get(pid)} (pid {pid}) ended: "
                  f"{describe_exit(code)}", file=sys.stderr, flush=True)
            for cell in cells_of.get(pid, []):
                if not any(n.startswith("evidence-") for n in _listdir(cell_dir(plan, cell))):
                    _ended(cell_dir(plan, cell), "the SM process that runs this cell", pid, code)
        return pid, int(code != 0)

    queues = plan_slots(groups, parallel)
    slot_of: dict[int, int] = {}

    def start(slot: int) -> None:
        if not queues[slot]:
            return
        cells = queues[slot].pop(0)
        pid = _fork(run_group, plan, cells, shared)
        running[pid] = None
        slot_of[pid] = slot
        groups_of[pid] = "SM " + ".".join(str(x) for x in cells[0]["system"]["capability"])
        cells_of[pid] = cells

    for slot in range(len(queues)):
        start(slot)
    while running:
        pid, code = reap_one()
        failed += code
        slot = slot_of.pop(pid, None)
        if slot is not None:  # the next SM process of the slot that freed
            start(slot)
    return 0 if not failed else 1


def _start_again(plan: dict, reads: list[dict], argv: list[str]) -> int:
    """A shared import read the device before any SKU was set: what it computed may be wrong for every SM, so
    this process is replaced by a fresh one that imports nothing before the SKU (the host reads the note and
    stops sharing those modules)."""
    from probes.resolve import cell as resolve

    note = os.path.join(plan["out_dir"], LEARN_DIR, "tripped.json")
    try:
        os.makedirs(os.path.dirname(note), exist_ok=True)
        with open(note, "w", encoding="utf-8") as fh:
            json.dump(reads, fh)
    except OSError:
        pass
    modules = sorted({m for r in reads for m in r.get("importing", ())})
    print(f"[serving-truth agent] a shared import read the device before a SKU was set ({', '.join(modules)}); "
          "starting again without shared imports", file=sys.stderr, flush=True)
    sys.stdout.flush()
    # the environment the agent started with: imports set variables of their own (vLLM sets Triton's), and the
    # fresh process must see what the first one saw
    env = dict(_STARTED_WITH, **{resolve.NO_SHARED_IMPORTS: "1"})
    os.execve(sys.executable, [sys.executable, "-m", "probes.resolve.agent", *argv], env)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
