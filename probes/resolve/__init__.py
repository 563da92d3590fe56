"""Resolve mode: vLLM's own selection code under a simulated platform, per (system, layout) cell."""
