"""The pull-request summary of a pin bump: the markdown a reviewer pastes into the PR, the one part of the audit most
of them read. A view of the diff's classed rows (``audit/report/diff.py``, classed by ``audit/report/changes.py``)
and of the two audits' ``routing.json``; deterministic, and self-contained: every sentence is true as written.

Most important first, and nothing consequential behind "and N more":

* the gate's answer, with every count in one unit (rows of the diff) and every audited system named (the unchanged
  ones as unchanged);
* every serving change, ranked by its kind (experts class and new paths, refusals, kernels, stops, per-call
  choices): a kernel, experts-class, path or refusal row is always named; per-call choices are grouped by lane
  (each lane named, with its rows' cells);
* the perf-database rows whose label moved (re-measure them), per layout with that layout's own batch sizes;
* refusals that appeared, went away, moved stage, or stand in both builds (a batch vLLM raises on included);
* claims newly failing or no longer failing, with their batches, and claims that fail against another backend now;
* the caveats that apply to the changed rows (post-load stops as "N of M steps"; choices made on the device).

A word budget (about :data:`WORDS`) shortens only what may be shortened: long before/after values are cut to their
head (the diff holds them whole), information is never listed here, and where it is still over, change rows of one
lane and kind are grouped into one line that names each.
"""
from __future__ import annotations

from audit import engines

from collections import defaultdict

from audit.lanevalue import is_inactive
from audit.report import changes as classes
from audit.report.dispatch import workload_order
from audit.report.perflabels import build_labels
from audit.report.refusals import cell_refusals

#: the word budget: about this many words before grouping rows of one lane into one line
WORDS = 450


def _label_points(labels: dict) -> dict[tuple, dict[str, tuple]]:
    """(system, layout, harness lane) -> {batch: (perf lane, family, kernel source, kernel)}; "all" where the row
    has no per-batch split."""
    out: dict[tuple, dict[str, tuple]] = defaultdict(dict)
    for r in labels["rows"]:
        k = (r["system"], r["layout"], r["harness_lane"], r.get("model", "target"))  # a draft's row is its own
        out[k]["all"] = (r["lane"], r["backend"], r["kernel_source"], r.get("kernel", ""))
        for t in r.get("by_tokens") or []:
            out[k][t["tokens"]] = (r["lane"], t.get("backend", "unknown"), t.get("kernel_source", "unknown"),
                                   t.get("kernel", ""))
    return out


def label_changes(old: dict, new: dict, profile) -> list[dict]:
    """The perf-database rows whose label moved between two audits: one entry per (harness lane, before, after) with,
    per layout, the systems and batch sizes it covers (never a product of layouts and batches). A batch one audit
    splits out and the other does not compares against the other's whole-lane label."""
    a, b = (_label_points(build_labels(r, profile, (r.get("verdicts") or {}).get("label_map") or {}))
            for r in (old, new))
    moved: dict[tuple, dict] = {}
    for k in sorted(set(a) & set(b)):
        pa, pb = a[k], b[k]
        batches = sorted((set(pa) | set(pb)) - {"all"}, key=workload_order) or ["all"]
        for t in batches:
            before, after = pa.get(t, pa.get("all")), pb.get(t, pb.get("all"))
            if before is None or after is None or before == after:
                continue
            per = moved.setdefault((k[2], k[3], before, after), {}).setdefault(k[1], {"systems": set(), "batches": set()})
            per["systems"].add(k[0])
            per["batches"].add(t)
    out = []
    for (lane, model, before, after), layouts in sorted(moved.items()):
        perf = after[0] if after[0] != "unknown" else before[0]
        out.append({"harness_lane": lane, "model": model, "perf_lane": perf, "before": before, "after": after,
                    "layouts": {lay: {"systems": sorted(v["systems"]), "batches": sorted(v["batches"], key=workload_order)}
                                for lay, v in layouts.items()},
                    "rows": sum(len(v["systems"]) * len(v["batches"]) for v in layouts.values())})
    return out


