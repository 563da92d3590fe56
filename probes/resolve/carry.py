"""Post-load's fast path: run vLLM's step once per kind of layer and carry what it did to identical layers.

vLLM's MoE weight conversion is the same function of the same inputs for every MoE layer of a model
(same module class, quant method, parameter shapes and dtypes, config), and on the meta device its
result is nothing but shapes, dtypes and the objects it builds. Running it 92 times (896 experts each,
one expert at a time for Marlin) costs a minute per cell and tells nothing the first run did not.

Per *group* of steps (the same step function on modules whose names differ only in the layer index):

1. **The representative** (the group's first layer) runs vLLM's step for real. Before it runs, the state of
   its decoder layer (every object reachable from the layer that the layer owns: modules, parameters, quant
   methods, configs) is described structurally; objects the next layer of the group shares with it (a
   config every layer holds, the platform, a class) are *shared* and named, not descended into. Before the
   step runs, :func:`gc.freeze` moves every live object out of the collector's generations, so the objects
   the step creates are the ones found there afterwards. Afterwards its *delta* is read: which
   slots of the layer's own objects changed (attributes, dict and list items, tensor metadata), and to what.
2. **An identical layer** (its state describes exactly as the representative's did, with its own layer
   index in names) gets the delta *carried*: each changed slot is set to a copy of the representative's new
   value, where objects the step created are rebuilt (meta tensors with the same shape, stride, offset,
   dtype and storage sharing; other objects from their own state), references to the representative's own
   objects become the layer's own, and shared objects stay shared. The layer's new state must then describe
   exactly as the representative's did after its step, or the carry is undone and the step runs for real.
3. **The check**: the group's last layer always runs the step for real, and its outcome and new state must
   equal the representative's. If they do not, every carried layer is restored and runs for real.

A layer whose state differs, a step that changed an object it shares with other layers, and anything the
copier cannot rebuild run the step for real; each case is recorded with the reason. With ``every_layer``
(``plan["postload_every_layer"]``, ``serving-truth audit --postload-every-layer``) every step runs for real;
tests require both paths to give the same routing. Imported only inside the pinned environment.
"""
from __future__ import annotations

import copyreg
import enum
import functools
import gc
import re
import types

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?=\.|$)")
#: values described by value; never per layer
_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_NAMED = (enum.Enum, type, types.BuiltinFunctionType, types.ModuleType, types.CodeType)
#: a description touching more objects than this is not compared (the layer reaches something global)
NODE_BUDGET = 50000
#: a key the step removed (in a delta), or that was absent (in an undo record)
MISSING = object()


class Differs(Exception):
    """Two states are not the same: ``where`` is the path of the first difference."""

    def __init__(self, where: str, why: str):
        super().__init__(f"{where}: {why}")
        self.where, self.why = where, why


class CarryError(Exception):
    """The delta could not be carried (an object the copier cannot rebuild)."""


def layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name or "")
    return int(m.group(1)) if m else None


def group_key(name: str) -> str:
    """A module's name with its layer index taken out (``...layers.7.mlp`` -> ``...layers.#.mlp``)."""
    m = _LAYER_RE.search(name or "")
    return name if m is None else name[:m.start(1)] + "#" + name[m.end(1):]


def layer_root(name: str) -> str | None:
    """The decoder layer a module belongs to (``...layers.7.mlp.experts`` -> ``...layers.7``)."""
    m = _LAYER_RE.search(name or "")
    return None if m is None else name[:m.end(1)]


def _layer_pattern(layer: int) -> re.Pattern:
    return re.compile(rf"((?:^|[^\w])(?:\w+\.)*layers\.){layer}(?=\.|\b)")


def _norm(text: str, layer: int | None) -> str:
    """``text`` with this layer's index in module names replaced by ``#``."""
    if layer is None or f"layers.{layer}" not in text:
        return text
    return _layer_pattern(layer).sub(r"\g<1>#", text)


