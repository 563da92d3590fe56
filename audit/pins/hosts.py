"""The serving host as a deployment fact: what vLLM's availability checks read about the machine, not the wheel.

vLLM decides some kernels from the host it runs on: whether FlashInfer is usable (``has_flashinfer()``: the
``flashinfer`` package and either ``flashinfer-cubin`` / ``VLLM_HAS_FLASHINFER_CUBIN`` or a CUDA toolkit's ``nvcc``
where it looks, plus ``ninja`` on PATH from 0.32), whether TRT-LLM attention's cubins can be had
(``has_nvidia_artifactory()``: the cubin package, else a network request), whether the vendored DeepGEMM finds a
CUDA home (0.27-0.29). The same wheel serves with other kernels on a host without a toolkit. So a host is declared
like a layout: a name, the facts it stands for, where they come from, and how resolve mode arranges the agent's
environment so that vLLM's own checks read exactly those facts (the checks run; nothing here answers for them).

Hosts:

* ``image``: the pin's official container image, its facts declared in images.lock (``[pin.host]``, with their
  source). A pin that declares none is audited under ``undeclared`` (a toolkit, no cubin package), said as such.
* ``pip``: ``pip install vllm==<version>`` on a machine with no CUDA toolkit: the wheel's own dependencies
  (flashinfer-python and ninja; no cubin or JIT-cache package, which no pinned wheel requires), no nvcc.

Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass

#: the facts a host declares: name -> (type, what vLLM reads it for)
FACTS: dict[str, tuple[type, str]] = {
    "nvcc": (bool, "a CUDA toolkit's nvcc where vLLM looks (PATH; CUDA_HOME from 0.32): has_flashinfer() without the "
                   "cubin package, the vendored DeepGEMM's CUDA home (0.27-0.29)"),
    "ninja": (bool, "ninja on PATH: has_flashinfer() through nvcc needs it from 0.32"),
    "flashinfer_cubin": (bool, "the flashinfer-cubin package: has_flashinfer_cubin(), so has_flashinfer() and "
                               "has_nvidia_artifactory() (TRT-LLM attention) without a toolkit or network"),
    "flashinfer_jit_cache": (bool, "the flashinfer-jit-cache package: precompiled FlashInfer kernels (vLLM only "
                                   "warns when it is missing; no selection reads it)"),
    "cuda": (str, "the CUDA version the host provides (the image's base; information)"),
}
#: facts every declaration must give (``cuda`` may be unknown: "")
REQUIRED = ("nvcc", "ninja", "flashinfer_cubin", "flashinfer_jit_cache")


@dataclass(frozen=True)
class Host:
    """One host an audit runs vLLM as if on. ``facts``: :data:`FACTS` values; ``source``: where they come from."""
    name: str
    title: str
    facts: dict
    source: str

    def record(self, *, arranged: bool = True) -> dict:
        """What routing.json keeps (``run.host``) and the ledger shows. ``arranged=False``: the audit ran the host
        itself (the Docker runtime runs the pinned image as it is), so nothing was arranged to match the facts."""
        return {"name": self.name, "title": self.title, "facts": dict(sorted(self.facts.items())),
                "source": self.source, "arranged": arrangement(self) if arranged else []}


#: the hosts ``--host`` names, with what each stands for
HOSTS = {
    "image": "the pin's official container image (facts declared in images.lock)",
    "pip": "pip install of the pinned wheel on a host with no CUDA toolkit",
}
DEFAULT = "image"


def check_facts(facts: dict) -> str:
    """Why *facts* is no host declaration ("" when it is one): unknown or missing facts, wrong types."""
    unknown = sorted(set(facts) - set(FACTS) - {"source"})
    if unknown:
        return f"unknown host fact {unknown[0]!r} (known: {', '.join(FACTS)})"
    missing = [f for f in REQUIRED if f not in facts]
    if missing:
        return f"host fact {missing[0]!r} is missing (each of {', '.join(REQUIRED)} must be declared)"
    for name, value in facts.items():
        if name == "source":
            continue
        want = FACTS[name][0]
        if type(value) is not want:
            return f"host fact {name!r} must be a {want.__name__}, got {type(value).__name__}"
    if not str(facts.get("source", "")).strip():
        return "a host declaration needs its source (where the facts were read: the image's recipe, its inventory)"
    return ""


def host_for(pin, name: str = DEFAULT) -> Host:
    """The host *name* for *pin* (a :class:`audit.pins.lock.Pin`); ValueError for a name no host has."""
    if name not in HOSTS:
        raise ValueError(name)
    if name == "pip":
        return Host("pip", f"pip install vllm=={pin.version}, no CUDA toolkit",
                    {"nvcc": False, "ninja": True, "flashinfer_cubin": False, "flashinfer_jit_cache": False, "cuda": ""},
                    "the wheel's own dependencies (its METADATA requires flashinfer-python and ninja, no cubin or "
                    "JIT-cache package); a machine with no CUDA toolkit")
    declared = dict(pin.host or {})
    if not declared:
        return Host("undeclared", "host facts not declared in images.lock",
                    {"nvcc": True, "ninja": True, "flashinfer_cubin": False, "flashinfer_jit_cache": False, "cuda": ""},
                    "none: images.lock declares no [pin.host] for this pin, so the harness's own arrangement is "
                    "audited (which may not be what the pin's image has)")
    source = declared.pop("source")
    declared.setdefault("cuda", "")
    return Host("image", "the official image", declared, source)


def arrangement(host: Host) -> list[str]:
    """How resolve mode makes vLLM's own checks read *host*'s facts (the local runtime does exactly this)."""
    f = host.facts
    out = ["nvcc: the environment's own nvidia-cuda-nvcc on PATH and as CUDA_HOME (the machine's toolkit never)"
           if f["nvcc"] else "nvcc: none (CUDA_HOME an empty directory, no toolkit on PATH)"]
    out.append("ninja: the environment's bin/ on PATH" if f["ninja"] else "ninja: not on PATH")
    out.append("flashinfer-cubin: VLLM_HAS_FLASHINFER_CUBIN=1, vLLM's own switch for the installed package (no cubin "
               "is loaded in resolve mode)" if f["flashinfer_cubin"] else
               "flashinfer-cubin: absent (and NVIDIA's artifactory is not reached: resolve mode runs offline)")
    return out


def differences(a: dict | None, b: dict | None) -> list[tuple[str, object, object]]:
    """(fact, before, after) for every fact vLLM reads (:data:`REQUIRED`) that two hosts' records (``run.host``)
    disagree on; the CUDA version is information, not compared."""
    fa, fb = (a or {}).get("facts") or {}, (b or {}).get("facts") or {}
    return [(k, fa.get(k), fb.get(k)) for k in REQUIRED if fa.get(k) != fb.get(k)]


def report_root(reports_dir, name: str):
    """Where the reports of audits on host *name* live: ``reports/`` for the image's host (and a pin that declares
    none), ``reports/hosts/<name>/`` for another (its own pins' folders, diffs and models beside them)."""
    from pathlib import Path

    return Path(reports_dir) if name in (DEFAULT, "undeclared") else Path(reports_dir) / "hosts" / name


def label(pin: str, host: str, *, always: bool = False) -> str:
    """How a report or diff names an audit: the pin, and its host where that is not the image's (or *always*, when
    the two sides compared differ in host)."""
    if always or host not in ("", DEFAULT, "undeclared"):
        return f"{pin} on the {host or 'unrecorded'} host"
    return pin