class View:
    """What every block of the summary reads: the diff, both audits, the model's profile, and how cells and
    systems are named."""

    def __init__(self, d: dict, old: dict, new: dict, profile):
        from audit.report.render import collapse_cells
        from audit.systems import SYSTEMS

        self.d, self.old, self.new, self.profile = d, old, new, profile
        self.audited = [f"{c['system']}/{c['layout']}" for c in new["cells"]]
        self.order = list(profile.layouts)
        self.titles = {**old.get("lane_titles", {}), **new.get("lane_titles", {})}
        self.rows = d["changes"]
        self.serving = [r for r in self.rows if r.get("serving")]
        self._collapse = collapse_cells
        self.systems = SYSTEMS
        self.layouts_of = {c["layout"] for c in new["cells"]}
        self.tight = False
        #: the same build audited on two hosts (audit/pins/hosts.py): the sides are hosts, not builds
        self.hosted = (d["from"].get("host") or "") != (d["to"].get("host") or "")
        self.sides = "hosts" if self.hosted else "builds"

    def where(self, cells) -> str:
        return self._collapse([f"{s}/{l}" for s, l in cells], self.audited, self.order)

    def on(self, systems, layouts) -> str:
        """The systems of some cells in words ("SM 10.0, SM 10.3", "every audited system"), the layouts left out."""
        cells = [(s, lay) for lay in layouts for s in systems]
        text = self.where(cells)
        return text.split(": ", 1)[1] if ";" not in text and ": " in text else text

    def title(self, lane: str) -> str:
        """A lane's title without its parenthesized detail."""
        return self.titles.get(lane, lane).split(" (")[0]

    def family(self, name: str) -> str:
        """``SM 10.0`` -> "SM 10.0 (b200_sxm, gb200)"; a system name as it is."""
        members = sorted({c["system"] for c in self.new["cells"] if c["system"] in self.systems
                          and f"SM {self.systems[c['system']].sm}" == name})
        return f"{name} ({', '.join(members)})" if members else name


def _short(text: str, n: int = 12) -> str:
    words = str(text).split()
    return " ".join(words[:n]) + (" …" if len(words) > n else "")


def _head(v: View) -> str:
    d = v.d
    levels = sorted({str(c.get("evidence", "")).split(" ")[0] for c in v.new["cells"]} - {"", "none"})
    evidence = {"resolved": "resolved (vLLM's selection code on a simulated platform; no kernel ran)",
                "observed": "observed (kernel entries hit on a real GPU)"}
    vk = engines.get(v.profile.engine).version_key
    pins = "" if (d["from"]["pin"], d["to"]["pin"]) == (f"v{d['from'][vk]}", f"v{d['to'][vk]}") \
        else f" (`{d['from']['pin']}` → `{d['to']['pin']}`)"
    systems = len({c["system"] for c in v.new["cells"]})
    layouts = len({c["layout"] for c in v.new["cells"]})
    hosted = v.hosted
    what = (f"vLLM {d['from'][vk]}, host {d['from'].get('host_title') or 'not recorded'} → "
            f"{d['to'].get('host_title') or 'not recorded'}" if hosted else
            f"vLLM {d['from'][vk]} → {d['to'][vk]}")
    head = (f"**{v.profile.title}, {what}**{pins if not hosted else ''}: "
            f"{d['cells_compared']} cells compared (a cell: one system and one layout; {systems} systems × {layouts} "
            f"layouts, each layout where it applies); evidence {', '.join(evidence.get(x, x) for x in levels) or 'none'}. ")
    if not d["cells_compared"]:
        return head + "**Nothing was judged**: the two audits share no cell."
    if hosted:  # the same build on two hosts: every serving row is a kernel that depends on the host
        facts = ", ".join(f"{k.replace('_', '-')} {_yes(a)} → {_yes(b)}" for k, a, b in d.get("hosts") or [])
        head += (f"The hosts differ in what vLLM's availability checks read ({facts or 'nothing recorded'}). "
                 + ("**These kernels depend on the host**: " if v.serving else "**No kernel depends on the host**: ")
                 + d["headline"] + " (information rows change no kernel).")
    else:
        head += ("**The pin-bump gate fails** (exit 6): " if v.serving else "**No serving change**: ") + d["headline"] + \
            " (information rows change no kernel; the diff lists them with the reason)."
    packages = d.get("packages") or []
    envs = (f" The compared environments differ in {len(packages)} package(s): "
            + ", ".join(f"{name} {a} → {b}" for name, a, b in packages) + ".") if packages else \
        " The compared environments hold the same package versions."
    return head + " " + _systems(v) + envs


