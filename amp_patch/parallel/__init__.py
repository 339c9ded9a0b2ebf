"""Data parallelism: DDP (rank-consistent skipping, broadcasts) and FSDP2 (O2 through MixedPrecisionPolicy)."""
