"""Turn combined evidence into the routing model: per cell (system x layout), per lane, per layer.

Pure functions on plain data: no I/O, no vLLM. The result is what ``routing.json`` holds and what
the ledger renders; the same evidence always gives the same routing (stable order, no timings).
"""
from __future__ import annotations

import re
from collections import defaultdict

from probes.core.stages import stop_rule

from audit.report.corroborate import corroborate
from audit.report.dispatch import cell_tiers as dispatch_tiers
from audit.evidence.files import EvidenceFile, model_view
from audit.report.layers import format_ranges
from audit.report.observed import merge as merge_observed
from audit.profiles import MOE_LANE, Lane, Profile
from audit import engines
from audit import lanevalue as values
from audit import limits
from audit.lanevalue import ROUTING_SCHEMA, cut, short

#: 2: one verdict for a refusal by vLLM's own code, at construction or load (REFUSED; was CRASH / LOAD_REFUSED);
#: 3: lane values as records (audit/report/values.py), schema 2's sentences derived from them
__all__ = ["ROUTING_SCHEMA", "short", "build_routing", "build_cell", "format_ranges"]
EVIDENCE_LEVELS = {
    "resolved": "resolved: vLLM's own selection code ran under a simulated NVIDIA platform; no kernel executed",
    "observed": "observed: the kernel entry was hit in the serving process on a real GPU (eager)",
    "observed-in-graph": "observed inside a CUDA graph capture on a real GPU (replays counted separately)",
}
#: how far the simulation went for a resolved row (a lane's ``level``; see README "Evidence levels")
RESOLVE_LEVELS = {
    "construction": "the model was built on the meta device; the row is what the built modules chose",
    "post-load": "vLLM's post-load steps for the row's layers ran to their end on the meta model (weights "
                 "never loaded); the row is what they left behind",
}
STAGE_ORDER = ("platform", "imports", "config", "distributed", "construct", "construct-draft", "inspect")
STAGE_MEANING = {
    "platform": "simulated platform installed",
    "imports": "vLLM imported under the simulated platform",
    "config": "VllmConfig built from the `vllm serve` arguments",
    "distributed": "parallel groups initialised (fake process group, rank 0)",
    "construct": "model constructed on the meta device (every layer's __init__ ran)",
    "construct-draft": "speculative draft model (MTP, EAGLE3, DSpark) constructed the same way (layouts with "
                       "speculation only)",
    "inspect": "constructed modules inspected",
}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_of(name: str | None) -> int | None:
    if not name:
        return None
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def collapse(per_layer: dict[int, object], raw: dict[int, dict] | None = None) -> list[dict]:
    """Group layers with the same value; groups ordered by their first layer. With ``raw``, each
    group also keeps the undisplayed evidence of its first layer (what labels are derived from)."""
    groups: dict[str, list[int]] = defaultdict(list)
    by_key: dict[str, object] = {}
    for layer in sorted(per_layer):
        key = repr(per_layer[layer])
        groups[key].append(layer)
        by_key[key] = per_layer[layer]
    ordered = sorted(groups.items(), key=lambda kv: kv[1][0])
    out = []
    for key, layers in ordered:
        group = {"layers": layers, "ranges": format_ranges(layers), "value": by_key[key]}
        if raw is not None:
            group["raw"] = raw[layers[0]]
        out.append(group)
    return out


def _argv(argv: list) -> list:
    """The cell's serve argv (the engine's command in argv[0:2], ``vllm serve``) with the run's model directory
    (argv[2], also inside an argument that names a draft in it) spelled ``<model-dir>``: the same evidence renders
    the same ledger, whatever the run's path."""
    model = str(argv[2]) if len(argv) > 2 else None
    return argv[:2] + ["<model-dir>"] + [a.replace(model, "<model-dir>") if model and isinstance(a, str) else a
                                         for a in argv[3:]]


def _field(record: dict, path: str):
    if path in ("result", "cls"):
        return record.get(path)
    head, _, name = path.partition(".")
    value = (record.get(head) or {}).get(name)
    return value


def _layer_kinds(f: EvidenceFile, profile: Profile) -> dict[str, list[int]]:
    kinds: dict[str, set[int]] = defaultdict(set)
    for r in f.of_kind("scope"):
        layer = layer_of(r.get("prefix"))
        cls = str(r.get("cls", "")).rsplit(":", 1)[-1]
        if layer is None:
            continue
        for key, kind in profile.layer_classes.items():
            name, _, leaf = key.partition("@")
            if cls == name and (not leaf or str(r.get("prefix", "")).endswith("." + leaf)):
                kinds[kind].add(layer)
    return {k: sorted(v) for k, v in sorted(kinds.items())}


def _module_kind(f: EvidenceFile, profile: Profile, module: str) -> str | None:
    """The layer kind (moe, kda, ...) of the block a module belongs to: the innermost built block around it
    whose class the profile names (``...layers.1.mlp.experts`` sits in the profile's MoE block class: moe)."""
    best, depth = None, -1
    for r in f.of_kind("scope"):
        prefix = str(r.get("prefix", ""))
        if not prefix or not (module == prefix or module.startswith(prefix + ".")):
            continue
        cls = str(r.get("cls", "")).rsplit(":", 1)[-1]
        for key, kind in profile.layer_classes.items():
            name, _, leaf = key.partition("@")
            if cls == name and (not leaf or prefix.endswith("." + leaf)) and len(prefix) > depth:
                best, depth = kind, len(prefix)
    return best