def _yes(value) -> str:
    """A host fact in words: yes / no, a version, or "not recorded"."""
    return "yes" if value is True else "no" if value is False else str(value) if value not in (None, "") else \
        "not recorded"


def _systems(v: View) -> str:
    """Every audited system, by SM family: those a serving row touched, and the unchanged ones."""
    touched = {c[0] for r in v.serving for c in r["cells"]}
    by_sm: dict[str, list[str]] = defaultdict(list)
    for name in dict.fromkeys(c["system"] for c in v.new["cells"]):
        sm = f"SM {v.systems[name].sm}" if name in v.systems else name
        by_sm[sm].append(name)
    changed = [f"{sm} ({', '.join(ns)})" for sm, ns in by_sm.items() if set(ns) & touched]
    same = [f"{sm} ({', '.join(ns)})" for sm, ns in by_sm.items() if not set(ns) & touched]
    parts = []
    if changed:
        parts.append("Changed on " + "; ".join(changed))
    moved = {c[0] for r in v.rows if r.get("class") == "refusal-moved" for c in r["cells"]}
    if same:
        note = "; a refusal moved stage there, see Refusals" if moved & {n for ns in by_sm.values() for n in ns
                                                                        if n not in touched} else ""
        parts.append(("unchanged" if changed else "Unchanged") + " on " + "; ".join(same) +
                     f" (no serving change in any layout{note})")
    return ", ".join(parts) + "."


def batches(ws) -> str:
    """decode 1, decode 8, verify 32 (8x4) -> "decode 1, 8; verify 32": one phase named once, verify widths as their
    token counts."""
    ws = list(ws)
    if ws == ["all"]:
        return "every batch"
    by: dict[str, list[str]] = defaultdict(list)
    for w in sorted(ws, key=workload_order):
        phase, _, rest = w.partition(" ")
        by[phase].append(rest.split(" ")[0])
    return "; ".join(f"{phase} {', '.join(sizes)}" for phase, sizes in by.items())


def _spans(rows: list[dict]) -> str:
    return batches(sorted({w for r in rows for ws in (r.get("workloads") or {}).values() for w in ws},
                          key=workload_order))


def _tag(rows: list[dict]) -> str:
    """How many rows of the diff a line stands for, and of which kinds ("[2 rows: 1 experts class, 1 kernel]"), so
    the lines add up to the headline's counts."""
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["class"]] = kinds.get(r["class"], 0) + 1
    words = ", ".join(f"{n} {classes.KINDS[k].word}" for k, n in kinds.items())
    return f" [1 row: {words[2:]}]" if len(rows) == 1 else f" [{len(rows)} rows: {words}]"


def _identity(side: dict, other: dict, words: str) -> str:
    """A lane side by what decides serving: its kernel where the kernels differ, else kernel and detail (no note);
    its words where it has no kernel."""
    ident, kernel, theirs = side.get("identity") or [], side.get("kernel"), other.get("kernel")
    if not kernel or not ident:
        return _short(words)
    return kernel if theirs and theirs != kernel else ident[0]


