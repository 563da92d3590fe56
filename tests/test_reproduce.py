"""The committed reports reproduce: what `make reports` wrote is what the code writes today.

Two checks: every committed ledger is exactly what rendering its own committed routing.json gives (with
the "changes since" section computed against the previous pin's committed routing, as the audit does);
and a fresh audit of one pin (its default layouts), on the real pinned wheel with no cache, routes each of its
cells exactly as the committed routing.json says (dates and run ids aside). The second is also the proof that
speed work (issue 15) changed no evidence: the committed reports came from the code before it.
"""
import json
import os
import subprocess
import sys

import pytest

from audit.models.kimi_k3 import KIMI_K3
from audit.pins import lock as lockmod
from audit.report.diff import diff_routings
from audit.errors import ExitCode
from tests.conftest import ROOT

REPORTS = ROOT / "reports"
LOCK = lockmod.load(ROOT / "images.lock")
#: the first engine's pins with a committed report of the default model
PINS = [p.name for p in LOCK.pins.values() if (REPORTS / p.name / "routing.json").is_file()]
#: cell fields that depend on when and where the audit ran, not on what vLLM decided
VOLATILE = ("argv",)


def _routing(pin: str) -> dict:
    return json.loads((REPORTS / pin / "routing.json").read_text(encoding="utf-8"))


def test_reports_exist_for_every_pin_with_a_wheel():
    """Every engine's pins: the default model's report is committed under that engine's reports folder."""
    from audit import models

    for engine, profiles in models.BY_ENGINE.items():
        root = models.reports_root(REPORTS, profiles[models.DEFAULT])
        want = [p.name for p in LOCK.pins.values() if p.wheel and p.engine == engine]
        have = [p for p in want if (root / p / "routing.json").is_file()]
        assert have == want, f"run `make reports ENGINE={engine}` to regenerate {root}/"


def _model_pins(with_hosts: bool = False):
    from audit import models
    from audit.pins import hosts

    for host in (hosts.HOSTS if with_hosts else [hosts.DEFAULT]):
        for profile in (p for profiles in models.BY_ENGINE.values() for p in profiles.values()):
            root = models.reports_root(hosts.report_root(REPORTS, host), profile)
            for p in LOCK.pins.values():
                if p.engine == profile.engine and (root / p.name / "routing.json").is_file():
                    yield pytest.param(profile, root, p.name, host,
                                       id=f"{profile.name}-{p.name}" + ("" if host == hosts.DEFAULT else f"@{host}"))


@pytest.mark.parametrize("profile,root,pin,host", list(_model_pins(with_hosts=True)))
def test_each_committed_report_is_its_routing_rendered(profile, root, pin, host):
    """Every model's committed report is what `serving-truth regenerate --from-reports` renders from its own
    routing.json with today's code (ledger, labels.json and routing.json itself, byte for byte), its ledger's
    "changes since" against the previous pin's committed routing; and the committed diff from the previous pin is
    that diff rendered."""
    from audit.core import report_from_routing
    from audit.report.diff import DIFF_SCHEMA, load_routing, render_diff

    files = report_from_routing(pin, lock_path=ROOT / "images.lock", reports_dir=REPORTS, profile=profile, write=False,
                                host=host)
    if host != "image":  # another host's report carries its diff against the image's host (among the files)
        assert any(name.startswith("../diffs/") for name in files), "the host diff is committed beside it"
    for name, text in sorted(files.items()):
        assert text == (root / pin / name).read_text(encoding="utf-8"), \
            f"{root / pin / name} is not what today's code renders from its routing.json: " \
            f"serving-truth regenerate --from-reports --model {profile.name}"
    prev = lockmod.previous_pin(LOCK, pin)
    if host != "image" or prev is None or not (root / prev.name / "routing.json").is_file():
        return
    d = diff_routings(load_routing(root, prev.name, profile), load_routing(root, pin, profile), profile)
    md = root / "diffs" / f"{prev.name}..{pin}.md"
    assert json.loads((root / "diffs" / f"{prev.name}..{pin}.json").read_text(encoding="utf-8"))["schema"] == DIFF_SCHEMA
    assert render_diff(d, profile) == md.read_text(encoding="utf-8"), f"{md} is not its routings' diff rendered"


