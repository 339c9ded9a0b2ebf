"""Casting alongside the rest of torch: checkpoint recompute, native autocast regions, warnings, forks, modules."""
