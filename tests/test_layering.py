"""The layout rules: probes/ is stdlib-only until it patches vLLM, its core imports neither mode, observe never
imports resolve and no probes module imports another in a cycle; audit/ never imports vLLM or torch; rich
lives only in the CLI; evidence schema versions are checked on read."""
import json
import re
import subprocess
import sys

import pytest

from audit.evidence import files as evidence
from audit.errors import EvidenceError
from tests.conftest import ROOT

def _modules(package: str) -> list[str]:
    """Every module of a package of this repository, found on disk (a new module is covered at once)."""
    base = ROOT / package
    out = []
    for p in sorted(base.rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


PROBE_MODULES = _modules("probes")
#: the CLI is the one place rich may be imported
AUDIT_MODULES = [m for m in _modules("audit") if m != "audit.cli"]


SCRIPT = """
import json, sys
before = set(sys.modules)
for name in sys.argv[1].split(","):
    __import__(name)
new = sorted(m.split(".")[0] for m in set(sys.modules) - before)
print(json.dumps(sorted(set(new))))
"""


def imported_top_levels(modules):
    out = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(modules)], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return set(json.loads(out.stdout))


def test_probes_import_only_the_standard_library():
    third_party = {m for m in imported_top_levels(PROBE_MODULES)
                   if m not in sys.stdlib_module_names and m not in ("probes", "_distutils_hack")}
    assert third_party == set()


def test_audit_never_imports_vllm_torch_or_rich_outside_the_cli():
    tops = imported_top_levels(AUDIT_MODULES)
    assert not tops & {"vllm", "torch", "triton", "rich"}, tops & {"vllm", "torch", "triton", "rich"}


def test_evidence_schema_is_in_step_and_checked(tmp_path):
    import probes

    assert evidence.SCHEMA == probes.EVIDENCE_SCHEMA
    path = tmp_path / "evidence-x.jsonl"
    path.write_text(json.dumps({"kind": "header", "schema": evidence.SCHEMA + 1}) + "\n")
    with pytest.raises(EvidenceError) as e:
        evidence.read_file(path)
    assert f"evidence schema {evidence.SCHEMA + 1}, this harness reads schema {evidence.SCHEMA}" in str(e.value)
    path.write_text(json.dumps({"kind": "header", "schema": evidence.SCHEMA}) + "\n{broken\n")
    with pytest.raises(EvidenceError) as e:
        evidence.read_file(path)
    assert e.value.line == 2


def _imports(package: str, modules: list[str]) -> dict[str, set[str]]:
    """module -> the modules of *package* it imports (at the top or inside functions), read from the source."""
    import ast

    graph = {}
    for mod in modules:
        path = ROOT / (mod.replace(".", "/") + ".py")
        if not path.exists():
            path = ROOT / mod.replace(".", "/") / "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{mod}: relative import; {package}/ imports by absolute name")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == package:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == package}
        graph[mod] = deps - {mod}
    return graph


def _probe_imports() -> dict[str, set[str]]:
    return _imports("probes", PROBE_MODULES)


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}

    def visit(mod, path):
        state[mod] = 1
        for dep in graph.get(mod, ()):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path + [dep])
            if dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in graph:
        if mod not in state:
            visit(mod, [mod])


def test_probes_layers_flow_one_way_without_cycles():
    graph = _probe_imports()
    assert {"probes.core.recorder", "probes.resolve.agent", "probes.observe.agent"} <= set(graph)
    for mod, deps in graph.items():
        if mod.startswith("probes.core"):
            assert all(d == "probes" or d.startswith("probes.core") for d in deps), (mod, deps)
        if mod.startswith("probes.observe"):
            assert not any(d.startswith("probes.resolve") for d in deps), (mod, deps)
        if mod.startswith(("probes.core", "probes.resolve", "probes.observe")):  # shared: no model package by name
            assert not any(d.startswith("probes.models.") for d in deps), (mod, deps)
        if mod.startswith("probes.models.") and not mod.endswith(".resolve"):  # a model's data: read by both modes
            assert not any(d.startswith("probes.resolve") for d in deps), (mod, deps)
    _assert_acyclic(graph)


#: string constants in the shared probes that name one model's code (vLLM's per-model packages and classes; vLLM's
#: model registry is shared)
_MODEL_NAME = re.compile(r"vllm\.models\.|model_executor\.models\.(?!registry\b)|Kimi|kimi_k3|GptOss|gpt_oss\b")


def _code_strings(path) -> list[tuple[int, str]]:
    """(line, text) of every string constant of a module that is not a docstring."""
    import ast

    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_the_shared_probes_name_no_model():
    """What one model brings (its layer classes, kernels, stand-ins, lanes) lives in its probes package
    (probes/models/<name>/), sent through the plan; the shared probes wrap vLLM's shared layers only."""
    found = []
    for part in ("core", "resolve", "observe"):
        for path in sorted((ROOT / "probes" / part).rglob("*.py")):
            found += [(str(path.relative_to(ROOT)), line, text) for line, text in _code_strings(path)
                      if _MODEL_NAME.search(text)]
    assert found == []


#: the same on the host: words only one model's code, lanes or ledger use
_HOST_MODEL_WORDS = re.compile(r"Kimi|kimi|K3|\bkda|KDA|SiTU|specialized|latent|gpt.oss|GptOss")


