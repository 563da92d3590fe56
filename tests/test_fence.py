"""The fence's mechanics on throwaway code (generic; the fence around vLLM's process is covered on the real wheel
in test_fence_vllm.py): a raise of the harness's own code is recorded even when the caller swallows it; what
foreign code raises, a deliberate limit and a protocol exception pass unrecorded; a planted fault goes off in
the piece named; a post-import hook that raises never breaks the import it rides on."""
import sys
import types

import pytest

from probes.core import fence, patching


@pytest.fixture(autouse=True)
def clean_fence():
    saved = (dict(fence.REGISTRY), dict(fence.CALLS), list(fence.FAULTS), fence.planted(), dict(fence.FIT))
    fence.FAULTS.clear()
    fence.plant("")
    yield
    fence.REGISTRY.clear(), fence.REGISTRY.update(saved[0])
    fence.CALLS.clear(), fence.CALLS.update(saved[1])
    fence.FAULTS[:] = saved[2]
    fence.plant("\n".join(saved[3]))
    fence.FIT.clear(), fence.FIT.update(saved[4])


def _library_swallows(fn, *args):
    """What vLLM's optional-package checks do: any exception means "not available"."""
    try:
        return fn(*args)
    except Exception:
        return "swallowed"


def test_a_raise_in_our_code_is_a_fault_even_when_the_caller_swallows_it():
    @fence.guard("test: broken stand-in")
    def broken(x):
        return {}[x]  # our own bug

    assert _library_swallows(broken, "k") == "swallowed"
    assert [f["piece"] for f in fence.FAULTS] == ["test: broken stand-in"]
    assert fence.FAULTS[0]["type"] == "builtins:KeyError" and "broken" in "".join(fence.FAULTS[0]["traceback"])
    assert fence.REGISTRY["test: broken stand-in"] == "stand-in" and fence.CALLS["test: broken stand-in"] == 1


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"])
def test_a_system_exit_or_keyboard_interrupt_our_code_raises_is_a_fault_too(exc):
    """Not only Exception: a stand-in that calls sys.exit or raises KeyboardInterrupt is the harness's fault (the agent
    is ended by SIGKILL, never by such an exception); it is recorded and still propagates."""
    @fence.guard("test: exits")
    def exits():
        raise exc

    with pytest.raises(type(exc)):
        exits()
    assert [(f["piece"], f["type"].split(":")[1]) for f in fence.FAULTS] == [("test: exits", type(exc).__name__)]

    def vllm_exits():
        raise type(exc)()

    @fence.guard("test: foreign exit")
    def through():
        return fence.foreign(vllm_exits)

    with pytest.raises(type(exc)):
        through()
    assert len(fence.FAULTS) == 1  # what foreign code raises is theirs, whatever its type


def test_foreign_raises_limits_and_protocol_exceptions_pass_unrecorded():
    class Refused(Exception):
        pass

    def vllm_refuses():
        raise Refused("vLLM says no")

    @fence.guard("test: passes through")
    def through():
        return fence.foreign(vllm_refuses)

    @fence.guard("test: limit")
    def limit():
        raise fence.SimulationLimit("not simulated")

    @fence.guard("test: protocol")
    def protocol():
        raise fence.deliberate(AttributeError("no such field"))

    with pytest.raises(Refused) as e:
        through()
    assert str(e.value) == "vLLM says no"  # the very exception, unchanged
    with pytest.raises(fence.SimulationLimit):
        limit()
    with pytest.raises(AttributeError):
        protocol()
    assert fence.FAULTS == []


def test_a_swallowing_guard_drops_the_raise_and_keeps_the_fault():
    @fence.guard("test: hook", "hook", swallow=True)
    def hook(mod):
        raise TypeError("cannot set '__new__' attribute of immutable type 'object'")

    assert hook(None) is None
    assert fence.FAULTS[0]["piece"] == "test: hook" and "immutable type" in fence.FAULTS[0]["message"]


def test_a_planted_fault_goes_off_only_in_the_pieces_named():
    @fence.guard("test: a")
    def a():
        return "a"

    @fence.guard("test: b")
    def b():
        return "b"

    fence.plant("test: b\ntest: c")
    assert a() == "a"
    assert _library_swallows(b) == "swallowed"
    assert [(f["piece"], f["type"]) for f in fence.FAULTS] == [("test: b", "probes.core.fence:PlantedFault")]
    assert fence.summary()["planted"] == ["test: b", "test: c"]


