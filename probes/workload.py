"""Observe mode's workload: serve a model slice through vLLM's real engine and exercise every phase.

The engine is configured from ``vllm serve`` arguments for the lane under audit (the layout's own
flags, dummy weights, the slice's model directory) parsed by vLLM's own server parser
(:func:`probes.resolve.engine_args_from_serve_argv`), so what is served is what a user's command
would serve. The requests then cover, in order:

* short prefill and long prefill longer than ``--max-num-batched-tokens`` (so it is chunked);
* plain decode at batch sizes inside the CUDA-graph capture sizes and beyond the largest one;
* speculative verify, which every decode step of a layout with ``--speculative-config`` is.

Prompts are token ids (``--skip-tokenizer-init``): no tokenizer or weights are downloaded.
Standard library only until :func:`run` imports vLLM; running needs GPUs.
"""
from __future__ import annotations

import json
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


def serve_argv(model_dir: str, layout_args: list[str], *, extra: list[str] = ()) -> list[str]:
    """The ``vllm serve`` arguments observe mode uses for a lane (after the word ``serve``)."""
    compilation = {"cudagraph_capture_sizes": list(CAPTURE_SIZES)}
    return [
        model_dir, *layout_args,
        "--load-format", "dummy",
        "--skip-tokenizer-init",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
        "--enable-chunked-prefill",
        "--max-num-seqs", str(max(p.prompts for p in PHASES)),
        "--compilation-config", json.dumps(compilation, separators=(",", ":")),
        *extra,
    ]


def token_prompts(phase: Phase, vocab: int = 32000) -> list[dict]:
    """Deterministic token-id prompts (no tokenizer needed)."""
    return [{"prompt_token_ids": [(7 * i + 13 * j + 1) % vocab for j in range(phase.prompt_tokens)]}
            for i in range(phase.prompts)]


def run(argv: list[str], *, on_phase=lambda name: None) -> dict:
    """Serve *argv* with vLLM's offline engine and run every phase; returns per-phase outcomes."""
    import dataclasses

    from vllm import LLM, SamplingParams

    from .resolve import engine_args_from_serve_argv

    engine_args = engine_args_from_serve_argv(argv)
    llm = LLM(**{f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)})
    out = {}
    for phase in PHASES:
        on_phase(phase.name)
        params = SamplingParams(max_tokens=phase.max_tokens, ignore_eos=True, temperature=0.0)
        results = llm.generate(token_prompts(phase), params, use_tqdm=False)
        out[phase.name] = {"requests": len(results),
                           "generated": sum(len(r.outputs[0].token_ids) for r in results)}
    return out


__all__ = ["CAPTURE_SIZES", "PHASES", "Phase", "run", "serve_argv", "token_prompts"]