def _lane_values(f: EvidenceFile, lane: Lane, post: dict | None = None, readings: dict | None = None,
                 state=None, kernels: dict | None = None) -> dict[int, dict]:
    """Per layer, the lane's value (a record, audit/report/values.py) with the evidence it was read from (``raw``):
    the first source that answers for a layer gives its value. *kernels*: the kernels the lane's backend strings
    enter (its profile's ``backend_labels``)."""
    per_layer: dict[int, dict] = {}
    for source in lane.sources:
        if source.kind == "postload":
            per_layer.update(_postload_values(f, source.target, post, readings or POSTLOAD_READINGS, state)
                             if post else {})
            continue
        if source.kind == "module":
            pattern = re.compile(source.target)
            found: dict[int, list] = defaultdict(list)
            for r in f.of_kind("module"):
                if pattern.search(r.get("name", "")):
                    leaf = r["name"].rsplit(".", 1)[-1]
                    found[r["layer"]].append((leaf, [_field(r, p) for p in source.fields]))
            for layer, items in found.items():
                if layer not in per_layer:
                    raw = [[leaf, *vals] for leaf, vals in sorted(items)]
                    per_layer[layer] = {"raw": raw, "value": values.from_modules(raw)}
            continue
        for r in f.of_kind(source.kind):
            if r.get("target") != source.target:
                continue
            layer = layer_of(r.get("scope"))
            if layer is None or layer in per_layer:
                continue
            shown = [_field(r, p) for p in source.fields]
            if all(v is None for v in shown):
                continue  # this record does not carry the lane's answer (e.g. an attribute of other releases)
            value = values.from_fields(shown, label=source.label, kernels=kernels)
            if lane.exercised_if and not _field(r, lane.exercised_if[0]):
                value = values.inactive(f"not exercised: {lane.exercised_if[1]}", kernel=value["kernel"],
                                        backend=value["backend"])
            per_layer[layer] = {"raw": shown + [_field(r, p) for p in source.extra], "source": source.target,
                                "value": value}
    return per_layer


def _candidates(f: EvidenceFile, target: str) -> list[dict]:
    per_layer: dict[int, list] = defaultdict(list)
    for r in f.of_kind("candidate"):
        if r.get("target") != target:
            continue
        layer = layer_of(r.get("scope"))
        if layer is None:
            continue
        per_layer[layer].append({"backend": short(r.get("backend")), "cls": short(r.get("cls")),
                                 "supported": bool(r.get("supported")), "reason": r.get("reason")})
    return collapse({layer: tried for layer, tried in per_layer.items()})


def _attention_candidates(f: EvidenceFile) -> dict | None:
    for r in f.of_kind("select"):
        if r.get("target") != "mla.attn_candidates":
            continue
        res = r.get("result")
        if not (isinstance(res, list) and len(res) == 2):
            continue
        valid, invalid = res
        return {
            "valid": [{"backend": short(v[1]), "priority": v[2]} for v in valid if isinstance(v, list) and len(v) == 3],
            "rejected": sorted(
                ({"backend": short(k), "priority": v[0], "reasons": list(v[1]) if isinstance(v[1], list) else [str(v[1])]}
                 for k, v in (invalid or {}).items() if isinstance(v, list) and len(v) == 2),
                key=lambda d: d["priority"]),
        }
    return None


def _stages(f: EvidenceFile, engine=None) -> tuple[list[dict], str, dict | None]:
    stages, failure, deepest = [], None, ""
    for r in f.of_kind("stage"):
        if r["stage"] == POSTLOAD_STAGE:  # reported by _postload, never a construction stop
            continue
        stages.append({"stage": r["stage"], "ok": bool(r["ok"])})
        if r["ok"]:
            deepest = r["stage"]
        elif failure is None:
            err = r.get("error") or {}
            failure = {"stage": r["stage"], "type": err.get("type", ""), "message": err.get("message", ""),
                       "where": _scrub_path(err.get("where", "")), **stop_outcome(err, engine)}
    return stages, deepest, failure


_FRAME = re.compile(r'^\s*File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>[^\n]+)\n(?P<src>[^\n]*)')


def stop_outcome(err: dict, engine=None) -> dict:
    """Why a stage stopped, ``refused`` (the engine's own check said no) or ``limit`` (the simulation could not go
    further), by the post-load stage's rules (probes.core.stages.stop_rule) read from the recorded traceback.
    *engine*: whose source files count as the engine's (``audit/engines``; the first engine where None)."""
    engine = engine or engines.get(engines.DEFAULT)
    tb = err.get("traceback") or []
    frames = [m for m in (_FRAME.match(entry) for entry in tb) if m]
    inner = frames[-1] if frames else None
    path = (inner.group("path") if inner else (err.get("where") or "").split(":", 1)[0]).replace("\\", "/")
    chained = any("direct cause of the following exception" in e or "During handling of the above exception" in e
                  for e in tb)
    package = engine.package
    outcome, rule = stop_rule(in_vllm=f"/{package}/" in path or path.startswith(f"{package}/"),
                              assertion=err.get("type", "").endswith(":AssertionError"),
                              raise_line=inner.group("src").strip().startswith("raise") if inner else None,
                              cause="an exception" if chained else None, message=err.get("message", ""),
                              type_name=err.get("type", ""), engine=engine.title)
    return {"outcome": outcome, "rule": rule}


_SITE = re.compile(r"(?:/[^\s'\"():,]+)*?/(?:lib/python\d\.\d+/)?site-packages/")


_OTHER_RUN = re.compile(r"<cache>/runs/[A-Za-z0-9._+-]+")


def scrub_paths(value, prefixes: dict[str, str]):
    """The same value with machine-specific paths replaced (an environment's site-packages by
    ``<env>/site-packages/``, each prefix by its placeholder), so two machines' evidence compares equal."""
    if isinstance(value, str):
        value = _SITE.sub("<env>/site-packages/", value)
        for prefix, placeholder in prefixes.items():
            if prefix and prefix != "/":
                value = value.replace(prefix, placeholder)
        return _OTHER_RUN.sub("<run>", value)  # evidence reused from an earlier run names that run's dir
    if isinstance(value, list):
        return [scrub_paths(v, prefixes) for v in value]
    if isinstance(value, dict):
        return {k: scrub_paths(v, prefixes) for k, v in value.items()}
    return value


POSTLOAD_STAGE = "post-load"
_WORST = {"ok": 0, "limit": 1, "refused": 2}


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _plain(text) -> str:
    """A message as a ledger can show it: terminal colour codes dropped, whitespace collapsed."""
    return " ".join(_ANSI.sub("", str(text or "")).split())


def _step_layer(r: dict) -> int | None:
    return r.get("layer") if r.get("layer") is not None else r.get("in_layer")


# post-load steps that belong to a whole model (its load_weights tail, its own post-load hook): they reach
# into every layer, so their outcome bounds every layer's level
MODEL_STEPS = ("model-load", "model")


