"""Model profiles: what to audit for a model, as data (the profiles themselves are in ``audit/models/``).

A profile names the model's config (shipped as package data, no weights), the modules worth
importing once per SM, the *lanes* the ledger reports (for each lane, which evidence records, by probe
target id, carry its answer per layer), the serving layouts, and the model's perf-database vocabulary.
A new model is a new profile registered in :mod:`audit.models`, not new code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from audit import engines


@dataclass(frozen=True)
class Source:
    """Where a lane's per-layer answer comes from.

    ``kind``/``target`` select records (for ``module`` records, ``target`` is a regular expression
    on the module name); ``fields`` are ``result`` (a selector's return value), ``attrs.<name>``
    (what a constructed object chose), ``facts.<name>`` (read off the built module) or ``cls``.
    ``postload`` sources read the post-load stage's records; ``target`` names the reading
    (a shared one, ``audit.report.routing.POSTLOAD_READINGS``, or the profile's own ``postload_readings``) and
    ``fields`` are unused.
    """

    kind: str
    target: str
    fields: tuple[str, ...]
    label: str = ""
    #: fields kept in routing.json (``raw``) but not shown, e.g. the quant method class for labels
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lane:
    id: str
    title: str
    layer_kind: str  # which layers it applies to: moe, kda, mla, dense
    phase: str  # prefill / decode / spec-verify / all
    sources: tuple[Source, ...]
    #: evidence kinds whose records in a layer are this lane's candidates
    candidates_target: str = ""
    #: (field, why): the phase only happens when this field of the source record is truthy
    exercised_if: tuple[str, str] | None = None
    #: how far the simulation must go for this lane's answer: construction or post-load
    level: str = "construction"


@dataclass(frozen=True)
class JudgedLane:
    """A harness lane perf databases label, so claims are judged against it.

    ``perf_lane`` is the perf database's name for it (None where the name follows from the value: the routed experts'
    lanes are named by their precision, the profile's quantization schemes' ``PRECISION_LANES``); ``phase`` is how labels.json states the phase;
    ``workloads`` the kinds of batch it serves (decode / prefill / verify); ``dispatch`` the dispatch lanes whose
    per-call choices refine it, as (lane, tier prefix)."""
    lane: str
    kind: str  # the layer kind it is about (a key of the cell's layer_kinds)
    perf_lane: str | None
    phase: str
    workloads: tuple[str, ...]
    dispatch: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Slice:
    """A served subset of the model for observe mode: fewer layers, every kept layer unchanged.

    ``patch`` is applied to the published config like a layout's; ``cut`` is what the ledger says
    was left out. Per-layer shapes and per-rank head counts are the published ones."""
    name: str
    layers: int
    patch: tuple[tuple[str, object], ...]
    kept: str
    cut: str


@dataclass(frozen=True)
class DispatchLanes:
    """What a model's ledger says about its per-call dispatch lanes (``audit/report/dispatch.py``; its probe side
    resolves them) beyond the shared ones (``dispatch.LANE_TITLES``, lanes the shared probes resolve for any model).

    ``order`` lists the dispatch lanes its ledger shows, shared ones included, in the order shown (lanes it does not
    list follow: the shared ones in their order, then its own in ``titles``' order); ``titles`` names its own lanes
    and renames shared ones for it; ``notes`` is what a reader must know to read a lane's table (shown under its
    title); ``stand_ins`` are the stand-ins its probe side runs a lane's vLLM function with, lane -> (what, how),
    listed under "What was simulated" wherever the lane has rows."""
    order: tuple[str, ...] = ()
    titles: dict[str, str] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    stand_ins: dict[str, tuple[str, str]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepPath:
    """A path of the model's own that serves the steps it takes in place of the stock lanes (probe side: its probes
    package's ``STEP_PATH``). The shared ``serving_path`` dispatch lane's choice for a step it takes ends with
    ``: <name>``; such a step is served by its own kernels, so verdicts and labels.json follow it, not the lane.

    ``lane`` is its dispatch lane (what it runs per step); ``parts`` maps a construction lane to its own component
    that serves that lane's work; its kernels are labelled ``vllm_<family>_<part>``, of backend family ``family``;
    ``owner`` is how the ledger and labels.json name it in a sentence."""
    name: str
    lane: str
    owner: str
    family: str
    parts: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchRoute:
    """A per-call choice that says which construction lane serves a batch: the tier choice of dispatch lane
    ``dispatch`` begins ``<path>: `` for a batch that takes a path of ``paths`` (path -> the lane whose group
    serves it), e.g. an attention metadata builder that sends a short prefill down the decode path, or a runner
    that builds a draft method's decode rows as speculative rows. Applies to the judged lanes in ``lanes``; where
    ``named`` is set, every batch names a path and a choice naming none is unknown; else such a batch is served by
    the lane itself. ``title`` names the layer kind in the note ("a decode 8 batch takes KDA's speculative
    rows ...")."""
    dispatch: str
    lanes: tuple[str, ...]
    paths: dict[str, str]
    title: str
    named: bool = False


@dataclass(frozen=True)
class ModelState:
    """What the model's worker builds once its weights are loaded (K3: its specialized decode), read model-wide after
    post-load: its probes package emits a ``postload-model`` record (``model_facts``) and runs the build as a
    ``model-state`` step (``postload_steps``). ``key`` names the entry in a cell's post-load summary (routing.json)
    and the reading a lane shows it with (``Source("postload", key)``); the ``*_field`` names are the record's
    fields saying whether the layout asked for it, what was built and with which config."""
    key: str
    requested_field: str
    built_field: str
    config_field: str


@dataclass(frozen=True)
class BackendLabels:
    """The kernels a lane's value enters, for lanes whose value is vLLM's resolved backend *string* (no class the
    harness could name a family from).

    ``kernels``: lane -> {value -> the ``kernel_source`` label of the kernel it enters} (a bool value: an older pin's
    yes/no answer); ``families``: labels a perf database has no entry for -> the backend family of their kernels;
    ``term``: how the ledger's key names such a value (one row per string value: its kernel in each lane)."""
    term: str
    kernels: dict[str, dict]
    families: dict[str, str] = field(default_factory=dict)
    #: the labels are kernel names the lane's value shows in place of the backend string (False: the labels are the
    #: harness's own derived names, used for verdicts and labels.json only; the value stays the engine's words)
    values_are_kernels: bool = True


@dataclass(frozen=True)
class Profile:
    name: str
    title: str
    architecture: str
    config_package_path: str  # inside audit/data
    warm_imports: tuple[str, ...]
    lanes: tuple[Lane, ...]
    #: class qualname suffix -> layer kind, read from scope records (what vLLM actually built)
    layer_classes: dict[str, str] = field(default_factory=dict)
    #: observe-mode slices by name (the full model needs no slice)
    slices: dict[str, Slice] = field(default_factory=dict)
    #: checkpoint weight names the speculative draft's ``load_weights`` must see to accept the checkpoint
    #: (``{layer}``: each of the draft's layer indices). Post-load feeds it one meta tensor per name, of the
    #: shape of the parameter it loads into, so vLLM's presence check passes; a real checkpoint must hold them.
    draft_weights: tuple[str, ...] = ()
    #: the serving layouts audited for this model, by name (``--layouts`` picks among them)
    layouts: dict = field(default_factory=dict)
    #: lanes judged against claims, in order (see :class:`JudgedLane`)
    judged: tuple[JudgedLane, ...] = ()
    #: the perf database's lane names -> the harness lane each is about (its vocabulary; ``judged`` holds the
    #: reverse direction)
    perf_lanes: dict[str, str] = field(default_factory=dict)
    #: perf-db lanes measured in one phase only: the workloads a claim about them can name
    perf_lane_phases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: layer kind -> how the ledger names it
    kind_titles: dict[str, str] = field(default_factory=dict)
    #: the probe-side module of this model (``probes/models/<probes>/``), named in the plan: its probe targets,
    #: post-load readings, dispatch lanes and observe-mode entries (the shared probes know no model by name)
    probes: str = ""
    #: what the ledger says about this model besides its lanes: ``glossary`` (term, meaning) rows of its key,
    #: ``layer_numbers`` (how its layer indices read), ``candidates_of`` (which layers the attention backend
    #: candidates are about), ``state_example`` (the model state vLLM builds after loading, if any)
    ledger_notes: dict = field(default_factory=dict)
    #: its per-call dispatch lanes as the ledger shows them (see :class:`DispatchLanes`)
    dispatch: DispatchLanes = field(default_factory=DispatchLanes)
    #: a path of its own that serves some steps in place of the stock lanes, if any (see :class:`StepPath`)
    step_path: StepPath | None = None
    #: per-call choices that say which construction lane serves a batch (see :class:`BatchRoute`)
    batch_routes: tuple[BatchRoute, ...] = ()
    #: kernel labels for lanes whose value is a backend string, if any (see :class:`BackendLabels`)
    backend_labels: BackendLabels | None = None
    #: what its worker builds once the weights are loaded, if anything (see :class:`ModelState`)
    model_state: ModelState | None = None
    #: post-load readings of the model's own modules, by name (a lane's ``Source("postload", name)``): each turns
    #: a module's post-load facts (``facts``, ``what``) into the lane's value, or None where it does not apply; the
    #: shared ones are ``audit.report.routing.POSTLOAD_READINGS``
    postload_readings: dict = field(default_factory=dict)
    #: for each of its own readings, how a schema 2 routing.json worded its value (a sentence) -> the record today's
    #: reading gives for the same facts (``audit/report/values.py`` upgrades old reports with it); the shared readings'
    #: are ``audit.report.routing.POSTLOAD_LEGACY``
    postload_legacy: dict = field(default_factory=dict)
    #: ``make selftest-gpu``: the observe-mode slice it serves on one GPU and the lanes whose kernel-entry probes
    #: must fire there (empty: the model has no selftest)
    selftest_slice: str = ""
    selftest_lanes: tuple[str, ...] = ()
    #: the quantization schemes of its experts (``probes/schemes/<name>.py``): what their probes wrap, their backend
    #: families and the perf database's precision lanes for its experts (added to ``perf_lanes``, naming the
    #: routed experts lane)
    schemes: tuple[str, ...] = ()
    #: the serving engine this profile audits the model on (``audit/engines``): its flags, probe targets and
    #: vocabulary are that engine's
    engine: str = engines.DEFAULT

    def __post_init__(self):
        check_profile(self)
        precision = {lane: MOE_LANE for scheme in self.scheme_parts() for lane in scheme.precision_lanes}
        object.__setattr__(self, "perf_lanes", {**precision, **self.perf_lanes})

    def scheme_parts(self) -> tuple:
        """Its quantization schemes, loaded (``probes.schemes.Scheme``)."""
        from probes import schemes

        return schemes.load_all(self.schemes)

    def moe_family(self, backend: str) -> str:
        """The backend family of an experts backend (its enum member's name) in its schemes' tables, else unknown."""
        return next((fam for s in self.scheme_parts() if (fam := s.family(backend))), "unknown")

    def precision_lane(self, source: str, backend: str) -> str:
        """The perf database's precision lane of the experts a lane group names, from its schemes' rules, else
        unknown."""
        return next((lane for s in self.scheme_parts() if (lane := s.precision_lane(source, backend))), "unknown")

    def precision_lanes(self) -> dict[str, str]:
        """Its schemes' precision lanes -> what each means."""
        return {lane: text for s in self.scheme_parts() for lane, text in s.precision_lanes.items()}

    def config_text(self) -> str:
        return resources.files("audit").joinpath("data", self.config_package_path).read_text(encoding="utf-8")

    def write_model_dir(self, directory: Path, patch: tuple = (), draft: str = "") -> Path:
        """A model directory holding only config.json (weights are dummy; nothing is downloaded).

        ``patch`` applies (dotted key, value) changes a layout declares, e.g. an MTP layer count; ``draft`` (a
        layout's ``draft_config``, package data) becomes ``<directory>/draft/config.json``, the speculative
        draft the layout's arguments name as ``<model>/draft``.
        """
        if draft:
            text = resources.files("audit").joinpath("data", draft).read_text(encoding="utf-8")
            json.loads(text)  # fail early on a damaged package
            (directory / "draft").mkdir(parents=True, exist_ok=True)
            _write_if_changed(directory / "draft" / "config.json", text)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "config.json"
        text = self.config_text()
        data = json.loads(text)  # fail early on a damaged package
        if patch:
            for key, value in patch:
                node = data
                *parents, leaf = key.split(".")
                for part in parents:
                    node = node[part]
                if leaf not in node:
                    raise KeyError(f"config patch {key!r}: no such key in {self.config_package_path}")
                node[leaf] = value
            text = json.dumps(data, indent=2, sort_keys=False) + "\n"
        _write_if_changed(path, text)
        return directory


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)