def renumber(value, src: int | None, dst: int | None):
    """A recorded value of layer ``src`` (an outcome, a message naming its modules) as layer ``dst``'s."""
    if src is None or dst is None or src == dst:
        return value
    if isinstance(value, str):
        return _layer_pattern(src).sub(rf"\g<1>{dst}", value) if f"layers.{src}" in value else value
    if isinstance(value, list):
        return [renumber(v, src, dst) for v in value]
    if isinstance(value, dict):
        return {k: renumber(v, src, dst) for k, v in value.items()}
    return value


def _state(x) -> dict | None:
    """An object's attributes (``__dict__`` and ``__slots__``), or None for an opaque (C) object."""
    has_dict = hasattr(x, "__dict__")
    out = dict(vars(x)) if has_dict else {}
    slots = [s for c in type(x).__mro__ for s in getattr(c, "__slots__", ()) if s not in ("__dict__", "__weakref__")]
    for s in slots:
        if hasattr(x, s):
            out[s] = getattr(x, s)
    return out if has_dict or slots else None


# -- describing a layer's state ------------------------------------------------------------------------------

class Walk:
    """A structural description of what ``root`` owns.

    ``desc`` is a nested tuple two layers share exactly when their states are the same up to the layer
    index; ``objs`` lists the layer's own objects in visit order, so two equal walks pair them index by
    index. Identities in ``shared`` (what the layers have in common) are named, not descended into; another
    module of the model reached through an attribute is named by its path."""

    def __init__(self, root, root_name: str, *, layer: int | None, shared: set[int], module_names: dict[int, str]):
        import torch

        self._torch = torch
        self.layer, self.shared, self.module_names = layer, shared, module_names
        self.root_name = root_name
        owner = layer_root(root_name) or root_name  # modules of the same decoder layer are the layer's own
        self.prefix = owner + "."
        self.owner = owner
        self.objs: list = []
        self.shared_objs: list = []  # shared objects met (a step must not change them for its delta to carry)
        self._shared_seen: set[int] = set()
        self._seen: dict[int, int] = {}
        self._storages: dict[int, int] = {}
        self.nodes = 0
        self.desc = self._d(root)

    def _own(self, name: str) -> bool:
        return name == self.owner or name.startswith(self.prefix)

    def _d(self, x):
        self.nodes += 1
        if self.nodes > NODE_BUDGET:
            raise Differs("<walk>", f"the layer reaches more than {NODE_BUDGET} objects")
        if isinstance(x, _ATOMS):
            return _norm(x, self.layer) if isinstance(x, str) else (type(x).__name__, x)
        if isinstance(x, _NAMED):
            return ("V", id(x))
        torch = self._torch
        if isinstance(x, (torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format)):
            return ("V", str(x))
        if id(x) in self.shared:
            if id(x) not in self._shared_seen:
                self._shared_seen.add(id(x))
                self.shared_objs.append(x)
            return ("S", id(x))
        if id(x) in self._seen:
            return ("R", self._seen[id(x)])
        if isinstance(x, torch.nn.Module) and id(x) in self.module_names and not self._own(self.module_names[id(x)]):
            return ("M", _norm(self.module_names[id(x)], self.layer))
        self._seen[id(x)] = len(self.objs)
        self.objs.append(x)
        if isinstance(x, torch.Tensor):
            skey = self._storages.setdefault(x.untyped_storage()._cdata if x.is_meta else id(x), len(self._storages))
            return ("T", type(x).__qualname__, tuple(x.shape), tuple(x.stride()), x.storage_offset(), str(x.dtype),
                    x.device.type, bool(x.requires_grad), skey, self._d(dict(vars(x))))
        if isinstance(x, types.MethodType):
            return ("B", self._d(x.__func__), self._d(x.__self__))
        if isinstance(x, types.FunctionType):
            cells = tuple(self._d(_cell(c)) for c in (x.__closure__ or ()))
            return ("F", id(x.__code__), cells, self._d(x.__defaults__), self._d(x.__kwdefaults__))
        if isinstance(x, functools.partial):
            return ("P", self._d(x.func), self._d(x.args), self._d(x.keywords))
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(self._d(v) for v in x))
        if isinstance(x, dict):
            return ("dict", type(x).__qualname__, tuple((self._d(k), self._d(v)) for k, v in x.items()))
        if isinstance(x, (set, frozenset)):
            return ("set", tuple(sorted(repr(self._d(v)) for v in x)))
        state = _state(x)
        if state is None:
            raise Differs(f"{type(x).__module__}:{type(x).__qualname__}", "an opaque object of the layer's own")
        return ("O", f"{type(x).__module__}:{type(x).__qualname__}", self._d(state))


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:
        return MISSING


