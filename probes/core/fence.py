"""The fence around the harness's own code inside vLLM's process.

Everything serving-truth runs inside the serving process (post-import hook callbacks, resolve mode's stand-ins,
the probes' bookkeeping around a wrapped call) runs *fenced*: an exception raised by our code is recorded as a
**harness fault** (which piece, its type and message, the traceback) before anything else sees it. Libraries
swallow exceptions (vLLM's optional-package checks catch everything a trial import raises), so an unfenced raise
in our code could silently become "vLLM chose X"; a recorded fault instead ends the cell INCOMPLETE on the host,
whatever vLLM made of it.

What is not a fault:

* an exception raised by the foreign code a fenced piece calls (vLLM's refusal passing through a stand-in):
  call foreign code through :func:`foreign`, which marks what it raises;
* a stand-in's deliberate refusal to answer: :class:`SimulationLimit` (and :func:`deliberate` for the
  protocol exceptions Python expects, such as ``AttributeError`` from ``__getattr__``).

Every fenced piece is registered by name (:data:`REGISTRY`), its calls are counted, and
:func:`plant` (the plan's ``plant_fault``, or ``SERVING_TRUTH_PLANT_FAULT=<piece>``) makes that piece raise :class:`PlantedFault` from inside the fence: the
mutation test iterates the registry and plants one raise at a time. Standard library only.
"""
from __future__ import annotations

import functools
import os
import traceback

#: names one piece in whose body a planted raise goes off (tests of the fence itself)
PLANT_ENV = "SERVING_TRUTH_PLANT_FAULT"
#: marks an exception that may pass a fence without being a fault
_PASSES = "__serving_truth_passes__"

#: every fenced piece of this process: name -> what it is ("hook", "stand-in", "probe")
REGISTRY: dict[str, str] = {}
#: how often each piece ran in this process (and its parents before the fork)
CALLS: dict[str, int] = {}
#: the harness faults of this process, and of its parents before the fork
FAULTS: list[dict] = []


class SimulationLimit(RuntimeError):
    """A stand-in declines to answer: what it was asked is not simulated (not a harness fault)."""


class NoDeviceCode(RuntimeError):
    """A library vLLM selected carries no code for the simulated GPU's SM: on the device, loading fails where this is
    raised. Raised by a stand-in that read the library's shipped code (audit: a load failure, never a limit). The
    message names the library, the SMs it has code for, and the SM asked for."""


class PlantedFault(RuntimeError):
    """Raised by a fence where :data:`PLANT_ENV` names its piece."""


def deliberate(exc: BaseException) -> BaseException:
    """Mark an exception a fenced piece raises on purpose as part of a protocol (e.g. ``AttributeError`` from
    ``__getattr__``); it passes the fence unrecorded. Returns it, for ``raise deliberate(...)``."""
    try:
        setattr(exc, _PASSES, True)
    except Exception:  # an exception type without a __dict__: it will be recorded, never lost
        pass
    return exc


def passes(exc: BaseException) -> bool:
    return isinstance(exc, (SimulationLimit, NoDeviceCode)) or bool(getattr(exc, _PASSES, False))


def foreign(fn, *args, **kwargs):
    """Call foreign code (vLLM, a library) from inside a fenced piece: what it raises is theirs, not a fault."""
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:
        deliberate(exc)
        raise


def register(piece: str, what: str) -> None:
    REGISTRY.setdefault(piece, what)


def _tb(exc: BaseException) -> list[str]:
    return traceback.format_exception(type(exc), exc, exc.__traceback__)[-12:]


