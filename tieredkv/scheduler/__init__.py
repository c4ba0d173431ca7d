"""The scheduler side's decisions: lookup, the job ledger, placement, tier indexes, policies."""