def test_the_shared_host_code_names_no_model():
    """What one model brings to the report (its lanes, dispatch lanes, readings, labels, ledger words) lives in its
    profile (audit/models/<name>.py); the shared host code reads it from there."""
    found = []
    for path in sorted((ROOT / "audit").rglob("*.py")):
        if "models" in path.relative_to(ROOT).parts:
            continue
        found += [(str(path.relative_to(ROOT)), line, text) for line, text in _code_strings(path)
                  if _HOST_MODEL_WORDS.search(text)]
    for path in sorted((ROOT / "audit" / "report" / "templates").glob("*.j2")):  # the ledger's words
        found += [(str(path.relative_to(ROOT)), n, line) for n, line in enumerate(path.read_text().splitlines(), 1)
                  if _HOST_MODEL_WORDS.search(line)]
    assert found == []


#: the second engine's words (its name, its package, its probes package)
_SECOND_ENGINE_WORDS = re.compile(r"sglang|SGLang|sgl_kernel|sgl-kernel", re.IGNORECASE)


def test_the_shared_code_names_no_second_engine():
    """Issue 47: adding SGLang left no SGLang name in the shared host code (audit/ but its engine registry and the
    engine's own model profiles), its templates, or the shared probes (every probes package but the engine's own):
    what differs by engine is read from its contract (audit/engines)."""
    found = []
    for path in sorted((ROOT / "audit").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] in (("audit", "engines"), ("audit", "models")):
            continue
        found += [(str(rel), line, text) for line, text in _code_strings(path) if _SECOND_ENGINE_WORDS.search(text)]
        found += [(str(rel), n, line) for n, line in enumerate(path.read_text().splitlines(), 1)
                  if line.lstrip().startswith(("import ", "from ")) and _SECOND_ENGINE_WORDS.search(line)]
    for path in sorted((ROOT / "audit" / "report" / "templates").glob("*.j2")):
        found += [(str(path.relative_to(ROOT)), n, line) for n, line in enumerate(path.read_text().splitlines(), 1)
                  if _SECOND_ENGINE_WORDS.search(line)]
    for path in sorted((ROOT / "probes").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[:2] == ("probes", "engines"):
            continue
        found += [(str(rel), n, line) for n, line in enumerate(path.read_text().splitlines(), 1)
                  if _SECOND_ENGINE_WORDS.search(line)]
    assert found == []


def test_the_model_name_check_sees_a_named_class(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Kimi-K3 in a docstring is an example."""\nX = "vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention"\n')
    assert [t for _, t in _code_strings(path) if _MODEL_NAME.search(t)] == [
        "vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention"]
    assert [t for _, t in _code_strings(path) if _HOST_MODEL_WORDS.search(t)] == [
        "vllm.models.kimi_k3.nvidia.kda:KimiK3DeltaAttention"]


#: audit/'s layers, lowest first: a module imports only from its own layer or below (the house order
#: cli -> core -> report output -> runtimes -> routing/evidence -> pins and the shared base)
AUDIT_LAYERS = [
    ("base", ("audit", "audit.errors", "audit.fsutil", "audit.tomlpos", "audit.systems", "audit.profiles",
              "audit.models", "audit.lanevalue", "audit.standinfit", "audit.engines")),
    ("pins", ("audit.pins",)),
    ("evidence and routing", ("audit.evidence", "audit.report.routing", "audit.report.dispatch",
                              "audit.report.observed", "audit.report.corroborate", "audit.report.layers")),
    ("runtimes", ("audit.runtimes",)),
    ("report output", ("audit.report",)),
    ("core", ("audit.core", "audit.selftest", "audit.pincheck")),
    ("cli", ("audit.cli",)),
]


def audit_layer(mod: str) -> int:
    """The layer of *mod*: the most specific prefix listed wins."""
    best = (-1, -1)
    for rank, (_, prefixes) in enumerate(AUDIT_LAYERS):
        for prefix in prefixes:
            if mod == prefix or mod.startswith(prefix + "."):
                best = max(best, (len(prefix), rank))
    assert best[1] >= 0, f"{mod} is in no layer of AUDIT_LAYERS: place it"
    return best[1]


def test_audit_layers_flow_one_way_without_cycles():
    modules = _modules("audit")
    graph = _imports("audit", modules)
    assert {"audit.pins.wheelindex", "audit.runtimes.local", "audit.report.render"} <= set(graph)
    upward = [(mod, dep, AUDIT_LAYERS[audit_layer(dep)][0]) for mod, deps in sorted(graph.items())
              for dep in sorted(deps) if audit_layer(dep) > audit_layer(mod)]
    assert not upward, "imports against the layer order (module, imported, its layer): " + repr(upward)
    _assert_acyclic(graph)


def test_the_layer_check_sees_an_upward_import_and_a_cycle():
    graph = {"audit.pins.lock": {"audit.runtimes.local"}, "audit.runtimes.local": {"audit.pins.lock"}}
    assert audit_layer("audit.runtimes.local") > audit_layer("audit.pins.lock")
    with pytest.raises(AssertionError, match="import cycle"):
        _assert_acyclic(graph)