#: marks an exception already recorded as a fault (one exception crossing several boundaries is one fault)
_RECORDED = "__serving_truth_fault__"
#: the probes package: a frame in a file under it is the harness's own code
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def raised_by_us(exc: BaseException) -> bool:
    """Whether the innermost frame of *exc*'s traceback is the harness's own code (the probes package)."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and os.path.abspath(last.tb_frame.f_code.co_filename).startswith(_OURS)


def check_origin(piece: str, exc: BaseException) -> bool:
    """At a boundary where the harness turns an exception into evidence (a stage that stopped, a post-load step's
    outcome, a per-call tier "not resolved"): an exception the harness's own code raised (not a limit, not a
    deliberate protocol raise) is recorded as a fault of *piece*. True when it was one."""
    if isinstance(exc, GeneratorExit) or passes(exc) or not raised_by_us(exc):
        return bool(getattr(exc, _RECORDED, False))
    fault(piece, exc)
    return True


def fault(piece: str, exc: BaseException, *, where: str = "") -> None:
    """Record a harness fault of *piece* (never raises); an exception already recorded is not recorded again."""
    if getattr(exc, _RECORDED, False):
        return
    try:
        setattr(exc, _RECORDED, True)
    except Exception:
        pass
    try:
        kind, message = f"{type(exc).__module__}:{type(exc).__qualname__}", str(exc)[:2000]
        for seen in FAULTS:  # the same fault again (a piece on a path run per layer): counted, not repeated
            if (seen["piece"], seen["type"], seen["message"]) == (piece, kind, message):
                seen["count"] = seen.get("count", 1) + 1
                return
        FAULTS.append({"piece": piece, "where": where, "type": kind, "message": message, "traceback": _tb(exc),
                       "pid": os.getpid(), "count": 1})
    except Exception:  # pragma: no cover - the record itself failed: keep a bare one
        FAULTS.append({"piece": piece, "where": where, "type": "?", "message": "unrecordable", "traceback": [],
                       "pid": os.getpid()})


#: a planted line of this prefix names a piece that returns a wrong value instead of raising (tests of contracts)
WRONG_VALUE = "wrong value: "


def _pieces(text: str) -> frozenset:
    return frozenset(p for p in (text or "").split("\n") if p and not p.startswith(WRONG_VALUE))


def _wrong(text: str) -> frozenset:
    return frozenset(p[len(WRONG_VALUE):] for p in (text or "").split("\n") if p.startswith(WRONG_VALUE))


class WrongValue:
    """What a piece planted with :data:`WRONG_VALUE` returns: a value no function it replaces returns."""

    def __repr__(self) -> str:
        return "<planted wrong value>"


#: the pieces a planted raise goes off in (set once, before the probes install: the fence is on hot paths)
_PLANTED = [_pieces(os.environ.get(PLANT_ENV, ""))]
#: the pieces that return a planted wrong value
_WRONG = [_wrong(os.environ.get(PLANT_ENV, ""))]
#: survey: a planted raise is caught by the piece's own fence and recorded, then the piece does its work
_SURVEY = [False]


def plant(pieces: str, *, survey: bool = False) -> None:
    """Make each piece named (one a line) raise :class:`PlantedFault` from inside its fence (the agent, from its
    plan), or, for a line ``wrong value: <piece>``, return a :class:`WrongValue` (its contract must catch it). The raise propagates as the piece's own would (into vLLM, which may swallow it); with *survey* the
    piece's fence catches it, records it and lets the piece go on, so one run reaches, and tests, every piece
    named (a propagating raise stops whatever runs after it)."""
    _PLANTED[0] = _pieces(pieces)
    _WRONG[0] = _wrong(pieces)
    _SURVEY[0] = bool(survey)


def planted() -> frozenset:
    return _PLANTED[0] | frozenset(WRONG_VALUE + p for p in _WRONG[0])


def _enter(piece: str) -> None:
    CALLS[piece] = CALLS.get(piece, 0) + 1
    if piece in _PLANTED[0]:
        try:
            raise PlantedFault(f"planted in {piece}")
        except PlantedFault as exc:
            if not _SURVEY[0]:
                raise
            fault(piece, exc)


class ContractBroken(RuntimeError):
    """A stand-in returned what the function it replaces never returns (a wrong type, an impossible value)."""


def returns(*types_, check=None, what: str = ""):
    """A stand-in's contract: what the replaced function returns (one of *types_*, ``bool`` never passing for
    ``int``), and *check* on the value where one is given. Returns a function value -> "" or what is wrong."""
    def contract(value) -> str:
        if isinstance(value, bool) and bool not in types_:
            return f"returned {value!r}, a bool, where {what or 'the function it replaces'} returns " + \
                   " or ".join(t.__name__ for t in types_)
        if types_ and not isinstance(value, types_):
            return (f"returned {type(value).__name__} {value!r:.80}, where {what or 'the function it replaces'} "
                    f"returns " + " or ".join(t.__name__ for t in types_))
        if check is not None and not check(value):
            return f"returned {value!r:.80}, which {what or 'the function it replaces'} never returns"
        return ""

    return contract


def guard(piece: str, what: str = "stand-in", *, swallow: bool = False, contract=None):
    """Decorator: run the function as fenced piece *piece*. A fault (any exception but a deliberate one, a
    ``SystemExit`` or ``KeyboardInterrupt`` included) is recorded, then re-raised (the caller gets no made-up
    value) or, with ``swallow``, dropped (a post-import hook: the import it rides on goes on as if the
    hook were absent; the cell is INCOMPLETE anyway). With a *contract* (:func:`returns`), a value the replaced
    function never returns is a fault too (:class:`ContractBroken`): vLLM would raise a line later in its own frame,
    or worse, decide on it."""
    register(piece, what)

    def wrap(fn):
        @functools.wraps(fn)
        def fenced(*args, **kwargs):
            try:
                _enter(piece)
                result = fn(*args, **kwargs)
                if piece in _WRONG[0]:
                    result = WrongValue()
                broken = contract(result) if contract is not None else ""
                if broken:
                    raise ContractBroken(f"{piece} {broken}")
                return result
            except BaseException as exc:
                # a SystemExit or KeyboardInterrupt our code raises is a fault like any other (the agent is ended
                # by SIGKILL, never by a signal turned into an exception, so none of these is the user's)
                if passes(exc) or isinstance(exc, GeneratorExit):
                    raise
                fault(piece, exc)
                if swallow:
                    return None
                raise

        return fenced

    return wrap


def enter(piece: str, what: str = "probe") -> None:
    """For code that fences itself (the probes' wrapper bookkeeping, which records its own errors): register,
    count, and raise a planted fault where asked."""
    register(piece, what)
    _enter(piece)


#: how each stand-in's target fitted the modules this process imported: piece -> "fits <package version> ..." or
#: "does not fit <package version>: <what is missing> (not applied)"
FIT: dict[str, str] = {}


def installed_version(mod) -> str:
    """``<distribution> <version>`` of the package a module belongs to (its top-level name when none is known)."""
    import importlib.metadata

    top = mod.__name__.split(".")[0]
    try:
        dists = importlib.metadata.packages_distributions().get(top, [])
        return f"{dists[0]} {importlib.metadata.version(dists[0])}" if dists else top
    except Exception:
        return top


def fits(piece: str, mod, *attrs: str) -> bool:
    """Whether *mod* has each dotted attribute a stand-in replaces or reads (its declared shape); records the
    answer in :data:`FIT` either way, so a target a release lacks is a named misfit, never a silent skip."""
    missing = []
    for path in attrs:
        obj = mod
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is None:
            missing.append(path)
    version = installed_version(mod)
    if missing:
        FIT[piece] = (f"does not fit {version}: {mod.__name__} has no {', '.join(missing)} (not applied)")
        return False
    FIT.setdefault(piece, f"fits {version}")
    return True


def summary() -> dict:
    """What the evidence says of the fence in this process."""
    return {"on": True, "pieces": dict(sorted(REGISTRY.items())), "calls": dict(sorted(CALLS.items())),
            "planted": sorted(planted()), "survey": _SURVEY[0]}


__all__ = ["CALLS", "FAULTS", "PLANT_ENV", "REGISTRY", "ContractBroken", "NoDeviceCode", "PlantedFault", "SimulationLimit", "returns",
           "check_origin", "deliberate",
           "enter", "fault", "foreign", "guard", "passes", "plant", "planted", "raised_by_us", "register", "summary"]
