"""serving-truth probes: run inside the serving process (or the resolve agent).

Nothing in this package imports anything but the standard library at import time; vLLM and torch
are touched only when a probe patches them, after they have been imported by vLLM's own code.
"""

#: Version of the evidence file format written by :mod:`probes.core.recorder`.
EVIDENCE_SCHEMA = 1
