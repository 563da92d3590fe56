"""The pull-request summary of a pin bump: at most about 250 words of markdown a reviewer pastes into the PR.

Generated from the two audits' ``routing.json`` and their diff (``audit/report/diff.py``), deterministic, and
self-contained: every sentence is true as written, without another section to qualify it. It says

* the gate's answer and the count of serving changes by kind;
* what now serves what, in the perf database's words (its lane, backend family and kernel source, from
  ``audit/report/perflabels.py``), per cell group and batch size: these are the rows a perf database must
  re-measure;
* the other kernel-level changes (lanes no perf label covers) and the per-call tiers that moved;
* refusals that appeared or went away;
* claims newly failing and no longer failing (a claim true now only because serving changed says so);
* the caveats for the changed rows: the evidence level, post-load stops at a simulation limit, choices only a
  GPU can make ("needs GPU").
"""
from __future__ import annotations

import re
from collections import defaultdict

from audit.report.dispatch import workload_order
from audit.report.perflabels import build_labels, refusal

#: the word budget ("about 250 words"); bullet lists are cut (with a count of what was left out and where it is)
#: to keep within it, the perf-db rows last
WORDS = 270


def _label_points(labels: dict) -> dict[tuple, dict[str, tuple]]:
    """(system, layout, harness lane) -> {batch: (perf lane, backend, kernel source)}; "all" where the row has no
    per-batch split."""
    out: dict[tuple, dict[str, tuple]] = defaultdict(dict)
    for r in labels["rows"]:
        key = (r["system"], r["layout"], r["harness_lane"])
        out[key]["all"] = (r["lane"], r["backend"], r["kernel_source"])
        for t in r.get("by_tokens") or []:
            out[key][t["tokens"]] = (r["lane"], t.get("backend", "unknown"), t.get("kernel_source", "unknown"))
    return out


def label_changes(old: dict, new: dict, profile) -> list[dict]:
    """The perf-database rows whose label moved between two audits: one entry per (harness lane, before, after)
    with the cells and batch sizes it covers. A batch one audit splits out and the other does not compares against
    the other's whole-lane label."""
    a, b = (_label_points(build_labels(r, profile, (r.get("verdicts") or {}).get("label_map") or {}))
            for r in (old, new))
    moved: dict[tuple, dict] = {}
    for key in sorted(set(a) & set(b)):
        pa, pb = a[key], b[key]
        batches = sorted((set(pa) | set(pb)) - {"all"}, key=workload_order)
        points = batches or ["all"]
        for t in points:
            before, after = pa.get(t, pa.get("all")), pb.get(t, pb.get("all"))
            if before is None or after is None or before == after:
                continue
            row = moved.setdefault((key[2], before, after), {"cells": set(), "batches": set()})
            row["cells"].add(key[:2])
            row["batches"].add(t)
    out = []
    for (lane, before, after), row in sorted(moved.items()):
        out.append({"harness_lane": lane, "perf_lane": after[0], "before": before, "after": after,
                    "cells": sorted(row["cells"]), "batches": sorted(row["batches"], key=workload_order)})
    return out


def _batches(batches: list[str], every: set[str]) -> str:
    if batches == ["all"]:
        return "every batch"
    if every and set(batches) >= every:
        by_phase: dict[str, list[str]] = defaultdict(list)
        for b in sorted(every, key=workload_order):
            by_phase[b.split(" ")[0]].append(b.split(" ", 1)[1].split(" ")[0])
        return "every batch (" + ", ".join(f"{p} {v[0]}–{v[-1]}" if len(v) > 1 else f"{p} {v[0]}"
                                           for p, v in by_phase.items()) + ")"
    by_phase: dict[str, list[str]] = defaultdict(list)
    for b in batches:
        phase, _, size = b.partition(" ")
        by_phase[phase].append(size)
    out = []
    for phase, sizes in by_phase.items():
        # verify batches ("32 (8x4)"): requests of a fixed number of tokens each, said in words
        shapes = [re.fullmatch(r"\d+ \((\d+)x(\d+)\)", size) for size in sizes]
        if all(shapes) and len({m.group(2) for m in shapes}) == 1:
            out.append(f"{phase} of {', '.join(m.group(1) for m in shapes)} requests × {shapes[0].group(2)} tokens")
        else:
            out.append(f"{phase} {', '.join(sizes)}")
    return "; ".join(out)