def shared_between(a, b) -> set[int]:
    """Identities reachable from both roots at the same place: what two layers share."""
    import torch

    shared: set[int] = set()
    seen: set[tuple[int, int]] = set()
    stack = [(a, b)]
    budget = 4 * NODE_BUDGET
    while stack and budget > 0:
        x, y = stack.pop()
        budget -= 1
        if x is y:
            if not isinstance(x, _ATOMS):
                shared.add(id(x))
            continue
        if type(x) is not type(y) or isinstance(x, _ATOMS) or (id(x), id(y)) in seen:
            continue
        seen.add((id(x), id(y)))
        if isinstance(x, torch.Tensor):
            stack.append((dict(vars(x)), dict(vars(y))))
        elif isinstance(x, types.MethodType):
            stack.extend(((x.__func__, y.__func__), (x.__self__, y.__self__)))
        elif isinstance(x, functools.partial):
            stack.extend(((x.func, y.func), (x.args, y.args), (x.keywords, y.keywords)))
        elif isinstance(x, (list, tuple)):
            stack.extend(zip(x, y))
        elif isinstance(x, dict):
            stack.extend((x[k], y[k]) for k in x if k in y)
        elif not isinstance(x, (set, frozenset, types.FunctionType) + _NAMED):
            sx, sy = _state(x), _state(y)
            if sx is not None and sy is not None:
                stack.extend((sx[k], sy[k]) for k in sx if k in sy)
    return shared


# -- the delta of a step -------------------------------------------------------------------------------------

def _tensor_meta(x) -> tuple:
    return (tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, bool(x.requires_grad))


def _slots(x):
    """Shallowly, what a step can change in one of the layer's own objects."""
    import torch

    if isinstance(x, torch.Tensor):
        # the storage object itself is kept: it stays alive, so its identity cannot be reused meanwhile
        return ("tensor", _tensor_meta(x), x.untyped_storage() if x.is_meta else None, dict(vars(x)))
    if isinstance(x, list):
        return ("list", list(x))
    if isinstance(x, dict):
        return ("dict", dict(x))
    if isinstance(x, (set, frozenset, tuple, types.MethodType, types.FunctionType, functools.partial)):
        return ("fixed",)
    return ("attrs", _state(x) or {})


def _dict_changes(out: list, i: int, kind: str, old: dict, new: dict) -> None:
    """Changed and added keys in the new dict's order (a carried dict keeps its insertion order), then removed."""
    for k, b in new.items():
        if old.get(k, MISSING) is not b:
            out.append((i, kind, (k, b)))
    for k in old:
        if k not in new:
            out.append((i, kind, (k, MISSING)))


def delta_of(objs: list, before: list) -> list[tuple]:
    """(index into objs, kind, payload) for every slot the step changed."""
    changes: list[tuple] = []
    for i, (x, old) in enumerate(zip(objs, before)):
        new = _slots(x)
        if old[0] == "tensor":
            if new[1] != old[1] or new[2] is not old[2] and (new[2] is None or new[2]._cdata != old[2]._cdata):
                changes.append((i, "tensor-data", x))
            _dict_changes(changes, i, "attr", old[3], new[3])
        elif old[0] == "attrs":
            _dict_changes(changes, i, "attr", old[1], new[1])
        elif old[0] == "dict":
            _dict_changes(changes, i, "item", old[1], new[1])
        elif old[0] == "list" and (len(old[1]) != len(new[1]) or any(a is not b for a, b in zip(old[1], new[1]))):
            changes.append((i, "list", new[1]))
    return changes


