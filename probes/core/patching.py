"""Transparent wrapping of third-party callables, and post-import hooks to apply it.

The contract every wrapper keeps (tested in tests/test_patching.py and on real vLLM functions):

* the original is called with the very same arguments; its return value (the same object) is
  returned and its exception (the same object) propagates unchanged;
* ``functools.wraps`` metadata and ``__wrapped__`` are set, so ``inspect.signature`` is unchanged;
* classmethod/staticmethod descriptors stay descriptors of the same kind, on the class that defines
  the attribute (never a subclass substitute), so identity and ``issubclass`` checks are unaffected;
* ``functools.cache`` helpers (``cache_clear``, ``cache_info``) keep working through the wrapper;
* a hook that fails is recorded through ``on_probe_error`` and never raised into the caller;
* wrapping twice is a no-op, and every patch can be undone.
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any, Callable

SENTINEL = "__serving_truth_probe__"
_CACHE_ATTRS = ("cache_clear", "cache_info", "cache_parameters")


class Hooks:
    """What a wrapper calls around the original. Subclass and override what you need.

    ``before`` returns a token handed to ``after``/``failed`` (e.g. a scope to pop).
    """

    def before(self, args: tuple, kwargs: dict) -> Any:  # pragma: no cover - trivial default
        return None

    def after(self, token: Any, args: tuple, kwargs: dict, result: Any) -> None:
        pass

    def failed(self, token: Any, args: tuple, kwargs: dict, exc: BaseException) -> None:
        pass


def _report(on_error: Callable[[str, BaseException], None] | None, where: str, exc: BaseException) -> None:
    if on_error is None:
        return
    try:
        on_error(where, exc)
    except Exception:  # pragma: no cover - the error sink itself failed; stay silent
        pass


def make_wrapper(fn: Callable, hooks: Hooks, *, label: str,
                 on_error: Callable[[str, BaseException], None] | None = None) -> Callable:
    """Wrap a plain function so ``hooks`` observe each call; the call itself is untouched. The hooks are the
    fenced piece ``probe <label>`` (a planted fault goes off in their place; see :mod:`probes.core.fence`)."""
    from probes.core import fence

    piece = f"probe {label}"
    fence.register(piece, "probe")
    planted = piece in fence.planted()  # read once: nothing but the hooks on the hot path

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            if planted:
                fence.enter(piece)
            token = hooks.before(args, kwargs)
        except Exception as exc:
            _report(on_error, label + ":before", exc)
            token = None
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            try:
                hooks.failed(token, args, kwargs, exc)
            except Exception as hook_exc:
                _report(on_error, label + ":failed", hook_exc)
            raise
        try:
            hooks.after(token, args, kwargs, result)
        except Exception as exc:
            _report(on_error, label + ":after", exc)
        return result

    for attr in _CACHE_ATTRS:
        if hasattr(fn, attr) and not hasattr(wrapper, attr):
            setattr(wrapper, attr, getattr(fn, attr))
    setattr(wrapper, SENTINEL, label)
    return wrapper


@dataclass
class Patch:
    owner: Any
    name: str
    original: Any  # the raw attribute as stored in owner.__dict__
    replacement: Any
    rebound: list[tuple[types.ModuleType, str]] = field(default_factory=list)


def resolve(module: types.ModuleType, qualname: str) -> tuple[Any, str, Any]:
    """Find ``qualname`` inside an imported module: (defining owner, attribute name, raw attribute).

    For class attributes the owner is the class in the MRO whose ``__dict__`` defines the name, so a
    method inherited from a base is patched where it is defined. Raises AttributeError when missing.
    """
    parts = qualname.split(".")
    obj: Any = module
    for part in parts[:-1]:
        obj = getattr(obj, part)
    name = parts[-1]
    if isinstance(obj, type):
        for klass in obj.__mro__:
            if name in vars(klass):
                return klass, name, vars(klass)[name]
        raise AttributeError(f"{obj.__qualname__} has no attribute {name!r}")
    if isinstance(obj, types.ModuleType):
        if name not in vars(obj):
            raise AttributeError(f"module {obj.__name__!r} has no attribute {name!r}")
        return obj, name, vars(obj)[name]
    raise AttributeError(f"{qualname}: {type(obj).__name__} is neither a module nor a class")


def _inner(raw: Any) -> Callable:
    if isinstance(raw, (classmethod, staticmethod)):
        return raw.__func__
    return raw


def is_wrapped(raw: Any) -> bool:
    return hasattr(_inner(raw), SENTINEL)


def wrap_attribute(owner: Any, name: str, raw: Any, hooks: Hooks, *, label: str,
                   on_error: Callable[[str, BaseException], None] | None = None,
                   rebind_prefixes: tuple[str, ...] = ()) -> Patch | None:
    """Replace ``owner.name`` (raw descriptor ``raw``) by a transparent wrapper.

    Returns None when it is already wrapped. With ``rebind_prefixes``, module-level bindings made by
    ``from x import f`` in already-imported modules under those prefixes are pointed at the wrapper too.
    """
    if is_wrapped(raw):
        return None
    fn = _inner(raw)
    if not callable(fn):
        raise TypeError(f"{label}: {type(raw).__name__} is not callable")
    wrapper = make_wrapper(fn, hooks, label=label, on_error=on_error)
    if isinstance(raw, classmethod):
        replacement: Any = classmethod(wrapper)
    elif isinstance(raw, staticmethod):
        replacement = staticmethod(wrapper)
    else:
        replacement = wrapper
    setattr(owner, name, replacement)
    patch = Patch(owner, name, raw, replacement)
    if rebind_prefixes and isinstance(owner, types.ModuleType):
        patch.rebound = rebind(fn, wrapper, rebind_prefixes, skip=owner)
    return patch


def rebind(original: Any, wrapper: Any, prefixes: tuple[str, ...], *, skip: Any = None) -> list:
    """Point ``from x import f`` copies of ``original`` in loaded modules at ``wrapper``."""
    done = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod is skip or not mod_name.startswith(prefixes):
            continue
        try:
            namespace = vars(mod)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            if value is original:
                setattr(mod, attr, wrapper)
                done.append((mod, attr))
    return done


def unpatch(patch: Patch) -> None:
    if vars(patch.owner).get(patch.name) is patch.replacement:
        setattr(patch.owner, patch.name, patch.original)
    wrapper = _inner(patch.replacement)
    for mod, attr in patch.rebound:
        if vars(mod).get(attr) is wrapper:
            setattr(mod, attr, _inner(patch.original))


# --------------------------------------------------------------------------------------------
# Post-import hooks: run callbacks the moment a module finishes executing, before any consumer
# can copy a name out of it with ``from x import f``.

class _HookedLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, callback: Callable[[types.ModuleType], None]):
        self._inner = inner
        self._callback = callback

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        # the module must look as if the original loader had loaded it
        module.__loader__ = self._inner
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._inner
        self._inner.exec_module(module)
        self._callback(module)

    def __getattr__(self, item):
        return getattr(self._inner, item)


class PostImportHooks(importlib.abc.MetaPathFinder):
    """A meta-path finder that calls ``callback(module)`` after a watched module is executed."""

    def __init__(self):
        self._callbacks: dict[str, list[Callable[[types.ModuleType], None]]] = {}
        self._local = threading.local()
        self._installed = False

    def register(self, module_name: str, callback: Callable[[types.ModuleType], None], piece: str = "") -> None:
        """Call ``callback`` now if the module is already imported, else right after its import. The callback
        runs fenced (:mod:`probes.core.fence`) as the piece *piece* (by default ``hook <module>: <callback>``):
        what it raises is recorded as a harness fault and never reaches the import it rides on."""
        from probes.core import fence

        piece = piece or f"hook {module_name}: {getattr(callback, '__qualname__', type(callback).__name__)}"
        callback = fence.guard(piece, "hook", swallow=True)(callback)
        mod = sys.modules.get(module_name)
        if mod is not None and getattr(getattr(mod, "__spec__", None), "_initializing", False) is False:
            callback(mod)
            return
        self._callbacks.setdefault(module_name, []).append(callback)
        if not self._installed:
            sys.meta_path.insert(0, self)
            self._installed = True

    def pending(self) -> list[str]:
        return sorted(self._callbacks)

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        self._installed = False
        self._callbacks.clear()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._callbacks:
            return None
        busy = getattr(self._local, "busy", None)
        if busy is None:
            busy = self._local.busy = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec

        def run(module):
            # taken when the module executes, not when it is found: importlib.util.find_spec() alone (a
            # "is this package installed" check) must not use up the hooks of a later real import
            for cb in self._callbacks.pop(fullname, []):
                cb(module)

        spec.loader = _HookedLoader(spec.loader, run)
        return spec