def _pair(before: tuple, after: tuple) -> str:
    """before -> after in the perf database's words: the backend family, and the kernel source where the family
    stays the same (a new class inside one family)."""
    if before[1] == after[1]:
        return f"{before[1]}, class `{before[2]}` → `{after[2]}`"
    return f"{before[1]} → {after[1]} (`{after[2]}`)"


def _lane_title(titles: dict, lane: str) -> str:
    """A lane's title without its parenthesized detail ("KDA kernel by batch type (decode, ...)" reads
    "KDA kernel by batch type")."""
    return titles.get(lane, lane).split(" (")[0]


def pr_summary(d: dict, old: dict, new: dict, profile) -> str:
    """The PR summary for the diff *d* of *profile*'s routings *old* -> *new* (markdown, about 250 words at most)."""
    from audit.report.render import collapse_cells

    order = list(profile.layouts)
    audited = [f"{c['system']}/{c['layout']}" for c in new["cells"]]
    titles = new.get("lane_titles", {})
    diff_name = f"{d['from']['pin']}..{d['to']['pin']}.md"

    def where(cells) -> str:
        return collapse_cells([f"{s}/{l}" for s, l in cells], audited, order)

    workloads = {(c["system"], c["layout"]): set((c.get("dispatch") or {}).get("workloads", [])) for c in new["cells"]}

    def every(cells) -> set:
        """The workloads every one of *cells* was audited at."""
        sets = [workloads.get(tuple(c), set()) for c in cells]
        return set.intersection(*sets) if sets else set()

    serving = [c for c in d["changes"] if c["serving"]]
    words = {"kernel": "kernel", "refusal": "refusal", "stop": "simulation stop", "tier": "per-call choice",
             "availability": "availability answer", "probe": "probe drift or error"}
    kinds = ", ".join(f"{n} {words.get(k, k)}" for k, n in d["by_class"].items() if n)
    levels = sorted({str(c.get("evidence", "")).split(" ")[0] for c in new["cells"]} - {""})
    pins = "" if (d["from"]["pin"], d["to"]["pin"]) == (f"v{d['from']['vllm_version']}", f"v{d['to']['vllm_version']}") \
        else f" (`{d['from']['pin']}` → `{d['to']['pin']}`)"
    evidence = {"resolved": "resolved (vLLM's selection code on a simulated platform, no kernel ran)",
                "observed": "observed (kernel entries hit on a real GPU)"}
    head = (f"**{profile.title}, vLLM {d['from']['vllm_version']} → {d['to']['vllm_version']}**{pins}: "
            f"{d['cells_compared']} cells (system × layout) compared; evidence "
            f"{', '.join(evidence.get(x, x) for x in levels) or 'none'}. ")
    if not d["cells_compared"]:
        head += "**Nothing was judged**: the two audits share no cell."
    elif serving:
        head += (f"**The pin-bump gate fails** (exit 6) on "
                 f"{d['serving_changes']} serving change rows in {d['serving_cells']} cells ({kinds}); "
                 f"{d['information_changes']} other rows change no kernel (versions, counts, notes).")
    else:
        head += f"**No serving change**; {d['information_changes']} rows change no kernel (versions, counts, notes)."
    blocks = [head]
    body: list = []  # what follows the head; the SM families it names are spelled out after it

    moved = label_changes(old, new, profile)
    grouped: dict[tuple, list[dict]] = defaultdict(list)  # the lanes that moved in the same cells at the same batches
    for m in moved:
        grouped[(where(m["cells"]), _batches(m["batches"], every(m["cells"])))].append(m)
    # the widest changes first (most cells)
    ordered = sorted(grouped.items(), key=lambda kv: (-max(len(m["cells"]) for m in kv[1]), kv[0]))
    def moved_text(ms: list[dict]) -> str:
        # several lanes that now go to one backend family (a step path taking them all) read as one arrow
        if len(ms) > 1 and len({m["after"][1] for m in ms}) == 1 and all(m["before"][1] != m["after"][1] for m in ms):
            return (", ".join(f"{_lane_title(titles, m['harness_lane'])} (`{m['perf_lane']}`: {m['before'][1]})"
                              for m in ms) + f" → {ms[0]['after'][1]}")
        return "; ".join(f"{_lane_title(titles, m['harness_lane'])} (`{m['perf_lane']}`) "
                         f"{_pair(m['before'], m['after'])}" for m in ms)

    lines = [f"- {cells}, {batches}: {moved_text(ms)}" for (cells, batches), ms in ordered]
    body.append(("**Perf-db rows whose kernel changed (re-measure them):**", lines, 3) if lines else
                  "**Perf-db rows:** no label moved; none needs re-measuring.")

    labelled = {m["harness_lane"] for m in moved}
    judged = {j.lane for j in profile.judged}
    other = [c for c in serving if c["class"] == "kernel" and c["kind"] == "path"
             and not (c["lane"] in judged and c["lane"] in labelled)]
    if other:
        body.append(("**Kernel-level changes no perf-db row covers:**",
                       [f"- {_lane_title(titles, c['lane'])}, {c['where']}: {_side(c['before'], d['from'])} → "
                        f"{_side(c['after'], d['to'])}" for c in sorted(other, key=lambda c: -len(c["cells"]))], 1))
    tiers: dict[str, set] = defaultdict(set)
    for c in serving:
        if c["class"] == "tier":
            tiers[c["title"].split(" · ")[0].split(" (")[0]].update(tuple(x) for x in c["cells"])
    if tiers:
        body.append(("**Per-call choices that moved** (vLLM's dispatch at a batch size; before/after in the diff):",
                       [f"- {t}: {where(cells)}" for t, cells in tiers.items()], 2))

    old_cells = {(c["system"], c["layout"]): c for c in old["cells"]}
    appeared = [(c["system"], c["layout"]) for c in new["cells"]
                if (c["system"], c["layout"]) in old_cells and refusal(c) and not refusal(old_cells[(c["system"], c["layout"])])]
    gone = [(c["system"], c["layout"]) for c in new["cells"]
            if (c["system"], c["layout"]) in old_cells and not refusal(c) and refusal(old_cells[(c["system"], c["layout"])])]
    ref = []
    if appeared:
        ref.append(f"vLLM now refuses {where(appeared)}")
    if gone:
        ref.append(f"vLLM no longer refuses {where(gone)}")
    body.append("**Refusals** (vLLM's own check says no): " + ("; ".join(ref) if ref else "none appeared or went away")
                  + ".")

    verdicts = [c for c in d["changes"] if c["kind"] == "verdict" and c.get("turn")]

    def before(c: dict) -> str:
        from audit.report.verdicts import verdict_before

        return verdict_before(d, c)

    claims = [f"`{c['field']}` {c['turn']}: {before(c)} → {c['after']} ({c['where']})"
              + (", true now only because serving changed under it" if c.get("because", "").startswith("claim now")
                 else "") for c in verdicts]
    body.append("**Claims:** " + ("; ".join(claims) if claims else "none newly failing, none newly passing") + ".")

    caveats = []
    changed_cells = {tuple(x) for c in serving for x in c["cells"]}
    stops: dict[str, list] = defaultdict(list)
    for c in new["cells"]:
        for g in (c.get("postload") or {}).get("limits") or []:
            if (c["system"], c["layout"]) in changed_cells:
                stops[str(g.get("raised_in", "")).rsplit(":", 1)[0]].append((c["system"], c["layout"]))
    gpu = sorted({tuple(x) for c in serving for x in c["cells"] if "needs GPU" in str(c["after"])})
    for raised_in, cells in sorted(stops.items()):
        both = set(cells) == set(gpu)
        caveats.append(f"in {where(cells)} post-load stopped at a simulation limit ({raised_in} needs a GPU), so what "
                       "is built at load is not known" + ("; some new choices there are made on the device (needs "
                                                          "GPU)" if both else ""))
        if both:
            gpu = []
    if gpu:
        caveats.append(f"in {where(gpu)} some new choices are made on the device (needs GPU)")
    if caveats:
        caveats[-1] += " (an observe run confirms them)"
    body.append("**Caveats:** " + "; ".join(caveats) + "." if caveats else "**Caveats:** none.")
    # the SM families named above, with the audited systems each stands for (a reader counts cells with it)
    named = sorted({f for b in body for f in re.findall(r"SM \d+\.\d+", b if isinstance(b, str) else " ".join(b[1]))})
    from audit.systems import SYSTEMS

    fams = []
    for fam in named:
        members = sorted({c["system"] for c in new["cells"] if c["system"] in SYSTEMS
                          and f"SM {SYSTEMS[c['system']].sm}" == fam})
        if members:
            fams.append(f"{fam} = {', '.join(members)}")
    if fams:
        blocks[0] += f" Systems: {'; '.join(fams)}."
    blocks += body
    blocks.append("**To merge:** only if every change is intended: re-measure these rows, fix the claims or "
                  "`make accept` them, confirm GPU-only choices by an observe run."
                  if serving or claims else "**To merge:** nothing to re-measure.")
    return _fit(blocks, f"see the diff, {diff_name}")


