"""Fixtures of the GPU mechanics suite (needs torch, Triton and an NVIDIA GPU; no vLLM).

Every profiled scenario writes its Chrome trace the way vLLM's worker profiler does (torch's
tensorboard handler, gzip, ``<prefix>_<rank suffix>.<ns>.pt.trace.json.gz``) and notes what it
launched (the ground truth: counts that follow from the scenario's own loop, never read from the
trace). With ``SERVING_TRUTH_GPU_TRACES=DIR`` the traces and ``traces.json`` (that ground truth plus
GPU, driver, torch, CUDA and Triton versions) are kept in DIR: that is how tests/data/gpu-traces/ was
recorded. Without it they go to a temporary directory."""
from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RANK_SUFFIX = "dp0_pp0_tp0_dcp0_ep0_rank0"


def environment() -> dict:
    """What the traces were recorded on (read off the machine, at recording time)."""
    import torch
    import triton

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = ""
    props = torch.cuda.get_device_properties(0)
    return {"gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
            "multiprocessors": props.multi_processor_count, "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "python": platform.python_version(),
            "recorded": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


class TraceBook:
    """Profiles scenarios into one directory and keeps each scenario's ground truth."""

    def __init__(self, directory: Path, keep: bool):
        self.dir = directory
        self.keep = keep
        self.entries: list[dict] = []

    def profile(self, scenario: str, body, *, activities=("cuda",)) -> Path:
        """Run *body* inside one torch.profiler session (GPU activity only unless *activities* says
        ``cpu`` too, as observe mode configures vLLM's workers) and return the trace file it wrote."""
        import torch
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        acts = [{"cuda": ProfilerActivity.CUDA, "cpu": ProfilerActivity.CPU}[a] for a in activities]
        worker = f"{scenario}_{RANK_SUFFIX}"
        torch.cuda.synchronize()
        with profile(activities=acts, on_trace_ready=tensorboard_trace_handler(str(self.dir), worker_name=worker,
                                                                               use_gzip=True)):
            body()
            torch.cuda.synchronize()
        (path,) = glob.glob(str(self.dir / f"{worker}.*.pt.trace.json.gz"))
        return Path(path)

    def note(self, path: Path, scenario: str, **truth) -> None:
        self.entries.append({"file": path.name, "scenario": scenario, **truth})

    def write(self) -> None:
        if self.keep:
            doc = {"environment": environment(), "traces": sorted(self.entries, key=lambda e: e["file"])}
            (self.dir / "traces.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


def _unavailable(reason: str):
    """Skip, or fail where the GPU suite was asked for (``make selftest-gpu-mechanics`` sets
    SERVING_TRUTH_REQUIRE_GPU=1, so a host without a GPU cannot pass it by skipping everything)."""
    if os.environ.get("SERVING_TRUTH_REQUIRE_GPU") == "1":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def gpu():
    """torch with a CUDA device, or skip (CPU hosts, CI)."""
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as exc:
        _unavailable(f"needs torch and Triton: {exc}")
    if not torch.cuda.is_available():
        _unavailable("no CUDA device")
    return torch


@pytest.fixture(scope="session")
def tracebook(gpu, tmp_path_factory):
    out = os.environ.get("SERVING_TRUTH_GPU_TRACES")
    directory = Path(out) if out else tmp_path_factory.mktemp("gpu-traces")
    directory.mkdir(parents=True, exist_ok=True)
    book = TraceBook(directory, keep=bool(out))
    yield book
    book.write()


@pytest.fixture(scope="session")
def k3_kda_src(gpu, tmp_path_factory):
    """The folder holding vLLM's K3 KDA op sources (tests/gpu_mechanics/k3_kda_src.py), put first on
    sys.path: SERVING_TRUTH_K3_KDA_SRC, else build/k3-kda-src, else extracted now from the cached wheel."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import k3_kda_src

    folder = Path(os.environ.get("SERVING_TRUTH_K3_KDA_SRC", k3_kda_src.DEFAULT_DEST)).resolve()
    if not (folder / "MANIFEST.json").is_file():
        wheel, sha = k3_kda_src.pinned_wheel()
        if not wheel.is_file():
            _unavailable(f"no K3 KDA sources at {folder} and no pinned wheel at {wheel} "
                         "(python tests/gpu_mechanics/k3_kda_src.py builds them from the wheel)")
        folder = tmp_path_factory.mktemp("k3-kda-src") / "src"
        k3_kda_src.extract(wheel, folder, sha)
    if "vllm" in sys.modules and not getattr(sys.modules["vllm"], "SHIM", False):
        _unavailable("a real vLLM is imported in this process; the KDA sources need their shim package")
    sys.path.insert(0, str(folder))
    return folder
