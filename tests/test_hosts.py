"""The serving host as a declared contract (audit/pins/hosts.py): images.lock's [pin.host], the hosts --host names,
how the local runtime arranges them for vLLM's own checks, where their reports go and how a diff names them."""
import pytest

from audit.core import reproduce_command
from audit.errors import LockError
from audit.models.kimi_k3 import KIMI_K3
from audit.pins import hosts, lock
from audit.runtimes.local import LocalRuntime
from audit.systems import SYSTEMS
from tests.conftest import ROOT

SHA = "a" * 64
PIN = f'''schema = 1

[[pin]]
name = "v9.0.0"
vllm_version = "9.0.0"
wheel = "vllm-9.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
wheel_sha256 = "{SHA}"
'''
HOST = '''
[pin.host]
source = "docker/Dockerfile:1-2"
nvcc = true
ninja = true
flashinfer_cubin = true
flashinfer_jit_cache = false
cuda = "13.0.2"
'''


def test_every_shipped_release_pin_declares_its_image_host_with_a_source():
    """Every vLLM release pin (its image's recipe is in the release's sdist). SGLang's releases ship wheels only, no
    recipe to read the image's host from: their pins declare none, and their ledgers say so."""
    lk = lock.load(ROOT / "images.lock")
    for pin in lk.pins.values():
        if not pin.has_wheel or pin.engine != "vllm":
            continue
        assert hosts.check_facts(pin.host) == "", pin.name
        assert f"vllm-{pin.version}.tar.gz" in pin.host["source"] and "docker/Dockerfile:" in pin.host["source"]
        image = hosts.host_for(pin, "image")
        assert image.name == "image" and image.facts["nvcc"] and image.facts["flashinfer_cubin"]


def test_a_host_table_parses_and_a_bad_one_names_its_line(write):
    pin = lock.load(write("images.lock", PIN + HOST)).get("v9.0.0")
    assert pin.host["flashinfer_jit_cache"] is False and pin.host["cuda"] == "13.0.2"
    line = (PIN + HOST).splitlines().index("[pin.host]") + 1
    for bad, fragment in (('nvcc = "yes"', "host fact 'nvcc' must be a bool"),
                          ("nvcc = true\nflux = true", "unknown host fact 'flux'"),
                          ("", "host fact 'nvcc' is missing"),
                          ('source = ""\nnvcc = true', "needs its source")):
        text = PIN + HOST.replace("nvcc = true", bad)
        if bad.startswith("source"):
            text = PIN + HOST.replace('source = "docker/Dockerfile:1-2"\n', "").replace("nvcc = true", bad)
        with pytest.raises(LockError) as e:
            lock.load(write("images.lock", text))
        assert fragment in str(e.value) and e.value.line == line, (bad, str(e.value))


def test_the_hosts_and_where_their_reports_go(write, tmp_path):
    declared = lock.load(write("images.lock", PIN + HOST)).get("v9.0.0")
    bare = lock.load(write("bare.lock", PIN)).get("v9.0.0")
    image, pip = hosts.host_for(declared, "image"), hosts.host_for(declared, "pip")
    assert image.facts == {"nvcc": True, "ninja": True, "flashinfer_cubin": True, "flashinfer_jit_cache": False,
                           "cuda": "13.0.2"} and image.source == "docker/Dockerfile:1-2"
    assert pip.facts["nvcc"] is False and pip.facts["flashinfer_cubin"] is False and "9.0.0" in pip.title
    undeclared = hosts.host_for(bare, "image")  # a pin without [pin.host]: said, never passed off as the image
    assert undeclared.name == "undeclared" and "declares no [pin.host]" in undeclared.source
    assert any("VLLM_HAS_FLASHINFER_CUBIN=1" in line for line in image.record()["arranged"])
    assert any("none" in line for line in pip.record()["arranged"] if line.startswith("nvcc"))
    assert hosts.report_root(tmp_path, "image") == hosts.report_root(tmp_path, "undeclared") == tmp_path
    assert hosts.report_root(tmp_path, "pip") == tmp_path / "hosts" / "pip"
    assert hosts.differences(image.record(), pip.record()) == [("nvcc", True, False), ("flashinfer_cubin", True, False)]
    assert hosts.label("v9.0.0", "pip") == "v9.0.0 on the pip host" and hosts.label("v9.0.0", "image") == "v9.0.0"
    assert hosts.label("v9.0.0", "image", always=True) == "v9.0.0 on the image host"
    with pytest.raises(ValueError):
        hosts.host_for(declared, "laptop")
    assert "hosts" in lock.reserved_names()  # a pin named "hosts" would be written into reports/hosts/


