"""Summaries of the torch.profiler traces vLLM's workers write (observe mode's corroboration).

With ``--profiler-config '{"profiler": "torch", "torch_profiler_dir": DIR, ...}'`` every vLLM worker
writes, per profiling session, one Chrome trace named ``<prefix>_<rank suffix>.<ns>.pt.trace.json.gz``
(the prefix is the one given to ``/start_profile``, the suffix vLLM's
``get_worker_rank_suffix``: ``dp0_pp0_tp0_dcp0_ep0_rank0``). The workload starts one session per
phase with the phase's name as the prefix.

:func:`summarize` reads those files and keeps, per file, how many times each GPU kernel name was
launched (``"cat": "kernel"`` events), split into launches from a CUDA graph replay (CUPTI gives
such kernels a ``graph id``) and direct launches. Traces stay on disk for a human; the evidence
carries only these counts. Standard library only.
"""
from __future__ import annotations

import gzip
import json
import os
import re

#: trace file name: worker name, a nanosecond stamp, the suffix torch's tensorboard handler writes
TRACE_NAME = re.compile(r"^(?P<worker>.+)\.(?P<stamp>\d+)\.pt\.trace\.json(?:\.gz)?$")
#: vLLM's rank suffix at the end of the worker name
RANK_SUFFIX = re.compile(r"(?:^|_)(?P<suffix>(?:dp(?P<dp>\d+)_pp\d+_tp(?P<tp>\d+)_dcp\d+_ep(?P<ep>\d+)_)?"
                         r"rank(?P<rank>\d+))$")
#: event categories counted as GPU kernels (what CUPTI's kernel activity becomes in a Kineto trace)
KERNEL_CATEGORIES = ("kernel",)


def parse_trace_name(name: str) -> dict | None:
    """``{"worker", "prefix", "rank", "tp", "dp", "ep"}`` from a trace file name, or None if it is not one."""
    m = TRACE_NAME.match(name)
    if not m:
        return None
    worker = m["worker"]
    r = RANK_SUFFIX.search(worker)
    out = {"worker": worker, "prefix": worker, "rank": None, "dp": None, "tp": None, "ep": None}
    if r:
        out["prefix"] = worker[:r.start()].rstrip("_")
        out.update({k: (int(r[k]) if r[k] is not None else None) for k in ("rank", "dp", "tp", "ep")})
    return out


def _in_graph(args) -> bool:
    if not isinstance(args, dict):
        return False
    gid = args.get("graph id", args.get("graph_id"))
    try:
        return int(gid) != 0
    except (TypeError, ValueError):
        return False


def read_trace(path: str, categories=KERNEL_CATEGORIES) -> dict:
    """Kernel launch counts of one trace: ``{"kernels": {name: [direct, in_graph]}, "events": n}``."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        doc = json.load(fh)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError("no traceEvents list")
    kernels: dict[str, list[int]] = {}
    wanted = set(categories)
    for ev in events:
        if not isinstance(ev, dict) or ev.get("cat") not in wanted or ev.get("ph") not in ("X", None):
            continue
        name = ev.get("name")
        if not isinstance(name, str):
            continue
        slot = kernels.setdefault(name, [0, 0])
        slot[1 if _in_graph(ev.get("args")) else 0] += 1
    return {"kernels": kernels, "events": len(events)}


def summarize(trace_dir: str, categories=KERNEL_CATEGORIES) -> list[dict]:
    """One entry per trace file under *trace_dir* (sorted by name): its session prefix, rank and
    kernel launch counts, or the error that kept it from being read (a truncated file, say)."""
    out = []
    if not os.path.isdir(trace_dir):
        return out
    for root, _dirs, names in os.walk(trace_dir):
        for name in names:
            meta = parse_trace_name(name)
            if meta is None:
                continue
            path = os.path.join(root, name)
            entry = {"file": os.path.relpath(path, trace_dir), "prefix": meta["prefix"], "rank": meta["rank"],
                     "tp": meta["tp"], "dp": meta["dp"], "ep": meta["ep"], "bytes": os.path.getsize(path)}
            try:
                got = read_trace(path, categories)
            except (OSError, ValueError, EOFError, UnicodeDecodeError) as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            else:
                entry["events"] = got["events"]
                entry["kernels"] = {k: {"direct": v[0], "in_graph": v[1]} for k, v in sorted(got["kernels"].items())}
            out.append(entry)
    return sorted(out, key=lambda e: e["file"])


__all__ = ["KERNEL_CATEGORIES", "parse_trace_name", "read_trace", "summarize"]