def test_a_raising_post_import_hook_never_breaks_the_import(tmp_path, monkeypatch):
    (tmp_path / "fence_throwaway_mod.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hooks = patching.PostImportHooks()

    def bad_patch(mod):
        object.__new__ = None  # the shape a stand-in did not expect: raises TypeError

    hooks.register("fence_throwaway_mod", bad_patch, piece="test: install bad patch")
    try:
        import fence_throwaway_mod

        assert fence_throwaway_mod.VALUE == 41  # imported as if the hook were absent
    finally:
        hooks.uninstall()
        sys.modules.pop("fence_throwaway_mod", None)
    assert [f["piece"] for f in fence.FAULTS] == ["test: install bad patch"]
    assert "immutable type" in fence.FAULTS[0]["message"]


def test_a_planted_fault_in_a_probe_wrapper_is_reported_and_the_call_is_untouched():
    errors = []
    fence.plant("probe test.target")

    def pick(x):
        return x * 2

    wrapper = patching.make_wrapper(pick, patching.Hooks(), label="test.target",
                                    on_error=lambda where, exc: errors.append((where, type(exc).__name__)))
    assert wrapper(21) == 42
    assert errors == [("test.target:before", "PlantedFault")]
    assert "probe test.target" in fence.REGISTRY


def test_a_boundary_records_what_our_code_raised_and_nothing_else():
    from probes.resolve import dispatch

    try:
        dispatch.meta.__globals__["Workload"]("decode", "x", 1, 1).as_dict()["missing"]
    except KeyError as exc:  # innermost frame: this test file, not the probes package
        assert fence.check_origin("test boundary", exc) is False
    try:
        dispatch.Workload.as_dict(None)  # raises inside probes/resolve/dispatch.py
    except AttributeError as exc:
        assert fence.raised_by_us(exc) and fence.check_origin("test boundary", exc) is True
        assert fence.check_origin("test boundary", exc) is True  # one exception, one fault
    assert [f["piece"] for f in fence.FAULTS] == ["test boundary"]
    assert fence.check_origin("test boundary", fence.SimulationLimit("not simulated")) is False


def test_a_stand_in_target_a_release_lacks_is_a_named_misfit(tmp_path):
    mod = types.ModuleType("fence_fit_throwaway")

    class DeviceInfo:
        def __init__(self, index):
            pass

    mod.DeviceInfo = DeviceInfo
    assert fence.fits("test: device info", mod, "DeviceInfo.__init__")
    assert fence.FIT["test: device info"] == "fits fence_fit_throwaway"
    assert not fence.fits("test: extension", mod, "_get_device_info_extension", "DeviceInfo")
    assert fence.FIT["test: extension"] == ("does not fit fence_fit_throwaway: fence_fit_throwaway has no "
                                            "_get_device_info_extension (not applied)")


def test_verify_pins_skips_a_misfit_only_where_it_says_why():
    from audit.pincheck import not_needed

    piece = "humming device info (csrc/device_info.cpp extension)"
    assert "no device-info extension" in not_needed(piece, "does not fit humming-kernels 0.1.12: x (not applied)")
    assert not_needed(piece, "does not fit humming-kernels 0.1.19: x (not applied)") == ""
    assert not_needed("another stand-in", "does not fit humming-kernels 0.1.12: x (not applied)") == ""


def test_a_stand_in_that_returns_what_the_function_it_replaces_never_returns_is_a_fault():
    """A wrong value vLLM would raise on a line later, in its own frame (a tuple where a DeviceCapability belongs, a
    str for a count): the stand-in's contract catches it at the fence, as a fault of the stand-in."""
    @fence.guard("test: count", contract=fence.returns(int, check=lambda v: v >= 0))
    def count(v):
        return v

    assert count(3) == 3 and not fence.FAULTS
    for wrong in ("8", True, -1, None):
        with pytest.raises(fence.ContractBroken):
            count(wrong)
    assert len(fence.FAULTS) == 4 and fence.FAULTS[0]["piece"] == "test: count"
    assert "returned str '8', where the function it replaces returns int" in fence.FAULTS[0]["message"]
    assert "a bool" in fence.FAULTS[1]["message"] and "never returns" in fence.FAULTS[2]["message"]
    # a planted wrong value (the faults suite's) goes through the same check
    fence.FAULTS.clear()
    fence.plant(fence.WRONG_VALUE + "test: count")
    assert _library_swallows(count, 3) == "swallowed"  # whatever the caller does with it, the fault is recorded
    assert [f["type"].split(":")[1] for f in fence.FAULTS] == ["ContractBroken"]
    assert fence.planted() == {fence.WRONG_VALUE + "test: count"}
