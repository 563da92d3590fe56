"""Expectations: the kernel lanes a perf database claims, checked against what the harness finds.

File format (TOML; ``expectations/kimi-k3.toml`` is the shipped example)::

    schema = 1
    model = "kimi-k3"                                  # the profile it applies to
    framework = "vllm"
    architecture = "KimiK3ForConditionalGeneration"    # claims key on the model, not only the dtype lane
    label_map = "kernel_source_backends.toml"          # optional: label -> backend family, relative path

    [[claim]]
    id = "moe-w4a16-marlin"                            # unique
    lane = "w4a16_mxfp4"                               # perf-db lane: the model profile's perf_lanes
    layouts = ["tp8", "tp16"]                          # layout names, or ["all"]
    systems = ["all"]                                  # system names, SM families (sm90, sm100, ...) or all
    kernel_source = "vllm_..._marlin_marlinexperts"    # optional: the label the perf db carries
    backend = "marlin"                                 # optional: the backend family (at least one of the two)
    forbidden = ["cutlass"]                            # optional: families that must not run
    source = "where the claim comes from"

A claim can be about a batch size (a perf database measures per token count): ``at`` names the
workloads it is judged at, and ``dispatch`` what vLLM's per-call choice must be there::

    [[claim]]
    id = "mla-prefill-512"
    lane = "mla.prefill"
    at = ["prefill 512", "prefill 2048"]               # "decode B" (B one-token requests), "prefill N"
                                                       # (one N-token chunk), "verify N" (N tokens verified)
    backend = "flash_attn"
    dispatch = { latent_tail = "TAIL_FUSION" }         # optional: dispatch lane -> the choice's leading text

Such a claim is judged against the dispatch tier resolved for that workload (audit/report/dispatch.py): the
lane path that serves the workload (a short prefill chunk can take MLA's decode path) and, with
``dispatch``, vLLM's per-call choice. A tier only a GPU decides leaves the claim UNVERIFIED.

A label map file holds ``[labels]`` with ``label = "family"`` entries (the same facts as
aiconfigurator's ``collector/kernel_source_backends.yaml``). Bad input raises ExpectationsError with
the file and line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from audit.errors import InputFileError
from audit.systems import SYSTEMS
from audit.tomlpos import header_lines as _lines
from audit.tomlpos import key_line as _key_line
from audit.tomlpos import read_toml

SCHEMA = 1
_LABEL = re.compile(r"^[a-z0-9][a-z0-9_]*$")
_KEYS = {"id", "lane", "layouts", "systems", "kernel_source", "backend", "forbidden", "source", "at", "dispatch"}
_AT = re.compile(r"^(decode|prefill|verify) ([1-9][0-9]*)$")


def sm_family(system) -> str:
    major, minor = system.capability
    return f"sm{major}{minor}"


class ExpectationsError(InputFileError):
    """A problem in an expectations (claims) or label-map file."""


@dataclass(frozen=True)
class Claim:
    id: str
    lane: str
    harness_lane: str
    layouts: tuple[str, ...]
    systems: tuple[str, ...]  # concrete system names
    kernel_source: str = ""
    backend: str = ""
    forbidden: tuple[str, ...] = ()
    source: str = ""
    line: int = 0
    at: tuple[str, ...] = ()  # workloads ("decode 1", "prefill 512", "verify 32") the claim is about
    dispatch: tuple[tuple[str, str], ...] = ()  # (dispatch lane, leading text of the expected choice)

    def covers(self, system: str, layout: str, harness_lane: str) -> bool:
        return harness_lane == self.harness_lane and system in self.systems and layout in self.layouts


@dataclass(frozen=True)
class Expectations:
    path: Path
    model: str
    framework: str
    architecture: str
    claims: tuple[Claim, ...]
    label_map: dict[str, str] = field(default_factory=dict)


def _toml(path: Path) -> tuple[str, dict]:
    return read_toml(path, ExpectationsError)


def load_label_map(path: Path) -> dict[str, str]:
    text, data = _toml(path)
    labels = data.get("labels")
    if data.get("schema") != SCHEMA or not isinstance(labels, dict):
        raise ExpectationsError(f"a label map needs 'schema = {SCHEMA}' and a [labels] table", path=str(path))
    out = {}
    start = (_lines(text, "[labels]") or [0])[0] + 1
    for label, family in labels.items():
        if not _LABEL.match(label) or not isinstance(family, str) or not _LABEL.match(family):
            raise ExpectationsError(f"malformed label entry {label!r} = {family!r}", path=str(path),
                                    line=_key_line(text, start, label), hint="labels and families are lower_snake_case")
        out[label] = family
    return out


def _tier_keys(raw: dict, cid: str, lane: str, err, lane_phases: dict,
               dispatch_lanes: dict[str, str]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """A claim's ``at`` workloads and ``dispatch`` expectations (lanes of *dispatch_lanes*, its model's), checked."""

    at = raw.get("at", [])
    if not isinstance(at, list) or not at and "at" in raw or not all(isinstance(w, str) for w in at):
        raise err(f"claim {cid!r}: at must be a non-empty list of workloads, got {at!r}", "at",
                  hint='e.g. at = ["decode 1", "decode 64", "prefill 2048"]')
    phases = lane_phases.get(lane)
    for w in at:
        m = _AT.match(w)
        if not m:
            raise err(f"claim {cid!r}: workload {w!r} is not '<decode|prefill|verify> <tokens>'", "at",
                      hint='e.g. "decode 8" (8 one-token requests), "prefill 2048" (one 2048-token chunk), '
                           '"verify 32" (32 tokens verified)')
        if phases and m.group(1) not in phases:
            raise err(f"claim {cid!r}: lane {lane} is measured at {' or '.join(phases)} only, not {w!r}", "at")
    if len(set(at)) != len(at):
        raise err(f"claim {cid!r}: at names a workload twice", "at")
    expected = raw.get("dispatch", {})
    if not isinstance(expected, dict) or not all(isinstance(v, str) and v for v in expected.values()):
        raise err(f"claim {cid!r}: dispatch must be a table of dispatch lane = \"leading text of the choice\"",
                  "dispatch", hint='e.g. dispatch = { serving_path = "FULL graph" }')
    for dlane in expected:
        if dlane not in dispatch_lanes:
            raise err(f"claim {cid!r}: unknown dispatch lane {dlane!r}", "dispatch",
                      hint="known: " + ", ".join(dispatch_lanes))
    if expected and not at:
        raise err(f"claim {cid!r}: dispatch expectations need the workloads they hold at", "dispatch",
                  hint='add at = ["decode 1", ...]')
    return tuple(at), tuple(sorted(expected.items()))


def _read_claim(raw: dict, line: int, err, profile, label_map: dict, dispatch_lanes: dict, seen: dict) -> Claim:
    """One [[claim]] table, checked against its model's vocabulary (*profile*); *err* makes an error at its line."""
    perf_lanes, layout_names = profile.perf_lanes, list(profile.layouts)
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise err(f"unknown key {unknown[0]!r} in [[claim]]", unknown[0], hint="known: " + ", ".join(sorted(_KEYS)))
    cid = raw.get("id")
    if not isinstance(cid, str) or not cid:
        raise err("claim without an id")
    if cid in seen:
        raise err(f"duplicate claim id {cid!r} (first at line {seen[cid]})", "id")
    seen[cid] = line
    lane = raw.get("lane")
    if lane not in perf_lanes:
        raise err(f"claim {cid!r}: unknown lane {lane!r} for {profile.title}", "lane",
                  hint="known lanes: " + ", ".join(perf_lanes))
    for key in ("id", "lane", "kernel_source", "backend", "source"):
        if key in raw and not isinstance(raw[key], str):
            raise err(f"claim {raw.get('id', '?')!r}: {key} must be a string, got {type(raw[key]).__name__}",
                      key)
    for key in ("layouts", "systems", "forbidden"):
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise err(f"claim {raw.get('id', '?')!r}: {key} must be a list of strings, got {value!r}", key,
                      hint=f'e.g. {key} = ["all"]' if key != "forbidden" else 'e.g. forbidden = ["cutlass"]')
        if not value and key != "forbidden":
            raise err(f"claim {raw.get('id', '?')!r}: {key} is empty, so the claim would judge nothing", key,
                      hint='name at least one, or ["all"]')
    layouts = raw.get("layouts", ["all"])
    if layouts == ["all"]:
        layouts = list(layout_names)
    for name in layouts:
        if name not in layout_names:
            raise err(f"claim {cid!r}: unknown layout {name!r} for {profile.title}", "layouts",
                      hint="known: " + ", ".join(layout_names))
    systems = []
    for name in raw.get("systems", ["all"]):
        if name == "all":
            systems += list(SYSTEMS)
        elif name in SYSTEMS:
            systems.append(name)
        elif name in {sm_family(s) for s in SYSTEMS.values()}:
            systems += [s.name for s in SYSTEMS.values() if sm_family(s) == name]
        else:
            raise err(f"claim {cid!r}: unknown system {name!r}", "systems",
                      hint="system names, SM families (" + ", ".join(sorted({sm_family(s) for s in SYSTEMS.values()}))
                      + ") or all")
    ks, backend = raw.get("kernel_source", ""), raw.get("backend", "")
    if not ks and not backend:
        raise err(f"claim {cid!r} names neither kernel_source nor backend", hint="a claim must say what runs")
    if ks and not _LABEL.match(ks):
        raise err(f"claim {cid!r}: malformed kernel_source label {ks!r}", "kernel_source",
                  hint="labels are lower_snake_case, e.g. vllm_mxfp4moe_marlin_marlinexperts")
    for fam in [backend, *raw.get("forbidden", [])]:
        if fam and not _LABEL.match(fam):
            raise err(f"claim {cid!r}: malformed backend family {fam!r}", "backend")
    if ks and not backend and ks not in label_map:
        raise err(f"claim {cid!r}: label {ks!r} is not in the label map and no backend is given", "kernel_source")
    at, expect_dispatch = _tier_keys(raw, cid, lane, err, profile.perf_lane_phases, dispatch_lanes)
    return Claim(id=cid, lane=lane, harness_lane=perf_lanes[lane], layouts=tuple(layouts),
                 systems=tuple(dict.fromkeys(systems)), kernel_source=ks,
                 backend=backend or label_map.get(ks, ""), forbidden=tuple(raw.get("forbidden", [])),
                 source=raw.get("source", ""), line=line, at=at, dispatch=expect_dispatch)