class Copier:
    """Copies values the representative's step produced into another layer: objects the step created are
    rebuilt, the representative's own objects become the other layer's, anything else is shared."""

    def __init__(self, corr: dict[int, object], created: set[int], storages: dict[int, object]):
        import torch

        self.torch = torch
        self.corr, self.created, self.storages = corr, created, storages
        self.memo: dict[int, object] = {}

    def __call__(self, x):
        torch = self.torch
        if id(x) in self.corr:
            return self.corr[id(x)]
        if isinstance(x, _ATOMS + _NAMED) or isinstance(x, (torch.dtype, torch.device, torch.Size, torch.layout)):
            return x
        if id(x) in self.memo:
            return self.memo[id(x)]
        if isinstance(x, torch.Tensor):
            return x if id(x) not in self.created else self.tensor(x)
        if type(x) in (list, dict, set):  # containers: copied wherever the delta reaches them
            out = type(x)()
            self.memo[id(x)] = out
            if isinstance(out, list):
                out.extend(self(v) for v in x)
            elif isinstance(out, dict):
                out.update((self(k), self(v)) for k, v in x.items())
            else:
                out.update(self(v) for v in x)
            return out
        if type(x) in (tuple, frozenset):
            out = type(x)(self(v) for v in x)
        elif id(x) not in self.created:
            return x  # existed before the step and is not the layer's own: shared
        elif isinstance(x, types.MethodType):
            out = types.MethodType(self(x.__func__), self(x.__self__))
        elif isinstance(x, types.FunctionType):
            cells = tuple(types.CellType(self(_cell(c))) if _cell(c) is not MISSING else types.CellType()
                          for c in (x.__closure__ or ()))
            out = types.FunctionType(x.__code__, x.__globals__, x.__name__, self(x.__defaults__), cells or None)
            out.__kwdefaults__ = self(x.__kwdefaults__)
            out.__dict__.update(self(dict(vars(x))))
            out.__qualname__ = x.__qualname__
        elif isinstance(x, functools.partial):
            out = functools.partial(self(x.func), *self(x.args), **self(x.keywords))
        else:
            out = self._object(x)
        self.memo[id(x)] = out
        return out

    def tensor(self, x):
        """A meta tensor with ``x``'s metadata, on the storage that corresponds to ``x``'s."""
        torch = self.torch
        if not x.is_meta:
            raise CarryError(f"the step left a tensor on {x.device}, not on the meta device")
        key = x.untyped_storage()._cdata
        storage = self.storages.get(key)
        if storage is None:
            storage = self.storages[key] = torch.UntypedStorage(x.untyped_storage().nbytes(), device="meta")
        t = torch.empty(0, dtype=x.dtype, device="meta").set_(storage, x.storage_offset(), x.shape, x.stride())
        if type(x) is not torch.Tensor:
            t = torch.Tensor._make_subclass(type(x), t, x.requires_grad)
        elif x.requires_grad:
            t.requires_grad_(True)
        self.memo[id(x)] = t
        for k, v in vars(x).items():
            vars(t)[k] = self(v)
        return t

    def _object(self, x):
        reducer = copyreg.dispatch_table.get(type(x))
        try:
            rv = reducer(x) if reducer is not None else x.__reduce_ex__(4)
        except Exception as exc:
            raise CarryError(f"{type(x).__qualname__} cannot be rebuilt: {type(exc).__name__}: {exc}") from None
        if not isinstance(rv, tuple) or len(rv) < 2:
            raise CarryError(f"{type(x).__qualname__} cannot be rebuilt from its reduction")
        func, args, state, listiter, dictiter = (tuple(rv) + (None,) * 5)[:5]
        out = func(*[self(a) for a in args])
        self.memo[id(x)] = out
        if state is not None:
            state = self(state)
            if hasattr(out, "__setstate__") and not isinstance(state, dict):
                out.__setstate__(state)
            else:
                slotstate = None
                if isinstance(state, tuple) and len(state) == 2:
                    state, slotstate = state
                if state:
                    vars(out).update(state)
                for k, v in (slotstate or {}).items():
                    object.__setattr__(out, k, v)
        for item in listiter or ():
            out.append(self(item))
        for k, v in dictiter or ():
            out[self(k)] = self(v)
        return out