def _rejudged(r: dict) -> dict:
    """A post-load step record whose outcome is decided here again, by the rule the probes apply
    (probes.core.stages.stop_rule), from what the record says was raised: the host never takes "refused" or
    "limit" on the record's word. Where the two disagree the rule wins and the record says so."""
    if r.get("outcome") not in ("refused", "limit"):
        return r
    where = str(r.get("raised_where") or "")
    in_vllm = where.startswith("vllm/") or "/vllm/" in where
    raised_in = str(r.get("raised_in") or "").rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    outcome, rule = stop_rule(in_vllm=in_vllm, assertion=str(r.get("type", "")).endswith(":AssertionError"),
                              raise_line=r.get("raise_line"), cause=r.get("cause"), message=str(r.get("message") or ""),
                              fed_no_weights=r.get("step") == "model-load", raised_in=raised_in,
                              type_name=str(r.get("type", "")))
    if outcome == r.get("outcome"):
        return r
    return {**r, "outcome": outcome, "rule": f"{rule} (the record said {r.get('outcome')}; the rule decided)"}


def _postload(f: EvidenceFile, profile: Profile) -> dict | None:
    """What vLLM's post-load path did in this cell: every step's outcome, vLLM's refusals (findings)
    apart from the places the simulation could not go further (limits), and per layer how far it went."""
    stage = next((r for r in f.of_kind("stage") if r["stage"] == POSTLOAD_STAGE), None)
    if stage is None:
        return None
    steps = [_rejudged({**r, "message": _plain(r.get("message"))} if "message" in r else r)
             for r in f.of_kind("postload-step")]  # the target's steps, then a speculative draft's
    counts = {k: sum(1 for r in steps if r.get("outcome") == k) for k in _WORST}
    refusals: dict[tuple, dict] = {}
    limits: dict[tuple, dict] = {}
    for r in steps:
        layer = _step_layer(r)
        if r.get("outcome") == "refused":
            key = (r.get("raised_in"), r.get("type"), r.get("message"))
            g = refusals.setdefault(key, {
                "function": r.get("raised_in", ""), "where": _scrub_path(r.get("raised_where", "")),
                "type": r.get("type", ""), "message": r.get("message", ""), "steps": [], "modules": [], "layers": []})
        elif r.get("outcome") == "limit":
            key = (r.get("raised_in"), r.get("type"), cut(r.get("message") or "", 300))
            g = limits.setdefault(key, {
                "raised_in": r.get("raised_in", ""), "vllm_function": r.get("vllm_function", ""),
                "type": r.get("type", ""), "message": cut(r.get("message") or "", 300), "rule": r.get("rule", ""),
                "steps": [], "modules": [], "layers": []})
        else:
            continue
        fn = str(r.get("fn", "")).rsplit(":", 1)[-1]  # Class.method
        if fn not in g["steps"]:
            g["steps"].append(fn)
        g["modules"].append(r.get("in_module") or r.get("module") or "<model>")
        if layer is not None:
            g["layers"].append(layer)
    for g in [*refusals.values(), *limits.values()]:
        g["count"] = len(g["modules"])
        g["ranges"] = format_ranges(g["layers"])
        g["modules"] = g["modules"][:3]  # examples; the count says how many
    # per layer: the worst outcome of its own steps and of the model-level hooks (which reach into layers)
    model_worst: dict[str, int] = {}  # per model (target, draft): its own hook reaches into its layers
    for r in steps:
        if r.get("step") in MODEL_STEPS:
            role = r.get("role", "target")
            model_worst[role] = max(model_worst.get(role, 0), _WORST[r.get("outcome", "ok")])
    per_layer = _layer_worst([r for r in steps if r.get("role", "target") == "target"])
    first = next((r for r in steps if r.get("outcome") == "refused"), None)
    refused_at = None
    if first is not None:
        refused_at = {"function": first.get("raised_in", ""), "where": _scrub_path(first.get("raised_where", "")),
                      "type": first.get("type", ""), "message": first.get("message", ""),
                      "step": str(first.get("fn", "")).rsplit(":", 1)[-1], "module": first.get("in_module") or first.get("module") or "",
                      "layer": _step_layer(first), "model": first.get("role", "target")}
    err = stage.get("error") or {}
    state = profile.model_state
    spec = next((r for r in f.of_kind("postload-model") if r.get("role", "target") == "target"), {})
    state_steps = [r for r in steps if r.get("step") == "model-state"]
    return {"ran": bool(stage.get("ok")), "error": {"type": err.get("type", ""), "message": err.get("message", "")}
            if not stage.get("ok") else None, "steps": len(steps), **counts,
            "refusals": list(refusals.values()), "limits": sorted(limits.values(), key=lambda g: -g["count"]),
            "refused_at": refused_at, "model_worst": model_worst,
            "layer_worst": per_layer,
            # what the model's worker builds once the weights are loaded (its profile's ``model_state``), if anything
            **({state.key: {"requested": spec.get(state.requested_field), "built": spec.get(state.built_field),
                            "config": spec.get(state.config_field),
                            # the step's record without its duration or record number: routing is a function of
                            # what vLLM decided, never of how long it took
                            "step": ({k: v for k, v in state_steps[0].items() if k not in ("seconds", "seq")}
                                     if state_steps else None)} if spec else None} if state is not None else {}),
            # how each group of identical per-layer steps was run (probes/resolve/carry.py): a function of the
            # run's mode, not of what vLLM decided, so a comparison of two paths leaves it out
            "carry": [{"role": r.get("role", "target"), "step": str(r.get("fn", "")).rsplit(":", 1)[-1],
                       "modules": r.get("modules", ""), "members": r.get("members", 0),
                       "ran": format_ranges(r.get("ran") or []), "carried": format_ranges(r.get("carried") or []),
                       "carried_count": len(r.get("carried") or []), "check": r.get("check"),
                       "notes": r.get("notes") or []} for r in f.of_kind("postload-carry")],
            # the target's own readings (a speculative draft's are read from its records: _draft)
            "_modules": [r for r in f.of_kind("postload-module") if r.get("role", "target") == "target"],
            "_activation_checks": [r for r in f.of_kind("activation_check") if r.get("role", "target") == "target"]}


def _layer_worst(steps: list[dict]) -> dict[str, int]:
    """Per layer, the worst outcome of its own post-load steps."""
    per_layer: dict[int, int] = {}
    for r in steps:
        layer = r.get("layer")
        if layer is not None:
            per_layer[layer] = max(per_layer.get(layer, 0), _WORST[_rejudged(r).get("outcome", "ok")])
    return {str(k): v for k, v in sorted(per_layer.items())}


