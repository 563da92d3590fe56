"""Two audits of a pin whose environment does not exist yet, started together on the real pinned wheel: the
environment is built once (the second audit waits for the first's build, then uses it) and both audits give
the same routing. The cache is a fresh one whose wheel and package caches are the shared ones (so the build
hard-links from uv's cache instead of downloading 9 GB again)."""
import json
import os
import subprocess
import sys

import pytest

from audit.errors import ExitCode
from audit.fsutil import cache_root
from tests.conftest import ROOT, VLLM_PIN

pytestmark = pytest.mark.vllm


def test_two_audits_needing_one_new_environment_build_it_once_and_agree(vllm_env, tmp_path):
    shared = cache_root()
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in ("wheels", "uv-cache", "envlocks"):
        if (shared / name).exists():
            (cache / name).symlink_to(shared / name)
    env = {**os.environ, "SERVING_TRUTH_CACHE": str(cache)}
    runs = []
    for i in (1, 2):
        cmd = [sys.executable, "-m", "audit.cli", "audit", VLLM_PIN, "--systems", "b200_sxm", "--layouts", "tp8",
               "--reports", str(tmp_path / f"reports{i}"), "--no-cache", "--baseline", "none"]
        runs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800) for p in runs]
    for p, (_, err) in zip(runs, outs):
        assert p.returncode in (ExitCode.OK, ExitCode.FINDINGS), err[-3000:]
    builds = (cache / "envs" / ".builds.log").read_text().splitlines()
    assert len(builds) == 1, builds  # one build; the other audit waited for it
    envs = [p for p in (cache / "envs").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(envs) == 1 and (envs[0] / ".serving-truth-env.json").is_file()

    def routing(i):
        r = json.loads((tmp_path / f"reports{i}" / VLLM_PIN / "routing.json").read_text())
        return [{k: c[k] for k in ("system", "layout", "status", "lanes", "dispatch")} for c in r["cells"]]

    assert routing(1) == routing(2)
