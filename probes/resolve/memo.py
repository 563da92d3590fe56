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

Each entry is **sealed** like evidence: it names its key (the file it belongs in) and carries the sha256 of its
key, facts and result. An entry whose key is not its file's, whose seal does not verify or whose shape is not an
entry's is never served: the answer is computed again and the entry replaced (counted as ``rejected``); a file
that is not a list of entries is ignored the same way, never a failure of the computation that asked.

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


def memoised(fn, label: str, directory: str, facts_now):
    """``fn`` answered from ``directory`` when the same code, arguments and device facts were seen before.
    ``facts_now(fields)`` gives the current SKU's values for recorded fact names."""
    code = _package_digest(fn.__module__)
    stats = STATS.setdefault(label, {"computed": 0, "reused": 0, "uncacheable": 0, "rejected": 0})
    here: dict[str, object] = {}  # this process's answers by key file (one SKU per process)

    @functools.wraps(fn)
    @fence.guard(f"memo {label}")
    def call(*args, **kwargs):
        text = repr((args, sorted(kwargs.items())))
        if _ADDRESS.search(text):
            stats["uncacheable"] += 1
            return foreign(fn, *args, **kwargs)
        key = hashlib.sha256(f"{label}\0{code}\0{text}".encode()).hexdigest()
        path = os.path.join(directory, key + ".json")
        if path in here:  # the same object each time, as the function's own cache would give
            stats["reused"] += 1
            return here[path]
        entries, rejected = _load(path, key)
        stats["rejected"] += rejected
        for entry in entries:
            try:
                same = facts_now(list(entry["facts"])) == entry["facts"]
            except Exception:  # a fact the current SKU cannot answer: not this entry
                same = False
            if same:
                stats["reused"] += 1
                here[path] = _decode(entry["result"])
                return here[path]
        READ.append({})
        try:
            result = foreign(fn, *args, **kwargs)
        finally:
            facts = READ.pop()
        try:
            stored = _encode(result)
            round_trip = _decode(json.loads(json.dumps(stored)))
        except (TypeError, ValueError):
            round_trip = stored = None
        if stored is None or round_trip != result or not _same_types(round_trip, result):
            stats["uncacheable"] += 1
            return result
        stats["computed"] += 1
        here[path] = result
        _save(path, [e for e in entries if e["facts"] != facts] + [seal(key, facts, stored)])
        return result

    return call


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


def _digest(key: str, facts, result) -> str:
    return hashlib.sha256(json.dumps({"key": key, "facts": facts, "result": result}, sort_keys=True).encode()).hexdigest()


def seal(key: str, facts: dict, result) -> dict:
    """A memo entry of *key*: its facts and result with the sha256 that seals them."""
    return {"key": key, "facts": facts, "result": result, "sha256": _digest(key, facts, result)}


def _load(path: str, key: str) -> tuple[list, int]:
    """(the entries of *path* that verify, how many did not): an entry must be an object naming *key* (the file's
    own), with a facts object, and its seal must match; anything else is dropped and counted, never served."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return [], 0
    except (OSError, ValueError):
        return [], 1
    if not isinstance(data, list):
        return [], 1
    good = [e for e in data if isinstance(e, dict) and e.get("key") == key and isinstance(e.get("facts"), dict)
            and "result" in e and e.get("sha256") == _digest(key, e["facts"], e["result"])]
    return good, len(data) - len(good)


def _save(path: str, entries: list) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(entries, fh, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a full or read-only cache only costs the computation next time
        try:
            os.unlink(tmp)
        except OSError:
            pass


def install(hooks, directory: str | None, facts_now) -> None:
    if not directory:
        return
    for module, name, why in MEMOS:

        def patch(mod, name=name, label=f"{module}:{name}"):
            original = getattr(mod, name, None)
            if callable(original):
                setattr(mod, name, memoised(original, label, directory, facts_now))

        fence.register(f"memo {module}:{name}", "stand-in")
        hooks.register(module, patch, piece=f"install memo {module}:{name}")
