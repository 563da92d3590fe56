"""Install the probes listed in :mod:`probes.targets` and turn calls into evidence records."""
from __future__ import annotations

import enum
import importlib.util
import inspect
import sys
import threading
from contextvars import ContextVar
from dataclasses import dataclass, field

from . import patching
from .recorder import Recorder, current_scope, describe
from .targets import TARGETS, Target, spec_applies, split_spec

_candidate_backend: ContextVar[object] = ContextVar("serving_truth_candidate_backend", default=None)


def _scope() -> str:
    stack = current_scope.get()
    return stack[-1] if stack else ""


def _bind(sig: inspect.Signature | None, args: tuple, kwargs: dict) -> dict:
    if sig is None:
        return {}
    try:
        bound = sig.bind_partial(*args, **kwargs)
    except TypeError:
        return {}
    return dict(bound.arguments)


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _exc(exc: BaseException) -> dict:
    return {"type": f"{type(exc).__module__}:{type(exc).__qualname__}", "message": str(exc)[:2000]}


class _TargetHooks(patching.Hooks):
    def __init__(self, probes: "ProbeSet", target: Target, spec: str, fn):
        self.p = probes
        self.t = target
        self.spec = spec
        self.sig = _signature(fn)

    def failed(self, token, args, kwargs, exc):
        self.p.rec.emit("raise", target=self.t.id, spec=self.spec, scope=_scope(), error=_exc(exc))


class ScopeHooks(_TargetHooks):
    def before(self, args, kwargs):
        prefix = _bind(self.sig, args, kwargs).get("prefix")
        if not isinstance(prefix, str):
            return None
        owner = type(args[0]) if args else None
        self.p.rec.emit("scope", target=self.t.id, prefix=prefix, cls=describe(owner))
        return current_scope.set(current_scope.get() + (prefix,))

    def after(self, token, args, kwargs, result):
        if token is not None:
            current_scope.reset(token)

    def failed(self, token, args, kwargs, exc):
        super().failed(token, args, kwargs, exc)
        if token is not None:
            current_scope.reset(token)


class SelectHooks(_TargetHooks):
    def after(self, token, args, kwargs, result):
        bound = _bind(self.sig, args, kwargs)
        recorded = {k: describe(bound[k]) for k in self.t.args if k in bound}
        self.p.rec.emit("select", target=self.t.id, scope=_scope(), phase=self.t.phase,
                        args=recorded, result=describe(result))


def _interesting_attrs(obj) -> dict:
    """Attributes an object chose at construction: enum members, classes, and strings naming them."""
    out = {}
    try:
        items = vars(obj).items()
    except TypeError:
        return out
    for name, value in items:
        if name.startswith("__"):
            continue
        if isinstance(value, (enum.Enum, type)):
            out[name] = describe(value)
    return dict(sorted(out.items()))


class ConstructHooks(_TargetHooks):
    def after(self, token, args, kwargs, result):
        if not args:
            return
        obj = args[0]
        self.p.rec.emit("construct", target=self.t.id, scope=_scope(), cls=describe(type(obj)),
                        attrs=_interesting_attrs(obj))


class CandidatesHooks(_TargetHooks):
    def before(self, args, kwargs):
        backend = _bind(self.sig, args, kwargs).get("backend")
        return _candidate_backend.set(backend)

    def after(self, token, args, kwargs, result):
        if token is not None:
            _candidate_backend.reset(token)
        backend = _bind(self.sig, args, kwargs).get("backend")
        classes = list(result) if isinstance(result, (list, tuple)) else [result]
        for cls in classes:
            if isinstance(cls, type):
                self.p.watch_support_check(cls, backend)
        self.p.rec.emit("candidates", target=self.t.id, scope=_scope(), backend=describe(backend),
                        classes=[describe(c) for c in classes])

    def failed(self, token, args, kwargs, exc):
        if token is not None:
            _candidate_backend.reset(token)
        super().failed(token, args, kwargs, exc)


class CheckHooks(patching.Hooks):
    """``is_supported_config(cls, ...) -> (supported, reason)`` of an experts class."""

    def __init__(self, probes: "ProbeSet", target_id: str):
        self.p = probes
        self.target_id = target_id

    def after(self, token, args, kwargs, result):
        cls = args[0] if args else None
        supported, reason = (result if isinstance(result, tuple) and len(result) == 2 else (result, None))
        self.p.rec.emit("candidate", target=self.target_id, scope=_scope(), cls=describe(cls),
                        backend=describe(_candidate_backend.get()), supported=bool(supported),
                        reason=describe(reason))

    def failed(self, token, args, kwargs, exc):
        cls = args[0] if args else None
        self.p.rec.emit("candidate", target=self.target_id, scope=_scope(), cls=describe(cls),
                        backend=describe(_candidate_backend.get()), supported=False,
                        reason="raised " + _exc(exc)["type"], error=_exc(exc))


