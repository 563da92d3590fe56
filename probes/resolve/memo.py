"""Pure computations below vLLM, done once: a memo keyed by everything they read.

Some libraries vLLM calls at load compute a table on the host from the layer's shapes and the device's
properties: Humming's kernel heuristics sweep 835 token counts per weight (an analytic model with seeded
sampling; no timing, no device), about seven seconds a layer shape. The answer is a function of its code,
its arguments and the device facts it reads, so one computation serves every cell (and every later audit)
that asks the same question:

* the **key** is the library's source (a digest of every ``.py`` file of its package), the call's arguments
  (their ``repr``, refused when it names an object address) and the device facts the computation read,
  which the device stand-ins report as they answer (``probes.resolve.standins.SimulatedHummingDevice``);
* an entry is reused only when the current SKU gives the same value for every fact it recorded, and only
  when the result survives its JSON round trip unchanged, types and key order included (anything else is
  computed every time);
* entries live in the directory the host names (``plan["memo_dir"]``, under the audit cache); without one,
  nothing is kept. ``plan["postload_every_layer"]`` (the straightforward path) computes every time.

Each entry is **sealed** like evidence: it names its key (the file it belongs in), the inputs the key is
computed from (the label, the package digest, the arguments' text) and carries the sha256 of all of it with the
facts and result. An entry is served only when its key recomputed from its own inputs is its file's and the
current call's, its facts are a flat object of JSON scalars, and its seal verifies; anything else is computed
again and the entry replaced (counted as ``rejected``); a file that is not a list of entries is ignored the same
way, never a failure of the computation that asked.

A seal is a plain digest: it catches an accident, not an edit by a hand that reseals. So the first answer of
each memoised function a process would reuse from disk is computed again (``checked``) and must be the stored
one, types included; one that is not is rejected, its file rewritten from the computation, and nothing from
that file is served. An edited entry a process does not check first is not caught this way: runs that must not
trust the cache at all use ``--no-cache`` (the memo then computes everything) or ``--postload-every-layer``.

The cell's evidence says how many answers were computed, reused and rejected (``memo`` record), and tests
require the same routing with the memo and without it, and after an entry is edited. Imported only inside the
pinned environment.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re

from probes.core import fence
from probes.core.fence import foreign

#: (module, function, why it is a pure function of its code, arguments and the device facts it reads)
MEMOS: tuple[tuple[str, str, str], ...] = (
    ("humming.tune", "_get_heuristics_config",
     "Humming's kernel-config heuristics: an analytic model of the layer's shapes and the device's properties "
     "(sampling seeded with 0); it launches nothing and times nothing"),
)

#: facts a device stand-in answered while a memoised computation ran: {field: value}
READ: list[dict] = []
#: per memoised function: {"computed": n, "reused": n, "uncacheable": n, "rejected": n}
STATS: dict[str, dict[str, int]] = {}
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def note_fact(field: str, value) -> None:
    """Called by a device stand-in for every fact it answers; kept while a memoised computation runs."""
    if READ:
        READ[-1][field] = value


def _package_digest(module_name: str) -> str:
    import importlib

    top = importlib.import_module(module_name.split(".")[0])
    root = os.path.dirname(top.__file__)
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def memoised(fn, label: str, directory: str, facts_now, trust: bool = True):
    """``fn`` answered from ``directory`` when the same code, arguments and device facts were seen before.
    ``facts_now(fields)`` gives the current SKU's values for recorded fact names. With *trust* False no stored
    answer is served: every call computes and refreshes its entry."""
    code = _package_digest(fn.__module__)
    stats = STATS.setdefault(label, {"computed": 0, "reused": 0, "uncacheable": 0, "rejected": 0, "checked": 0})
    here: dict[str, object] = {}  # this process's answers by key file (one SKU per process)
    unchecked = [True]  # the first answer this process would take from disk is computed again

    @functools.wraps(fn)
    @fence.guard(f"memo {label}")
    def call(*args, **kwargs):
        text = repr((args, sorted(kwargs.items())))
        if _ADDRESS.search(text):
            stats["uncacheable"] += 1
            return foreign(fn, *args, **kwargs)
        inputs = {"label": label, "code": code, "args": text}
        key = key_of(inputs)
        path = os.path.join(directory, key + ".json")
        if path in here:  # the same object each time, as the function's own cache would give
            stats["reused"] += 1
            return here[path]
        entries, rejected = _load(path, key)
        stats["rejected"] += rejected
        for entry in entries if trust else ():
            try:
                same = facts_now(list(entry["facts"])) == entry["facts"]
            except Exception:  # a fact the current SKU cannot answer: not this entry
                same = False
            if not same:
                continue
            stored = _decode(entry["result"])
            if unchecked[0]:
                unchecked[0] = False
                stats["checked"] += 1
                # the answer must be the stored one; the facts read may be fewer (the library caches what it read
                # earlier in this process), and the stored ones already matched this SKU
                result, facts = _compute(fn, args, kwargs)
                if result != stored or not _same_types(result, stored):
                    stats["rejected"] += 1  # an edited answer, resealed: the computation's is kept instead
                    _keep(path, [], entry["facts"], result, inputs, stats, here)
                    return result
            stats["reused"] += 1
            here[path] = stored
            return stored
        result, facts = _compute(fn, args, kwargs)
        _keep(path, entries, facts, result, inputs, stats, here)
        return result

    return call


def _compute(fn, args, kwargs):
    """(what *fn* returns, the device facts it read meanwhile)."""
    READ.append({})
    try:
        result = foreign(fn, *args, **kwargs)
    finally:
        facts = READ.pop()
    return result, facts


def _keep(path: str, entries: list, facts: dict, result, inputs: dict, stats: dict, here: dict) -> None:
    """Store a computed *result* beside the other *entries* of its file, when JSON keeps it exactly."""
    try:
        stored = _encode(result)
        round_trip = _decode(json.loads(json.dumps(stored)))
    except (TypeError, ValueError):
        round_trip = stored = None
    if stored is None or round_trip != result or not _same_types(round_trip, result):
        stats["uncacheable"] += 1
        return
    stats["computed"] += 1
    here[path] = result
    _save(path, [e for e in entries if e["facts"] != facts] + [seal(inputs, facts, stored)])


#: the entry format: part of every key, so a file an older format wrote is never found (not "rejected": it was
#: not edited). 2: entries record their inputs; 3: files keep a result's key order (2 wrote keys sorted, so every
#: dict answer came back in another order than computed, and every check of one was counted as rejected)
FORMAT = 3


def key_of(inputs: dict) -> str:
    """The key of a memoised call: sha256 over the entry format, its label, its package's digest and its
    arguments' text."""
    return hashlib.sha256(f"memo-{FORMAT}\0{inputs['label']}\0{inputs['code']}\0{inputs['args']}".encode()).hexdigest()