def _side(text: str, build: dict) -> str:
    """One side of a change in a sentence: "—" (no value in that audit) reads "absent in <version>"."""
    return f"absent in {build['vllm_version']}" if str(text) == "—" else _short(text)


def _short(text: str, n: int = 10) -> str:
    words = str(text).split()
    return " ".join(words[:n]) + (" …" if len(words) > n else "")


def _fit(blocks: list, more: str) -> str:
    """Join the blocks within the word budget. A list block is (head, lines, priority); lists are cut from the end,
    the least important first, each cut list saying how many entries the diff's tables hold beyond it."""
    def text(bs, cut) -> str:
        out = []
        for i, b in enumerate(bs):
            if isinstance(b, str):
                out.append(b)
            elif len(b[1]) == 1 and cut.get(i):  # cut to nothing: one line saying how many and where
                out.append(f"{b[0].split(' (')[0].rstrip(':*')}:** {cut[i]}; {more}.")
            else:
                out.append("\n".join([b[0], *b[1]]))
        return "\n\n".join(out)

    full = [b if isinstance(b, str) else (b[0], list(b[1]), b[2]) for b in blocks]
    cut: dict[int, int] = {i: 0 for i, b in enumerate(full) if not isinstance(b, str)}

    def shown(counts: dict[int, int]) -> list:
        """The blocks with *counts* entries cut from the end of each list (a cut list ends with how many more)."""
        out = []
        for i, b in enumerate(full):
            if isinstance(b, str) or not counts.get(i):
                out.append(b)
            else:
                kept = b[1][:len(b[1]) - counts[i]]
                out.append((b[0], kept + [f"- … and {counts[i]} more: {more}"], b[2]))
        return out

    def words(counts) -> int:
        return len(text(shown(counts), counts).split())

    # cut the least important lists first, one entry at a time; the perf-db rows keep at least one line
    while words(cut) > WORDS:
        open_ = [i for i in cut if len(full[i][1]) - cut[i] > (1 if full[i][2] >= 3 else 0)]
        if not open_:
            break
        cut[min(open_, key=lambda k: (full[k][2], -k))] += 1
    # then give back what fits, the most important lists first
    for i in sorted(cut, key=lambda k: -full[k][2]):
        while cut[i] and words({**cut, i: cut[i] - 1}) <= WORDS:
            cut[i] -= 1
    return text(shown(cut), cut)
