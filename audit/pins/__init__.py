"""Pins: images.lock, the registry that resolves image references, and vLLM's wheel indexes."""
