"""Stages of a probe process: each is recorded with its outcome and duration, and a failing one is
evidence (a ``stage`` record with the exception), then :class:`StageFailed` for the caller."""
from __future__ import annotations

import contextlib
import re
import time
import traceback

from probes.core import fence
from probes.core.recorder import Recorder


class StageFailed(Exception):
    pass


class Stage(contextlib.AbstractContextManager):
    def __init__(self, rec: Recorder, name: str):
        self.rec, self.name = rec, name

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, et, ev, tb):
        seconds = round(time.perf_counter() - self.t0, 3)
        if ev is None:
            self.rec.emit("stage", stage=self.name, ok=True, seconds=seconds)
            return False
        fence.check_origin(f"stage {self.name}", ev)  # the harness's own code raised: a fault, not a stop
        where = traceback.extract_tb(tb)[-1] if tb else None
        self.rec.emit("stage", stage=self.name, ok=False, seconds=seconds,
                      error={"type": f"{et.__module__}:{et.__qualname__}", "message": str(ev)[:4000],
                             "where": f"{where.filename}:{where.lineno} in {where.name}" if where else "",
                             "traceback": traceback.format_exception(et, ev, tb)[-12:]})
        raise StageFailed(self.name) from ev


#: messages that name the simulation itself, whatever raised them
SIMULATION_WORDS = re.compile(r"\bmeta\b|stand-in|is not simulated|CUDA_ERROR|cuInit|no NVIDIA driver|"
                              r"Found no NVIDIA|libcuda|CUDA driver|NOT_INITIALIZED", re.IGNORECASE)


#: in a weight-loading step fed no tensors: the function that raised loads weights itself, or the message
#: is about which tensors the checkpoint held
WEIGHT_LOADING_FUNCTION = re.compile(r"(?:^|_)load_weights?$|weight_loader|^_load_module$|^_load_param$")
WEIGHT_CHECK_WORDS = re.compile(r"checkpoint|\bmissing\b|not (?:been )?loaded|unexpected (?:weight|key|param)",
                                re.IGNORECASE)


#: the exception type (``module:qualname``) a stand-in raises where the library vLLM selected carries no code for the
#: GPU's SM (probes.core.fence.NoDeviceCode)
NO_DEVICE_CODE = "probes.core.fence:NoDeviceCode"


def stop_rule(*, in_vllm: bool, assertion: bool, raise_line: bool | None, cause: str | None,
              message: str, fed_no_weights: bool = False, raised_in: str = "", type_name: str = "",
              engine: str = "vLLM") -> tuple[str, str]:
    """(outcome, rule) for an exception that stopped a step of the simulation: ``refused`` when the engine's own
    code said no (an explicit ``raise`` in one of the engine's source files, not an assertion, not chained from
    another exception, not about the simulation), else ``limit``: the simulation could not go further. Shared by
    the post-load stage (live exceptions) and the host (recorded tracebacks of construction stops);
    *in_vllm* says the raising frame is in the engine's own source (named so for the first engine, whose records
    predate the others); *engine* names the engine in the rule's words; *raise_line* None means the raising line
    is unknown, *cause* names the chained exception; *fed_no_weights* says the step ran ``load_weights`` on an
    empty stream, where the loading's own check on the tensors it received (raised by *raised_in*, a
    weight-loading function, or naming the checkpoint or missing weights) is the simulation's doing."""
    e = engine
    if type_name == NO_DEVICE_CODE:
        return "refused", (f"the library {e} selected carries no code for this GPU's SM (read from what it ships): "
                           "on the device, loading fails here")
    if not in_vllm:
        return "limit", f"raised outside {e} (torch, a compiled op, a library, or a stand-in)"
    if assertion:
        return "limit", f"an assertion in {e} about the tensors it was given (meta tensors)"
    if raise_line is False:
        return "limit", f"raised by a call inside {e}'s line (an op or extension), not a {e} check"
    if cause is not None:
        return "limit", f"{e} re-raised {cause} from a call it made"
    if SIMULATION_WORDS.search(message):
        return "limit", f"{e}'s message names the simulation (meta tensors, the stub driver)"
    if fed_no_weights and (WEIGHT_LOADING_FUNCTION.search(raised_in) or WEIGHT_CHECK_WORDS.search(message)):
        return "limit", f"{e}'s weight loading checked the tensors it received; the simulation feeds none"
    return "refused", f"an explicit raise in {e}'s own code"
