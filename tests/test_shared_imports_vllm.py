"""Shared imports on the real vLLM wheel pinned in images.lock: a run that learns which modules every SM process
imports before the first device read; a run whose SM processes import the third-party packages seen only after
that read ahead of vLLM's own modules; a run whose agent parent imports, once for every SM process, everything
learned to read no device; and a run given a stale list with a module that reads the device (vLLM's Triton
check, which swallows the failure). All four route every cell the same, and the stale one starts again without
sharing and says why."""
import copy
import json

import pytest

from audit.evidence import files as evidence
from audit.models.kimi_k3 import KIMI_K3
from audit.report import routing
from audit.runtimes import RunRequest
from audit.systems import SYSTEMS

from audit.models.kimi_k3 import LAYOUTS

pytestmark = pytest.mark.vllm

CELLS = [("h200_sxm", "tp8"), ("b200_sxm", "tp8")]
#: imported by vLLM's config package; at import it asks every Triton backend whether it is active, which asks
#: torch for a device count, and turns any failure into HAS_TRITON = False
READER = "vllm.triton_utils.importing"


def _run(vllm_env, tmp_path_factory, name, listing):
    rt, pin, _ = vllm_env
    run_dir = tmp_path_factory.mktemp(name)
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in CELLS], run_dir=run_dir,
                     parallel=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SERVING_TRUTH_SHARED_IMPORTS", str(listing))
        result = rt.run(req, lambda *a, **k: None)
    assert result.missing == {}
    files = evidence.read_dir(result.evidence_dir)
    r = routing.build_routing(files, KIMI_K3, pin={"name": pin.name, "vllm_version": pin.version},
                              expected=list(CELLS))
    return {"cells": {(c["system"], c["layout"]): c for c in r["cells"]}, "files": files,
            "log": (run_dir / "agent.log").read_text(encoding="utf-8", errors="replace"),
            "learn": result.evidence_dir / ".shared-imports"}


@pytest.fixture(scope="module")
def runs(vllm_env, tmp_path_factory):
    listing = tmp_path_factory.mktemp("listing") / "shared-imports.json"
    learned = _run(vllm_env, tmp_path_factory, "learn", listing)
    learned_list = json.loads(listing.read_text())
    ahead = _run(vllm_env, tmp_path_factory, "ahead", listing)
    ahead_list = json.loads(listing.read_text())
    shared = _run(vllm_env, tmp_path_factory, "shared", listing)
    stale = dict(ahead_list, shared=[*ahead_list["shared"], READER])
    listing.write_text(json.dumps(stale))
    tripped = _run(vllm_env, tmp_path_factory, "stale", listing)
    return {"learned": learned, "list": learned_list, "ahead": ahead, "ahead_list": ahead_list, "shared": shared,
            "tripped": tripped, "after": json.loads(listing.read_text())}


def _parent(run):
    return [r for f in run["files"] if f.cell for r in f.of_kind("shared_parent")]


def test_learning_finds_the_readers_and_shares_only_what_comes_before_them(runs):
    listed = runs["list"]
    assert READER in listed["readers"] and "vllm.config" in listed["readers"]
    assert listed["shared"] and not set(listed["shared"]) & set(listed["readers"])
    assert "vllm.platforms.cuda" in listed["shared"]  # the simulated platform's base, imported before any read
    assert _parent(runs["learned"]) == []  # nothing was shared in the run that learned


def test_packages_imported_ahead_of_vllm_are_shared_once_they_read_nothing(runs):
    first, second = runs["list"], runs["ahead_list"]
    assert "openai" in first["ahead"] and "openai" not in first["shared"]  # seen only after vllm.config
    assert "openai" in second["shared"]  # imported ahead of vLLM, it read no device
    assert "xgrammar" in second["readers"] and "xgrammar" not in second["shared"]  # its import reads one


def test_a_shared_run_routes_every_cell_as_the_learning_run(runs):
    parents = _parent(runs["shared"])
    # the parent imported the packages learned in the run before (the rest came in with the platform)
    assert parents and all(p["failed"] == 0 and p["ok"] > 0 and p["listed"] == len(runs["ahead_list"]["shared"])
                           for p in parents), parents
    # vLLM aliases vllm.third_party.triton_kernels as triton_kernels: an alias is never in the list
    assert "triton_kernels" not in runs["ahead_list"]["shared"]
    for key in CELLS:
        assert runs["ahead"]["cells"][key] == runs["learned"]["cells"][key], key
        assert runs["shared"]["cells"][key] == runs["learned"]["cells"][key], key


def test_a_stale_list_starts_again_without_sharing_and_routes_the_same(runs):
    stale = runs["tripped"]
    assert "a shared import read the device before a SKU was set" in stale["log"]
    tripped = json.loads((stale["learn"] / "tripped.json").read_text())
    assert any(READER in read["importing"] for read in tripped)
    assert _parent(stale) == []  # the run that produced the evidence shared nothing
    for key in CELLS:
        assert stale["cells"][key] == runs["learned"]["cells"][key], key
    # the host learned from it: the reader is not shared again
    assert READER not in runs["after"]["shared"] and READER in runs["after"]["readers"]