def _change_line(v: View, rows: list[dict]) -> str:
    """One line for change rows of one kind and lane/field in the same cells (rows at other batch sizes of a lane
    are named by their batches; the values shown are the first row's, cut to their head), tagged with the rows it
    stands for."""
    r = rows[0]
    word = classes.KINDS[r["class"]].word
    name = v.title(r["lane"]) if r["lane"] else r["field"]
    if r["facet"] == "lane":
        name = _row_name(v, r)  # a speculative draft's own row names the draft's class
    if r["facet"] == "dispatch":
        name = r["title"].rsplit(" at ", 1)[0].split(" (")[0].split(" · ")[0] + _drafts(r)
        where = v.where({tuple(c) for x in rows for c in x["cells"]})
        example = f": e.g. {_short(r['before'], 6)} → {_short(r['after'], 8)}" if not v.tight else ""
        return f"- *{word}*: {name}, {where}, at {_spans(rows)}{example}{_tag(rows)}"
    head = f"- *{word}*: {name}, {r['where']}"
    if r["facet"] == "post-load":
        return head + f": {r['before'].split(' (')[0]} → {r['after'].split(' (')[0]} (the caveats say where)" + _tag(rows)
    if r["facet"] == "candidates":
        return head + f" (candidates): vLLM's oracle chooses {r['b'].get('chosen') or 'none'} (was " \
                      f"{r['a'].get('chosen') or 'none'})" + _tag(rows)
    before, after = r["before"], r["after"]
    if r["facet"] == "lane":
        before, after = _identity(r.get("a", {}), r.get("b", {}), before), _identity(r.get("b", {}), r.get("a", {}), after)
    fam = ""
    fa, fb = r.get("a", {}).get("family"), r.get("b", {}).get("family")
    if r["facet"] == "lane" and fa != fb and (fa or fb):
        fam = f" ({fa or '—'} → {fb or '—'})"
    also = [x for x in rows[1:] if x.get("_also")]
    more = f"; the same move in {', '.join(dict.fromkeys(_row_name(v, x) for x in also))}" if also else ""
    return head + f": {_short(before)} → {_short(after)}{fam}{more}" + _tag(rows)


def _drafts(r: dict) -> str:
    """" (speculative draft <class>)" for a row of a speculative draft (the diff's facts carry its class), else ""."""
    return f" (speculative draft {r.get('draft_class') or '?'})" if r.get("role", "target") != "target" else ""


def _row_name(v: View, r: dict) -> str:
    """A lane row's name: its lane's title, and a speculative draft's class where the row is the draft's."""
    return v.title(r["lane"]) + _drafts(r)


def _kernels(r: dict) -> tuple:
    return ((r.get("a") or {}).get("kernel"), (r.get("b") or {}).get("kernel"))


def _folded(groups: dict) -> list[list[dict]]:
    """Groups of rows as listed: a candidates row whose lane has a row of its own in the same cells says nothing
    more (its choice is that row's change); a lane row that moves between the same two kernels in the same cells as
    a row listed before it joins that row's line."""
    out: list[list[dict]] = []
    lane_rows = [r for rows in groups.values() for r in rows if r["facet"] == "lane"]
    for rows in groups.values():
        r = rows[0]
        cells = {tuple(c) for c in r["cells"]}
        if r["facet"] == "candidates" and any(x["lane"] == r["lane"] and {tuple(c) for c in x["cells"]} >= cells
                                              for x in lane_rows):
            continue
        host = next((g for g in out if r["facet"] == "lane" and g[0]["facet"] == "lane" and _kernels(g[0]) ==
                     _kernels(r) and all(_kernels(r)) and {tuple(c) for c in g[0]["cells"]} == cells), None)
        if host is not None:
            host.append({**r, "_also": True})
            continue
        out.append(list(rows))
    return out


def _step_path_rows(v: View) -> list[dict]:
    """The rows where the model's own step path (its profile's) takes steps on one side only, with the rows of its
    own dispatch lane in the same cells (what it runs there)."""
    path = v.profile.step_path
    rows = [r for r in v.serving if r["facet"] == "dispatch" and bool(r.get("a", {}).get("step_path")) !=
            bool(r.get("b", {}).get("step_path"))]
    cells = {tuple(c) for r in rows for c in r["cells"]}
    return rows + [r for r in v.serving if rows and r["facet"] == "dispatch" and r["lane"] == path.lane
                   and {tuple(c) for c in r["cells"]} <= cells]