#: the post-load readings of vLLM's shared MoE layers, by name (their functions: audit.report.routing's
#: ``POSTLOAD_READINGS``, which a test keeps equal to this list)
SHARED_POSTLOAD_READINGS = ("moe_kernel", "activation", "deferred_finalize")
#: lanes the shared code reads by name: the routed experts lane (its candidates and precision lanes) and MLA's
#: decode/prefill split (a short prefill chunk takes the decode path)
MOE_LANE = "moe"


def check_profile(p: "Profile") -> None:
    """The rules the shared code relies on, checked when a profile is made (a typo or a renamed lane is an error at
    registration, never a lane the shared code silently skips)."""
    from audit.errors import ProfileError

    from probes.schemes import UnknownScheme, load_all

    try:
        parts = load_all(p.schemes)
    except UnknownScheme as exc:
        raise ProfileError(p.name, str(exc)) from None
    precision = {lane for s in parts for lane in s.precision_lanes}
    for lane, harness_lane in p.perf_lanes.items():
        if lane in precision and harness_lane != MOE_LANE:
            raise ProfileError(p.name, f"perf lane {lane!r} is its quantization scheme's precision lane, about the "
                                       f"routed experts lane {MOE_LANE!r}, not {harness_lane!r}; remove it from "
                                       "perf_lanes (precision lanes come from the scheme)")
    if any(j.perf_lane is None for j in p.judged) and not precision:
        raise ProfileError(p.name, "a judged lane's perf lane is left to the precision of its experts, but none of "
                                   f"its schemes ({', '.join(p.schemes) or 'none'}) names precision lanes")
    ids = [lane.id for lane in p.lanes]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ProfileError(p.name, f"lane id(s) {', '.join(dup)} defined twice")
    kinds = set(p.layer_classes.values()) | {"model"}
    for lane in p.lanes:
        if lane.layer_kind not in kinds:
            raise ProfileError(p.name, f"lane {lane.id!r} is about layer kind {lane.layer_kind!r}, which no class in "
                                       f"layer_classes maps to (kinds: {', '.join(sorted(kinds))})")
        if lane.candidates_target and lane.layer_kind == "moe" and lane.id != MOE_LANE:
            raise ProfileError(p.name, f"the routed experts lane (layer kind moe, with candidates) must be named "
                                       f"{MOE_LANE!r}, not {lane.id!r}: the shared verdicts and labels read it by name")
        for src in lane.sources:
            if src.kind == "postload":
                known = set(SHARED_POSTLOAD_READINGS) | set(p.postload_readings) | \
                    ({p.model_state.key} if p.model_state is not None else set())
                if src.target not in known:
                    raise ProfileError(p.name, f"lane {lane.id!r} reads the post-load reading {src.target!r}, which is "
                                               f"neither shared nor the profile's (known: {', '.join(sorted(known))})")
    refs = [("judged", [j.lane for j in p.judged]), ("perf_lanes", list(p.perf_lanes.values())),
            ("selftest_lanes", list(p.selftest_lanes)),
            ("step_path.parts", list(p.step_path.parts) if p.step_path is not None else []),
            ("backend_labels.kernels", list(p.backend_labels.kernels) if p.backend_labels is not None else []),
            ("batch_routes", [lane for r in p.batch_routes for lane in (*r.lanes, *r.paths.values())])]
    for where, lanes in refs:
        unknown = sorted(set(lanes) - set(ids))
        if unknown:
            raise ProfileError(p.name, f"{where} names lane(s) {', '.join(unknown)}, which the profile does not "
                                       f"define (lanes: {', '.join(ids)})")
