import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


@pytest.fixture
def write(tmp_path):
    """write(name, text) -> path inside a fresh temporary directory."""

    def _write(name: str, text: str) -> Path:
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        return p

    return _write


# --- the real pinned vLLM -------------------------------------------------------------------------
VLLM_PIN = "v0.33.0"
#: small but covering: SM90 and SM100, the single-node lane, the MegaMoE lane, MTP speculation
VLLM_CELLS = (("h100_sxm", "tp8"), ("h100_sxm", "dep8"), ("b200_sxm", "tp8"), ("b200_sxm", "dep8"),
              ("b200_sxm", "tp8-mtp"))


@pytest.fixture(scope="session")
def vllm_env():
    """The environment holding the wheel pinned in images.lock (built once, cached across runs)."""
    from audit.pins import lock
    from audit.runtimes.local import LocalRuntime

    from audit.pins.hosts import host_for

    pin = lock.load(ROOT / "images.lock").get(VLLM_PIN)
    facts = host_for(pin).facts  # the pin's declared image host, as `make audit` runs it
    rt = LocalRuntime(with_cuda_toolkit=facts["nvcc"], with_flashinfer_cubin=facts["flashinfer_cubin"])
    env = rt.ensure_env(pin, lambda *a, **k: None)
    return rt, pin, env


def _run(vllm_env, tmp_path_factory, name, **kw):
    from audit.models.kimi_k3 import KIMI_K3
    from audit.runtimes import RunRequest
    from audit.systems import SYSTEMS

    from audit.models.kimi_k3 import LAYOUTS

    rt, pin, _ = vllm_env
    run_dir = tmp_path_factory.mktemp(name)
    req = RunRequest(pin=pin, profile=KIMI_K3, cells=[(SYSTEMS[s], LAYOUTS[l]) for s, l in VLLM_CELLS],
                     run_dir=run_dir, parallel=2, **kw)
    result = rt.run(req, lambda *a, **k: None)
    return req, result


@pytest.fixture(scope="session")
def probed_run(vllm_env, tmp_path_factory):
    """A resolve run of VLLM_CELLS with the probes installed, plus one drifted target."""
    drifted = {"id": "test.drifted", "kind": "select", "title": "a selector renamed upstream",
               "specs": ["vllm.models.kimi_k3.nvidia.kda:resolve_kda_prefill_backend_renamed"]}
    return _run(vllm_env, tmp_path_factory, "probed", extra_targets=[drifted])


@pytest.fixture(scope="session")
def bare_run(vllm_env, tmp_path_factory):
    """The same cells and simulation without any probe: the baseline for transparency."""
    return _run(vllm_env, tmp_path_factory, "bare", probes=False)


# --- the real Docker engine -----------------------------------------------------------------------
@pytest.fixture(scope="session")
def docker_client():
    """The local Docker engine. CI starts one (.ci/run); elsewhere the docker tests skip without it."""
    import os

    import docker

    try:
        client = docker.from_env(timeout=300)
        client.ping()
    except Exception as exc:  # noqa: BLE001 - any failure means "no engine here"
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide a Docker engine: {exc}")
        pytest.skip(f"no Docker engine: {exc}")
    return client


@pytest.fixture(scope="session")
def vllm_image(docker_client, vllm_env, tmp_path_factory):
    """An image carrying Python and the pinned vLLM wheel (built locally once, then cached by the
    engine), and a lock file pinning it by config digest as ``<pin>-image``."""
    from tests.images.build_image import build, lock_entry

    from audit.pins import lock

    pin = lock.load(ROOT / "images.lock").get(VLLM_PIN)
    built = build(pin)
    path = tmp_path_factory.mktemp("lock") / "images.lock"
    path.write_text((ROOT / "images.lock").read_text() + "\n" + lock_entry(pin, built["image_id"], built["tag"]))
    return {"lock": path, "pin": f"{VLLM_PIN}-image", "image_id": built["image_id"], "tag": built["tag"]}


SGLANG_PIN = "sglang-0.5.23"


@pytest.fixture(scope="session")
def sglang_image(docker_client):
    """An image carrying Python 3.11 and the pinned SGLang wheel under its shipped resolution (built locally once
    from the audit's uv cache, which building the pin's environment first fills), and a lock file pinning it by
    config digest as ``<pin>-image``."""
    from tests.images.build_image import build, lock_entry

    from audit.pins import lock
    from audit.runtimes.local import LocalRuntime

    pin = lock.load(ROOT / "images.lock").get(SGLANG_PIN)
    LocalRuntime().ensure_env(pin, lambda *a, **k: None)
    built = build(pin)
    return {"lock_text": (ROOT / "images.lock").read_text() + "\n" + lock_entry(pin, built["image_id"], built["tag"]),
            "pin": f"{SGLANG_PIN}-image", "image_id": built["image_id"], "tag": built["tag"]}


def audit_beside_k3(tmp_path_factory, profile, systems: str, layouts: str) -> dict:
    """Audit another model on v0.33.0 into a reports directory holding K3's committed report (which it must leave
    untouched): the outcome, the directory, K3's report bytes before, the routing and its cells by (system, layout)."""
    import json
    import shutil

    from audit.core import AuditOptions, run_audit

    reports = tmp_path_factory.mktemp("reports")
    shutil.copytree(ROOT / "reports" / "v0.33.0", reports / "v0.33.0")
    before = {p.name: p.read_bytes() for p in (reports / "v0.33.0").iterdir()}
    outcome = run_audit("v0.33.0", AuditOptions(lock_path=ROOT / "images.lock", reports_dir=reports, profile=profile,
                                                systems=systems, layouts=layouts, baseline="none", cache=False,
                                                parallel=2))
    routing = json.loads(outcome.routing_path.read_text())
    return {"outcome": outcome, "reports": reports, "before": before, "routing": routing,
            "cells": {(c["system"], c["layout"]): c for c in routing["cells"]}}
