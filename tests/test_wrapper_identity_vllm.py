"""The probe wrapper returns exactly what it wraps, on every target of every model, on the pinned wheel.

Each installed wrapper is called the way vLLM calls it (through the owning class or module, so the
classmethod and staticmethod descriptors bind as they do in serving; and through every ``from x import f``
copy the install rebound), with the wrapped function swapped for one that returns a fresh object or raises a
fresh exception. The caller must get that very object and that very exception, and every rebound copy must be
the wrapper itself. The probes' own hooks run as they would (they cannot bind such arguments, so they record
nothing); only the wrapped function is swapped, and put back before the next target.
"""
import json
import shutil
import subprocess
import textwrap

import pytest

from audit.models import PROFILES
from tests.conftest import ROOT

pytestmark = pytest.mark.vllm

EVERY_TARGET = textwrap.dedent('''
    import importlib, json, sys
    sys.path.insert(0, sys.argv[1])
    from probes.resolve import simulate
    from probes.core.recorder import Recorder
    from probes.core.install import ProbeSet
    from probes.core.targets import TARGETS, split_spec, spec_applies, with_model
    from probes import models as models_probes
    simulate.load_stub_libcuda(sys.argv[2])
    simulate.set_simulated({"name": "h100_sxm", "device_name": "NVIDIA H100 80GB HBM3", "capability": [9, 0],
                            "total_memory_gib": 80, "sm_count": 132, "arch": "amd64"}, 8)
    simulate.simulate_torch()
    import vllm
    version = vllm.__version__.split("+")[0]
    targets = TARGETS
    for name, schemes in json.loads(sys.argv[3]):
        targets = with_model(targets, models_probes.load(name, schemes=tuple(schemes)).targets)
    ps = ProbeSet(Recorder(None), targets=targets, vllm_version=version).install()
    simulate.install_platform()
    unimportable = {}
    for t in targets:
        for spec in t.specs:
            module, _, vrange = split_spec(spec)
            if spec_applies(vrange, version):
                try:
                    importlib.import_module(module)
                except Exception as exc:  # a module this simulated platform cannot import: named, not hidden
                    unimportable[module] = type(exc).__name__
    results = []
    for patch in ps.patches:
        repl = patch.replacement
        wrapper = repl.__func__ if isinstance(repl, (classmethod, staticmethod)) else repl
        cell = wrapper.__closure__[wrapper.__code__.co_freevars.index("fn")]
        original = cell.cell_contents
        where = getattr(patch.owner, "__qualname__", None) or patch.owner.__name__
        problems = []

        class Planted(Exception):
            pass

        def returns(*args, **kwargs):
            return returns.answer

        def raises(*args, **kwargs):
            raise raises.exc

        try:
            returns.answer, raises.exc = object(), Planted("from the wrapped function")
            attr = getattr(patch.owner, patch.name)  # the descriptor binds as it does when vLLM calls it
            cell.cell_contents = returns
            if attr() is not returns.answer:
                problems.append("returned another object than the wrapped function's")
            cell.cell_contents = raises
            try:
                attr()
                problems.append("returned where the wrapped function raised")
            except Planted as exc:
                if exc is not raises.exc:
                    problems.append("raised another exception object")
            # every module-level copy of the function (``from x import f``, made before or after the install)
            # is the wrapper; none still holds the unwrapped original
            copies = 0
            for mod in list(sys.modules.values()):
                if getattr(mod, "__name__", "").startswith("vllm") and mod is not patch.owner:
                    for held, value in list(vars(mod).items()):
                        if value is wrapper:
                            copies += 1
                        elif value is original and not isinstance(patch.owner, type):
                            problems.append(f"{mod.__name__}.{held} still holds the unwrapped function")
        finally:
            cell.cell_contents = original
        results.append({"target": f"{where}.{patch.name}", "kind": type(patch.original).__name__,
                        "copies": copies, "problems": problems})
    states = {tid: st.status for tid, st in ps.state.items()}
    applicable = sorted(t.id for t in targets if any(spec_applies(split_spec(sp)[2], version) for sp in t.specs))
    print(json.dumps({"results": results, "states": states, "unimportable": unimportable, "applicable": applicable,
                      "targets": sorted({t.id for t in targets})}))
''')


def _every_target(vllm_env, tmp_path, root=ROOT) -> dict:
    rt, pin, env = vllm_env
    stub = rt.ensure_stub(env)
    models = json.dumps([[p.probes, list(p.schemes)] for p in PROFILES.values()])
    out = subprocess.run([str(env / "bin" / "python"), "-c", EVERY_TARGET, str(root), str(stub), models],
                         capture_output=True, text=True, env=rt._env(env, stub, run_dir=tmp_path), timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_wrapper_that_returns_something_else_is_caught_on_every_target(vllm_env, tmp_path):
    """The check itself, on a copy of the probes whose wrapper hands back None instead of the wrapped result (the
    bug the faults campaign planted): every target reports it."""
    copy = tmp_path / "planted"
    shutil.copytree(ROOT / "probes", copy / "probes", ignore=shutil.ignore_patterns("__pycache__"))
    src = copy / "probes" / "core" / "patching.py"
    text = src.read_text(encoding="utf-8")
    assert text.count("        return result\n") == 1
    src.write_text(text.replace("        return result\n", "        return None\n"), encoding="utf-8")
    got = _every_target(vllm_env, tmp_path, root=copy)
    assert got["results"] and all("returned another object than the wrapped function's" in r["problems"]
                                  for r in got["results"])


def test_every_wrapper_returns_and_raises_exactly_what_it_wraps(vllm_env, tmp_path):
    got = _every_target(vllm_env, tmp_path)
    results = got["results"]
    assert [r for r in results if r["problems"]] == []
    # every target of every model that this release has was reached and wrapped
    assert set(got["states"]) == set(got["targets"])
    assert {tid for tid, st in got["states"].items() if st == "patched"} == set(got["applicable"])
    assert len(results) >= len(got["applicable"]) >= 20
    # every descriptor kind the targets use was exercised, and consumers' copies with them
    assert {r["kind"] for r in results} >= {"function", "classmethod"}
    assert sum(r["copies"] for r in results) > 0
