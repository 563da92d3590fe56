"""vLLM's own Kimi-K3 KDA Triton kernels, taken as source files from the pinned wheel, runnable without vLLM.

    python tests/gpu_mechanics/k3_kda_src.py [--wheel WHEEL] [--dest build/k3-kda-src]

The GPU mechanics tests run vLLM 0.33.0's KDA entries (``chunk_kda_with_fused_gate``,
``fused_recurrent_kda_packed_decode``, ``fused_recurrent_kda``) on a machine that has torch and Triton
but no vLLM (and cannot carry it). This script copies, unchanged, the few ``.py`` files those entries
need out of the wheel pinned in images.lock (hash-checked) into an ignored folder, under their own
module paths (``vllm/models/kimi_k3/nvidia/ops/third_party/kda/...``), so the kernels keep the names
and module paths the kernel-name map was written against. Only the handful of vLLM helpers they import
and that would drag the rest of vLLM in are written as small shims (:data:`SHIMS`, a few lines each,
clearly marked). ``MANIFEST.json`` in the folder lists the wheel, its hash and every file with its
sha256 and whether it is the wheel's file or a shim. Nothing of vLLM is committed to this repository.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DEST = ROOT / "build" / "k3-kda-src"
PIN = "v0.33.0"
KDA = "vllm/models/kimi_k3/nvidia/ops/third_party/kda/"
FLA = "vllm/third_party/flash_linear_attention/"
#: copied unchanged from the wheel: the K3 KDA ops package and the FLA modules it imports
FROM_WHEEL = (
    KDA + "__init__.py", KDA + "chunk.py", KDA + "chunk_intra.py", KDA + "chunk_intra_token_parallel.py",
    KDA + "fused_recurrent.py",
    FLA + "__init__.py", FLA + "LICENSE", FLA + "ops/chunk_delta_h.py", FLA + "ops/cumsum.py", FLA + "ops/index.py",
    FLA + "ops/l2norm.py", FLA + "ops/op.py", FLA + "ops/utils.py",
    "vllm/utils/math_utils.py",  # pure Python (cdiv, next_power_of_2, RCP_LN2)
)
_MARK = "# serving-truth shim: stands in for vLLM's module of this name (tests/gpu_mechanics/k3_kda_src.py)\n"
#: vLLM modules the copied files import that would pull the rest of vLLM in: the few names they use
SHIMS = {
    "vllm/__init__.py": '"""serving-truth shim package: only the K3 KDA ops copied from the vLLM wheel."""\n'
                        "SHIM = True\n",
    # the real ops/__init__ imports every FLA op (layernorm_guard needs einops and vLLM's warmup machinery)
    FLA + "ops/__init__.py": "",
    "vllm/triton_utils/__init__.py": "import triton\nimport triton.language as tl\n"
                                     "import triton.language.extra.libdevice as tldevice\n",
    "vllm/platforms/__init__.py": (
        "import torch\n\n\nclass _Cuda:\n"
        "    # the answers of vllm.platforms.cuda.CudaPlatform for the methods the KDA ops call\n"
        "    def is_cuda(self):\n        return True\n\n"
        "    def is_cuda_alike(self):\n        return True\n\n"
        "    def is_rocm(self):\n        return False\n\n"
        "    def has_device_capability(self, capability, device_id=0):\n"
        "        major, minor = torch.cuda.get_device_capability(device_id)\n"
        "        if isinstance(capability, tuple):\n            return (major, minor) >= capability\n"
        "        return major * 10 + minor >= capability\n\n"
        "    def is_arch_support_pdl(self):\n"
        "        return torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9\n\n\n"
        "current_platform = _Cuda()\n"),
    # vLLM's sync checker (off unless VLLM_GPU_SYNC_CHECK is set): the allow region is a no-op here
    "vllm/utils/gpu_sync_debug.py": "import contextlib\n\n\ndef gpu_sync_allowed():\n"
                                    "    return contextlib.nullcontext()\n",
    "vllm/utils/torch_utils.py": (
        "import torch\n\n\ndef async_tensor_h2d(data, device=None, dtype=None, out=None):\n"
        "    # vLLM stages through pinned memory; the copy it makes is the same\n"
        "    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)\n"
        "    if out is not None:\n        return out.copy_(t, non_blocking=True)\n"
        "    return t.pin_memory().to(device=device, dtype=dtype or t.dtype, non_blocking=True)\n"),
    "vllm/utils/__init__.py": "",
}
#: the Kernel.path of probes/models/kimi_k3's KERNELS each copied entry is counted as, with its module:function
ENTRIES = {
    "triton chunk_kda": "vllm.models.kimi_k3.nvidia.ops.third_party.kda:chunk_kda_with_fused_gate",
    "triton packed decode": "vllm.models.kimi_k3.nvidia.ops.third_party.kda:fused_recurrent_kda_packed_decode",
    "triton fused_recurrent_kda": "vllm.models.kimi_k3.nvidia.ops.third_party.kda:fused_recurrent_kda",
}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pinned_wheel() -> tuple[Path, str]:
    """The pinned wheel as the local runtime caches it (SERVING_TRUTH_CACHE or ~/.cache/serving-truth),
    and its sha256 from images.lock."""
    import tomllib

    with open(ROOT / "images.lock", "rb") as fh:
        lock = tomllib.load(fh)
    (pin,) = [p for p in lock["pin"] if p["name"] == PIN]
    cache = Path(os.environ.get("SERVING_TRUTH_CACHE", Path.home() / ".cache" / "serving-truth"))
    return cache / "wheels" / pin["wheel"], pin["wheel_sha256"]


def extract(wheel: Path, dest: Path, sha256: str | None = None) -> dict:
    """Copy :data:`FROM_WHEEL` out of *wheel* and write :data:`SHIMS` under *dest* (replaced whole)."""
    got = _sha256(wheel)
    if sha256 and got != sha256:
        raise SystemExit(f"{wheel}: sha256 {got}, images.lock pins {sha256}")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    files = []
    with zipfile.ZipFile(wheel) as zf:
        for name in FROM_WHEEL:
            out = tmp / name
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(zf.read(name))
            files.append({"file": name, "from": "wheel", "sha256": _sha256(out)})
    for name, text in SHIMS.items():
        out = tmp / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_MARK + text, encoding="utf-8")
        files.append({"file": name, "from": "shim", "sha256": _sha256(out)})
    manifest = {"wheel": wheel.name, "wheel_sha256": got, "pin": PIN, "entries": ENTRIES, "files": files}
    (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--wheel", type=Path, help="the vLLM wheel (default: the pinned one in the local cache)")
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    a = ap.parse_args(argv)
    wheel, sha = (a.wheel, None) if a.wheel else pinned_wheel()
    if not wheel.is_file():
        print(f"no wheel at {wheel}: `make env PIN={PIN}` caches it, or pass --wheel "
              f"(pip download --no-deps vllm==0.33.0)", file=sys.stderr)
        return 2
    m = extract(wheel, a.dest, sha)
    n = sum(1 for f in m["files"] if f["from"] == "wheel")
    print(f"{a.dest}: {n} files from {m['wheel']} (sha256 {m['wheel_sha256'][:12]}...), "
          f"{len(m['files']) - n} shims")
    return 0


if __name__ == "__main__":
    sys.exit(main())