def restore(undo: list[tuple]) -> None:
    """Undo a carry (``Template.carry``'s record), latest change first."""
    for target, kind, key, old in reversed(undo):
        if kind == "data":
            target.data = old
        elif kind == "attr":
            if old is MISSING:
                vars(target).pop(key, None)
            else:
                vars(target)[key] = old
        elif kind == "item":
            if old is MISSING:
                target.pop(key, None)
            else:
                target[key] = old
        elif kind == "list":
            target[:] = old


def first_difference(a, b, path: str = "") -> tuple[str, str]:
    """Where two descriptions first differ, as a path of attribute names and indices."""
    if type(a) is not type(b):
        return path or "/", "different kinds of value"
    if isinstance(a, tuple) and len(a) == len(b):
        if a and a[0] == "dict" and len(a) == 3 and len(a[2]) == len(b[2]):
            for (ka, va), (kb, vb) in zip(a[2], b[2]):
                if ka != kb:
                    return f"{path}/<keys>", f"{str(ka)[:80]} vs {str(kb)[:80]}"
                if va != vb:
                    return first_difference(va, vb, f"{path}.{ka if isinstance(ka, str) else ka}")
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, path if (a and a[0] in ("O", "T", "dict")) else f"{path}[{i}]")
    return path or "/", f"{str(a)[:120]} vs {str(b)[:120]}"


# -- one group of identical steps ----------------------------------------------------------------------------

class Template:
    """The representative's run: its layer's state before and after, the delta, and the outcome."""

    def __init__(self, root, root_name: str, layer: int, shared: set[int], module_names: dict[int, str]):
        self.root_name, self.layer, self.shared, self.module_names = root_name, layer, shared, module_names
        self.pre = Walk(root, root_name, layer=layer, shared=shared, module_names=module_names)
        self.before = [_slots(x) for x in self.pre.objs]
        self.changes: list[tuple] = []
        self.created: list = []  # kept alive, so their identities are not reused by later objects
        self.created_ids: set[int] = set()
        self.post_desc = None
        self.outcome: dict = {}
        self.problem = ""  # why this run cannot be carried

    def walk(self, root, root_name: str, layer: int) -> Walk:
        return Walk(root, root_name, layer=layer, shared=self.shared, module_names=self.module_names)

    def run(self, root, execute) -> dict:
        """Run the representative's step, setting apart the objects it creates; then read its delta."""
        shared_before = [(x, _slots(x)) for x in self.pre.shared_objs]
        # every object alive now goes out of the collector's generations, so the ones left in them afterwards
        # are the step's; they are not put back (the cell process ends soon, and the collector has less to walk)
        gc.freeze()
        try:
            outcome = execute()
        finally:
            self.created = gc.get_objects()
        self.created_ids = {id(o) for o in self.created}
        self.outcome = outcome
        self.changes = delta_of(self.pre.objs, self.before)
        changed = [x for x, old in shared_before if delta_of([x], [old])]
        if changed:
            self.problem = (f"the step changed {type(changed[0]).__module__}:{type(changed[0]).__qualname__}, "
                            "an object the layer shares with others")
            return outcome
        try:
            self.post_desc = self.walk(root, self.root_name, self.layer).desc
        except Differs as exc:
            self.problem = f"the layer's state after the step cannot be described ({exc})"
        return outcome

    def same_before(self, root, root_name: str, layer: int) -> Walk:
        walk = self.walk(root, root_name, layer)
        if walk.desc != self.pre.desc:
            raise Differs(*first_difference(self.pre.desc, walk.desc))
        return walk

    def same_after(self, root, root_name: str, layer: int) -> None:
        desc = self.walk(root, root_name, layer).desc
        if desc != self.post_desc:
            raise Differs(*first_difference(self.post_desc, desc))

    def carry(self, walk: Walk) -> list[tuple]:
        """Apply the delta to the layer ``walk`` described (its state before the step); returns the undo record."""
        corr = {id(a): b for a, b in zip(self.pre.objs, walk.objs)}
        storages = {}
        for (kind, *snap), b in zip(self.before, walk.objs):
            if kind == "tensor" and snap[1] is not None and b.is_meta:
                storages[snap[1]._cdata] = b.untyped_storage()
        copy = Copier(corr, self.created_ids, storages)
        undo: list[tuple] = []
        try:
            for i, kind, payload in self.changes:
                target = walk.objs[i]
                if kind == "tensor-data":
                    new = copy.tensor(payload.data) if payload.is_meta else None
                    if new is None:
                        raise CarryError("a parameter's data left the meta device")
                    undo.append((target, "data", None, target.data))
                    target.data = new
                elif kind == "attr":
                    key, value = payload
                    undo.append((target, "attr", key, vars(target).get(key, MISSING)))
                    if value is MISSING:
                        vars(target).pop(key, None)
                    else:
                        vars(target)[key] = copy(value)
                elif kind == "item":
                    key, value = payload
                    undo.append((target, "item", key, target.get(key, MISSING)))
                    if value is MISSING:
                        target.pop(key, None)
                    else:
                        target[key] = copy(value)
                elif kind == "list":
                    undo.append((target, "list", None, list(target)))
                    target[:] = [copy(v) for v in payload]
        except Exception:
            restore(undo)
            raise
        return undo