def _postload_level(post: dict, layer: int, role: str = "target") -> str:
    worst = max(post["layer_worst"].get(str(layer), 0), post["model_worst"].get(role, 0))
    if worst == _WORST["refused"]:
        return "construction; vLLM refused at load"
    if worst == _WORST["limit"]:
        return "construction; post-load stopped at a simulation limit"
    return "post-load"


def _no_runner(facts: dict) -> dict:
    """What a model's MoE block that built no MoE runner says about why (its probes package's ``block_facts``)."""
    return values.inactive("none: no MoE runner is built",
                           note=f"vLLM's `{facts['runner_absent_because']}`")


def _dispatch_combine(facts: dict) -> tuple[str, str]:
    """How experts that are a module of their own (no MoE runner around them) dispatch and combine, from what they
    hold: (who does it, the rest in words): a prepare/finalize object, or none (the experts kernel does it over its
    own buffers)."""
    if facts.get("prepare_finalize"):
        return f"dispatch/combine by {short(facts['prepare_finalize'])}", ""
    who = (f"dispatch/combine inside DeepGEMM `{facts['kernel']}`" if facts.get("kernel") else
           "dispatch/combine inside the experts' own kernel")
    parts = []
    if facts.get("symm_buffer_cache"):
        parts.append(f"over a symmetric-memory buffer (class cache `{facts['symm_buffer_cache']}`, filled at the "
                     "first forward)")
    parts.append("no prepare/finalize object" + ("" if facts.get("has_moe_config") else ", no MoE config"))
    if facts.get("all2all_manager"):
        parts.append(f"all2all backend {facts.get('all2all_backend')}: its {short(facts['all2all_manager'])} exists "
                     "on the EP group, these experts hold no reference to it")
    return who, "; ".join(parts)


def _reading_kernel(facts: dict, what: str, **_) -> dict | None:
    if what == "moe-block":
        return None  # the block's experts are read on their own module
    if what == "mega-moe":
        experts = short(facts.get("experts"))
        if "transformed" not in facts:
            state = "keeps no post-load state"
        else:
            state = "weights transformed" if facts["transformed"] else "weights not transformed"
        if "has_moe_config" not in facts:  # evidence from before the harness read how they dispatch
            return values.make(experts, detail=state)
        # who dispatches decides serving (a prepare/finalize class, or the experts kernel); how, in words, is a note
        who = short(facts["prepare_finalize"]) if facts.get("prepare_finalize") else f"in {facts.get('kernel') or 'kernel'}"
        words, rest = _dispatch_combine(facts)
        return values.make(experts, detail=f"{state}; dispatch/combine {who}", note="; ".join(p for p in (words, rest) if p))
    if facts.get("moe_kernel") is None:
        return values.make("", detail="no kernel object built")
    fused = short(facts.get("fused_experts") or facts.get("moe_kernel"))
    if not facts.get("prepare_finalize"):
        return values.make(fused)
    detail = f"with {short(facts.get('prepare_finalize'))}"
    if facts.get("all2all_manager"):
        detail += f" (all2all: {short(facts['all2all_manager'])})"
    return values.make(fused, detail=detail)


def _reading_activation(facts: dict, what: str, checks: dict, **_) -> dict | None:
    """The activation the experts run and whether the kernel takes it: the activation is the value; a kernel that
    does not take it (vLLM asked, or the experts declare activations that leave it out) is part of its identity;
    which experts class and how the check was recorded is a note (the experts class is the routed experts lane's)."""
    if what == "moe-block":
        return None
    if what == "mega-moe":
        act = facts.get("activation") or "none"
        allowed = facts.get("format_activations")
        experts = short(facts.get("experts"))
        if allowed is None:
            return values.make(act, note=f"{experts}; vLLM records no kernel-support check")
        if act in allowed:
            return values.make(act, note=f"{experts}; in the experts' declared activations {', '.join(allowed)}")
        return values.make(act, detail="NOT declared by the experts",
                           note=f"{experts}; their declared activations: {', '.join(allowed)}")
    act = short(facts.get("layer_activation"))
    kernel = facts.get("fused_experts") or facts.get("experts_cls")
    asked = checks.get(short(kernel)) if kernel else None
    declared = facts.get("kernel_supports_activation")
    if asked is None:
        note = f"{short(kernel)}; vLLM did not ask the kernel about it"
        if declared not in (None, True):
            return values.make(act, detail="NOT declared by the kernel", note=note)
        return values.make(act, note=note)
    if not asked:
        return values.make(act, detail="NOT supported by the kernel", note=f"{short(kernel)}; vLLM asked the kernel")
    return values.make(act, note=f"{short(kernel)}; vLLM asked the kernel: supported")


def _reading_deferred(facts: dict, what: str, **_) -> dict | None:
    if what == "moe-block" and facts.get("runner_absent_because"):
        return _no_runner(facts)
    if what != "moe-runner" or "defer_requested" not in facts:
        return None
    if not facts.get("defer_requested"):
        return values.inactive("not requested")
    if facts.get("defer_effective"):
        cap = facts.get("defer_max_tokens")
        detail = f"up to {cap} tokens" if isinstance(cap, int) and cap >= 0 else "no token cap"
        note = ("cap as at construction (no MoE kernel was built)"
                if "moe_kernel" in facts and facts["moe_kernel"] is None else "")  # kernels built at load may lower it
        return values.make("deferred", detail=detail, note=note)
    why = facts.get("defer_fails")
    return values.make("not deferred", note="requested, not in effect on this deployment" +
                       (f": vLLM's condition fails at `{why}`" if why else ""))


#: the post-load readings of vLLM's shared MoE layers, by name (a lane's ``Source("postload", name)``); a model's
#: readings of its own modules' facts are its profile's (``Profile.postload_readings``). Each turns a module's
#: post-load facts into a lane value record (audit/report/values.py), or None where it does not apply.
POSTLOAD_READINGS = {"moe_kernel": _reading_kernel, "activation": _reading_activation,
                     "deferred_finalize": _reading_deferred}


# --- schema 2 (values as sentences): how the shared readings worded a value then, read back as today's record ------
def _legacy_kernel(said: str, ident: str) -> dict | None:
    if said == "no kernel object built":
        return values.make("", detail=said)
    if ident != said:  # MegaMoE experts: schema 2 kept "<class> <state>; dispatch/combine <who>" as the identity
        kernel, _, detail = ident.partition(" ")
        return values.make(kernel, detail=detail, note=said[len(kernel):].strip())
    kernel, _, detail = said.partition(" ")
    return values.make(kernel, detail=detail)


