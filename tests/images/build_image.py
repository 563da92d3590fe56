"""Build a local container image that carries Python and a pinned engine wheel (vLLM's, SGLang's), as the
engines' own images do.

No registry is reachable on the machines this project is tested on, so the docker runtime's tests
run against an image built here: a Debian rootfs from ``debootstrap``, the same CPython minor version
the pin names (copied from this host's build of it), a venv at ``/opt/venv`` holding the pinned wheel
(hash-checked first), then ``docker import``. The image is cached: a second call with the same pin
returns the existing image in a second.

The wheel goes in by uv, under the pin's shipped resolution (``audit/data/envlocks``, its ``overrides``
included), hard-linked from the audit's uv cache into the rootfs: the image holds exactly the packages the
local runtime's environment holds (a docker audit and a local one can be compared cell by cell), nothing is
downloaded twice (building the pin's environment first fills the cache), and the rootfs costs no disk beyond
what ``docker import`` stores.

    python tests/images/build_image.py --pin v0.33.0 [--lock images.lock] [--lock-out FILE]

Prints a JSON object (image id, tag, pin entry). With ``--lock-out`` it also writes a lock file with
the pin ``<pin>-image`` that names the image by its config digest (``image_config_digest``), which is
how a locally built or ``docker load``-ed image is pinned. Needs root (debootstrap, chroot).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from audit import engines  # noqa: E402
from audit.pins import lock as lockmod  # noqa: E402
from audit.fsutil import cache_root  # noqa: E402
from audit.runtimes.environment import find_uv  # noqa: E402
from audit.runtimes.local import LocalRuntime, find_python  # noqa: E402

#: bump when the recipe changes: it is part of the cache key
RECIPE = 3
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
#: shared libraries a CPython build links against (and the CA bundle its ssl module loads)
DEB_PACKAGES = ("ca-certificates", "libssl3", "libffi8", "libsqlite3-0", "libbz2-1.0", "liblzma5", "zlib1g",
                "libreadline8", "libncursesw6", "libuuid1", "libgdbm6", "libexpat1")
LABEL = "serving-truth.test-image"
#: how the wheel is installed (part of the image's cache key): uv from the pin's shipped resolution, its scripts
#: moved onto the venv's PATH (2)
INSTALLER = "uv-2"


def sh(cmd, **kw):
    print("+", " ".join(map(str, cmd)) if isinstance(cmd, list) else cmd, file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def image_key(pin: lockmod.Pin, python_version: str) -> str:
    extra = f":{INSTALLER}:{','.join(pin.overrides)}"
    return hashlib.sha256(f"{RECIPE}:{pin.wheel_sha256}:{python_version}:{SUITE}{extra}".encode()).hexdigest()[:12]


def find_image(client, tag: str):
    import docker.errors

    try:
        return client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None


def build(pin: lockmod.Pin, *, log=sys.stderr) -> dict:
    import docker

    client = docker.from_env()
    python = find_python(pin.python)
    prefix = Path(subprocess.run([python, "-c", "import sys; print(sys.base_prefix)"], check=True,
                                 capture_output=True, text=True).stdout.strip())
    full_version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                                  check=True, capture_output=True, text=True).stdout.strip()
    key = image_key(pin, full_version)
    engine = pin.engine_contract
    tag = f"serving-truth-test/{engine.package}:{pin.version}-{key}"
    found = find_image(client, tag)
    if found is not None:
        return {"image_id": found.id, "tag": tag, "cached": True}

    if os.geteuid() != 0:
        raise SystemExit("building the test image needs root (debootstrap, chroot)")
    for sbin in ("/usr/sbin", "/sbin"):  # debootstrap, chroot, mount live there; root's PATH may lack them
        if sbin not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + sbin
    if not shutil.which("debootstrap"):
        raise SystemExit("debootstrap is not installed: apt-get install -y debootstrap")
    local = LocalRuntime()
    wheel = local.wheel_path(pin, lambda *a, **k: None)  # hash-checked against images.lock
    work = cache_root() / "image-build" / key
    rootfs = work / "rootfs"
    log.write(f"building {tag} in {work}\n")
    if work.exists():
        _umount_all(rootfs)
        shutil.rmtree(work)
    rootfs.mkdir(parents=True)
    try:
        base = cache_root() / "image-build" / f"base-{SUITE}-python{full_version}-r{RECIPE}.tar"
        if base.exists():  # debootstrap + CPython, kept from an earlier build
            sh(["tar", "-C", str(rootfs), "--numeric-owner", "-xf", str(base)])
        else:
            sh(["debootstrap", "--variant=minbase", "--include=" + ",".join(DEB_PACKAGES), SUITE, str(rootfs),
                MIRROR], stdout=log)
            # CPython: this host's build of the pinned minor version, installed under /usr/local
            for part in ("bin", "lib", "include"):
                sh(["cp", "-a", str(prefix / part), str(rootfs / "usr/local")])
            shutil.rmtree(rootfs / f"usr/local/lib/python{pin.python}/test", ignore_errors=True)
            site = rootfs / f"usr/local/lib/python{pin.python}/site-packages"
            for entry in site.iterdir():
                if entry.name.startswith(("pip", "setuptools", "README")):
                    continue
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            sh(["chroot", str(rootfs), "ldconfig"])
            shutil.rmtree(rootfs / "var/cache/apt", ignore_errors=True)
            sh(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(base) + ".tmp", "."])
            os.replace(str(base) + ".tmp", base)
        sh(["mount", "-t", "proc", "proc", str(rootfs / "proc")])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/root", "LANG": "C.UTF-8"}
        try:
            sh(["chroot", str(rootfs), f"/usr/local/bin/python{pin.python}", "-c",
                "import ssl, ctypes, sqlite3, lzma, bz2, uuid; print('python ok')"], env=env, stdout=log)
            sh(["chroot", str(rootfs), f"/usr/local/bin/python{pin.python}", "-m", "venv",
                "/opt/venv"], env=env)
            _uv_install(local, pin, wheel, python, rootfs, work, log)
            info = subprocess.run(["chroot", str(rootfs), "/opt/venv/bin/python", "-c", engine.env_probe],
                                  env=env, check=True, capture_output=True, text=True).stdout
            facts = json.loads(info.strip().splitlines()[-1])
            if not facts["cuda"] or facts["engine"] != pin.version:
                raise SystemExit(f"the image would hold {facts}: not the pinned {engine.title} with a CUDA torch")
        finally:
            _umount_all(rootfs)
        (rootfs / "etc/resolv.conf").write_text("")
        shutil.rmtree(rootfs / "var/cache/apt", ignore_errors=True)
        nvcc = sorted(rootfs.glob(f"opt/venv/lib/python{pin.python}/site-packages/nvidia/*/bin/nvcc"))
        changes = [
            "ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "ENV VIRTUAL_ENV=/opt/venv",
            "ENV LANG=C.UTF-8",
            f"LABEL {LABEL}={key}",
            f"LABEL org.opencontainers.image.title={engine.package}-{pin.version}-test",
            'CMD ["python3"]',
        ]
        if nvcc:  # a toolkit at CUDA_HOME, as the engines' images carry one
            changes.append("ENV CUDA_HOME=/" + str(nvcc[0].parent.parent.relative_to(rootfs)))
        cmd = ["docker", "import"]
        for c in changes:
            cmd += ["--change", c]
        cmd += ["-", tag]
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", "-", "."], stdout=subprocess.PIPE)
        sh(cmd, stdin=tar.stdout, stdout=log)
        tar.stdout.close()
        if tar.wait() != 0:
            raise SystemExit("tar of the rootfs failed")
    finally:
        _umount_all(rootfs)
        shutil.rmtree(work, ignore_errors=True)
    image = client.images.get(tag)
    return {"image_id": image.id, "tag": tag, "cached": False}


def _uv_install(local: LocalRuntime, pin: lockmod.Pin, wheel: Path, python: str, rootfs: Path, work: Path,
                log) -> None:
    """The pinned wheel into the image's venv by uv, under the pin's shipped resolution and its overrides, files
    hard-linked from the audit's uv cache (the rootfs sits beside it, under the same cache root)."""
    resolution = local.resolution_file(pin)
    if resolution is None:
        raise SystemExit(f"pin {pin.name} has no shipped resolution (audit/data/envlocks); build its environment "
                         "once (`serving-truth env build`) first")
    site = rootfs / f"opt/venv/lib/python{pin.python}/site-packages"
    overrides = []
    if pin.overrides:
        path = work / "overrides.txt"
        path.write_text("".join(f"{r}\n" for r in pin.overrides), encoding="utf-8")
        overrides = ["--override", str(path)]
    sh([find_uv(), "pip", "install", "--no-config", "--python", python, "--target", str(site), "--constraint",
        str(resolution), *overrides, str(wheel)], env=local._uv_env(), stdout=log)
    _scripts_onto_path(site / "bin", rootfs / "opt/venv/bin", python)


