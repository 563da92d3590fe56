"""Model profiles: what to audit for a model, as data.

A profile names the model's config (shipped as package data, no weights), the modules worth
importing once per SM, and the *lanes* the ledger reports: for each lane, which evidence records
(by probe target id) carry its answer per layer. A new model is a new profile, not new code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path


@dataclass(frozen=True)
class Source:
    """Where a lane's per-layer answer comes from.

    ``kind``/``target`` select records (for ``module`` records, ``target`` is a regular expression
    on the module name); ``fields`` are ``result`` (a selector's return value), ``attrs.<name>``
    (what a constructed object chose), ``facts.<name>`` (read off the built module) or ``cls``.
    ``postload`` sources read the post-load stage's records; ``target`` names the reading
    (``audit.report.routing.POSTLOAD_READINGS``) and ``fields`` are unused.
    """

    kind: str
    target: str
    fields: tuple[str, ...]
    label: str = ""
    #: fields kept in routing.json (``raw``) but not shown, e.g. the quant method class for labels
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lane:
    id: str
    title: str
    layer_kind: str  # which layers it applies to: moe, kda, mla, dense
    phase: str  # prefill / decode / spec-verify / all
    sources: tuple[Source, ...]
    #: evidence kinds whose records in a layer are this lane's candidates
    candidates_target: str = ""
    #: (field, why): the phase only happens when this field of the source record is truthy
    exercised_if: tuple[str, str] | None = None
    #: how far the simulation must go for this lane's answer: construction or post-load
    level: str = "construction"


@dataclass(frozen=True)
class Slice:
    """A served subset of the model for observe mode: fewer layers, every kept layer unchanged.

    ``patch`` is applied to the published config like a layout's; ``cut`` is what the ledger says
    was left out. Per-layer shapes and per-rank head counts are the published ones."""
    name: str
    layers: int
    patch: tuple[tuple[str, object], ...]
    kept: str
    cut: str


@dataclass(frozen=True)
class Profile:
    name: str
    title: str
    architecture: str
    config_package_path: str  # inside audit/data
    warm_imports: tuple[str, ...]
    lanes: tuple[Lane, ...]
    #: class qualname suffix -> layer kind, read from scope records (what vLLM actually built)
    layer_classes: dict[str, str] = field(default_factory=dict)
    #: observe-mode slices by name (the full model needs no slice)
    slices: dict[str, Slice] = field(default_factory=dict)
    #: checkpoint weight names the speculative draft's ``load_weights`` must see to accept the checkpoint
    #: (``{layer}``: each of the draft's layer indices). Post-load feeds it one meta tensor per name, of the
    #: shape of the parameter it loads into, so vLLM's presence check passes; a real checkpoint must hold them.
    draft_weights: tuple[str, ...] = ()

    def config_text(self) -> str:
        return resources.files("audit").joinpath("data", self.config_package_path).read_text(encoding="utf-8")

    def write_model_dir(self, directory: Path, patch: tuple = ()) -> Path:
        """A model directory holding only config.json (weights are dummy; nothing is downloaded).

        ``patch`` applies (dotted key, value) changes a layout declares, e.g. an MTP layer count.
        """
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "config.json"
        text = self.config_text()
        data = json.loads(text)  # fail early on a damaged package
        if patch:
            for key, value in patch:
                node = data
                *parents, leaf = key.split(".")
                for part in parents:
                    node = node[part]
                if leaf not in node:
                    raise KeyError(f"config patch {key!r}: no such key in {self.config_package_path}")
                node[leaf] = value
            text = json.dumps(data, indent=2, sort_keys=False) + "\n"
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
        return directory


KIMI_K3 = Profile(
    name="kimi-k3",
    title="Kimi-K3",
    architecture="KimiK3ForConditionalGeneration",
    config_package_path="kimi-k3/config.json",
    warm_imports=(
        "vllm.config",
        "vllm.engine.arg_utils",
        "vllm.model_executor.model_loader",
        "vllm.models.kimi_k3",
    ),
    layer_classes={
        "KimiK3DeltaAttention": "kda",
        "MultiHeadLatentAttention": "mla",
        "KimiMoE": "moe",
        "KimiMLP@mlp": "dense",
        "KimiK3MultiTokenPredictorLayer": "mtp",
    },
    draft_weights=("model.layers.{layer}.enorm.weight",),
    lanes=(
        Lane("moe", "Routed experts", "moe", "all", (
            Source("construct", "moe.quant_method", ("attrs.mxfp4_backend", "attrs.experts_cls"), extra=("cls",)),
            Source("construct", "moe.mega_moe_experts", ("cls",), label="MegaMoE"),
        ), candidates_target="moe.candidate"),
        Lane("kda.prefill", "KDA prefill", "kda", "prefill", (Source("select", "kda.prefill", ("result",)),)),
        Lane("kda.decode", "KDA decode", "kda", "decode", (
            Source("select", "kda.decode", ("result",)),
            Source("select", "kda.decode_fused_check", ("result",), label="fused decode kernel supported:"),
            Source("construct", "scope.kda", ("attrs.kda_decode_backend",)),
        )),
        Lane("kda.spec_verify", "KDA spec-verify", "kda", "spec-verify", (
            Source("select", "kda.spec_decode", ("result",)),
        ), exercised_if=("args.num_spec", "no speculative decoding in this layout (num_spec=0)")),
        Lane("mla.decode", "MLA attention (decode)", "mla", "decode", (
            Source("construct", "scope.mla", ("attrs.attn_backend", "attrs.impl")),
        )),
        Lane("mla.prefill", "MLA prefill", "mla", "prefill", (
            Source("construct", "scope.mla", ("attrs.prefill_backend",)),
        )),
        Lane("dense", "Dense MLP linears (layer 0)", "dense", "all", (
            Source("module", r"\.mlp\.(gate_up_proj|down_proj)$", ("facts.quant_method",)),
        )),
        Lane("shared", "Shared-expert linears", "moe", "all", (
            Source("module", r"\.shared_experts\.(gate_up_proj|down_proj)$", ("facts.quant_method",)),
        )),
        Lane("moe.kernel", "MoE kernel built at load", "moe", "all", (Source("postload", "moe_kernel", ()),),
             level="post-load"),
        Lane("moe.activation", "Experts activation (SiTU check)", "moe", "all",
             (Source("postload", "activation", ()),), level="post-load"),
        Lane("moe.tail_fusion", "Latent-MoE tail fusion", "moe", "all", (Source("postload", "tail_fusion", ()),),
             level="post-load"),
        Lane("moe.deferred_finalize", "Deferred MoE finalize", "moe", "all",
             (Source("postload", "deferred_finalize", ()),), level="post-load"),
        Lane("decode.specialized", "Specialized decode (decode_backend)", "model", "decode",
             (Source("postload", "specialized_decode", ()),), level="post-load"),
    ),
)

_K3_LAYERS = "text_config.num_hidden_layers"
_K3_KDA = "text_config.linear_attn_config.kda_layers"
_K3_FULL = "text_config.linear_attn_config.full_attn_layers"
KIMI_K3.slices.update({
    "slice4": Slice("slice4", 4, ((_K3_LAYERS, 4), (_K3_KDA, [1, 2, 3]), (_K3_FULL, [4])),
                    kept="layers 0-3: 0 (KDA, dense MLP), 1-2 (KDA, latent MoE), 3 (MLA, latent MoE)",
                    cut="layers 4-92 (66 KDA, 23 MLA, 89 MoE layers of the same shapes as the kept ones)"),
    "slice8": Slice("slice8", 8, ((_K3_LAYERS, 8), (_K3_KDA, [1, 2, 3, 5, 6, 7]), (_K3_FULL, [4, 8])),
                    kept="layers 0-7: 0 (KDA, dense MLP), 1-2 and 4-6 (KDA, latent MoE), 3 and 7 (MLA, latent MoE)",
                    cut="layers 8-92 (63 KDA, 22 MLA, 85 MoE layers of the same shapes as the kept ones)"),
})

PROFILES = {p.name: p for p in (KIMI_K3,)}