def _legacy_activation(said: str, ident: str) -> dict | None:
    m = re.fullmatch(r"(\S+) \((.*)\)", said)
    if not m:
        return None
    act, inner = m.groups()
    detail = ("NOT supported by the kernel" if "NOT supported" in inner else
              "NOT declared by the experts" if "NOT in the experts' declared" in inner else
              "NOT declared by the kernel" if "the kernel does not declare it" in inner else "")
    return values.make(act, detail=detail, note=inner)


def _legacy_deferred(said: str, ident: str) -> dict | None:
    if said == "not requested":
        return values.inactive(said)
    if said.startswith("none: no MoE runner is built"):
        return values.inactive("none: no MoE runner is built", note=said[len("none: no MoE runner is built"):].strip(" ()"))
    m = re.fullmatch(r"deferred \((up to \d+ tokens|no token cap)\)(?:; (.*))?", said)
    if m:
        return values.make("deferred", detail=m.group(1), note=m.group(2) or "")
    if said.startswith("requested, not in effect"):
        return values.make("not deferred", note=said)
    return None


def _legacy_model_state(said: str, ident: str) -> dict | None:
    if said == "not requested":
        return values.inactive(said)
    if said.startswith("built: "):
        return values.make(said[len("built: "):], note="built")
    if said.startswith("refused at load: "):
        return values.make("", detail="refused at load", note=said[len("refused at load: "):])
    m = re.fullmatch(r"requested; not built in simulation \((.*)\)", said)
    return values.make("", detail="requested; not built in simulation", note=m.group(1)) if m else None


#: the shared readings' schema 2 wording, read back as records (a model's own are its profile's ``postload_legacy``;
#: "model-state" is the model state's, whatever its key)
POSTLOAD_LEGACY = {"moe_kernel": _legacy_kernel, "activation": _legacy_activation,
                   "deferred_finalize": _legacy_deferred, "model-state": _legacy_model_state}


def _model_state_value(post: dict, state) -> dict[int, dict]:
    """The model state (one model-wide answer, on layer -1): requested or not, built, refused at load, or stopped
    at a simulation limit."""
    sd = post.get(state.key)
    if not sd:
        return {}
    if not sd["requested"]:
        value, level = values.inactive("not requested"), "construction"
    else:
        step = sd.get("step") or {}
        if step.get("outcome") == "ok":
            value, level = values.make(short(sd["built"]), note="built"), "post-load"
        elif step.get("outcome") == "refused":
            value = values.make("", detail="refused at load", note=step.get("message", ""))
            level = "construction; vLLM refused at load"
        else:
            value = values.make("", detail="requested; not built in simulation", note=short(step.get("type", "")))
            level = "construction; post-load stopped at a simulation limit"
    return {-1: {"value": value, "level": level, "raw": [], "source": f"postload.{state.key}"}}


def _postload_values(f: EvidenceFile, reading: str, post: dict, readings: dict, state=None) -> dict[int, dict]:
    if state is not None and reading == state.key:
        return _model_state_value(post, state)
    fn = readings[reading]
    checks: dict[int, dict] = defaultdict(dict)
    for r in post["_activation_checks"]:
        layer = layer_of(r.get("scope"))
        if layer is not None:
            checks[layer][short(r.get("cls") or r.get("owner"))] = r.get("result")
    out: dict[int, dict] = {}
    for r in post["_modules"]:
        layer = r.get("layer")
        if layer is None or layer in out:
            continue
        value = fn(r.get("facts") or {}, r.get("what", ""), checks=checks.get(layer, {}))
        if value is not None:
            out[layer] = {"value": value, "level": _postload_level(post, layer, r.get("role", "target")), "raw": [],
                          "source": f"postload.{reading}"}
    return out


def _scrub_path(text: str) -> str:
    """Drop the environment's location from a source path (keeps ledgers host-independent)."""
    return re.sub(r"^.*?/site-packages/", "", text)


def _one(f: EvidenceFile, kind: str) -> dict:
    recs = f.of_kind(kind)
    if not recs:
        return {}
    return {k: v for k, v in recs[-1].items() if k not in ("kind", "seq")}


def _model_lanes(f: EvidenceFile, profile: Profile, post: dict | None, state) -> tuple[dict, dict]:
    """One model's lanes (per lane, its layer groups, each with how far the simulation went for it) and the
    candidates vLLM tried, from that model's records (*f*: a view, audit.evidence.files.model_view)."""
    lanes, candidates = {}, {}
    readings = {**POSTLOAD_READINGS, **profile.postload_readings}
    # a lane's value names the kernel its backend string enters where the profile's labels are kernel names
    kernels = profile.backend_labels.kernels if profile.backend_labels is not None and \
        profile.backend_labels.values_are_kernels else {}
    wide = profile.model_state.key if profile.model_state is not None else None
    for lane in profile.lanes:
        if state is None and any(s.kind == "postload" and s.target == wide for s in lane.sources):
            continue  # the model state is the target's (its worker builds it once): no lane of a draft
        per_layer = _lane_values(f, lane, post, readings, state, kernels.get(lane.id))
        levels = {k: v.get("level", lane.level) for k, v in per_layer.items()}
        groups = collapse({k: (v["value"], levels[k]) for k, v in per_layer.items()},
                          raw={k: {"source": v.get("source", ""), "fields": v["raw"]} for k, v in per_layer.items()})
        for g in groups:  # each row says how far the simulation went for it
            g["value"], g["level"] = g["value"]
            if g["layers"] == [-1]:  # a model-wide answer
                g["ranges"] = "model"
        lanes[lane.id] = groups
        if lane.candidates_target:
            candidates[lane.id] = _candidates(f, lane.candidates_target)
    return lanes, candidates


def _numbering(rec: dict) -> tuple[dict[int, int], str]:
    """A draft record's module layer -> vLLM layer numbers, and what is wrong with them ("" when nothing)."""
    out: dict[int, int] = {}
    for k, v in (rec.get("numbering") or {}).items():
        if not (isinstance(k, str) and k.isdigit() and isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return {}, f"the draft record numbers module layer {k!r} as {v!r}"
        out[int(k)] = v
    shares = rec.get("shares") or []
    if not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in shares):
        return {}, "the draft record's shared modules are not [draft module, target module] pairs"
    return out, ""