def _scripts_onto_path(scripts: Path, venv_bin: Path, host_python: str) -> None:
    """uv's ``--target`` leaves the packages' scripts (``ninja``, ``cmake``, the engine's CLI) in ``<target>/bin``,
    off PATH, with the host interpreter in their shebang: each goes to the venv's ``bin`` (where a pip install puts
    it, and where the engines look for ``ninja``), a Python script's shebang naming the venv's interpreter. Written
    anew, never edited in place (files under the target may be hard links into the uv cache)."""
    if not scripts.is_dir():
        return
    for entry in sorted(scripts.iterdir()):
        dest = venv_bin / entry.name
        if dest.exists() or dest.is_symlink():
            entry.unlink()
            continue
        data = entry.read_bytes()
        first, sep, rest = data.partition(b"\n")
        if first.startswith(b"#!") and b"python" in first:
            data = b"#!/opt/venv/bin/python" + sep + rest
        dest.write_bytes(data)
        dest.chmod(0o755)
        entry.unlink()
    scripts.rmdir()


def _mounts_under(rootfs: Path) -> list[str]:
    """Mount points at or below *rootfs* (bind mounts of the same filesystem included)."""
    prefix = str(rootfs.resolve())
    with open("/proc/self/mounts", encoding="utf-8") as fh:
        points = [line.split()[1].replace("\\040", " ") for line in fh]
    return [p for p in points if p == prefix or p.startswith(prefix + "/")]


