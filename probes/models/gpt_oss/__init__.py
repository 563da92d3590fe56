"""gpt-oss's probes, as data: vLLM's attention layer as a scope (so each backend choice is attributed to the layer
it is made for: gpt-oss alternates sliding-window and full attention, both with sinks) and vLLM's gpt-oss MXFP4 MoE
quant method. Standard library only."""
from __future__ import annotations

from probes.core.targets import Target

TARGETS: tuple[Target, ...] = (
    Target("scope.attention", "scope", ("vllm.model_executor.layers.attention.attention:Attention.__init__",
                                        "vllm.attention.layer:Attention.__init__"),
           args=("prefix",), construct=True, title="attention layer"),
    Target("moe.gpt_oss_quant_method", "construct",
           ("vllm.model_executor.layers.quantization.mxfp4:GptOssMxfp4MoEMethod.__init__",),
           title="gpt-oss MXFP4 MoE quant method", required=False),
)