def _draft(f: EvidenceFile, profile: Profile, post: dict | None) -> tuple[dict | None, str]:
    """A speculative draft's own account beside its target, or None where the cell built none: its class, the
    numbers vLLM serves its layers under (its modules count from 0), the target modules it holds, its layer kinds,
    lanes and candidates (never under a target layer). With what is wrong with the record, if anything."""
    rec = _one(f, "draft")
    model = next((r for r in f.of_kind("model") if r.get("role") == "draft"), None)
    if not rec and model is None and not any(r.get("role") == "draft" for r in f.records):
        return None, ""
    numbering, wrong = _numbering(rec)
    view = model_view(f, "draft", numbering)
    dpost = None if post is None else {
        **post, "layer_worst": _layer_worst(view.of_kind("postload-step")),
        "_modules": view.of_kind("postload-module"), "_activation_checks": view.of_kind("activation_check")}
    lanes, candidates = _model_lanes(view, profile, dpost, None)
    kinds = _layer_kinds(view, profile)
    layers = sorted(set(numbering.values()) | {n for ns in kinds.values() for n in ns})
    return {"cls": rec.get("cls") or (model or {}).get("cls", ""), "described": bool(rec), "layers": layers,
            "numbering": {str(k): v for k, v in sorted(numbering.items()) if k != v},
            "shares": [list(p) for p in rec.get("shares") or []] if not wrong else [],
            "layer_kinds": kinds, "lanes": {k: v for k, v in lanes.items() if v},
            "candidates": {k: v for k, v in candidates.items() if v}}, wrong


def build_cell(f: EvidenceFile, profile: Profile) -> dict:
    system, layout = f.cell or ("?", "?")
    stages, deepest, failure = _stages(f, engines.get(profile.engine))
    target = model_view(f, "target")  # a speculative draft's records are its own rows (_draft)
    kinds = _layer_kinds(target, profile)
    post = _postload(f, profile)
    lanes, candidates = _model_lanes(target, profile, post, profile.model_state)
    draft, draft_wrong = _draft(f, profile, post)
    if post is not None and post.get("refused_at"):  # which kind of layer vLLM refused to load
        post["refused_at"]["kind"] = _module_kind(f, profile, post["refused_at"].get("module", ""))
    if post is not None:  # read into the lanes above; not kept in routing.json
        post.pop("_modules")
        post.pop("_activation_checks")
    targets = f.of_kind("target")
    drift = [{"target": t["target"], "title": t.get("title", ""), "required": t.get("required", True),
              "attempts": t.get("attempts", [])} for t in targets if t.get("status") == "drift"]
    not_reached = [t["target"] for t in targets if t.get("status") == "not-reached"]
    not_applicable = [t["target"] for t in targets if t.get("status") == "not-applicable"]
    raises: list[dict] = []
    for r in f.of_kind("raise"):  # one exception propagates through nested probes: keep the innermost
        err = r.get("error") or {}
        key = (err.get("type"), err.get("message"))
        same = next((x for x in raises if (x["type"], x["message"]) == key), None)
        if same is not None:
            same["through"].append(r.get("target"))
            continue
        raises.append({"target": r.get("target"), "scope": r.get("scope"), "layer": layer_of(r.get("scope")),
                       "type": err.get("type"), "message": err.get("message"), "through": []})
    complete = bool(stages) and all(s["ok"] for s in stages) and deepest == STAGE_ORDER[-1]
    sim = _one(f, "simulated")
    return {
        "system": system,
        "layout": layout,
        "evidence": f.header.get("mode") == "resolve" and "resolved" or "observed",
        "status": "COMPLETE" if complete else "PARTIAL",
        "stages": stages,
        "depth": deepest,
        "failure": failure,
        "layer_kinds": kinds,
        "lanes": lanes,
        "candidates": candidates,
        "attention_candidates": _attention_candidates(target),
        "draft": draft,
        "postload": post,
        "load_refused": (post or {}).get("refused_at"),
        "raises": raises,
        "probe_errors": [{"where": r.get("where"), "error": r.get("error")} for r in f.of_kind("probe_error")],
        "drift": drift,
        "not_reached": not_reached,
        "not_applicable": not_applicable,
        "config": _one(f, "config"),
        "argv": _argv(_one(f, "job").get("argv") or []),
        "simulated": sim.get("items", {}),
        "stand_in_calls": sim.get("stand_in_calls", []),
        "device": sim.get("device", {}),
        "availability": _one(f, "availability"),
        "availability_why": _one(f, "availability_why").get("items", {}),
        "fingerprint": _one(f, "fingerprint"),
        "fence": _fence(f),
        "standin_fit": _one(f, "standin_fit").get("items", {}),
        # a stop in a cell whose own harness code faulted is that fault's doing: not asked about as a limit
        "harness_faults": harness_faults(f) or _draft_fault(draft_wrong, system, layout)
        or _undeclared_stops(failure, post, _one(f, "fingerprint")),
        # --- dispatch tiers (audit/report/dispatch.py): per-call choices by token count, None if not resolved ---
        "dispatch": _draft_tiers(dispatch_tiers(f, profile), draft),
    }


def _draft_tiers(tiers: dict | None, draft: dict | None) -> dict | None:
    """The cell's dispatch tiers with a speculative draft's rows naming its class and its layers as vLLM numbers
    them (the dispatch probe counts a draft's modules from 0, like its other per-module records)."""
    if not tiers or not draft:
        return tiers
    numbering = {int(k): v for k, v in draft.get("numbering", {}).items()}
    for rows in tiers["lanes"].values():
        for g in rows:
            if g["role"] == "target":
                continue
            g["draft"] = short(draft.get("cls", ""))
            if numbering and g["layers"]:
                g["layers"] = [numbering.get(n, n) for n in g["layers"]]
                g["ranges"] = format_ranges(g["layers"])
    return tiers


def _draft_fault(wrong: str, system: str, layout: str) -> list[dict]:
    """A draft record that says what no draft record can (the probes wrote it): a harness fault, never routing."""
    return [{"piece": "probe draft description", "where": f"{system}/{layout}", "type": "malformed evidence",
             "traceback": [], "message": wrong}] if wrong else []


UNDECLARED = "simulation limit not declared"