def _step_path_line(v: View, rows: list[dict]) -> str:
    """Where the model's own step path now takes (or no longer takes) steps: which lanes it serves there (its
    profile's parts that take work in those cells), which batches of that phase stay with the lanes, in one line
    for its rows."""
    path = v.profile.step_path
    serving = [r for r in rows if r["lane"] != path.lane]
    taken = [r for r in serving if r.get("b", {}).get("step_path")]
    side = v.new if taken else v.old
    cells = {tuple(c) for r in rows for c in r["cells"]}
    built = {(c["system"], c["layout"]): c for c in side["cells"]}
    lanes = ", ".join(dict.fromkeys(v.title(lane) for lane in path.parts if lane in v.titles and any(
        not is_inactive(g.get("value")) for cell in cells for g in (built.get(cell) or {}).get("lanes", {}).get(lane, []))))
    works = {w for r in serving for ws in (r.get("workloads") or {}).values() for w in ws}
    phases = {w.split(" ")[0] for w in works}
    stock = sorted({w for cell in cells for w in ((built.get(cell) or {}).get("dispatch") or {}).get("workloads", [])
                    if w.split(" ")[0] in phases and w not in works}, key=workload_order)
    rest = f"; {batches(stock)} stay{'s' if len(stock) == 1 else ''} with the lanes' kernels" if stock else ""
    return (f"- *{classes.KINDS[serving[0]['class']].word}*: {path.owner} {'now takes' if taken else 'no longer takes'} "
            f"the steps at {_spans(serving)} in {v.where(cells)}: there {lanes} run its own kernels, not the lanes'"
            f"{rest} (its planner, vLLM's own code, decides; what it builds after load is in the caveats){_tag(rows)}")


def _changes_block(v: View, tight: bool) -> list[str]:
    """Every serving change, most important first: the model's step path taking steps as one line; per-call choices
    grouped by lane; rows of one kind and lane in the same cells as one line (for the rest only when the budget is
    tight)."""
    handover = _step_path_rows(v) if v.profile.step_path is not None else []
    groups: dict[tuple, list[dict]] = {}
    for r in sorted(v.serving, key=classes.order_key):
        if r in handover:
            continue
        # a draft's rows never fold into the target's, nor one draft's into another's
        name = (r["lane"] or r["field"], r.get("role", "target"), r.get("draft_class", ""))
        if r["facet"] == "dispatch":
            k = (r["class"], r["facet"], name)
        elif tight:
            k = (r["class"], r["facet"], name, r["where"])
        else:
            k = (r["class"], r["facet"], name, r["where"], r["title"], r["before"], r["after"])
        groups.setdefault(k, []).append(r)
    lines = [(rows[0]["rank"], _change_line(v, rows)) for rows in _folded(groups)]
    if handover:
        lines.append((handover[0]["rank"], _step_path_line(v, handover)))
    return [line for _, line in sorted(lines, key=lambda x: x[0])]


def _layouts_text(v: View, layouts: dict) -> str:
    """tp8-mtp, tp8-eagle3 at verify 4, 32; tp8-dspark at verify 5, 40; on SM 10.0, SM 10.3: each layout with its own
    batch sizes; the systems said once where all layouts share them."""
    by: dict[tuple, list[str]] = defaultdict(list)
    for lay in sorted(layouts, key=lambda l: v.order.index(l) if l in v.order else 99):
        e = layouts[lay]
        by[(tuple(e["batches"]), tuple(e["systems"]))].append(lay)
    shared = len({k[1] for k in by}) == 1
    parts = [f"{', '.join(lays)} at {batches(bs)}" + ("" if shared else f" on {v.on(ss, lays)}")
             for (bs, ss), lays in by.items()]
    if shared:
        systems = next(iter(by))[1]
        parts[-1] += f"; on {v.on(systems, list(layouts))}"
    return "; ".join(parts)


