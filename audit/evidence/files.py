"""Read the per-process evidence files the probes write, check their schema, and combine them.

Every file starts with a header record ``{"kind": "header", "schema": N, ...}`` naming what it is evidence
of (mode, pin, the wheel's sha256, the cell, the ``vllm serve`` argv), and ends with a closing record
(``{"kind": "end", "records": N, "sha256": ..., "final": bool}``: the records before it, the digest of their
lines, whether it was the process's last write). A reader refuses a schema it does not know, naming both
versions. A file without its closing record (cut short), or whose records do not match it (changed after it
was written), is *damaged*: its ``damage`` says how, and the host treats its cell as INCOMPLETE rather than
render what is left. Combining keeps every record, tagged with the cell (system, layout) and the process it
came from, in a stable order.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from audit.errors import EvidenceError
from audit.evidence.schema import SCHEMA, check_header, check_record


@dataclass
class EvidenceFile:
    path: Path
    header: dict
    records: list[dict] = field(default_factory=list)
    #: "" for whole evidence; else why it cannot be trusted (cut short, changed, the process never finished)
    damage: str = ""
    #: the closing record said this was the process's last write
    final: bool = True

    @property
    def cell(self) -> tuple[str, str] | None:
        c = self.header.get("cell") or {}
        if "system" in c and "layout" in c:
            return c["system"], c["layout"]
        return None

    #: records by kind, built on the first of_kind (routing asks about a thousand times per audit); rebuilt if
    #: the records list is replaced or grows
    _by_kind: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def of_kind(self, kind: str) -> list[dict]:
        cached = self._by_kind
        if cached is None or cached[0] is not self.records or cached[1] != len(self.records):
            index: dict[str, list[dict]] = {}
            for r in self.records:
                index.setdefault(r.get("kind"), []).append(r)
            cached = self._by_kind = (self.records, len(self.records), index)
        return list(cached[2].get(kind, ()))


#: record kinds about the whole cell (how far it got, its environment, the simulation), not one of its models
CELL_WIDE = frozenset({"stage", "job", "config", "platform", "distributed", "simulated", "fingerprint", "availability",
                       "availability_why", "standin_fit", "fence", "contract", "dispatch-stage"})
#: per-layer records a draft numbers by its own modules (counted from 0), renumbered by vLLM's names for its layers
_MODULE_NUMBERED = ("module", "postload-step", "postload-module")


def model_view(f: EvidenceFile, model: str, numbering: dict[int, int] | None = None) -> EvidenceFile:
    """The records of one model of a cell (``target``, or a speculative ``draft``): those that say they are about
    it (a record that names no role is the target's), with the cell-wide kinds. *numbering*: module layer ->
    vLLM's number for that layer, applied to the records counted by module (a draft's), so each of the model's
    rows names the layer as vLLM serves it."""
    kept = []
    for r in f.records:
        role = r.get("role", "target")
        if role != model and not (r.get("kind") in CELL_WIDE and "role" not in r):
            continue
        if numbering and r.get("kind") in _MODULE_NUMBERED:
            r = dict(r)
            for key in ("layer", "in_layer"):
                if isinstance(r.get(key), int) and r[key] in numbering:
                    r[key] = numbering[r[key]]
        kept.append(r)
    return EvidenceFile(path=f.path, header=f.header, records=kept, damage=f.damage, final=f.final)


def read_file(path: str | Path) -> EvidenceFile:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EvidenceError(f"cannot read evidence: {exc}", path=str(path)) from None
    if not lines:
        raise EvidenceError("empty evidence file (the process wrote nothing)", path=str(path))
    records = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvidenceError(f"malformed JSON: {exc.msg}", path=str(path), line=no) from None
        if not isinstance(rec, dict) or "kind" not in rec:
            raise EvidenceError("record without a 'kind'", path=str(path), line=no)
        records.append(rec)
    header = records[0]
    if header.get("kind") != "header":
        raise EvidenceError("first record is not a header", path=str(path), line=1)
    if header.get("schema") != SCHEMA:
        raise EvidenceError(
            f"evidence schema {header.get('schema')!r}, this harness reads schema {SCHEMA}",
            path=str(path), line=1,
            hint="re-run the audit with this harness's probes, or use the harness that wrote it",
        )
    body = [line for line in lines if line.strip()]
    end = records[-1] if records[-1].get("kind") == "end" else None
    if end is None:
        damage = "cut short: the file has no closing record"
    elif end.get("records") != len(records) - 2:
        damage = (f"the closing record counts {end.get('records')} records, the file holds {len(records) - 2}: "
                  "records were added or removed after it was written")
    elif end.get("sha256") != hashlib.sha256(("\n".join(body[:-1]) + "\n").encode("utf-8")).hexdigest():
        damage = "the records do not match the closing record's sha256: the file was changed after it was written"
    else:
        damage = ""
        _validate(records, lines, path)  # whole as sealed: then it must also say what it is (a reseal is no proof)
    return EvidenceFile(path=path, header=header, records=records[1:-1] if end is not None else records[1:],
                        damage=damage, final=bool(end and end.get("final")))


def _validate(records: list[dict], lines: list[str], path: Path) -> None:
    """Every record is what its kind declares (audit/evidence/schema.py), the header names what the evidence is
    of, the records are numbered 1, 2, ... with none missing, and a finished resolve cell's file ends with the
    fence's account (then only harness faults): a file edited and resealed still says what it is, or is refused
    with its path and line."""
    numbers = [no for no, line in enumerate(lines, 1) if line.strip()]
    why = check_header(records[0])
    if why:
        raise EvidenceError(why, path=str(path), line=numbers[0],
                            hint="evidence this harness's probes write names its model, pin, wheel, cell and role; "
                                 "audit again")
    closed = records[-1].get("kind") == "end"
    body = records[1:-1] if closed else records[1:]
    for i, rec in enumerate(body, 1):
        why = check_record(rec)
        if not why and rec["seq"] != i:
            why = (f"record {rec['seq']} where record {i} belongs: records are missing, added or out of order "
                   "(the probes number every record they write)")
        if why:
            raise EvidenceError(why, path=str(path), line=numbers[i],
                                hint="the file is not what the probes wrote: audit the cell again")
    if closed and records[-1].get("final") and records[0].get("role") == "resolve-agent":
        kinds = [r["kind"] for r in body]
        last = max((i for i, k in enumerate(kinds) if k == "fence"), default=None)
        if last is None or any(k != "harness_fault" for k in kinds[last + 1:]):
            raise EvidenceError("a finished resolve cell's evidence ends with the fence's account (then only harness "
                                "faults); this file does not: records were cut from its end and the file resealed",
                                path=str(path), line=numbers[-1], hint="audit the cell again")


def read_dir(directory: str | Path) -> list[EvidenceFile]:
    """All evidence files below ``directory``, ordered by cell then file name (stable)."""
    directory = Path(directory)
    files = [read_file(p) for p in sorted(directory.rglob("evidence-*.jsonl"))]
    return sorted(files, key=lambda f: (f.cell or ("", ""), f.header.get("role", ""), f.path.name))
