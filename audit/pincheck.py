"""``serving-truth verify-pins``: before any report is regenerated, check the harness against every pinned release.

For each pin with a wheel (its environment built if missing), in release order:

* one cell per SM family (``tp8`` on the first audited system of each capability major) runs with the fences on
  (probes/core/fence.py): a harness fault, or a cell that did not finish, fails the pin;
* each stand-in's **fit** (the shape it expects of its target: the attribute defined by the named class itself,
  the argument in its signature, the module attributes it replaces) as the cells recorded it: a stand-in that
  does not fit a release fails the pin unless :data:`NOT_NEEDED` says, for that package version, why nothing
  reads it there (the skip is printed with its reason);
* vLLM's own availability answers (``has_humming()``, ``has_deep_gemm()``, ...) beside a **plain import** of
  each package in the same environment (the stub driver loaded, nothing of the harness): where they disagree the
  pin fails, with the reason the cell recorded (a reason that runs through the harness's code is also a fault).

Nothing under ``reports/`` is touched: the cells' reports go to a scratch directory under the run.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from audit.core import AuditOptions, run_audit
from audit.errors import AuditError, HarnessFaultError, Interrupted
from audit.pins import lock as lockmod
from audit.profiles import Profile
from audit.runtimes.base import Progress
from audit.systems import SYSTEMS
from audit.standinfit import NOT_NEEDED, misfit, not_needed  # noqa: F401 (NOT_NEEDED: named in the docs above)

#: what a plain import is asked about: vLLM's answer key -> module (probes.core.environment.ANSWER_MODULES)
PLAIN_IMPORT = ("import importlib, json, sys\n"
                "out = {}\n"
                "for key, mods in json.loads(sys.argv[1]).items():\n"
                "    errors = []\n"
                "    for mod in mods:\n"
                "        try:\n"
                "            importlib.import_module(mod)\n"
                "            out[key] = 'imports'\n"
                "            break\n"
                "        except Exception as exc:\n"
                "            errors.append(f'{mod}: {type(exc).__name__}: ' + (str(exc).splitlines() or [''])[0][:200])\n"
                "    else:\n"
                "        out[key] = '; '.join(errors)\n"
                "print(json.dumps(out))\n")


@dataclass
class PinCheck:
    pin: str
    cells: list[str] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    fit: dict[str, str] = field(default_factory=dict)
    misfits: list[str] = field(default_factory=list)
    #: misfits NOT_NEEDED explains (named, with why; they do not fail the pin)
    skipped: list[str] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)
    #: the pin's declared host (images.lock [pin.host]) missing, or not what vLLM's own checks read in the run
    host: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not (self.faults or self.unfinished or self.misfits or self.disagreements or self.host or self.error)


def family_systems() -> list[str]:
    """One system per SM family (capability major), the first of each in the audit's order."""
    seen, out = set(), []
    for s in SYSTEMS.values():
        if s.capability[0] not in seen:
            seen.add(s.capability[0])
            out.append(s.name)
    return out


def _answer_modules() -> dict[str, tuple]:
    from probes.core.environment import ANSWER_MODULES  # stdlib-only module: the same map the cells use

    return dict(ANSWER_MODULES)


def plain_imports(pin, progress: Progress) -> dict[str, str]:
    """Each package vLLM answers about, imported plainly in the pin's environment (stub driver loaded)."""
    from audit.runtimes.local import LocalRuntime

    rt = LocalRuntime()
    env = rt.ensure_env(pin, progress)
    stub = rt.ensure_stub(env)
    out = subprocess.run([str(env / "bin" / "python"), "-c", PLAIN_IMPORT, json.dumps(_answer_modules())],
                         capture_output=True, text=True, env=rt._env(env, stub), timeout=900)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {k: f"the plain-import check failed: {out.stderr.strip()[-200:]}" for k in _answer_modules()}


def _read_routing(path: Path) -> dict | None:
    found = sorted(path.rglob("routing.json"))
    if not found:
        return None
    return json.loads(found[0].read_text(encoding="utf-8"))


