"""The Runtime protocol names every attribute audit/core.py uses of a runtime, and every runtime has them all:
core calls a runtime through the declared contract, never through hasattr/getattr conventions."""
import ast

from audit.runtimes import base
from audit.runtimes.docker import DockerRuntime
from audit.runtimes.local import LocalRuntime
from audit.runtimes.slurm import SlurmRuntime
from tests.conftest import ROOT

DECLARED = {name for name in vars(base.Runtime) if not name.startswith("_")} | set(base.Runtime.__annotations__)


def _uses_of_rt(tree) -> tuple[set[str], list[str]]:
    """Attributes core reads off its runtime variable ``rt`` (also inside helpers taking ``rt``), and any
    hasattr/getattr applied to it."""
    attrs, probing = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "rt":
            attrs.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr"):
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "rt":
                probing.append(ast.unparse(node))
    return attrs, probing


def test_core_uses_only_declared_runtime_attributes_and_probes_none():
    attrs, probing = _uses_of_rt(ast.parse((ROOT / "audit" / "core.py").read_text()))
    assert attrs and attrs <= DECLARED, attrs - DECLARED
    assert probing == [], probing


def test_every_runtime_implements_the_whole_protocol():
    from audit.runtimes.cluster import load

    assert {"name", "root", "run_root", "stat_memo", "check", "bind", "cache_identity", "run"} <= DECLARED
    slurm = SlurmRuntime(load(ROOT / "clusters" / "example.toml"))
    for rt in (LocalRuntime(), DockerRuntime(), slurm):
        missing = [a for a in DECLARED if not hasattr(rt, a)]
        assert missing == [] and isinstance(rt, base.Runtime), (type(rt).__name__, missing)
    assert slurm.run_root == slurm.profile.shared_dir and slurm.cache_identity(None, None) is None
    assert DockerRuntime().cache_identity(None, None) is None and DockerRuntime().run_root is None