def _undeclared_stops(failure: dict | None, post: dict | None, fingerprint: dict) -> list[dict]:
    """The stops of a cell that no declared simulation limit (audit/limits.py) covers, as harness faults; a stop a
    declaration covers is marked with its id (``declared``). A stop vLLM's own code made (a refusal) is no limit and
    is not asked about."""
    packages = fingerprint.get("packages") or {}
    stops = [(g, g.get("raised_in", "")) for g in (post or {}).get("limits") or []]
    if failure and failure.get("outcome") == "limit":
        stops.append((failure, limits.raised_in_of(failure.get("where", ""))))
    faults = []
    for stop, raised_in in stops:
        lim = limits.declared(raised_in, stop.get("type", ""), stop.get("message", ""), packages)
        if lim is not None:
            stop["declared"] = lim.id
            continue
        faults.append({"piece": UNDECLARED, "where": raised_in, "type": stop.get("type", "?"),
                       "message": (f"the simulation stopped in {raised_in or '?'} ({stop.get('type', '?')}: "
                                   f"{cut(stop.get('message', ''), 200)}) and no declared limit covers that place for "
                                   "this release (audit/limits.py): resolve mode has gone further there before, or "
                                   "nobody has looked at why it cannot; declare it with its reason if it truly needs "
                                   "a device"), "traceback": []})
    return faults


def went_further(before: dict, cell: dict) -> str:
    """Why *cell* stopped short of where *before* (the committed audit of the same cell of the same build) went, or
    "": construction stopped at a limit where it finished or reached a later stage before, or post-load stopped in
    more steps than before."""
    failure = cell.get("failure") or {}
    if failure.get("outcome") == "limit" and before.get("status") != "INCOMPLETE":
        depth = lambda c: STAGE_ORDER.index(c["depth"]) if c.get("depth") in STAGE_ORDER else -1  # noqa: E731
        if depth(before) > depth(cell):
            return (f"construction stopped at a simulation limit in {failure.get('stage')}, where the committed audit "
                    f"of this build reached {before.get('depth')}")
    now, then = cell.get("postload") or {}, before.get("postload") or {}
    if now.get("limit") and then.get("ran") and then.get("limit", 0) < now.get("limit", 0):
        return (f"post-load stopped at a simulation limit in {now['limit']} of {now.get('steps')} steps, where the "
                f"committed audit of this build stopped in {then.get('limit', 0)} of {then.get('steps')}")
    return ""


#: what the probes record in every cell whose construction finished: a selection of some kind, and the modules
#: built (a resolve cell that finished construction without them recorded nothing a claim could be judged on)
BUILT_CELL_RECORDS = (("select", "candidates", "candidate"), ("construct", "scope"))


def _unjudgeable(f: EvidenceFile, cell: dict) -> str:
    """Why a cell's evidence can judge nothing although it is whole (closing record consistent), or "": no stage
    record at all, or a construction that finished with no selection or no construction record."""
    if f.header.get("mode") != "resolve":
        return ""
    if not cell["stages"]:
        return ("evidence damaged: it holds no stage record (every resolve cell records how far it went), so "
                "nothing in it can be judged")
    probes_off = any(r.get("installed") is False for r in f.of_kind("probes"))  # a bare run (transparency baseline)
    if "construct" in {s["stage"] for s in cell["stages"] if s["ok"]} and not probes_off:
        for kinds in BUILT_CELL_RECORDS:
            if not any(f.of_kind(k) for k in kinds):
                return (f"evidence damaged: construction finished but it holds no {' / '.join(kinds)} record, which "
                        "every built cell records; nothing in it can be judged")
    return ""


def harness_faults(f: EvidenceFile) -> list[dict]:
    """The harness faults an evidence file records (probes.core.fence): the harness's own code raised inside
    vLLM's process (paths are made machine-independent with the rest of the cell)."""
    return [{"piece": r.get("piece", "?"), "where": str(r.get("where", "")), "type": r.get("type", "?"),
             "message": r.get("message", ""), "traceback": [str(x) for x in r.get("traceback", [])]}
            for r in f.of_kind("harness_fault")]


def _fence(f: EvidenceFile) -> dict:
    """Whether the fence was on in the cell's process, how many pieces it held, and any planted fault (how often
    each piece ran stays in the evidence: it depends on what earlier runs left in the memo and caches)."""
    rec = _one(f, "fence")
    if not rec:
        return {"on": False, "pieces": 0, "planted": []}
    return {"on": bool(rec.get("on")), "pieces": len(rec.get("pieces", {})), "planted": list(rec.get("planted") or [])}


def memo_rejected(files: list[EvidenceFile]) -> int:
    """Memo entries that did not verify in this run's cells (computed again, never served)."""
    total = 0
    for f in files:
        memo = _one(f, "simulated").get("memo") or {}
        total += sum(int((v or {}).get("rejected", 0)) for v in memo.values() if isinstance(v, dict))
    return total


def fault_reason(faults: list[dict]) -> str:
    first = faults[0]
    more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
    return (f"harness fault in {first['piece']}: {first['type'].split(':')[-1]}: {cut(first['message'], 300)}{more}; "
            "the harness's own code raised inside vLLM's process, so what vLLM did after it is not vLLM's decision "
            "alone: no routing of this cell is shown")


def _observed_raw(row: dict, profile) -> dict:
    """What labels are derived from, in the shape resolve mode's lanes have (see audit.report.labels): an experts
    class one of the profile's quantization schemes records by class (``EXPERTS_SOURCES``) under its source."""
    if row["lane"] == MOE_LANE and row.get("backend"):
        source = next((s.experts_sources[row["backend"]] for s in profile.scheme_parts()
                       if row["backend"] in s.experts_sources), None)
        if source is not None:
            return {"source": source, "fields": [row["backend"]]}
    return {"source": "observed", "fields": [row["backend"]] if row.get("backend") and row["lane"] != "moe" else []}


def observed_cell(system: str, layout: str, observed: dict, profile) -> dict:
    """A cell known only from observe-mode processes: its lanes are the kernel paths that ran."""
    cell = incomplete_cell(system, layout, reason="", log="")
    lanes: dict[str, list] = {}
    for row in observed["rows"]:
        lanes.setdefault(row["lane"], []).append({
            "layers": row["layers"], "ranges": row["ranges"], "value": values.make(row["path"]), "phase": row["phase"],
            "evidence": row["evidence"], "raw": _observed_raw(row, profile)})
    cell.update(status="COMPLETE", evidence="observed", failure=None, lanes=lanes, observed=observed,
                layer_kinds={})
    return cell