def check_pin(pin_name: str, profile: Profile, *, lock_path: str | Path = "images.lock", layout: str | None = None,
              progress: Progress = lambda *a, **k: None) -> PinCheck:
    lock = lockmod.load(lock_path)
    pin = lock.get(pin_name)
    res = PinCheck(pin=pin.name)
    systems = family_systems()
    with tempfile.TemporaryDirectory(prefix="verify-pins-") as scratch:
        opts = AuditOptions(lock_path=lock_path, systems=systems,
                            layouts=[layout or next(iter(profile.layouts))], reports_dir=scratch,
                            expectations="none", baseline="none", accepted="none", cache=False, replace=True,
                            profile=profile)
        where = Path(scratch)
        try:
            outcome = run_audit(pin.name, opts, progress=progress)
        except Interrupted:
            raise  # the user's signal ends verify-pins (exit 130); it says nothing about how the harness fits a pin
        except HarnessFaultError as exc:
            res.faults = sorted({f"{f['cell']}: {f['piece']}: {f['type'].split(':')[-1]}: {f['message'][:200]}"
                                 for f in exc.faults})
            where = Path(exc.run_dir)
        except AuditError as exc:
            res.error = str(exc).splitlines()[0]
            where = Path(getattr(exc, "run_dir", "") or scratch)
        else:
            where = Path(outcome.ledger).parent
        routing = _read_routing(where)
    if routing is None:
        res.error = res.error or "no routing.json was written"
        return res
    answers: dict = {}
    why: dict = {}
    res.fit.update(routing.get("standin_fit") or {})  # the run's account (routing.build_routing)
    for c in routing["cells"]:
        name = f"{c['system']}/{c['layout']}"
        res.cells.append(name)
        if c["status"] == "INCOMPLETE" and not c.get("harness_faults"):
            res.unfinished.append(f"{name}: {(c.get('failure') or {}).get('message', '')[:200]}")
        for k, v in (c.get("availability") or {}).items():
            answers.setdefault(k, v)
        for k, v in (c.get("availability_why") or {}).items():
            why.setdefault(k, v)
    for k, v in sorted(res.fit.items()):
        if misfit(v):
            why = not_needed(k, v)
            if why:
                res.skipped.append(f"{k}: {v}; not needed: {why}")
            else:
                res.misfits.append(f"{k}: {v}")
    # an engine whose releases ship no image recipe declares no host facts: nothing to check against
    res.host = host_problems(pin, routing) if pin.engine_contract.declares_host else []
    plain = plain_imports(pin, progress)
    for key, modules in sorted(_answer_modules().items()):
        said, got = answers.get(key), plain.get(key, "?")
        names = " or ".join(modules)
        if said is True and got != "imports":
            res.disagreements.append(f"{key}: vLLM says available, a plain import of {names} fails ({got})")
        elif said is False and got == "imports":
            res.disagreements.append(f"{key}: vLLM says unavailable, a plain import of {names} works"
                                     + (f" ({why[key]})" if key in why else ""))
    return res


def host_problems(pin, routing: dict) -> list[str]:
    """How the run's host falls short of the pin's declared one (audit/pins/hosts.py): no declaration, or a fact vLLM's
    own checks read otherwise in some cell (the arrangement did not reach vLLM)."""
    from audit.pins.hosts import check_facts

    if not pin.host:
        return [f"images.lock declares no [pin.host] for {pin.name}: its audits run under the harness's own "
                "arrangement, not its image's"]
    problem = check_facts(pin.host)
    if problem:
        return [problem]
    host = (routing.get("run") or {}).get("host") or {}
    if host.get("name") != "image":
        return [f"the run recorded the host {host.get('name')!r}, not the pin's image"]
    out = []
    # what each declared fact makes vLLM's own check answer, read back from every cell
    expect = {"flashinfer_cubin": pin.host["flashinfer_cubin"]}
    if pin.host["flashinfer_cubin"] or (pin.host["nvcc"] and pin.host["ninja"]):
        expect["flashinfer"] = True
    for c in routing["cells"]:
        said = c.get("availability") or {}
        for key, want in expect.items():
            if key in said and said[key] is not want:
                out.append(f"{c['system']}/{c['layout']}: vLLM's {key} check says {said[key]}, the declared host "
                           f"makes it {want}")
    return sorted(set(out))


def verify_pins(profile: Profile, *, lock_path: str | Path = "images.lock", pins: list[str] | None = None,
                progress: Progress = lambda *a, **k: None) -> list[PinCheck]:
    """:func:`check_pin` of *profile*'s model for each pin of its engine with a wheel (or those named), in release
    order."""
    lock = lockmod.load(lock_path)
    chosen = [p for p in lockmod.sorted_pins(lock) if p.has_wheel and p.engine == profile.engine
              and (not pins or p.name in pins)]
    for name in sorted(set(pins or ()) - {p.name for p in chosen}):
        other = lock.get(name)  # an unknown name: UnknownPinError
        if other.engine != profile.engine:
            from audit.errors import UsageError

            raise UsageError(f"{name} is a {other.engine_contract.title} pin, not one of the profile's engine",
                             hint=f"verify it with --engine {other.engine}")
    out = []
    for pin in chosen:
        progress("stage", text=f"verifying the harness against {pin.name}")
        out.append(check_pin(pin.name, profile, lock_path=lock_path, progress=progress))
    return out


__all__ = ["NOT_NEEDED", "PinCheck", "check_pin", "family_systems", "not_needed", "verify_pins"]