def load(path: str | Path) -> Expectations:
    path = Path(path)
    sp = str(path)
    text, data = _toml(path)
    if data.get("schema") != SCHEMA:
        raise ExpectationsError(f"schema is {data.get('schema')!r}, this harness reads {SCHEMA}", path=sp, line=1)
    for key in ("model", "framework", "architecture"):
        if not isinstance(data.get(key), str) or not data.get(key):
            raise ExpectationsError(f"top-level {key!r} is required", path=sp, line=_key_line(text, 1, key))
    from audit import models

    profile = models.PROFILES.get(data["model"])
    if profile is None:
        raise ExpectationsError(f"claims are about model {data['model']!r}, which this harness has no profile for",
                                path=sp, line=_key_line(text, 1, "model"),
                                hint="known models: " + ", ".join(models.PROFILES))
    from audit.report.dispatch import lane_titles

    dispatch_lanes = lane_titles(profile)
    if not isinstance(data.get("claim", []), list):
        raise ExpectationsError("'claim' must be an array of tables ([[claim]])", path=sp,
                                line=_key_line(text, 1, "claim"))
    if "label_map" in data and not isinstance(data["label_map"], str):
        raise ExpectationsError("label_map must be a path (a string)", path=sp, line=_key_line(text, 1, "label_map"))
    label_map = {}
    if data.get("label_map"):
        label_map = load_label_map(path.parent / data["label_map"])
    headers = _lines(text, "[[claim]]")
    claims, seen = [], {}
    for idx, raw in enumerate(data.get("claim", [])):
        line = headers[idx] if idx < len(headers) else 0

        def err(msg, key=None, hint=None, line=line):
            return ExpectationsError(msg, path=sp, line=_key_line(text, line + 1, key) if key else line, hint=hint)

        claims.append(_read_claim(raw, line, err, profile, label_map, dispatch_lanes, seen))
    if not claims:
        raise ExpectationsError("no [[claim]] tables", path=sp)
    return Expectations(path=path, model=data["model"], framework=data["framework"],
                        architecture=data["architecture"], claims=tuple(claims), label_map=label_map)