def _umount_all(rootfs: Path) -> None:
    if not rootfs.exists():
        return
    for point in sorted(_mounts_under(rootfs), reverse=True):
        subprocess.run(["umount", "-l", point], check=False)
    left = _mounts_under(rootfs)
    if left:  # never rmtree through a bind mount into the host
        raise SystemExit(f"cannot unmount {left}; remove them by hand before rebuilding")


def lock_entry(pin: lockmod.Pin, image_id: str, tag: str) -> str:
    engine = pin.engine_contract
    return (
        "[[pin]]\n"
        f'name = "{pin.name}-image"\n'
        + (f'engine = "{engine.name}"\n' if engine.name != engines.DEFAULT else "")
        + f'{engine.version_key} = "{pin.version}"\n'
        f'python = "{pin.python}"\n'
        f'image_config_digest = "{image_id}"\n'
        f'note = "built on this machine by tests/images/build_image.py ({tag}) from {pin.wheel}"\n'
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pin", default="v0.33.0")
    ap.add_argument("--lock", default=str(ROOT / "images.lock"))
    ap.add_argument("--lock-out", help="write a lock file: the given lock plus the image pin")
    args = ap.parse_args(argv)
    lock = lockmod.load(args.lock)
    pin = lock.get(args.pin)
    if not pin.has_wheel:
        raise SystemExit(f"pin {pin.name} has no wheel to install")
    out = build(pin)
    out["pin"] = f"{pin.name}-image"
    if args.lock_out:
        text = Path(args.lock).read_text(encoding="utf-8").rstrip("\n") + "\n\n" + lock_entry(pin, out["image_id"], out["tag"])
        tmp = Path(args.lock_out + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(args.lock_out)
    print(json.dumps(out, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
