"""Install the probes listed in :mod:`probes.core.targets` and turn calls into evidence records."""
from __future__ import annotations

import enum
import importlib.util
import inspect
import sys
import threading
from dataclasses import dataclass, field

from probes.core import fence, patching
from probes.core.recorder import Recorder, current_scope, describe
from probes.core.targets import TARGETS, Target, spec_applies, split_spec


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
        bound = _bind(self.sig, args, kwargs)
        prefix = next((bound[a] for a in (self.t.args or ("prefix",)) if isinstance(bound.get(a), str)), None)
        if prefix is None:
            return None
        owner = type(args[0]) if args else None
        self.p.rec.emit("scope", target=self.t.id, prefix=prefix, cls=describe(owner))
        return current_scope.set(current_scope.get() + (prefix,))

    def after(self, token, args, kwargs, result):
        if token is not None:
            if self.t.construct and args:
                self.p.rec.emit("construct", target=self.t.id, scope=_scope(), cls=describe(type(args[0])),
                                attrs=_interesting_attrs(args[0]))
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
    """What an object chose at construction: enum members, classes, the classes of its strategy
    objects, and flags/strings whose names say they are a choice (``use_*``, ``*backend*``)."""
    out = {}
    try:
        items = list(vars(obj).items())
    except TypeError:
        return out
    for name, value in items:
        if name.startswith("__") or name == "training":
            continue
        key = name.lstrip("_")
        if isinstance(value, (enum.Enum, type)):
            out[name] = describe(value)
        elif isinstance(value, bool):
            if key.startswith(("use_", "enable_", "is_")) or "backend" in key or "fused" in key:
                out[name] = value
        elif isinstance(value, str):
            if "backend" in key or key.endswith(("_impl", "_kind", "_mode")):
                out[name] = value
        elif name in ("quant_method", "impl", "prefill_backend", "runner", "experts", "moe_kernel",
                      "fused_experts", "routed_experts", "router", "act_fn"):
            if value is not None:
                out[name] = describe(type(value))
    return dict(sorted(out.items()))


class ConstructHooks(_TargetHooks):
    def after(self, token, args, kwargs, result):
        if not args:
            return
        obj = args[0]
        self.p.rec.emit("construct", target=self.t.id, scope=_scope(), cls=describe(type(obj)),
                        attrs=_interesting_attrs(obj))


class CandidatesHooks(_TargetHooks):
    """``backend_to_kernel_cls(backend) -> [experts classes]``: the oracle is about to try these."""

    def after(self, token, args, kwargs, result):
        backend = _bind(self.sig, args, kwargs).get("backend")
        classes = list(result) if isinstance(result, (list, tuple)) else [result]
        # the oracle asks each class right after this call returns: remember what is being tried
        self.p.current_backend = backend
        for cls in classes:
            if isinstance(cls, type):
                self.p.watch_support_check(cls)
        self.p.rec.emit("candidates", target=self.t.id, scope=_scope(), backend=describe(backend),
                        classes=[describe(c) for c in classes])


class CheckHooks(patching.Hooks):
    """``is_supported_config(cls, ...) -> (supported, reason)`` of an experts class.

    Overrides call the base implementation; only the outermost call is the oracle's question.
    """

    def __init__(self, probes: "ProbeSet", target_id: str):
        self.p = probes
        self.target_id = target_id
        self._depth = probes.check_depth  # shared by every wrapped class: overrides call the base

    def before(self, args, kwargs):
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        if not depth:
            self._depth.cls = args[0] if args else None
        return depth

    def after(self, token, args, kwargs, result):
        self._depth.n = token or 0
        if token:
            return
        cls = args[0] if args else None
        supported, reason = (result if isinstance(result, tuple) and len(result) == 2 else (result, None))
        self.p.rec.emit("candidate", target=self.target_id, scope=_scope(), cls=describe(cls),
                        backend=describe(self.p.current_backend), supported=bool(supported),
                        reason=describe(reason))

    def failed(self, token, args, kwargs, exc):
        self._depth.n = token or 0
        if token:
            return
        cls = args[0] if args else None
        self.p.rec.emit("candidate", target=self.target_id, scope=_scope(), cls=describe(cls),
                        backend=describe(self.p.current_backend), supported=False,
                        reason="raised " + _exc(exc)["type"], error=_exc(exc))


