"""Shared imports (the agent's parent imports, once, the modules every SM process imports before the first one
whose import reads the device): the host's learning from the SM processes' records, and the probes' read
tracking on a throwaway module. The real wheel's runs are in tests/test_shared_imports_vllm.py."""
import json
import sys

import pytest

from audit.runtimes.base import learn_shared_imports, shared_imports


def _sm(evidence, name, order, readers):
    d = evidence / ".shared-imports"
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps({"order": order, "readers": readers}))


def test_the_shared_list_is_the_common_prefix_before_the_first_reader(tmp_path, monkeypatch):
    monkeypatch.delenv("SERVING_TRUTH_SHARED_IMPORTS", raising=False)
    ev, cache = tmp_path / "evidence", tmp_path / "cache"
    # SM 9.0 starts a, b, c, then r (reads the device), then d; SM 10.0 imports b before a and x only there
    _sm(ev, "sm9.0-1.json", ["a", "b", "c", "r", "d"], ["r"])
    _sm(ev, "sm10.0-2.json", ["b", "a", "x", "c", "r", "d"], ["r"])
    learn_shared_imports(cache, ev)
    # d comes after a reader; x is not in every SM process; the order is one SM process's own (the first
    # record's by name: sm10.0 sorts first), so each module's dependencies come before it
    assert shared_imports(cache) == ["b", "a", "c"]
    # a later run whose parent tripped on c: c is a reader from then on, and readers accumulate
    _sm(ev, "sm9.0-1.json", ["a", "b", "c", "r"], [])
    _sm(ev, "sm10.0-2.json", ["a", "b", "c"], [])
    (ev / ".shared-imports" / "tripped.json").write_text(json.dumps([{"what": "device", "importing": ["c"]}]))
    learn_shared_imports(cache, ev)
    assert shared_imports(cache) == ["a", "b"]
    assert set(json.loads((cache / "shared-imports.json").read_text())["readers"]) == {"r", "c"}


def test_bad_or_missing_records_keep_the_list_and_never_fail(tmp_path, monkeypatch):
    monkeypatch.delenv("SERVING_TRUTH_SHARED_IMPORTS", raising=False)
    ev, cache = tmp_path / "evidence", tmp_path / "cache"
    _sm(ev, "sm9.0-1.json", ["a", "r"], ["r"])
    learn_shared_imports(cache, ev)
    (ev / ".shared-imports" / "sm9.0-1.json").write_text("{not json")
    learn_shared_imports(cache, ev)  # nothing readable this run: the list stays
    assert shared_imports(cache) == ["a"]
    (cache / "shared-imports.json").write_text("[1, 2]")  # a list file of the wrong shape shares nothing
    assert shared_imports(cache) == []


def test_the_override_names_the_list_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVING_TRUTH_SHARED_IMPORTS", str(tmp_path / "elsewhere.json"))
    ev, cache = tmp_path / "evidence", tmp_path / "cache"
    _sm(ev, "sm9.0-1.json", ["a", "r"], ["r"])
    learn_shared_imports(cache, ev)
    assert (tmp_path / "elsewhere.json").exists() and not (cache / "shared-imports.json").exists()
    assert shared_imports(cache) == ["a"]


@pytest.fixture
def state():
    from probes.resolve import simulate

    saved = (simulate._State.props, simulate._State.world_size, simulate._State.learning)
    simulate._State.props, simulate._State.world_size, simulate._State.learning = None, None, False
    simulate._State.readers, simulate._State.reads_before_sku = set(), []
    yield simulate
    simulate._State.props, simulate._State.world_size, simulate._State.learning = saved
    simulate._State.readers, simulate._State.reads_before_sku = set(), []


SYSTEM = {"device_name": "NVIDIA H200", "capability": [9, 0], "total_memory_gib": 141, "sm_count": 132}


def _own(state, names) -> list[str]:
    """*names* without the modules whose code runs the test itself (a test process of pytest-xdist runs inside its
    ``__channelexec__`` module's code, a ``<module>`` frame on the stack like an import's)."""
    runner = set(state.importing_modules())
    return [n for n in names if n not in runner]


def test_a_read_before_a_sku_raises_and_is_recorded_even_when_swallowed(state, tmp_path, monkeypatch):
    """A module that swallows the failed read (as vLLM's Triton check does) still leaves the record the parent
    checks before it lets any SM process fork."""
    (tmp_path / "st_swallows.py").write_text(
        "from probes.resolve import simulate\n"
        "try:\n    CAP = simulate._State.sku().major\nexcept Exception:\n    CAP = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import st_swallows

    assert st_swallows.CAP is None
    assert [{**r, "importing": _own(state, r["importing"])} for r in state._State.reads_before_sku] == \
        [{"what": "device", "importing": ["st_swallows"]}]
    with pytest.raises(state.SkuNotSet, match="device count was read before a SKU was set"):
        state._State.world()
    sys.modules.pop("st_swallows", None)


def test_learning_names_every_module_importing_at_a_read(state, tmp_path, monkeypatch):
    (tmp_path / "st_outer.py").write_text("import st_inner\n")
    (tmp_path / "st_inner.py").write_text("from probes.resolve import simulate\nMAJOR = simulate._State.sku().major\n")
    (tmp_path / "st_clean.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    state.set_simulated(SYSTEM, 8)
    state.ImportOrder.start()
    from probes.core.patching import PostImportHooks

    hooks = PostImportHooks()
    seen = []
    hooks.register("st_clean", lambda module: seen.append(module.__name__))  # its finder asks ImportOrder itself
    try:
        import importlib.util

        # a probe for a package imported later (torch._dynamo asks find_spec about optional backends) places
        # nothing: the order is the order imports start
        assert importlib.util.find_spec("st_outer") is not None
        import st_clean  # noqa: F401
        import st_outer  # noqa: F401
    finally:
        state._State.learning = False
        sys.meta_path.remove(state.ImportOrder)
        hooks.uninstall()
    assert seen == ["st_clean"]
    assert sys.modules["st_inner"].MAJOR == 9
    assert set(_own(state, state._State.readers)) == {"st_outer", "st_inner"}
    assert [m for m in state.ImportOrder.order if m.startswith("st_")] == ["st_clean", "st_outer", "st_inner"]
    assert state._State.reads_before_sku == []
    state.ImportOrder.order.clear()
    state.ImportOrder._seen.clear()
    for name in ("st_outer", "st_inner", "st_clean"):
        sys.modules.pop(name, None)