def test_the_third_model_is_committed_for_every_pin():
    from audit.models.deepseek_v3 import DEEPSEEK_V3

    ids = {p.id for p in _model_pins()}
    # the pip host's report and its diff against the image's host, for K3 and DeepSeek-V3 (issue 48)
    hosted = {p.id for p in _model_pins(with_hosts=True)} - ids
    assert {"kimi-k3-v0.33.0@pip", f"{DEEPSEEK_V3.name}-v0.33.0@pip"} <= hosted
    assert {f"{DEEPSEEK_V3.name}-{p.name}" for p in LOCK.pins.values() if p.wheel and p.engine == DEEPSEEK_V3.engine} <= ids
    # a pin bump that moved nothing says so, never an empty table (0.33.0 changes no DeepSeek-V3 lane)
    text = (REPORTS / DEEPSEEK_V3.name / "v0.33.0" / "ledger.md").read_text(encoding="utf-8")
    assert "0 serving change row(s)" in text and "Below: nothing." in text
    assert "|---|---|---|---|\n\n## Summary" not in text


def _cell(routing: dict, system: str, layout: str) -> dict:
    found = [c for c in routing["cells"] if (c["system"], c["layout"]) == (system, layout)]
    assert len(found) == 1, (system, layout)
    return {k: v for k, v in found[0].items() if k not in VOLATILE}


@pytest.mark.vllm
def test_a_fresh_audit_routes_every_committed_cell_the_same(vllm_env, tmp_path):
    pin = "v0.33.0"
    committed = _routing(pin)
    env = {**os.environ, "SERVING_TRUTH_EVIDENCE_CACHE": str(tmp_path / "evcache")}
    r = subprocess.run([sys.executable, "-m", "audit.cli", "audit", pin, "--reports", str(tmp_path / "reports"),
                        "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert r.returncode in (ExitCode.OK, ExitCode.FINDINGS), r.stderr[-3000:]
    fresh = json.loads((tmp_path / "reports" / pin / "routing.json").read_text(encoding="utf-8"))
    # a plain audit covers the default layouts; the committed report also holds the deployment options (audited
    # with --layouts all by make reports): every cell the fresh audit covers must route as committed
    cells = sorted((c["system"], c["layout"]) for c in fresh["cells"])
    options = {n for n, l in KIMI_K3.layouts.items() if l.opt_in}
    assert cells == sorted((c["system"], c["layout"]) for c in committed["cells"] if c["layout"] not in options)
    assert {c["layout"] for c in committed["cells"]} >= options
    for system, layout in cells:
        want, got = _cell(committed, system, layout), _cell(fresh, system, layout)
        assert sorted(got) == sorted(want), (system, layout)
        for key in want:  # field by field, so a failure names what moved
            assert got[key] == want[key], f"{system}/{layout}: {key} differs from reports/{pin}/routing.json"
    audited = set(cells)

    def only(rows):  # the rows about the fresh audit's cells (the fresh one also says the options were not audited)
        return [r for r in rows if (r.get("system"), r.get("layout")) in audited]

    for key in ("claims", "expectations", "label_map"):
        assert fresh["verdicts"][key] == committed["verdicts"][key]
    assert only(fresh["verdicts"]["rows"]) == only(committed["verdicts"]["rows"])
    labels = [json.loads(path.read_text(encoding="utf-8"))
              for path in (tmp_path / "reports" / pin / "labels.json", REPORTS / pin / "labels.json")]
    assert only(labels[0]["rows"]) == only(labels[1]["rows"]) and labels[0]["rows"]
    assert only(labels[0]["not_labelled"]) == only(labels[1]["not_labelled"])


def test_the_committed_comparison_is_its_routings_rendered():
    """Issue 47: the side-by-side table of vLLM v0.33.0 and the newest SGLang pin is committed, and is what today's
    code renders from the two committed routings (markdown and data, byte for byte)."""
    from audit import models
    from audit.report.compare import compare, render

    newest = [p for p in lockmod.sorted_pins(LOCK) if p.engine == "sglang"][-1]
    left, right = models.get("kimi-k3"), models.get("kimi-k3", "sglang")
    stem = REPORTS / "compare" / f"v0.33.0..{newest.name}"
    data = compare(REPORTS, "v0.33.0", left, newest.name, right)
    md, js = stem.parent / f"{stem.name}.md", stem.parent / f"{stem.name}.json"
    assert render(data) == md.read_text(encoding="utf-8"), f"run `make compare PIN=v0.33.0 WITH={newest.name}`"
    assert json.loads(js.read_text(encoding="utf-8")) == json.loads(json.dumps(data))
    assert len(data["tables"]) == 56 and {"moe", "mla.decode", "kda.prefill"} <= set(data["lanes"])