def _side(t: tuple) -> str:
    """(perf lane, family, kernel source, kernel) in words: the kernel, its family beside it."""
    if t[1] == "refused":
        return "refused (vLLM raises on the batch)"
    kernel = t[3] or t[2]
    return f"`{kernel}` ({t[1]})" if t[1] not in ("", "unknown") else f"`{kernel}` (family unknown to the harness)"


def _perf_lane(v: View, m: dict) -> str:
    """The perf-db lane of a moved label: its lane now; where the harness cannot name that (a backend whose
    activation precision its scheme has no rule for), the row it was measured in before, saying so."""
    now, was = m["after"][0], m["before"][0]
    draft = " (the speculative draft's)" if m.get("model", "target") != "target" else ""
    if now != "unknown":
        return f"`{now}`{draft}"
    if was != "unknown":
        return f"`{was}`{draft} (the row it was measured in; the harness cannot name the new kernel's precision lane)"
    return f"{v.title(m['harness_lane'])}{draft} (no perf-db lane the harness can name)"


def _perf_block(v: View) -> list[str]:
    """The perf-db rows whose label moved, one line per lane and change; lanes that move to the same kernel family in
    the same cells (a step path taking them all) share one line."""
    merged: dict[tuple, list[dict]] = defaultdict(list)
    for m in label_changes(v.old, v.new, v.profile):
        merged[(m["after"][1], _layouts_text(v, m["layouts"]))].append(m)
    out = []
    for (family, where), ms in merged.items():
        rows = sum(m["rows"] for m in ms)
        if len(ms) > 1 and len({m["before"][1] for m in ms} | {family}) > 1:
            lanes = ", ".join(f"{_perf_lane(v, m)} {_side(m['before'])}" for m in ms)
            out.append(f"- {lanes} → {family}: {where} ({rows} rows)")
            continue
        out += [f"- {_perf_lane(v, m)}: {_side(m['before'])} → {_side(m['after'])}: {where} ({m['rows']} rows)"
                for m in ms]
    return out


def _refusal_turns(was: list[dict], now: list[dict]) -> list[tuple]:
    """(turn, refusal, from stage) of one cell's refusals in two audits: a refusal of the whole deployment (at
    construction or at load) in both is one that stands or moved stage; a batch vLLM raises on stands, is new or is
    gone on its own."""
    whole = [r for r in was if r["stage"] != "dispatch"], [r for r in now if r["stage"] != "dispatch"]
    out = []
    if whole[0] and whole[1]:
        w0, w1 = whole[0][0], whole[1][0]
        out.append(("moved", w1, w0["stage"]) if w0["stage"] != w1["stage"] else ("stands", w1, ""))
    elif whole[1]:
        out.append(("new", whole[1][0], ""))
    elif whole[0]:
        out.append(("gone", whole[0][0], ""))
    keys = [{(r["why"], r["at"]): r for r in side if r["stage"] == "dispatch"} for side in (was, now)]
    for k in sorted(keys[0].keys() | keys[1].keys()):
        turn = "stands" if k in keys[0] and k in keys[1] else "new" if k in keys[1] else "gone"
        out.append((turn, keys[1].get(k) or keys[0][k], ""))
    return out


