"""The systems an audit covers, and what a serving layout is, as data (each model's layouts are in its
profile, ``audit/models/``).

Device properties are what resolve mode presents to vLLM through the simulated platform. Only the
capability decides most selections; the rest (name, memory, SM count) are listed in the ledger's
provenance as simulated values, so a reader can see exactly what vLLM was told.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from audit.errors import SelectionError


@dataclass(frozen=True)
class System:
    name: str
    device_name: str
    capability: tuple[int, int]
    total_memory_gib: int
    sm_count: int
    arch: str  # amd64 | arm64: picks the platform digest of a multi-arch image
    #: CUDA driver attributes (CU_DEVICE_ATTRIBUTE_* without the prefix) measured on the real GPU, for the
    #: libraries that read them (Humming's kernel heuristics); empty where none was measured: such a read is
    #: then a simulation limit, never a guess
    attributes: tuple[tuple[str, int], ...] = ()
    attributes_source: str = ""

    @property
    def sm(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"

    def as_job(self) -> dict:
        d = asdict(self)
        d["capability"] = list(self.capability)
        d["attributes"] = dict(self.attributes)
        return d


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("l40s", "NVIDIA L40S", (8, 9), 45, 142, "amd64"),
    System("h100_sxm", "NVIDIA H100 80GB HBM3", (9, 0), 80, 132, "amd64"),
    System("h200_sxm", "NVIDIA H200", (9, 0), 141, 132, "amd64", attributes=(
        ("MULTIPROCESSOR_COUNT", 132), ("MAX_THREADS_PER_BLOCK", 1024), ("MAX_THREADS_PER_MULTIPROCESSOR", 2048),
        ("MAX_REGISTERS_PER_MULTIPROCESSOR", 65536), ("L2_CACHE_SIZE", 62914560),
        ("MAX_SHARED_MEMORY_PER_BLOCK", 49152), ("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", 232448),
        ("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", 233472), ("MEMORY_CLOCK_RATE", 3201000),
        ("GLOBAL_MEMORY_BUS_WIDTH", 6016), ("CLOCK_RATE", 1980000)),
        attributes_source="cuDeviceGetAttribute on a real NVIDIA H200 (CUDA 13.0 driver), 2026-12-03"),
    System("b200_sxm", "NVIDIA B200", (10, 0), 179, 148, "amd64"),
    System("gb200", "NVIDIA GB200", (10, 0), 185, 152, "arm64"),
    System("b300_sxm", "NVIDIA B300 SXM6 AC", (10, 3), 268, 148, "amd64"),
    System("gb300", "NVIDIA GB300", (10, 3), 277, 160, "arm64"),
    System("rtx_pro_6000_server", "NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 95, 188, "amd64"),
)}


@dataclass(frozen=True)
class Layout:
    name: str
    title: str
    #: arguments after ``vllm serve MODEL`` exactly as a user would pass them
    serve_args: tuple[str, ...]
    #: world size a single process pretends to be rank 0 of
    world_size: int
    #: changes to the published model config this layout needs (dotted key -> value); the ledger
    #: states them. Empty for every layout that serves the published config as is.
    config_patch: tuple[tuple[str, object], ...] = ()
    note: str = ""
    #: SM capabilities this layout exists on ((10, 0), ...); empty: every system
    capabilities: tuple[tuple[int, int], ...] = ()
    #: a deployment option audited only when asked for (``--layouts all`` or by name; ``make reports`` audits
    #: them): the default selection leaves it out, so the default audit's time does not grow with the options
    opt_in: bool = False
    #: a speculative draft's config.json, as package data under ``audit/data`` (no draft weights: dummy, like the
    #: target's). It is written to ``<model dir>/draft``; ``serve_args`` name that directory as ``<model>/draft``.
    draft_config: str = ""

    def applies_to(self, system: "System") -> bool:
        return not self.capabilities or tuple(system.capability) in self.capabilities

    @property
    def scope(self) -> str:
        """'' or e.g. 'SM 10.0, 10.3 only' (what the ledger says where the layout does not apply)."""
        return ("SM " + ", ".join(f"{a}.{b}" for a, b in self.capabilities) + " only") if self.capabilities else ""

    def as_job(self) -> dict:
        job = {"name": self.name, "title": self.title, "serve_args": list(self.serve_args),
               "world_size": self.world_size, "config_patch": [list(kv) for kv in self.config_patch],
               "note": self.note}
        if self.capabilities:
            job["capabilities"] = [list(c) for c in self.capabilities]
        if self.opt_in:
            job["opt_in"] = True
        if self.draft_config:
            job["draft_config"] = self.draft_config
        return job


def cells_of(systems: list, layouts: list) -> list:
    """The (system, layout) pairs an audit covers: every pair whose layout exists on that system."""
    return [(s, l) for s in systems for l in layouts if l.applies_to(s)]


#: the selection word for every entry but the opt-in ones (what an audit covers unless told otherwise)
DEFAULT = "default"


def is_default(entry) -> bool:
    return not getattr(entry, "opt_in", False)


def select(kind: str, names: str | list[str] | None, table: dict) -> list:
    """Resolve ``all`` (every entry) / ``default`` or None (every entry but the opt-in ones) / a comma list into
    table entries, in table order."""
    if names == "all" or names == ["all"]:
        return list(table.values())
    if names is None or names == DEFAULT or names == [DEFAULT]:
        return [v for v in table.values() if is_default(v)]
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out = []
    for n in names:
        n = n.strip()
        if n not in table:
            raise SelectionError(kind, n, known=list(table) + ["all", DEFAULT])
        if table[n] not in out:
            out.append(table[n])
    if not out:
        raise SelectionError(kind, ",".join(names) if isinstance(names, list) else str(names), known=list(table))
    return [v for v in table.values() if v in out]
