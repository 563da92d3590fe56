"""Probes of engines other than the first (vLLM's live in ``probes/resolve`` and ``probes/observe``): one package
per engine, each run inside that engine's own environment. Standard library only until a cell patches the
engine. They write the same evidence (``probes/core/recorder.py``, schema in ``audit/evidence/schema.py``) with
the same fence (``probes/core/fence.py``): a fault of the harness ends a cell INCOMPLETE, never as the engine's
decision."""
