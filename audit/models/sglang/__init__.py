"""The models audited on SGLang (``audit/engines``: the second engine), one profile each, in SGLang's own flags,
module classes and record targets (``probes/engines/sglang``). Registered with the shared registry
(:mod:`audit.models`) under the engine's name."""
from __future__ import annotations

from audit.models.sglang.kimi_k3 import KIMI_K3

#: engine name -> its profiles by model name
PROFILES = {"sglang": {p.name: p for p in (KIMI_K3,)}}
