"""vLLM general plugin: the probes in every Python process vLLM starts.

vLLM calls ``load_general_plugins()`` in the API server, the engine core and each worker, and it
loads entry points of the group ``vllm.general_plugins``. The harness provides one without changing
the image: it stages the ``probes`` package and a tiny distribution metadata directory
(:func:`dist_info_files`) in a directory it mounts read-only and puts on ``PYTHONPATH``, and sets
``VLLM_PLUGINS=serving_truth`` so no other plugin of the image is loaded because of it.

:func:`register` does nothing unless ``SERVING_TRUTH_OUT`` names the evidence directory. It installs
the probes once per process and writes one evidence file per process (a forked child gets its own
file and starts with no records of its parent). Standard library only until a probe patches vLLM.
"""
from __future__ import annotations

import os
import sys

from probes.core.recorder import Recorder

ENV_OUT = "SERVING_TRUTH_OUT"
ENV_MODE = "SERVING_TRUTH_MODE"
#: the served model's probes package (probes/models/<name>): its targets, observe entries and scopes
ENV_MODEL = "SERVING_TRUTH_MODEL_PROBES"
#: the quantization schemes its profile selects (probes/schemes), comma-separated
ENV_SCHEMES = "SERVING_TRUTH_SCHEMES"
ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "serving_truth"
DIST_NAME = "serving_truth_probes"

_state: dict = {"pid": None, "rec": None, "probes": None, "observe": None}


def recorder():
    """This process's recorder once :func:`register` ran (else None)."""
    return _state["rec"]


def observe_session():
    """This process's observe session in observe mode (else None)."""
    return _state.get("observe")


def dist_info_files(version: str) -> dict[str, str]:
    """Relative path -> text of the metadata that makes ``register`` an entry point."""
    d = f"{DIST_NAME}-{version}.dist-info"
    return {
        f"{d}/METADATA": f"Metadata-Version: 2.1\nName: {DIST_NAME}\nVersion: {version}\n",
        f"{d}/entry_points.txt": f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT_NAME} = probes.observe.plugin:register\n",
        f"{d}/top_level.txt": "probes\n",
    }


def _role() -> str:
    argv0 = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return f"vllm-process:{argv0}"


def _after_fork_in_child() -> None:
    rec = _state["rec"]
    if rec is not None:
        rec.forked()
        _state["pid"] = os.getpid()
        session = _state.get("observe")
        if session is not None:  # counts restart in the child; its timer thread did not survive the fork
            session.counters.reset()
            session.start_timer(float(os.environ.get("SERVING_TRUTH_FLUSH_S", "30")))
        rec.emit("plugin", event="forked")
        rec.flush()


def register() -> None:
    """The entry point vLLM calls (possibly several times per process)."""
    out = os.environ.get(ENV_OUT)
    if not out or _state["pid"] == os.getpid():
        return
    _state["pid"] = os.getpid()
    try:
        meta = {"mode": os.environ.get(ENV_MODE, "observe"), "argv": [os.path.basename(a) for a in sys.argv[:6]],
                "model_probes": os.environ.get(ENV_MODEL, ""),
                # the model the run audits (the host refuses evidence of another model in its run)
                "model": os.environ.get("SERVING_TRUTH_MODEL") or None}
        system, _, layout = os.environ.get("SERVING_TRUTH_CELL", "").partition("--")
        if system and layout:
            meta["cell"] = {"system": system, "layout": layout}
        rec = Recorder(out, role=_role(), meta=meta)
        _state["rec"] = rec
        from probes import models as models_probes
        from probes.core.install import ProbeSet
        from probes.core.targets import TARGETS, with_model

        try:
            from importlib.metadata import version

            vllm_version = version("vllm")
        except Exception:
            vllm_version = ""
        own = models_probes.use(models_probes.load(os.environ.get(ENV_MODEL, ""), schemes=[
            s for s in os.environ.get(ENV_SCHEMES, "").split(",") if s]))
        _state["probes"] = ProbeSet(rec, targets=with_model(TARGETS, own.targets), vllm_version=vllm_version).install()
        if os.environ.get(ENV_MODE) == "observe":  # count kernel entries, graphs, phases
            import atexit

            from probes.observe.session import ObserveSession, entries

            kernels, scopes = entries(own)
            session = ObserveSession(rec, kernels=kernels, scopes=scopes).install()
            _state["observe"] = session
            session.start_timer(float(os.environ.get("SERVING_TRUTH_FLUSH_S", "30")))
            atexit.register(session.flush)
        os.register_at_fork(after_in_child=_after_fork_in_child)
        rec.emit("plugin", event="loaded", via=ENTRY_POINT_GROUP, vllm=vllm_version)
        rec.flush()
    except Exception as exc:  # the plugin must never break vLLM's startup
        print(f"serving-truth plugin: not installed in pid {os.getpid()}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
