"""Observe mode's hot path: count kernel-entry calls per (path, layer, phase) without touching vLLM.

A counting wrapper does one thing per call: add 1 to a slot of a preallocated list chosen by the
path it wraps, the current layer and the current phase, then call the original. No container
grows, nothing is logged, formatted or synchronised with a device (CPython does allocate a new int
object once a count passes 256: measured, a list slot is still cheaper than an ``array`` slot); the
layer and phase are read from a small list the scope wrappers keep current (``Counters.state``).

CUDA graphs: while a graph is being captured (``state[GRAPH]`` is non-zero, set by the graph-manager
probe around capture), a call is *not* an execution: it is recorded as "path P (layer, phase) is
inside graph G" instead, and each later replay of G is counted per graph. A capture is never counted
as an execution. Eager calls and replays are flushed into evidence at the end and on a timer.

Standard library only.
"""
from __future__ import annotations

import functools
import threading

from probes.core.patching import SENTINEL

PHASES = ("prefill", "decode", "spec-verify", "mixed", "unknown")
PHASE_INDEX = {p: i for i, p in enumerate(PHASES)}
#: state slots: OFFSET = layer slot * len(PHASES) + phase index, precomputed so a call adds one index
OFFSET, GRAPH, LAYER, PHASE = 0, 1, 2, 3


class Counters:
    """Per-process counters. Registration and flushing are cold; :meth:`counting_wrapper`'s calls are hot."""

    def __init__(self, max_layers: int = 256):
        self.max_layers = max_layers
        self.n_layer_slots = max_layers + 1  # the last slot: a call outside any known layer
        self.stride = self.n_layer_slots * len(PHASES)
        self.paths: list[str] = []
        self.counts: list[int] = []
        #: [offset, graph id (0: not capturing), layer slot, phase index]
        self.state = [0, 0, max_layers, PHASE_INDEX["unknown"]]
        self._update()
        #: graph id -> {"key": description, "paths": {(path, layer, phase)}, "replays": int}
        self.graphs: dict[int, dict] = {}
        self._lock = threading.Lock()

    # -- cold: registration ------------------------------------------------------------------
    def register(self, path: str) -> int:
        """Reserve this path's slots; returns its base offset."""
        with self._lock:
            if path in self.paths:
                return self.paths.index(path) * self.stride
            self.paths.append(path)
            self.counts.extend([0] * self.stride)
            return (len(self.paths) - 1) * self.stride

    def reset(self) -> None:
        """Zero every count and forget graphs (e.g. in a forked child)."""
        for i in range(len(self.counts)):
            self.counts[i] = 0
        self.graphs.clear()
        self.state[1] = 0

    def layer_slot(self, layer: int | None) -> int:
        if layer is None or layer < 0 or layer >= self.max_layers:
            return self.max_layers
        return layer

    # -- scope setters (called once per layer/step, not per kernel call) ---------------------------
    def _update(self) -> None:
        st = self.state
        st[OFFSET] = st[LAYER] * len(PHASES) + st[PHASE]

    def set_layer(self, layer: int | None) -> None:
        self.state[LAYER] = self.layer_slot(layer)
        self._update()

    def set_phase(self, phase: str) -> None:
        self.state[PHASE] = PHASE_INDEX.get(phase, PHASE_INDEX["unknown"])
        self._update()

    def begin_capture(self, key: str) -> int:
        gid = len(self.graphs) + 1
        self.graphs[gid] = {"key": key, "paths": set(), "replays": 0}
        self.state[GRAPH] = gid
        return gid

    def end_capture(self) -> None:
        self.state[GRAPH] = 0

    def replayed(self, gid: int) -> None:
        g = self.graphs.get(gid)
        if g is not None:
            g["replays"] += 1

    def _captured(self, base: int) -> None:
        """A call while a graph is being captured: membership, not an execution (cold: capture only)."""
        st = self.state
        g = self.graphs.get(st[GRAPH])
        if g is not None:
            g["paths"].add((self.paths[base // self.stride], st[LAYER], st[PHASE]))

    # -- hot ---------------------------------------------------------------------------------------
    def counting_wrapper(self, fn, path: str, *, layer_of=None):
        """A wrapper counting calls of *fn* as *path*. ``layer_of(args)`` may name the layer per call
        (e.g. from the module instance a method is bound to); otherwise the current layer scope is used."""
        base = self.register(path)
        counts, state, captured = self.counts, self.state, self._captured
        max_layers, n_phases = self.max_layers, len(PHASES)

        if layer_of is None:
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                if state[1]:
                    captured(base)
                else:
                    counts[base + state[0]] += 1
                return fn(*args, **kwargs)
        else:
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                try:
                    layer = layer_of(args)
                    if layer is None or layer < 0 or layer >= max_layers:
                        layer = max_layers
                    state[2] = layer
                    state[0] = layer * n_phases + state[3]
                except Exception:  # attribution must never break the call
                    pass
                if state[1]:
                    captured(base)
                else:
                    counts[base + state[0]] += 1
                return fn(*args, **kwargs)
        setattr(wrapper, SENTINEL, "count:" + path)
        return wrapper

    # -- cold: reading -------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """{"eager": [{path, layer, phase, calls}], "graphs": [{id, key, replays, paths: [...]}]}."""
        rows = []
        n_phases = len(PHASES)
        for p, path in enumerate(self.paths):
            base = p * self.stride
            for slot in range(self.n_layer_slots):
                for ph in range(n_phases):
                    n = self.counts[base + slot * n_phases + ph]
                    if n:
                        rows.append({"path": path, "layer": None if slot == self.max_layers else slot,
                                     "phase": PHASES[ph], "calls": n})
        graphs = []
        for gid, g in sorted(self.graphs.items()):
            graphs.append({"id": gid, "key": g["key"], "replays": g["replays"],
                           "paths": [{"path": p, "layer": None if l == self.max_layers else l, "phase": PHASES[ph]}
                                     for p, l, ph in sorted(g["paths"])]})
        return {"eager": rows, "graphs": graphs}


__all__ = ["Counters", "PHASES"]