def _refusals_block(v: View) -> str:
    """Refusals that appeared, went away, moved stage, or stand in both builds (at construction, at load, or a batch
    vLLM raises on), each with the cells it holds in."""
    a = {(c["system"], c["layout"]): c for c in v.old["cells"]}
    groups: dict[tuple, set] = defaultdict(set)
    for c in v.new["cells"]:
        cell = (c["system"], c["layout"])
        if cell in a:
            for turn, r, was in _refusal_turns(cell_refusals(a[cell], v.profile), cell_refusals(c, v.profile)):
                at = batches(r["workloads"]) if r.get("workloads") else r.get("at", "")
                groups[(turn, r["stage"], was, at, r.get("raised") or r["why"])].add(cell)
    order = ("new", "gone", "moved", "stands")
    words = {"new": "new", "gone": "gone", "moved": "moved stage", "stands": f"in both {v.sides}"}
    lines = []
    merged: dict[tuple, set] = defaultdict(set)
    for (turn, stage, was, at, raised), cells in groups.items():
        merged[(turn, stage, was, at, _short(raised, 9))] |= cells
    moved_rows = [r for r in v.rows if r.get("class") == "refusal-moved"]
    for (turn, stage, was, at, raised), cells in sorted(merged.items(), key=lambda kv: (order.index(kv[0][0]), kv[0])):
        where = f"at {stage}" + (f" ({at})" if at else "") + (f", was at {was}" if was else "")
        rows = [r for r in moved_rows if {tuple(c) for c in r["cells"]} <= cells] if turn == "moved" else []
        tag = f" [{len(rows)} rows: {', '.join(r['field'] for r in rows)}]" if rows else ""
        lines.append(f"{words[turn]}: {v.where(cells)}, {where}: {raised}{tag}")
    return "**Refusals** (vLLM's own check says no; a server there fails): " + (
        "; ".join(lines) if lines else ("none on either host" if v.hosted else "none in either build")) + "."


def _at_text(r: dict) -> str:
    """A verdict row's batch sizes, per layout where the layouts differ."""
    at = r.get("at") or {}
    if not at:
        return ""
    by: dict[tuple, list[str]] = defaultdict(list)
    for lay, ws in at.items():
        by[tuple(ws)].append(lay)
    if len(by) == 1:
        return f", at {batches(next(iter(by)))}"
    return ", at " + "; ".join(f"{batches(ws)} in {', '.join(lays)}" for ws, lays in by.items())


def _claims_block(v: View) -> str:
    from audit.report.verdicts import verdict_before

    verdicts = [c for c in v.rows if c["facet"] == "verdict"]
    claimed = {c["id"]: c.get("layouts", []) for c in (v.new.get("verdicts") or {}).get("claims", [])}

    def scope(c: dict) -> str:
        """The layouts a claim is about, where it is not about every layout of the model."""
        lays = claimed.get(c["field"]) or []
        return "" if not lays or set(lays) >= set(v.order) else f"; it claims {', '.join(lays)} only"

    turned = [f"`{c['field']}` {c['turn']}: {verdict_before(v.d, c)} → {c['after']} ({c['where']}{_at_text(c)}{scope(c)})"
              + (", true now only because serving changed under it" if c.get("because", "").startswith("claim now")
                 else "") for c in verdicts if c.get("turn")]
    other = [f"`{c['field']}` still failing, now against {c['after'].split(' ', 1)[1].strip('()')} (was "
             f"{c['before'].split(' ', 1)[1].strip('()')}) ({c['where']}{_at_text(c)}{scope(c)})"
             for c in verdicts if not c.get("turn") and c["before"] != "—" and c["after"] != "—"
             and c["before"].split(" ")[0] == c["after"].split(" ")[0] and " " in c["before"] and " " in c["after"]
             and c["before"].split(" ")[0] not in ("MATCH", "NOT_EXERCISED", "UNVERIFIED")]
    lines = turned + other
    return "**Claims:** " + ("; ".join(lines) if lines else "none newly failing, none newly passing") + "."


def _caveats_block(v: View) -> str:
    """What the changed rows rest on: post-load stops in their cells (N of M steps, what they build), choices made
    on the device; and what would confirm them."""
    changed = {tuple(x) for c in v.serving for x in c["cells"]}
    stops: dict[tuple, list] = defaultdict(list)
    for c in v.new["cells"]:
        post = c.get("postload") or {}
        for g in post.get("limits") or []:
            if (c["system"], c["layout"]) in changed:
                stops[(str(g.get("raised_in", "")).rsplit(":", 1)[0], ", ".join(g.get("steps") or []),
                       sum(x.get("count", 0) for x in post["limits"]), post.get("steps", 0))].append(
                    (c["system"], c["layout"]))
    gpu = sorted({tuple(x) for c in v.serving for x in c["cells"] if "needs GPU" in str(c["after"])})
    caveats = [f"in {v.where(cells)} {n} of {m} post-load step(s) ({steps or '?'}) stopped at a simulation limit "
               f"({raised_in} needs a GPU): what {'it builds' if n == 1 else 'they build'} is not known"
               for (raised_in, steps, n, m), cells in sorted(stops.items())]
    if gpu:
        caveats.append(f"in {v.where(gpu)} some new per-call choices are made on the device (needs GPU) and are not "
                       "named")
    if not caveats:
        return "**Caveats:** none beyond the evidence level."
    observed = any(str(c.get("evidence", "")).startswith("observed") for c in v.new["cells"])
    confirm = ("" if observed else "; only an observe run (`MODE=observe`) on those GPUs could confirm them, and "
               "these reports hold none")
    return "**Caveats:** " + "; ".join(caveats) + confirm + "."