def test_the_local_runtime_arranges_the_host_for_vllms_checks_and_only_in_resolve_mode(tmp_path):
    env = tmp_path / "env"
    nvcc = env / "lib" / "python3.12" / "site-packages" / "nvidia" / "cu13" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    stub = tmp_path / "stub" / "libcuda.so.1"
    image = LocalRuntime(tmp_path / "cache", with_cuda_toolkit=True, with_flashinfer_cubin=True)
    pip = LocalRuntime(tmp_path / "cache", with_cuda_toolkit=False, with_flashinfer_cubin=False)
    on_image, on_pip = image._env(env, stub), pip._env(env, stub)
    assert on_image["VLLM_HAS_FLASHINFER_CUBIN"] == "1" and on_image["CUDA_HOME"] == str(nvcc.parent.parent)
    assert str(nvcc.parent) in on_image["PATH"].split(":")
    assert "VLLM_HAS_FLASHINFER_CUBIN" not in on_pip and str(nvcc.parent) not in on_pip["PATH"]
    assert on_pip["CUDA_HOME"].endswith("no-cuda-toolkit")
    # observe mode (no stub: the real driver) serves on the host as it is: no fact is claimed for it
    assert "VLLM_HAS_FLASHINFER_CUBIN" not in image._env(env, None)
    assert image.harness_env() == ["CUDA_HOME", "VLLM_HAS_FLASHINFER_CUBIN"] and pip.harness_env() == ["CUDA_HOME"]


def test_the_reproduce_command_names_a_host_other_than_the_image():
    systems, layouts = list(SYSTEMS.values()), [KIMI_K3.layouts["tp8"]]
    assert "HOST=pip" in reproduce_command("v0.33.0", systems, layouts, "local", host="pip", profile=KIMI_K3)
    for host in ("image", "undeclared"):
        assert "HOST" not in reproduce_command("v0.33.0", systems, layouts, "local", host=host, profile=KIMI_K3)


def test_verify_pins_checks_the_declared_host_reached_vllms_checks(write):
    from audit.pincheck import host_problems

    declared = lock.load(write("images.lock", PIN + HOST)).get("v9.0.0")
    bare = lock.load(write("bare.lock", PIN)).get("v9.0.0")
    cell = {"system": "b200_sxm", "layout": "tp8", "availability": {"flashinfer_cubin": True, "flashinfer": True}}
    run = {"host": hosts.host_for(declared, "image").record()}
    assert host_problems(declared, {"run": run, "cells": [cell]}) == []
    missed = {**cell, "availability": {"flashinfer_cubin": False, "flashinfer": True}}
    assert host_problems(declared, {"run": run, "cells": [missed]}) == [
        "b200_sxm/tp8: vLLM's flashinfer_cubin check says False, the declared host makes it True"]
    assert "declares no [pin.host]" in host_problems(bare, {"run": {}, "cells": [cell]})[0]
    pip_run = {"host": hosts.host_for(declared, "pip").record()}
    assert "not the pin's image" in host_problems(declared, {"run": pip_run, "cells": [cell]})[0]


def test_the_committed_reports_state_their_host_and_the_host_diffs_name_what_depends_on_it():
    """Issue 48's "Done when" on the committed reports: both models' v0.33.0 reports say the host they assume and its
    source; the pip host's diff against the image's host is committed for both and names the SM 10.x experts change."""
    from audit import models

    for name in ("kimi-k3", "deepseek-v3"):
        profile = models.get(name)
        ledger = (models.reports_root(ROOT / "reports", profile) / "v0.33.0" / "ledger.md").read_text(encoding="utf-8")
        assert "- **Host:** the official image (CUDA 13.0.2): nvcc yes, ninja yes, flashinfer-cubin yes" in ledger
        assert "Source: the official image's recipe in vllm-0.33.0.tar.gz" in ledger
        pip = models.reports_root(ROOT / "reports" / "hosts" / "pip", profile)
        assert (pip / "v0.33.0" / "routing.json").is_file()
        diff = (pip / "diffs" / "v0.33.0@image..v0.33.0@pip.md").read_text(encoding="utf-8")
        assert "**These kernels depend on the host**" in diff and "nvcc yes → no" in diff
        assert "SM 10.0" in diff.split("**What changed", 1)[0]
    k3 = (ROOT / "reports" / "hosts" / "pip" / "diffs" / "v0.33.0@image..v0.33.0@pip.md").read_text(encoding="utf-8")
    assert "TrtLlmMxfp4ExpertsMonolithic → DeepGemmFP4Experts" in k3


def test_a_host_run_as_it_is_says_nothing_was_arranged():
    """The Docker runtime runs the pinned image itself: its record keeps the declared facts and arranges nothing,
    and the ledger says the checks read the image's own files instead of naming an arrangement."""
    import json

    from audit.report.render import render_ledger

    pin = lock.load(ROOT / "images.lock").get("v0.33.0")
    host = hosts.host_for(pin)
    as_is, arranged = host.record(arranged=False), host.record()
    assert as_is["facts"] == arranged["facts"] and as_is["arranged"] == [] and arranged["arranged"]
    routing = json.loads((ROOT / "tests" / "data" / "routing-v0.33.0.json").read_text(encoding="utf-8"))
    routing.setdefault("run", {})["host"] = as_is

    def host_item(text: str) -> str:  # the "Host" item of At a glance, with its wrapped lines
        item = text.split("- **Host:**", 1)[1]
        return item.split("\n- **", 1)[0]

    line = host_item(render_ledger(routing, profile=KIMI_K3, reproduce="x"))
    assert "the audit ran the pinned image itself" in line and "resolve mode arranged" not in line
    routing["run"]["host"] = arranged
    line = host_item(render_ledger(routing, profile=KIMI_K3, reproduce="x"))
    assert "resolve mode arranged them: nvcc:" in " ".join(line.split()) and "ran the pinned image" not in line
