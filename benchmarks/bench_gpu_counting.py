"""Cost of observe mode's counting wrappers against a real eager step on an NVIDIA GPU, in one run.

    python benchmarks/bench_gpu_counting.py [--batch 8] [--steps 30] [--rounds 7] [--json OUT]

The step: one Kimi-K3 decode step's kernel-entry calls at one TP8 rank, eager (no CUDA graph): per
step 70 KDA, 23 MLA and 92 MoE entry calls (the counts bench_counting.py uses), in layer order, each
launching real GPU work. KDA calls run vLLM 0.33.0's own packed decode Triton kernel
(``fused_recurrent_kda_packed_decode``, 12 heads x 128, taken from the wheel by
tests/gpu_mechanics/k3_kda_src.py) when its sources are there; MLA and MoE calls are *stand-ins*
(bf16 GEMMs of one rank's shapes: MLA 12 heads x 576 -> 512 latent; MoE up 7168 -> 768, down 768 ->
7168), since their kernels cannot run without vLLM. A real eager K3 step launches far more kernels
per entry (norms, projections, routing, communication), so it is longer and the ratio printed here is
an upper bound for that step.

Bare and wrapped steps alternate in rounds; each step is timed wall-clock from launch to
``torch.cuda.synchronize()``. The wrapped step runs every entry through ``Counters.counting_wrapper``
and sets the layer scope per layer, as observe mode's scope wrappers do. It prints the median step
times, their difference and ratio, and, as a steadier figure, the wrapper cost per call measured on
this machine's CPU times the calls per step, over the bare step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from probes.observe.counting import Counters  # noqa: E402

KDA_LAYERS, MLA_LAYERS, MOE_LAYERS = 70, 23, 92
H, D = 12, 128


def layer_plan():
    """(attention kind, has MoE) per layer: 93 layers, 23 MLA spread evenly, 92 with MoE (not the first)."""
    n = KDA_LAYERS + MLA_LAYERS
    mla = {round((i + 1) * n / MLA_LAYERS) - 1 for i in range(MLA_LAYERS)}
    plan = [("mla" if i in mla else "kda", i >= n - MOE_LAYERS) for i in range(n)]
    assert sum(a == "kda" for a, _ in plan) == KDA_LAYERS and sum(m for _, m in plan) == MOE_LAYERS
    return plan


def kda_entry(torch, batch, src):
    """vLLM's packed decode entry and its inputs, or a stand-in GEMM (and the reason) without its sources."""
    if src and (Path(src) / "MANIFEST.json").is_file():
        sys.path.insert(0, str(src))
        from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent_kda_packed_decode as fn

        kw = dict(mixed_qkv=torch.randn(batch, 3 * H * D, device="cuda", dtype=torch.bfloat16),
                  raw_g=torch.randn(1, batch, H, D, device="cuda", dtype=torch.bfloat16),
                  raw_beta=torch.randn(1, batch, H, device="cuda", dtype=torch.bfloat16),
                  A_log=torch.randn(H, device="cuda"), dt_bias=torch.randn(H * D, device="cuda"), lower_bound=-5.0,
                  initial_state=torch.zeros(batch, H, D, D, device="cuda"),
                  state_indices=torch.arange(batch, device="cuda", dtype=torch.int32))

        def kda(layer):
            return fn(**kw)
        return kda, "vLLM 0.33.0 fused_recurrent_kda_packed_decode (Triton)"
    x = torch.randn(batch, 3 * H * D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(3 * H * D, H * D, device="cuda", dtype=torch.bfloat16)

    def kda(layer):
        return x @ w
    return kda, "stand-in GEMM (no K3 KDA sources)"


def build(torch, batch, src):
    kda, kda_what = kda_entry(torch, batch, src)
    q = torch.randn(batch * H, 576, device="cuda", dtype=torch.bfloat16)
    w_mla = torch.randn(576, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(batch, 7168, device="cuda", dtype=torch.bfloat16)
    w_up = torch.randn(7168, 768, device="cuda", dtype=torch.bfloat16)
    w_down = torch.randn(768, 7168, device="cuda", dtype=torch.bfloat16)

    def mla(layer):
        return q @ w_mla

    def moe(layer):
        return (x @ w_up) @ w_down
    return {"kda": kda, "mla": mla, "moe": moe}, kda_what


def make_steps(entries, counters, plan):
    wrapped = {k: counters.counting_wrapper(fn, f"bench {k}") for k, fn in entries.items()}
    counters.set_phase("decode")

    def bare_step():
        for i, (attn, has_moe) in enumerate(plan):
            entries[attn](i)
            if has_moe:
                entries["moe"](i)

    def wrapped_step():
        for i, (attn, has_moe) in enumerate(plan):
            counters.set_layer(i)  # what the layer scope wrapper does on entry
            wrapped[attn](i)
            if has_moe:
                wrapped["moe"](i)
    return bare_step, wrapped_step


def time_steps(torch, step, n) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def per_call_overhead_ns(n=200_000) -> float:
    """The wrapper's added cost per call on this CPU (best of 5), as bench_counting.py measures it."""
    c = Counters()
    c.set_layer(7)

    def f(i):
        return i
    w = c.counting_wrapper(f, "x")

    def best(fn):
        b = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for i in range(n):
                fn(i)
            b = min(b, (time.perf_counter_ns() - t0) / n)
        return b
    return best(w) - best(f)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--k3-kda-src", default=str(ROOT / "build" / "k3-kda-src"))
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("needs an NVIDIA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 3
    plan = layer_plan()
    entries, kda_what = build(torch, a.batch, a.k3_kda_src)
    counters = Counters()
    bare_step, wrapped_step = make_steps(entries, counters, plan)
    for _ in range(3):  # compile, autotune, warm the allocator
        bare_step()
        wrapped_step()
    counters.reset()
    bare, wrapped = [], []
    for r in range(a.rounds):
        first, second = (bare_step, wrapped_step) if r % 2 == 0 else (wrapped_step, bare_step)
        t1, t2 = time_steps(torch, first, a.steps), time_steps(torch, second, a.steps)
        (bare if first is bare_step else wrapped).extend(t1)
        (wrapped if first is bare_step else bare).extend(t2)
    calls_per_step = KDA_LAYERS + MLA_LAYERS + MOE_LAYERS
    counted = sum(r["calls"] for r in counters.snapshot()["eager"])
    assert counted == calls_per_step * len(wrapped), (counted, calls_per_step, len(wrapped))
    b, w = statistics.median(bare), statistics.median(wrapped)
    ns = per_call_overhead_ns()
    est_us = ns * calls_per_step / 1000
    fig = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": sys.version.split()[0], "batch": a.batch, "kda_entry": kda_what,
           "calls_per_step": calls_per_step, "steps_each": len(bare),
           "bare_step_ms": b * 1e3, "wrapped_step_ms": w * 1e3, "difference_us": (w - b) * 1e6,
           "ratio_measured": (w - b) / b, "wrapper_ns_per_call_cpu": ns, "estimated_added_us": est_us,
           "ratio_estimated": est_us / (b * 1e6), "bare_step_ms_p10_p90": [sorted(bare)[len(bare) // 10] * 1e3,
                                                                             sorted(bare)[len(bare) * 9 // 10] * 1e3]}
    print(f"GPU {fig['gpu']}, torch {fig['torch']} (CUDA {fig['cuda']}), Python {fig['python']}")
    print(f"eager K3 decode step at one TP8 rank, batch {a.batch}: {calls_per_step} entry calls "
          f"(KDA: {kda_what}; MLA, MoE: stand-in GEMMs); {len(bare)} bare and {len(wrapped)} wrapped steps, "
          f"alternating in {a.rounds} rounds")
    print(f"bare step (median):     {fig['bare_step_ms']:.3f} ms  (p10 {fig['bare_step_ms_p10_p90'][0]:.3f}, "
          f"p90 {fig['bare_step_ms_p10_p90'][1]:.3f})")
    print(f"wrapped step (median):  {fig['wrapped_step_ms']:.3f} ms")
    print(f"difference:             {fig['difference_us']:+.1f} us per step -> ratio {100 * fig['ratio_measured']:+.2f}%")
    print(f"wrapper cost on this CPU: {ns:.1f} ns per call x {calls_per_step} = {est_us:.1f} us per step -> "
          f"{100 * fig['ratio_estimated']:.2f}% of the bare step")
    if a.json:
        Path(a.json).write_text(json.dumps(fig, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
