"""Observe mode's workload: serve a model slice with ``vllm serve`` and exercise every phase.

The server is started with the ``vllm serve`` arguments of the lane under audit (the layout's own
flags, dummy weights, the slice's model directory): the same command a user runs, so the API
server, the engine core and every worker are real (and each loads the probes' plugin). vLLM's
offline ``LLM`` class is not used: it refuses ``data_parallel_size > 1``, which the DEP8 lane needs.
The requests (OpenAI completions API on 127.0.0.1, token-id prompts) then cover, in order:

* short prefill and long prefill longer than ``--max-num-batched-tokens`` (so it is chunked);
* plain decode at batch sizes inside the CUDA-graph capture sizes and beyond the largest one;
* speculative verify, which every decode step of a layout with ``--speculative-config`` is.

Prompts are token ids (``--skip-tokenizer-init``): no tokenizer or weights are downloaded.

Corroboration (optional, on by default in observe mode): the server also gets vLLM's own
``--profiler-config`` for the torch profiler, and each phase runs inside one profiling session
(``/start_profile`` with the phase's name as the trace prefix, ``/stop_profile`` after), so every
worker writes one Chrome trace per phase (read by :mod:`probes.observe.traces`). A session that vLLM refuses
is recorded and the phase runs unprofiled: the probes stay the primary evidence.
Standard library only; running needs GPUs.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

#: CUDA-graph capture sizes the workload serves with; decode batches are chosen around them
CAPTURE_SIZES = (1, 2, 4, 8, 16)
MAX_NUM_BATCHED_TOKENS = 2048
MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class Phase:
    name: str
    prompts: int        # how many requests at once (the batch size)
    prompt_tokens: int
    max_tokens: int
    why: str


PHASES = (
    Phase("prefill-short", 1, 32, 1, "one short prompt: a prefill that fits one step"),
    Phase("prefill-long", 1, 3 * MAX_NUM_BATCHED_TOKENS + 100, 1,
          f"longer than --max-num-batched-tokens {MAX_NUM_BATCHED_TOKENS}: chunked prefill"),
    Phase("decode-bs1", 1, 16, 24, "decode at batch 1 (inside the capture sizes)"),
    Phase("decode-bs8", 8, 16, 24, "decode at batch 8 (inside the capture sizes)"),
    Phase(f"decode-bs{CAPTURE_SIZES[-1] * 3}", CAPTURE_SIZES[-1] * 3, 16, 24,
          f"decode beyond the largest capture size ({CAPTURE_SIZES[-1]}): eager or piecewise"),
)


def profiler_config(trace_dir: str) -> dict:
    """vLLM's ``--profiler-config`` for corroboration: the torch profiler on the workers, GPU activity
    only (kernels, with CUPTI's graph ids), no stacks, shapes or summary tables, no front-end trace."""
    return {"profiler": "torch", "torch_profiler_dir": trace_dir, "torch_profiler_activities": ["CUDA"],
            "torch_profiler_with_stack": False, "torch_profiler_record_shapes": False,
            "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True}


def serve_argv(model_dir: str, layout_args: list[str], *, extra: list[str] = (),
               trace_dir: str | None = None) -> list[str]:
    """The ``vllm serve`` arguments observe mode uses for a lane (after the word ``serve``); with
    *trace_dir*, vLLM's torch profiler writes the workers' traces there."""
    compilation = {"cudagraph_capture_sizes": list(CAPTURE_SIZES)}
    profiling = ["--profiler-config", json.dumps(profiler_config(trace_dir), separators=(",", ":"))] \
        if trace_dir else []
    return [
        model_dir, *(a.replace("<model>", model_dir) for a in layout_args),  # a draft lives in <model>/draft
        "--load-format", "dummy",
        "--skip-tokenizer-init",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        "--enable-chunked-prefill",
        "--max-num-seqs", str(max(p.prompts for p in PHASES)),
        "--compilation-config", json.dumps(compilation, separators=(",", ":")),
        *profiling,
        *extra,
    ]


def token_prompts(phase: Phase, vocab: int = 32000) -> list[dict]:
    """Deterministic token-id prompts (no tokenizer needed)."""
    return [{"prompt_token_ids": [(7 * i + 13 * j + 1) % vocab for j in range(phase.prompt_tokens)]}
            for i in range(phase.prompts)]


def vllm_command() -> list[str]:
    """``vllm`` of the environment this runs in (next to its Python, else on PATH)."""
    beside = os.path.join(os.path.dirname(sys.executable), "vllm")
    if os.access(beside, os.X_OK):
        return [beside]
    found = shutil.which("vllm")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from vllm.entrypoints.cli.main import main; sys.exit(main())"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _send(url: str, body: dict, timeout: float) -> bytes:
    """POST *body* as JSON; the response body (raises on HTTP errors)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def _post(url: str, body: dict, timeout: float) -> dict:
    return json.loads(_send(url, body, timeout))


def _profile(base: str, what: str, body: dict | None, timeout: float) -> str:
    """POST /start_profile or /stop_profile; "" when vLLM accepted it, else why not."""
    try:
        _send(base + "/" + what, body or {}, timeout)
        return ""
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"


def run(argv: list[str], *, on_phase=lambda name: None, log_path: str | None = None,
        ready_timeout_s: float = 3600, request_timeout_s: float = 1800, profile: bool = False) -> dict:
    """Start ``vllm serve *argv`` on 127.0.0.1, run every phase, stop the server; per-phase outcomes.
    With *profile* (the server was started with ``--profiler-config``), each phase is one profiling
    session whose trace prefix is the phase's name."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = open(log_path or os.devnull, "ab")
    server = subprocess.Popen([*vllm_command(), "serve", *argv, "--host", "127.0.0.1", "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {server.returncode} before it was ready (log: {log_path})")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve was not ready after {ready_timeout_s:.0f}s")
            time.sleep(2)
        out = {}
        for phase in PHASES:
            on_phase(phase.name)
            started = _profile(base, "start_profile", {"profile_prefix": phase.name}, request_timeout_s) \
                if profile else None
            body = {"model": argv[0], "prompt": [p["prompt_token_ids"] for p in token_prompts(phase)],
                    "max_tokens": phase.max_tokens, "temperature": 0.0, "ignore_eos": True}
            try:
                answer = _post(base + "/v1/completions", body, request_timeout_s)
            finally:
                stopped = _profile(base, "stop_profile", None, request_timeout_s) if started == "" else None
            usage = answer.get("usage") or {}
            entry = {"requests": phase.prompts, "choices": len(answer.get("choices") or []),
                     "completion_tokens": usage.get("completion_tokens")}
            if profile:
                entry["profiled"] = started == "" and stopped == ""
                if started or stopped:
                    entry["profiler_error"] = started or stopped
            out[phase.name] = entry
        return out
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)  # vLLM shuts its engine and workers down on SIGINT
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()


__all__ = ["CAPTURE_SIZES", "PHASES", "Phase", "profiler_config", "run", "serve_argv", "token_prompts",
           "vllm_command"]
