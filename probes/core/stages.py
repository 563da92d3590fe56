"""Stages of a probe process: each is recorded with its outcome and duration, and a failing one is
evidence (a ``stage`` record with the exception), then :class:`StageFailed` for the caller."""
from __future__ import annotations

import contextlib
import time
import traceback

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
        where = traceback.extract_tb(tb)[-1] if tb else None
        self.rec.emit("stage", stage=self.name, ok=False, seconds=seconds,
                      error={"type": f"{et.__module__}:{et.__qualname__}", "message": str(ev)[:4000],
                             "where": f"{where.filename}:{where.lineno} in {where.name}" if where else "",
                             "traceback": traceback.format_exception(et, ev, tb)[-12:]})
        raise StageFailed(self.name) from ev