def _words(blocks: list) -> int:
    return sum(len((b if isinstance(b, str) else "\n".join([b[0], *b[1]])).split()) for b in blocks)


def pr_summary(d: dict, old: dict, new: dict, profile) -> str:
    """The PR summary for the diff *d* of *profile*'s routings *old* -> *new* (markdown), in the words of *profile*'s
    engine: the summary's own sentences name the first engine, and the engine's contract gives the name and serve
    command they take for another."""
    text = _pr_summary(d, old, new, profile)
    engine = engines.get(profile.engine)
    if engine.name == engines.DEFAULT:
        return text
    first = engines.get(engines.DEFAULT)
    return text.replace(f"`{first.command}`", f"`{engine.command}`").replace(first.title, engine.title)


def _pr_summary(d: dict, old: dict, new: dict, profile) -> str:
    v = View(d, old, new, profile)
    diff_name = (f"{d['from']['pin']}@{d['from'].get('host')}..{d['to']['pin']}@{d['to'].get('host')}.md"
                 if d["from"].get("host") != d["to"].get("host") else f"{d['from']['pin']}..{d['to']['pin']}.md")
    blocks: list = [_head(v)]
    tight = False
    for attempt in (False, True):
        tight = v.tight = attempt
        changes = _changes_block(v, tight)
        body: list = []
        if changes:
            body.append(("**What changed, most important first** (one line per row of the diff, or per lane where "
                         f"several rows share it; whole values in {diff_name}):", changes))
        perf = _perf_block(v)
        body.append(("**Perf-db rows whose label moved (re-measure them)** (a row: one system, layout and batch "
                     "size):", perf) if perf else "**Perf-db rows:** no label moved; none needs re-measuring.")
        body += [_refusals_block(v), _claims_block(v), _caveats_block(v)]
        if _words(blocks + body) <= WORDS:
            break
    blocks += body
    examples = ", ".join(v.title(lane) for lane in list(new.get("lane_order") or v.titles)[:3])
    blocks.append("*Terms:* a **cell** is one system and one layout (a `vllm serve` configuration); a **lane** is one "
                  f"kind of work in a layer ({examples}, ...); a **row** is one "
                  "distinct change of the diff, with the cells it touched; **information** rows change no kernel; a "
                  "**per-call choice** is vLLM's dispatch at one batch size; **resolved** evidence is vLLM's own "
                  "selection code run on a simulated GPU, not a kernel observed running.")
    claims = any(c.get("turn") for c in d["changes"] if c["facet"] == "verdict")
    if v.hosted:
        blocks.append("**For the perf database:** a row measured on one host holds there only: label each row with "
                      "its host, or measure both." if v.serving else "**For the perf database:** no label depends on "
                      "the host.")
        return "\n\n".join(b if isinstance(b, str) else "\n".join([b[0], *b[1]]) for b in blocks)
    blocks.append("**To merge:** only if every change is intended: re-measure the perf-db rows above, fix the claims "
                  "or `make accept` them." if v.serving or claims else "**To merge:** nothing to re-measure.")
    return "\n\n".join(b if isinstance(b, str) else "\n".join([b[0], *b[1]]) for b in blocks)
