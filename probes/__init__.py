"""serving-truth probes: run inside the serving process (or the resolve agent).

Nothing in this package imports anything but the standard library at import time; vLLM and torch
are touched only when a probe patches them, after they have been imported by vLLM's own code.
"""

#: Version of the evidence file format written by :mod:`probes.core.recorder`. 2: a process's last write ends
#: with a closing record (the number of records and the sha256 of the lines before it).
EVIDENCE_SCHEMA = 3
