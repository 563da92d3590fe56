"""SGLang's probes: resolve mode runs SGLang's own server-argument resolution and model construction for each
(system, layout) cell under a simulated GPU, and records what SGLang decided, with SGLang's own record of who
decided it (its declaration stash: ``sglang.srt.arg_groups.overrides``).

* :mod:`.agent` is the process layout (``python -m probes.engines.sglang.agent PLAN.json``);
* :mod:`.cell` runs one cell's stages and reads SGLang's decisions;
* :mod:`.platform` holds the device stand-ins SGLang needs beyond the shared torch ones.

Standard library only at import; SGLang and torch are imported inside the cell's process.
"""
