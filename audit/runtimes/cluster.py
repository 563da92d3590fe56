"""Cluster profiles: where each system's cells run on a Slurm cluster, and how.

Format (TOML; ``clusters/example.toml`` is the checked-in example, a user's own file is passed with
``--cluster PATH`` or ``SERVING_TRUTH_CLUSTER``)::

    schema = 1
    name = "example"
    shared_dir = "/lustre/serving-truth"   # same path on the submit host and every node: run dirs
    env_root = ""                          # local mode: where pinned venvs live (default: shared_dir/cache)
    sbatch_args = ["--account=inference"]  # added to every job
    time_limit = "01:00:00"

    [resolve]                # cells that need no GPU (resolve mode) run here, on CPUs
    partition = "cpu"
    cpus = 2
    mem = "16G"

    [systems.h100_sxm]       # one table per system that runs anywhere but the defaults
    partition = "h100"       # observe mode: the GPU partition
    constraint = ""          # --constraint
    gpus = 8                 # --gpus for hardware-bound cells (observe mode, the 8-GPU lanes)
    arch = "amd64"           # picks the platform digest; must agree with the system's architecture
    container = "local"      # "local": the pinned venv on the shared filesystem;
                             # "pyxis": srun --container-image (the pinned digest, or squashfs)
    squashfs = ""            # pyxis: a pre-imported image, used instead of pulling the digest
    squashfs_sha256 = ""     # required with squashfs: the file is checked before submission
    resolve_partition = ""   # resolve cells of this system elsewhere than [resolve] (e.g. arm64 CPUs)

Systems without a table use ``[defaults]`` (same keys) and then the built-in defaults.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from audit.errors import InputFileError
from audit.systems import SYSTEMS
from audit.tomlpos import key_line, read_toml

SCHEMA = 1
CONTAINERS = ("local", "pyxis")
_SYSTEM_KEYS = {"partition", "constraint", "gpus", "arch", "container", "squashfs", "squashfs_sha256",
                "resolve_partition"}
_TOP_KEYS = {"schema", "name", "shared_dir", "env_root", "sbatch_args", "time_limit", "resolve", "defaults",
             "systems"}
_RESOLVE_KEYS = {"partition", "cpus", "mem"}
_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$|^\d+$")


class ClusterProfileError(InputFileError):
    """A problem in a cluster profile."""


@dataclass(frozen=True)
class Placement:
    system: str
    partition: str = ""
    constraint: str = ""
    gpus: int = 0
    arch: str = "amd64"
    container: str = "local"
    squashfs: str = ""
    squashfs_sha256: str = ""
    resolve_partition: str = ""


@dataclass(frozen=True)
class ClusterProfile:
    path: str
    name: str
    shared_dir: Path
    env_root: Path
    sbatch_args: tuple[str, ...] = ()
    time_limit: str = "01:00:00"
    resolve_partition: str = ""
    resolve_cpus: int = 2
    resolve_mem: str = ""
    placements: dict[str, Placement] = field(default_factory=dict)

    def placement(self, system: str) -> Placement:
        return self.placements[system]


def load(path: str | Path) -> ClusterProfile:
    spath = str(path)
    text, data = read_toml(path, ClusterProfileError, hint="pass --cluster PATH (see clusters/example.toml)")

    def err(msg, key=None, start=1, hint=None):
        return ClusterProfileError(msg, path=spath, line=key_line(text, start, key) if key else None, hint=hint)

    if data.get("schema") != SCHEMA:
        raise err(f"schema is {data.get('schema')!r}, this harness reads schema {SCHEMA}", "schema",
                  hint=f"add 'schema = {SCHEMA}' at the top")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise err(f"unknown key {unknown[0]!r}", unknown[0], hint="known keys: " + ", ".join(sorted(_TOP_KEYS)))
    shared = data.get("shared_dir", "")
    if not isinstance(shared, str) or not shared.startswith("/"):
        raise err("shared_dir must be an absolute path on a filesystem every node mounts", "shared_dir")
    env_root = data.get("env_root") or str(Path(shared) / "cache")
    sbatch_args = data.get("sbatch_args", [])
    if not isinstance(sbatch_args, list) or not all(isinstance(a, str) and a.startswith("-") for a in sbatch_args):
        raise err("sbatch_args must be a list of sbatch options such as \"--account=x\"", "sbatch_args")
    time_limit = data.get("time_limit", "01:00:00")
    if not isinstance(time_limit, str) or not _TIME.match(time_limit):
        raise err(f"time_limit {time_limit!r} is not a Slurm time ([D-]HH:MM:SS or minutes)", "time_limit")
    resolve = data.get("resolve", {})
    if not isinstance(resolve, dict) or set(resolve) - _RESOLVE_KEYS:
        raise err("[resolve] takes partition, cpus, mem", "resolve")
    headers = {m.group(1): i for i, line in enumerate(text.splitlines(), 1)
               if (m := re.match(r"^\s*\[systems\.([A-Za-z0-9_.-]+)\]", line))}
    defaults = _placement_fields(data.get("defaults", {}), where="[defaults]", err=err, start=1)
    placements = {}
    for name, system in SYSTEMS.items():
        placements[name] = Placement(system=name, **{"arch": system.arch, **defaults})
    for name, raw in (data.get("systems") or {}).items():
        start = headers.get(name, 1) + 1
        if name not in SYSTEMS:
            raise ClusterProfileError(f"unknown system {name!r}", path=spath, line=headers.get(name),
                                      hint="known systems: " + ", ".join(SYSTEMS))
        fields = _placement_fields(raw, where=f"[systems.{name}]", err=err, start=start)
        p = Placement(system=name, **{"arch": SYSTEMS[name].arch, **defaults, **fields})
        if p.arch != SYSTEMS[name].arch:
            raise err(f"{name} is {SYSTEMS[name].arch}, the profile says arch = {p.arch!r}", "arch", start,
                      hint="the architecture picks the image's platform digest; fix the profile")
        placements[name] = p
    return ClusterProfile(
        path=spath, name=str(data.get("name", Path(spath).stem)), shared_dir=Path(shared), env_root=Path(env_root),
        sbatch_args=tuple(sbatch_args), time_limit=time_limit, resolve_partition=str(resolve.get("partition", "")),
        resolve_cpus=int(resolve.get("cpus", 2)), resolve_mem=str(resolve.get("mem", "")), placements=placements)


def _placement_fields(raw, *, where: str, err, start: int) -> dict:
    if not isinstance(raw, dict):
        raise err(f"{where} must be a table")
    unknown = sorted(set(raw) - _SYSTEM_KEYS)
    if unknown:
        raise err(f"unknown key {unknown[0]!r} in {where}", unknown[0], start,
                  hint="known keys: " + ", ".join(sorted(_SYSTEM_KEYS)))
    out = dict(raw)
    if "container" in out and out["container"] not in CONTAINERS:
        raise err(f"container must be one of {', '.join(CONTAINERS)}, got {out['container']!r}", "container", start)
    if "gpus" in out and (not isinstance(out["gpus"], int) or out["gpus"] < 0):
        raise err("gpus must be a non-negative integer", "gpus", start)
    if out.get("squashfs") and not re.match(r"^[0-9a-f]{64}$", out.get("squashfs_sha256", "")):
        raise err("squashfs needs squashfs_sha256 (64 hex digits): the file is checked before use",
                  "squashfs", start)
    for k, v in out.items():
        if k != "gpus" and not isinstance(v, str):
            raise err(f"{k} must be a string", k, start)
    return out


def default_profile_path(lock_dir: Path) -> Path:
    import os

    env = os.environ.get("SERVING_TRUTH_CLUSTER")
    return Path(env) if env else lock_dir / "clusters" / "example.toml"


__all__ = ["ClusterProfile", "ClusterProfileError", "Placement", "load", "default_profile_path"]
