"""The layout rules: probes/ is stdlib-only until it patches vLLM; audit/ never imports vLLM or torch;
rich lives only in the CLI; evidence schema versions are checked on read."""
import json
import subprocess
import sys

import pytest

from audit import evidence
from audit.errors import EvidenceError
from tests.conftest import ROOT

PROBE_MODULES = ["probes", "probes.recorder", "probes.patching", "probes.targets", "probes.install",
                 "probes.agent", "probes.simulate", "probes.resolve", "probes.inventory", "probes.elfscan",
                 "probes.plugin", "probes.counting", "probes.observe", "probes.workload", "probes.observe_agent",
                 "probes.traces", "probes.kernel_names", "probes.lifecycle", "probes.dispatch"]
AUDIT_MODULES = ["audit.errors", "audit.lock", "audit.systems", "audit.evidence", "audit.routing",
                 "audit.profiles", "audit.render", "audit.fsutil", "audit.cudastub", "audit.core",
                 "audit.runtimes", "audit.runtimes.base", "audit.runtimes.local", "audit.tomlpos",
                 "audit.expectations", "audit.labels", "audit.verdicts", "audit.diff", "audit.registry",
                 "audit.runtimes.docker", "audit.runtimes.slurm", "audit.cluster", "audit.observed", "audit.selftest",
                 "audit.corroborate", "audit.layers", "audit.wheelindex", "audit.dispatch"]

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
