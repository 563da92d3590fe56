"""A non-editable install carries every model: the wheel built from pyproject.toml holds each model's profile,
its probes package and its config, and `serving-truth models` run from the unpacked wheel (not this checkout)
lists them all."""
import os
import subprocess
import sys
import zipfile

from tests.conftest import ROOT


def test_the_built_wheel_holds_every_model_and_lists_them(tmp_path):
    from audit import models

    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next(out.glob("serving_truth-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for profile in models.PROFILES.values():
        assert f"audit/data/{profile.config_package_path}" in names, profile.name
        if profile.probes:
            assert f"probes/models/{profile.probes}/__init__.py" in names, profile.name
        for scheme in profile.schemes:  # its quantization schemes' probes and vocabulary
            assert f"probes/schemes/{scheme}.py" in names, profile.name
    assert "probes/models/kimi_k3/resolve.py" in names and "audit/report/templates/ledger.md.j2" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", "import audit, sys; print(audit.__file__); from audit.cli import main; "
                        "sys.argv = ['serving-truth', 'models']; sys.exit(main())"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[0].startswith(str(site))  # the installed copy, not this checkout
    for name in models.PROFILES:
        assert name in r.stdout
