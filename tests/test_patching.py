"""Wrapper mechanics on a throwaway module (generic; vLLM itself is covered in test_probes_vllm.py)."""
import enum
import functools
import inspect
import subprocess
import sys
import textwrap
import types

import pytest

from probes.core import patching
from tests.conftest import ROOT


class Color(enum.Enum):
    RED = 1


class Recorder(patching.Hooks):
    def __init__(self):
        self.calls = []

    def after(self, token, args, kwargs, result):
        self.calls.append(("ok", args, kwargs, result))

    def failed(self, token, args, kwargs, exc):
        self.calls.append(("raised", exc))


def make_module():
    mod = types.ModuleType("throwaway_target")

    def pick(a: int, *, b: str = "x") -> Color:
        """docs"""
        return Color.RED

    class Boom(Exception):
        pass

    def explode():
        raise Boom("no")

    @functools.cache
    def cached(n):
        return object()

    class Base:
        @classmethod
        def check(cls, x):
            return cls, x

        @staticmethod
        def static(cls, x):
            return (cls, x)

    class Child(Base):
        pass

    mod.__dict__.update(pick=pick, Boom=Boom, explode=explode, cached=cached, Base=Base, Child=Child)
    return mod


def wrap(mod, qual, hooks, **kw):
    owner, name, raw = patching.resolve(mod, qual)
    return patching.wrap_attribute(owner, name, raw, hooks, label=qual, **kw)


def test_same_result_object_and_signature():
    mod, rec = make_module(), Recorder()
    orig = mod.pick
    sig = inspect.signature(orig)
    wrap(mod, "pick", rec)
    assert mod.pick is not orig
    assert mod.pick(1, b="y") is Color.RED
    assert inspect.signature(mod.pick) == sig
    assert mod.pick.__name__ == "pick" and mod.pick.__doc__ == "docs" and mod.pick.__wrapped__ is orig
    assert rec.calls == [("ok", (1,), {"b": "y"}, Color.RED)]


def test_same_exception_object_propagates():
    mod, rec = make_module(), Recorder()
    wrap(mod, "explode", rec)
    with pytest.raises(mod.Boom) as e:
        mod.explode()
    assert rec.calls[0][1] is e.value


def test_descriptors_stay_on_the_defining_class():
    mod, rec = make_module(), Recorder()
    owner, name, raw = patching.resolve(mod, "Child.check")
    assert owner is mod.Base and isinstance(raw, classmethod)
    patching.wrap_attribute(owner, name, raw, rec, label="check")
    assert isinstance(vars(mod.Base)["check"], classmethod)
    assert "check" not in vars(mod.Child)
    assert mod.Child.check(3) == (mod.Child, 3)
    owner, name, raw = patching.resolve(mod, "Base.static")
    patching.wrap_attribute(owner, name, raw, rec, label="static")
    assert isinstance(vars(mod.Base)["static"], staticmethod)
    assert mod.Child.static(mod.Child, 4) == (mod.Child, 4)


def test_cache_helpers_keep_working():
    mod, rec = make_module(), Recorder()
    first = mod.cached(1)
    wrap(mod, "cached", rec)
    assert mod.cached(1) is first
    mod.cached.cache_clear()
    assert mod.cached(1) is not first
    assert mod.cached.cache_info().currsize == 1


def test_hook_failure_is_recorded_not_raised():
    mod = make_module()

    class Bad(patching.Hooks):
        def before(self, args, kwargs):
            raise RuntimeError("probe bug")

        def after(self, token, args, kwargs, result):
            raise KeyError("probe bug 2")

    errors = []
    wrap(mod, "pick", Bad(), on_error=lambda where, exc: errors.append((where, type(exc))))
    assert mod.pick(1) is Color.RED
    assert errors == [("pick:before", RuntimeError), ("pick:after", KeyError)]


def test_double_wrap_is_noop_and_unpatch_restores():
    mod, rec = make_module(), Recorder()
    orig = mod.pick
    patch = wrap(mod, "pick", rec)
    assert wrap(mod, "pick", rec) is None
    mod.pick(1)
    assert len(rec.calls) == 1
    patching.unpatch(patch)
    assert mod.pick is orig