_HOOKS = {"scope": ScopeHooks, "select": SelectHooks, "construct": ConstructHooks,
          "candidates": CandidatesHooks}


@dataclass
class TargetState:
    target: Target
    status: str = "pending"  # pending | patched | drift | not-reached
    spec: str = ""
    attempts: list[str] = field(default_factory=list)


class ProbeSet:
    """All probes of one process: post-import hooks, patches, and their evidence."""

    def __init__(self, recorder: Recorder, targets: tuple[Target, ...] = TARGETS, vllm_version: str = "",
                 rebind_prefixes: tuple[str, ...] = ("vllm",)):
        self.rec = recorder
        self.targets = targets
        self.version = vllm_version
        self.rebind_prefixes = rebind_prefixes
        self.hooks = patching.PostImportHooks()
        self.patches: list[patching.Patch] = []
        self.state: dict[str, TargetState] = {t.id: TargetState(t) for t in targets}
        self._lock = threading.RLock()

    # -- installation --------------------------------------------------------------------------
    def install(self) -> "ProbeSet":
        for t in self.targets:
            for spec in t.specs:
                module, _, vrange = split_spec(spec)
                if not spec_applies(vrange, self.version):
                    continue
                self.hooks.register(module, lambda mod, t=t, spec=spec: self._on_import(t, spec, mod))
        return self

    def _on_import(self, t: Target, spec: str, module) -> None:
        try:
            with self._lock:
                st = self.state[t.id]
                if st.status == "patched":
                    return
                _, qualname, _ = split_spec(spec)
                try:
                    owner, name, raw = patching.resolve(module, qualname)
                except AttributeError as exc:
                    st.attempts.append(f"{spec}: {exc}")
                    return
                fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
                hooks = _HOOKS[t.kind](self, t, spec, fn)
                patch = patching.wrap_attribute(owner, name, raw, hooks, label=t.id, on_error=self._probe_error,
                                                rebind_prefixes=self.rebind_prefixes)
                if patch is not None:
                    self.patches.append(patch)
                st.status, st.spec = "patched", spec.split("@")[0]
        except Exception as exc:  # a probe must never break the import it rides on
            self._probe_error(f"install {t.id}", exc)

    def watch_support_check(self, cls: type, backend) -> None:
        """Wrap ``is_supported_config`` where ``cls`` finds it (its defining class), once."""
        with self._lock:
            for klass in cls.__mro__:
                raw = vars(klass).get("is_supported_config")
                if raw is None:
                    continue
                if not patching.is_wrapped(raw):
                    patch = patching.wrap_attribute(klass, "is_supported_config", raw,
                                                    CheckHooks(self, "moe.candidate"), label="moe.candidate",
                                                    on_error=self._probe_error)
                    if patch is not None:
                        self.patches.append(patch)
                return

    def _probe_error(self, where: str, exc: BaseException) -> None:
        self.rec.emit("probe_error", where=where, error=_exc(exc))

    # -- end of run ------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Record each target's fate: patched, drift (missing in this vLLM) or not reached."""
        for tid, st in self.state.items():
            if st.status == "pending":
                missing_modules = []
                for spec in st.target.specs:
                    module, qualname, vrange = split_spec(spec)
                    if not spec_applies(vrange, self.version):
                        continue
                    if module in sys.modules:
                        continue  # attempt already recorded
                    try:
                        found = importlib.util.find_spec(module) is not None
                    except (ImportError, ValueError):
                        found = False
                    if not found:
                        missing_modules.append(module)
                        st.attempts.append(f"{spec.split('@')[0]}: module {module} does not exist")
                    else:
                        st.attempts.append(f"{spec.split('@')[0]}: module {module} was never imported")
                imported_or_missing = [a for a in st.attempts if "never imported" not in a]
                st.status = "drift" if imported_or_missing else "not-reached"
            self.rec.emit("target", target=tid, kind=st.target.kind, status=st.status, spec=st.spec,
                          required=st.target.required, attempts=st.attempts, title=st.target.title)

    def uninstall(self) -> None:
        for patch in reversed(self.patches):
            patching.unpatch(patch)
        self.patches.clear()
        self.hooks.uninstall()
