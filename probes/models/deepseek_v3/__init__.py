"""DeepSeek-V3's probes, as data: its layer scopes (decoder layer, MoE block, dense MLP) and vLLM's shared MLA
attention layer as a scope, so each attention backend choice is attributed to its layer. Its FP8 block-quantized
experts go through vLLM's FP8 MoE oracle, whose probes are the FP8 scheme's (``probes/schemes/fp8_block.py``).
Standard library only."""
from __future__ import annotations

from probes.core.targets import Target

DS = "vllm.model_executor.models.deepseek_v2:"

TARGETS: tuple[Target, ...] = (
    Target("scope.decoder_layer", "scope", (DS + "DeepseekV2DecoderLayer.__init__",), args=("prefix",),
           title="decoder layer"),
    Target("scope.moe_block", "scope", (DS + "DeepseekV2MoE.__init__",), args=("prefix",), construct=True,
           title="MoE block (routed + shared experts)"),
    Target("scope.mlp", "scope", (DS + "DeepseekV2MLP.__init__",), args=("prefix",), construct=True,
           title="dense / shared-expert MLP", required=False),
    Target("scope.mla", "scope", ("vllm.model_executor.layers.attention.mla_attention:MLAAttention.__init__",),
           args=("prefix",), construct=True, title="MLA attention layer"),
)
