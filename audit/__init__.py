"""serving-truth host side: pins, runtimes, evidence, routing and ledgers. Never imports vLLM."""

__version__ = "0.1.0"
