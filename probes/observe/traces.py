"""Summaries of the torch.profiler traces vLLM's workers write (observe mode's corroboration).

With ``--profiler-config '{"profiler": "torch", "torch_profiler_dir": DIR, ...}'`` every vLLM worker
writes, per profiling session, one Chrome trace named ``<prefix>_<rank suffix>.<ns>.pt.trace.json.gz``
(the prefix is the one given to ``/start_profile``, the suffix vLLM's
``get_worker_rank_suffix``: ``dp0_pp0_tp0_dcp0_ep0_rank0``). The workload starts one session per
phase with the phase's name as the prefix.

:func:`summarize` reads those files and keeps, per file, how many times each GPU kernel name was
launched (``"cat": "kernel"`` events), split into launches from a CUDA graph replay and direct
launches. Traces stay on disk for a human; the evidence carries only these counts. Standard library
only.

How a replayed kernel is recognised: a kernel event's ``correlation`` id is that of the host API call
that launched it. A kernel launched by a graph replay carries the correlation id of the
``cudaGraphLaunch`` (runtime API, ``"cat": "cuda_runtime"``) or ``cuGraphLaunch`` (driver API,
``"cat": "cuda_driver"``) event of that replay: on an H200 with driver 580, torch 2.11.0+cu130, no
kernel event of a trace carried a ``graph id`` (tests/data/gpu-traces/), so the correlation is what
tells them apart. Where a Kineto does write a non-zero ``graph id`` on a kernel, that counts too.
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
#: categories of host API events (CUPTI runtime and driver API activity in a Kineto trace)
API_CATEGORIES = ("cuda_runtime", "cuda_driver")
#: host API calls that launch a whole CUDA graph (with the suffixes CUPTI adds for API versions and
#: per-thread default streams: ``cudaGraphLaunch_v10000``, ``cuGraphLaunch_ptsz``)
GRAPH_LAUNCH = re.compile(r"^cu(?:da)?GraphLaunch(?:_v\d+|_ptsz|_ptds)*$")


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


def _graph_id(args) -> int:
    """The non-zero ``graph id`` a newer Kineto writes on a replayed kernel, else 0."""
    if not isinstance(args, dict):
        return 0
    gid = args.get("graph id", args.get("graph_id"))
    try:
        return int(gid)
    except (TypeError, ValueError):
        return 0


def _correlation(args):
    if not isinstance(args, dict):
        return None
    c = args.get("correlation")
    return c if isinstance(c, int) and not isinstance(c, bool) else None


def _load_events(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        doc = json.load(fh)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError("no traceEvents list")
    return events


def attribute(events, categories=KERNEL_CATEGORIES) -> dict:
    """Kernel launch counts of a list of trace events.

    ``{"kernels": {name: [direct, in_graph]}, "events": n, "graph_launches": n, "by_graph_id": n,
    "by_correlation": n}``: a kernel is in a graph when it carries a non-zero ``graph id``
    (``by_graph_id``) or, failing that, when its correlation id is that of a graph-launch API event
    (``by_correlation``); ``graph_launches`` is the number of such API events (replays)."""
    launches: set[int] = set()
    n_launches = 0
    api = set(API_CATEGORIES)
    for ev in events:
        if isinstance(ev, dict) and ev.get("cat") in api and isinstance(ev.get("name"), str) \
                and GRAPH_LAUNCH.match(ev["name"]):
            n_launches += 1
            c = _correlation(ev.get("args"))
            if c is not None:
                launches.add(c)
    kernels: dict[str, list[int]] = {}
    by_gid = by_corr = 0
    wanted = set(categories)
    for ev in events:
        if not isinstance(ev, dict) or ev.get("cat") not in wanted or ev.get("ph") not in ("X", None):
            continue
        name = ev.get("name")
        if not isinstance(name, str):
            continue
        args = ev.get("args")
        slot = kernels.setdefault(name, [0, 0])
        if _graph_id(args):
            by_gid += 1
            slot[1] += 1
        elif _correlation(args) in launches:
            by_corr += 1
            slot[1] += 1
        else:
            slot[0] += 1
    return {"kernels": kernels, "events": len(events), "graph_launches": n_launches, "by_graph_id": by_gid,
            "by_correlation": by_corr}


def read_trace(path: str, categories=KERNEL_CATEGORIES) -> dict:
    """Kernel launch counts of one trace file (see :func:`attribute`)."""
    return attribute(_load_events(path), categories)


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
                entry["graph_launches"] = got["graph_launches"]
                entry["kernels"] = {k: {"direct": v[0], "in_graph": v[1]} for k, v in sorted(got["kernels"].items())}
            out.append(entry)
    return sorted(out, key=lambda e: e["file"])


__all__ = ["API_CATEGORIES", "GRAPH_LAUNCH", "KERNEL_CATEGORIES", "attribute", "parse_trace_name", "read_trace",
           "summarize"]