class ActivationCheckHooks(patching.Hooks):
    """``_supports_activation(activation) -> bool`` of an experts class: whether vLLM asked the class
    about the layer's activation (SiTU for K3), and its answer. Only the outermost call is recorded
    (a fallback class asks both of its members)."""

    def __init__(self, probes: "ProbeSet", target_id: str, owner: type):
        self.p = probes
        self.target_id = target_id
        self.owner = describe(owner)
        self._depth = probes.activation_depth

    def before(self, args, kwargs):
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        return depth

    def after(self, token, args, kwargs, result):
        self._depth.n = token or 0
        if token:
            return
        # a staticmethod gets (activation,), a classmethod (cls, activation); the class asked is the
        # one whose is_supported_config is running, if any (a subclass inherits the staticmethod)
        asked = getattr(self.p.check_depth, "cls", None) if getattr(self.p.check_depth, "n", 0) else None
        if asked is None and args and isinstance(args[0], type):
            asked = args[0]
        activation = args[-1] if args else kwargs.get("activation")
        self.p.rec.emit("activation_check", target=self.target_id, scope=_scope(), cls=describe(asked),
                        owner=self.owner, activation=describe(activation), result=describe(result))

    def failed(self, token, args, kwargs, exc):
        self._depth.n = token or 0


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
        #: the MoE backend whose experts classes the oracle is asking right now
        self.current_backend = None
        self.check_depth = threading.local()
        self.activation_depth = threading.local()
        self._lock = threading.RLock()

    # -- installation --------------------------------------------------------------------------
    def install(self) -> "ProbeSet":
        for t in self.targets:
            for spec in t.specs:
                module, _, vrange = split_spec(spec)
                if not spec_applies(vrange, self.version):
                    continue
                self.hooks.register(module, lambda mod, t=t, spec=spec: self._on_import(t, spec, mod),
                                    piece=f"probe install {t.id} ({spec.split('@')[0]})")
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

    def watch_support_check(self, cls: type) -> None:
        """Wrap ``is_supported_config`` and ``_supports_activation`` where ``cls`` finds them (their
        defining classes), once each."""
        with self._lock:
            for attr, hooks in (("is_supported_config", lambda: CheckHooks(self, "moe.candidate")),
                                ("_supports_activation", None)):
                for klass in cls.__mro__:
                    raw = vars(klass).get(attr)
                    if raw is None:
                        continue
                    if not patching.is_wrapped(raw):
                        h = hooks() if hooks else ActivationCheckHooks(self, "moe.activation_check", klass)
                        patch = patching.wrap_attribute(klass, attr, raw, h, label=h.target_id,
                                                        on_error=self._probe_error)
                        if patch is not None:
                            self.patches.append(patch)
                    break

    def _probe_error(self, where: str, exc: BaseException) -> None:
        """A probe's own code raised (installing a target, or its bookkeeping around a call): recorded as a probe
        error and, since the probe then saw less than vLLM did, as a harness fault of the cell."""
        self.rec.emit("probe_error", where=where, error=_exc(exc))
        fence.fault(f"probe {where}", exc)

    # -- end of run ------------------------------------------------------------------------------
    def finalize(self) -> None:
        """Record each target's fate: patched, drift (missing in this vLLM) or not reached."""
        for tid, st in self.state.items():
            applicable = [spec for spec in st.target.specs if spec_applies(split_spec(spec)[2], self.version)]
            if st.status == "pending" and not applicable:
                st.status = "not-applicable"  # every spec is for other vLLM releases
                st.attempts.append(f"no spec for vLLM {self.version}: " + "; ".join(st.target.specs))
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
            self.rec.emit("target", target=tid, target_kind=st.target.kind, status=st.status, spec=st.spec,
                          required=st.target.required, attempts=st.attempts, title=st.target.title)
        self.rec.emit("contract", checks=self.check_contract())

    def check_contract(self) -> list[dict]:
        """Re-verify, on the live objects, what every wrapper promises: same signature, metadata and
        descriptor kind as the original, installed on the class that defines the attribute."""
        out = []
        for patch in self.patches:
            orig = patch.original.__func__ if isinstance(patch.original, (classmethod, staticmethod)) else patch.original
            repl = patch.replacement
            wrapper = repl.__func__ if isinstance(repl, (classmethod, staticmethod)) else repl
            problems = []
            if type(repl) is not type(patch.original) and isinstance(patch.original, (classmethod, staticmethod)):
                problems.append("descriptor kind changed")
            if getattr(wrapper, "__wrapped__", None) is not orig:
                problems.append("__wrapped__ is not the original")
            for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
                if getattr(wrapper, attr, None) != getattr(orig, attr, None):
                    problems.append(f"{attr} differs")
            try:
                if inspect.signature(wrapper) != inspect.signature(orig):
                    problems.append("signature differs")
            except (TypeError, ValueError):
                pass
            if vars(patch.owner).get(patch.name) is not repl:
                problems.append("no longer installed")
            if isinstance(patch.owner, type):
                where = f"{patch.owner.__module__}:{patch.owner.__qualname__}.{patch.name}"
            else:
                where = f"{patch.owner.__name__}:{patch.name}"
            out.append({"target": where, "ok": not problems, "problems": problems})
        return sorted(out, key=lambda c: c["target"])

    def uninstall(self) -> None:
        for patch in reversed(self.patches):
            patching.unpatch(patch)
        self.patches.clear()
        self.hooks.uninstall()