def test_rebind_reaches_from_import_copies():
    mod, rec = make_module(), Recorder()
    consumer = types.ModuleType("throwaway_consumer")
    consumer.pick = mod.pick  # what `from throwaway_target import pick` does
    sys.modules["throwaway_target"], sys.modules["throwaway_consumer"] = mod, consumer
    try:
        patch = wrap(mod, "pick", rec, rebind_prefixes=("throwaway_",))
        assert consumer.pick is mod.pick
        consumer.pick(2)
        assert rec.calls
        patching.unpatch(patch)
        assert consumer.pick is mod.pick.__wrapped__ if hasattr(mod.pick, "__wrapped__") else consumer.pick is mod.pick
    finally:
        sys.modules.pop("throwaway_target")
        sys.modules.pop("throwaway_consumer")


PKG = {
    "tgt/__init__.py": "",
    "tgt/sel.py": "def choose(x):\n    return ('chosen', x)\n",
    "tgt/consumer.py": "from tgt.sel import choose\n\ndef build():\n    return choose(1)\n",
}

def write_pkg(root):
    """The throwaway package (a selector and a consumer that binds it with from-import) under root."""
    for rel, text in PKG.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


ORDER_SCRIPT = textwrap.dedent('''
    import importlib, json, sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    from probes.core.recorder import Recorder
    from probes.core.targets import Target
    from probes.core.install import ProbeSet
    order = sys.argv[3]
    t = (Target("t.choose", "select", ("tgt.sel:choose",)),)
    if order == "import-then-patch":
        import tgt.consumer
    ps = ProbeSet(Recorder(None), targets=t, rebind_prefixes=("tgt",)).install()
    if order == "patch-twice":
        ps.install()
    if order == "patch-unpatch-patch":
        ps.uninstall()
        ps = ProbeSet(Recorder(None), targets=t, rebind_prefixes=("tgt",)).install()
    import tgt.consumer, tgt.sel
    result = tgt.consumer.build()
    ps.finalize()
    wrapped = tgt.sel.choose
    depth = 0
    while hasattr(wrapped, "__wrapped__"):
        wrapped, depth = wrapped.__wrapped__, depth + 1
    selects = [r for r in ps.rec.records() if r["kind"] == "select"]
    status = [r["status"] for r in ps.rec.records() if r["kind"] == "target"]
    print(json.dumps({"result": result, "selects": len(selects), "depth": depth, "status": status}))
''')


@pytest.mark.parametrize("order", ["import-then-patch", "patch-then-import", "patch-twice", "patch-unpatch-patch"])
def test_patch_orders_in_fresh_processes(tmp_path, order):
    """Every order of import and patching gives exactly one wrapper and one record per call."""
    write_pkg(tmp_path)
    out = subprocess.run([sys.executable, "-c", ORDER_SCRIPT, str(tmp_path), str(ROOT), order],
                         capture_output=True, text=True, check=True)
    import json

    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"result": ["chosen", 1], "selects": 1, "depth": 1, "status": ["patched"]}


def test_post_import_hook_patches_before_consumers_bind(tmp_path):
    write_pkg(tmp_path)
    script = textwrap.dedent('''
        import sys
        sys.path[:0] = [sys.argv[1], sys.argv[2]]
        from probes.core.patching import PostImportHooks
        seen = []
        hooks = PostImportHooks()
        hooks.register("tgt.sel", lambda m: seen.append(
            ("hook", hasattr(m, "choose"), hasattr(sys.modules.get("tgt.consumer"), "choose"))))
        import tgt.consumer
        assert tgt.consumer.__spec__.loader.__class__.__name__ != "_HookedLoader"
        print(seen)
    ''')
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(ROOT)], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[('hook', True, False)]"


def test_missing_target_is_drift_not_crash(tmp_path):
    write_pkg(tmp_path)
    script = textwrap.dedent('''
        import json, sys
        sys.path[:0] = [sys.argv[1], sys.argv[2]]
        from probes.core.recorder import Recorder
        from probes.core.targets import Target
        from probes.core.install import ProbeSet
        t = (Target("gone.attr", "select", ("tgt.sel:renamed_choose",)),
             Target("gone.module", "select", ("tgt.removed:choose",)),
             Target("never.imported", "select", ("json.tool:main",)))
        ps = ProbeSet(Recorder(None), targets=t).install()
        import tgt.consumer
        assert tgt.consumer.build() == ("chosen", 1)
        ps.finalize()
        print(json.dumps({r["target"]: r["status"] for r in ps.rec.records() if r["kind"] == "target"}))
    ''')
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(ROOT)], capture_output=True, text=True,
                         check=True)
    import json

    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "gone.attr": "drift", "gone.module": "drift", "never.imported": "not-reached"}
