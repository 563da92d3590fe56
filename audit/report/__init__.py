"""Report building: routing from evidence, per-call dispatch, verdicts against claims, labels, the ledger and the diff."""
