"""Training frameworks that own the loop (Lightning Trainer and Fabric)."""
