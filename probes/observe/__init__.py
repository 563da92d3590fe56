"""Observe mode: kernel entries counted in the serving process on real GPUs, and their corroboration."""
