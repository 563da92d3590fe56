"""The systems and serving layouts an audit covers, as data.

Device properties are what resolve mode presents to vLLM through the simulated platform. Only the
capability decides most selections; the rest (name, memory, SM count) are listed in the ledger's
provenance as simulated values, so a reader can see exactly what vLLM was told.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import SelectionError


@dataclass(frozen=True)
class System:
    name: str
    device_name: str
    capability: tuple[int, int]
    total_memory_gib: int
    sm_count: int
    arch: str  # amd64 | arm64: picks the platform digest of a multi-arch image

    @property
    def sm(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"

    def as_job(self) -> dict:
        d = asdict(self)
        d["capability"] = list(self.capability)
        return d


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("l40s", "NVIDIA L40S", (8, 9), 45, 142, "amd64"),
    System("h100_sxm", "NVIDIA H100 80GB HBM3", (9, 0), 80, 132, "amd64"),
    System("h200_sxm", "NVIDIA H200", (9, 0), 141, 132, "amd64"),
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

    def as_job(self) -> dict:
        return {"name": self.name, "title": self.title, "serve_args": list(self.serve_args),
                "world_size": self.world_size, "config_patch": [list(kv) for kv in self.config_patch],
                "note": self.note}


MTP_SPEC = '{"method": "mtp", "num_speculative_tokens": 3}'


LAYOUTS: dict[str, Layout] = {l.name: l for l in (
    Layout("tp8", "single-node TP8", ("--tensor-parallel-size", "8"), 8),
    Layout("tp16", "two-node TP16", ("--tensor-parallel-size", "16"), 16),
    Layout("dep8", "DEP8 MegaMoE (DP8 + EP8, --moe-backend deep_gemm_mega_moe)",
           ("--data-parallel-size", "8", "--enable-expert-parallel", "--moe-backend", "deep_gemm_mega_moe"), 8),
    Layout("tp8-mtp", "single-node TP8 + MTP speculative decoding",
           ("--tensor-parallel-size", "8", "--speculative-config", MTP_SPEC), 8,
           config_patch=(("text_config.num_nextn_predict_layers", 1),),
           note="The published config has num_nextn_predict_layers = 0, with which vLLM cannot start MTP "
                "(it divides by it). This layout serves a copy with one MTP layer, the only change."),
)}


def select(kind: str, names: str | list[str] | None, table: dict) -> list:
    """Resolve ``all`` / a comma list / None (all) into table entries, in table order."""
    if names is None or names == "all" or names == ["all"]:
        return list(table.values())
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out = []
    for n in names:
        n = n.strip()
        if n not in table:
            raise SelectionError(kind, n, known=list(table))
        if table[n] not in out:
            out.append(table[n])
    if not out:
        raise SelectionError(kind, ",".join(names) if isinstance(names, list) else str(names), known=list(table))
    return [v for v in table.values() if v in out]
