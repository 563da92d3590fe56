"""The probes' own sources: what a run stages beside its evidence and what the evidence cache keys on."""
from __future__ import annotations

from importlib import resources


def probe_sources() -> list[tuple[str, bytes]]:
    """Every source file of the probes package and its subpackages, as (path relative to it, bytes),
    sorted: what a run stages and what the evidence cache keys on."""
    out = []

    def walk(node, prefix: str) -> None:
        for entry in node.iterdir():
            if entry.is_dir() and entry.name != "__pycache__":
                walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".py"):
                out.append((prefix + entry.name, entry.read_bytes()))

    walk(resources.files("probes"), "")
    return sorted(out)