def incomplete_cell(system: str, layout: str, *, reason: str, log: str) -> dict:
    """A cell for which no evidence exists (its process died or never ran). *log*: where its process's output is,
    relative to the run directory ("" where none is kept); never its text, which differs from run to run."""
    return {"system": system, "layout": layout, "evidence": "none", "status": "INCOMPLETE", "stages": [],
            "depth": "", "failure": {"stage": "process", "type": "", "message": reason, "where": ""},
            "log": log, "layer_kinds": {}, "lanes": {}, "candidates": {}, "attention_candidates": None,
            "postload": None, "load_refused": None,
            "raises": [], "probe_errors": [], "drift": [], "not_reached": [], "not_applicable": [], "config": {},
            "argv": [],
            "simulated": {}, "stand_in_calls": [], "device": {}, "availability": {}, "fingerprint": {},
            "availability_why": {}, "fence": {"on": False, "pieces": 0, "planted": []},
            "harness_faults": []}


def _observed(files: list[EvidenceFile]) -> dict:
    """A cell's observe-mode files: the merged per-rank counts, with the profiler's corroboration if it ran."""
    observed = merge_observed(files)
    profiled = corroborate(files, observed)
    if profiled is not None:
        observed["profiler"] = profiled
    return observed


def build_routing(files: list[EvidenceFile], profile: Profile, *, pin: dict, expected: list[tuple[str, str]],
                  missing: dict[tuple[str, str], dict] | None = None, run: dict | None = None,
                  scrub: dict[str, str] | None = None, previous: dict | None = None) -> dict:
    """The whole routing model of one audit: provenance plus one entry per expected cell. *previous*: the committed
    routing of the same build (pin and wheel), where a cell that stops short of where it went there is a harness
    fault, never a limit."""
    before = {(c["system"], c["layout"]): c for c in (previous or {}).get("cells", [])}
    damaged: dict[tuple, list[str]] = defaultdict(list)
    for f in files:  # evidence that cannot be trusted makes its cell INCOMPLETE; none of it is rendered
        why = f.damage or ("" if f.final or f.header.get("mode") == "observe"
                           else "the process ended before its last write")
        if why and f.cell:
            damaged[f.cell].append(f"{f.path.name}: {why}")
    files = [f for f in files if f.cell not in damaged]
    observe_files: dict[tuple, list[EvidenceFile]] = defaultdict(list)
    for f in files:
        if f.cell and f.header.get("mode") == "observe":
            observe_files[f.cell].append(f)
    by_cell = {f.cell: f for f in files if f.cell and f.header.get("mode") != "observe"}
    cells = []
    for system, layout in expected:
        f = by_cell.get((system, layout))
        seen = observe_files.get((system, layout))
        if f is not None:
            cell = build_cell(f, profile)
            # a cell whose own harness code faulted stopped for that reason: not asked again
            shorter = went_further(before[(system, layout)], cell) \
                if (system, layout) in before and not cell["harness_faults"] else ""
            if shorter:
                cell["harness_faults"].append({
                    "piece": "the committed audit of this build went further", "where": f"{system}/{layout}",
                    "type": "stopped short", "traceback": [],
                    "message": f"{shorter}: the same vLLM build ran further in this cell before, so this stop is the "
                               "harness's doing (a stand-in or probe that changed), not a limit of resolve mode"})
            unjudgeable = _unjudgeable(f, cell)
            if unjudgeable:  # what every built cell records is missing: nothing in it could be judged
                cells.append(incomplete_cell(system, layout, reason=unjudgeable, log=""))
                continue
            if cell["harness_faults"]:  # never vLLM's decision: the cell is INCOMPLETE, its fault named
                faulty = incomplete_cell(system, layout, reason=fault_reason(cell["harness_faults"]), log="")
                for key in ("harness_faults", "fence", "standin_fit", "availability", "availability_why",
                            "fingerprint"):
                    faulty[key] = cell[key]
                faulty["failure"]["stage"] = "harness"
                cells.append(faulty)
                continue
            if seen:
                cell["observed"] = _observed(seen)
            cells.append(cell)
        elif seen:
            cells.append(observed_cell(system, layout, _observed(seen), profile))
        elif (system, layout) in damaged:
            cells.append(incomplete_cell(system, layout, reason="evidence damaged: " + "; ".join(damaged[(system, layout)]),
                                         log=""))
        else:
            info = (missing or {}).get((system, layout), {})
            cells.append(incomplete_cell(system, layout, reason=info.get("reason", "no evidence was written"),
                                         log=info.get("log", "")))
    cells = scrub_paths(cells, dict(sorted((scrub or {}).items(), key=lambda kv: -len(kv[0]))))
    # how each stand-in's target fitted the release is a fact of the release, not of a cell: a cell's process
    # checks a target when its module is imported, which an SM process's warm imports (a speed-up that depends on
    # what earlier runs learned) may do ahead of the cell. One account for the run, the union over its cells.
    fit: dict[str, str] = {}
    for c in cells:
        for k, v in (c.pop("standin_fit", None) or {}).items():
            fit.setdefault(k, v)
    run = dict(run or {})
    rejected = memo_rejected(files)
    if rejected:  # a fact of this run (what the memo held), like the evidence cache's hits: not of any cell
        run["memo_rejected"] = rejected
    met: dict[str, list[str]] = {}
    for c in cells:
        for stop in [*((c.get("postload") or {}).get("limits") or []), c.get("failure") or {}]:
            if stop.get("declared"):
                met.setdefault(stop["declared"], []).append(f"{c['system']}/{c['layout']}")
    routing = {"schema": ROUTING_SCHEMA, "model": profile.name, "architecture": profile.architecture,
            "standin_fit": dict(sorted(fit.items())),
            # the declared simulation limits the cells stopped at (audit/limits.py), with the cells
            "declared_limits": {k: sorted(set(v)) for k, v in sorted(met.items())},
            "lane_titles": {lane.id: lane.title for lane in profile.lanes},
            # routing.json is written with sorted keys: the profile's lane order is kept as a list
            "lane_order": [lane.id for lane in profile.lanes],
            "lane_levels": {lane.id: lane.level for lane in profile.lanes},
            # lanes read off the built modules after construction (not from a selector as it ran): a stop
            # leaves them unread, not unbuilt
            "lanes_read_after_construction": sorted(lane.id for lane in profile.lanes
                                                    if lane.sources and all(s.kind == "module" for s in lane.sources)),
            "pin": pin, "run": run, "cells": cells}
    return routing