_TUPLE = "__memo_tuple__"


def _encode(x):
    """JSON for lists, dicts with string keys, tuples (tagged) and scalars; anything else is refused."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, tuple):
        return {_TUPLE: [_encode(v) for v in x]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, dict) and all(isinstance(k, str) for k in x) and _TUPLE not in x:
        return {k: _encode(v) for k, v in x.items()}
    raise TypeError(type(x).__name__)


def _decode(x):
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if isinstance(x, dict):
        if set(x) == {_TUPLE}:
            return tuple(_decode(v) for v in x[_TUPLE])
        return {k: _decode(v) for k, v in x.items()}
    return x


def _same_types(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return all(_same_types(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_types(a[k], b[k]) for k in a)
    return True


def _digest(key: str, inputs, facts, result) -> str:
    return hashlib.sha256(json.dumps({"key": key, "inputs": inputs, "facts": facts, "result": result},
                                     sort_keys=True).encode()).hexdigest()


def seal(inputs: dict, facts: dict, result) -> dict:
    """A memo entry for the call *inputs* describe: its key, inputs, facts and result, and the sha256 sealing them."""
    key = key_of(inputs)
    return {"key": key, "inputs": dict(inputs), "facts": facts, "result": result,
            "sha256": _digest(key, inputs, facts, result)}


_SCALAR = (str, int, float, bool, type(None))


def _sound(e, key: str) -> bool:
    """An entry of the call whose key is *key*: its own inputs give that key, its facts are flat scalars, its
    seal verifies."""
    if not isinstance(e, dict) or e.get("key") != key or "result" not in e:
        return False
    inputs, facts = e.get("inputs"), e.get("facts")
    if not isinstance(inputs, dict) or not all(isinstance(inputs.get(f), str) for f in ("label", "code", "args")):
        return False
    if key_of(inputs) != key or not isinstance(facts, dict) or not all(isinstance(v, _SCALAR) for v in facts.values()):
        return False
    return e.get("sha256") == _digest(key, inputs, facts, e["result"])


def _load(path: str, key: str) -> tuple[list, int]:
    """(the entries of *path* that verify, how many did not): see :func:`_sound`; anything else is dropped and
    counted, never served."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return [], 0
    except (OSError, ValueError):
        return [], 1
    if not isinstance(data, list):
        return [], 1
    good = [e for e in data if _sound(e, key)]
    return good, len(data) - len(good)


def _save(path: str, entries: list) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(entries, fh)  # key order kept: a dict's order is part of the answer (the seal ignores it)
        os.replace(tmp, path)
    except OSError:  # a full or read-only cache only costs the computation next time
        try:
            os.unlink(tmp)
        except OSError:
            pass


def install(hooks, directory: str | None, facts_now, trust: bool = True) -> None:
    if not directory:
        return
    for module, name, why in MEMOS:

        def patch(mod, name=name, label=f"{module}:{name}"):
            original = getattr(mod, name, None)
            if callable(original):
                setattr(mod, name, memoised(original, label, directory, facts_now, trust))

        fence.register(f"memo {module}:{name}", "stand-in")
        hooks.register(module, patch, piece=f"install memo {module}:{name}")