# -- the groups of one model's post-load ---------------------------------------------------------------------

class Group:
    def __init__(self, key: tuple, members: list[int]):
        self.key, self.members = key, members
        self.template: Template | None = None
        self.rep_name = ""
        self.carried: list[tuple[int, list]] = []  # (step index, undo record)
        self.ran: list[int] = []
        self.notes: list[str] = []
        self.off = ""  # why the rest of the group runs for real

    def stop(self, why: str) -> None:
        if not self.off:
            self.off = why
            self.notes.append(why)


class Carrier:
    """Decides, step by step, whether post-load runs vLLM's step or carries the representative's delta.

    ``steps`` are post-load's ``(kind, name, module, call, fn)`` in the loader's order; ``eligible(kind, module)``
    says which steps take part (post-load uses vLLM's MoE quant-method steps, the per-expert conversions).
    ``run(i, execute)`` returns the step's outcome fields plus ``carry``: how they were obtained."""

    def __init__(self, model, steps: list[tuple], eligible, *, every_layer: bool = False):
        self.steps = steps
        self.names = {id(m): n for n, m in model.named_modules()}
        self.modules = {n: m for n, m in model.named_modules()}
        self.groups: dict[tuple, Group] = {}
        self.of: dict[int, Group] = {}
        if every_layer:
            return
        members: dict[tuple, list[int]] = {}
        for i, (kind, name, module, _call, fn) in enumerate(steps):
            if layer_root(name) is not None and layer_root(name) in self.modules and eligible(kind, module):
                members.setdefault((fn, group_key(name)), []).append(i)
        for key, idx in members.items():
            if len(idx) >= 3:  # a representative, the check, and at least one layer to carry to
                g = self.groups[key] = Group(key, idx)
                for i in idx:
                    self.of[i] = g

    def _root(self, i: int):
        name = self.steps[i][1]
        return self.steps[i][2], name, layer_index(name)

    def run(self, i: int, execute) -> dict:
        g = self.of.get(i)
        if g is None:
            return {**execute(), "carry": "ran"}
        root, root_name, layer = self._root(i)
        pos = g.members.index(i)
        if pos == 0:
            return self._representative(g, i, root, root_name, layer, execute)
        if g.off or g.template is None:
            g.ran.append(i)
            return {**execute(), "carry": "ran"}
        if pos == len(g.members) - 1:
            return self._check(g, i, root, root_name, layer, execute)
        t = g.template
        try:
            walk = t.same_before(root, root_name, layer)
        except Differs as exc:
            g.notes.append(f"layer {layer} differs before the step ({exc}); it ran")
            g.ran.append(i)
            return {**execute(), "carry": "ran"}
        try:
            undo = t.carry(walk)
        except (CarryError, Exception) as exc:  # the copier met something it cannot rebuild: run for real
            g.stop(f"the step's result could not be carried to layer {layer} ({type(exc).__name__}: {exc}); "
                   "the rest of the group ran")
            g.ran.append(i)
            return {**execute(), "carry": "ran"}
        try:
            t.same_after(root, root_name, layer)
        except Differs as exc:
            restore(undo)
            g.stop(f"the carried state of layer {layer} differed from the representative's ({exc}); "
                   "the rest of the group ran")
            g.ran.append(i)
            return {**execute(), "carry": "ran"}
        g.carried.append((i, undo))
        return {**_as_layer(t.outcome, t.layer, layer), "carry": "carried", "carried_from": g.rep_name}

    def _representative(self, g: Group, i, root, root_name, layer, execute) -> dict:
        other_root, _, _ = self._root(g.members[1])
        try:
            g.template = Template(root, root_name, layer, shared_between(root, other_root), self.names)
        except Differs as exc:
            g.stop(f"the representative's state cannot be described ({exc}); every layer ran")
            g.ran.append(i)
            return {**execute(), "carry": "ran"}
        g.rep_name = self.steps[i][1]
        outcome = g.template.run(root, execute)
        g.ran.append(i)
        if g.template.problem:
            g.stop(f"{g.template.problem}; every layer ran")
            g.template = None
            return {**outcome, "carry": "ran"}
        return {**outcome, "carry": "representative"}

    def _check(self, g: Group, i, root, root_name, layer, execute) -> dict:
        t = g.template
        try:
            t.same_before(root, root_name, layer)
            same_before = ""
        except Differs as exc:
            same_before = str(exc)
        outcome = execute()
        g.ran.append(i)
        problem = ""
        if same_before:
            problem = f"layer {layer} differed before the step ({same_before})"
        elif _outcome(outcome) != _outcome(_as_layer(t.outcome, t.layer, layer)):
            problem = f"layer {layer}'s outcome differs from the representative's"
        else:
            try:
                t.same_after(root, root_name, layer)
            except Differs as exc:
                problem = f"layer {layer}'s state after the step differs from the representative's ({exc})"
        if not problem:
            return {**outcome, "carry": "check"}
        g.stop(f"check failed: {problem}; the carried layers were restored and ran")
        redo = g.carried
        g.carried = []
        for j, undo in reversed(redo):
            restore(undo)
        g.redo = [j for j, _ in redo]
        return {**outcome, "carry": "check-failed"}

    def redo(self) -> list[int]:
        """Steps whose carried result was withdrawn by a failed check: post-load runs them again, in order."""
        return sorted(j for g in self.groups.values() for j in getattr(g, "redo", ()))

    def summary(self) -> list[dict]:
        out = []
        for (fn, key), g in self.groups.items():
            layer_of = lambda j: layer_index(self.steps[j][1])
            out.append({"fn": fn, "modules": key, "members": len(g.members),
                        "representative": layer_of(g.members[0]),
                        "check": layer_of(g.members[-1]),
                        "carried": [layer_of(j) for j, _ in g.carried],
                        "ran": sorted(layer_of(j) for j in g.ran),
                        "notes": g.notes})
        return out


def _as_layer(outcome: dict, src: int, dst: int) -> dict:
    """The representative's outcome fields as layer ``dst``'s: names of its modules, and the layer it raised in."""
    out = renumber(outcome, src, dst)
    if out.get("in_layer") == src:
        out["in_layer"] = dst
    return out


def _outcome(record: dict) -> dict:
    """What must agree between two layers' runs of the same step (durations and places in the code aside)."""
    return {k: v for k, v in record.items() if k not in ("seconds",)}
