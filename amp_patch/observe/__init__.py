"""Observability: the overflow diagnosis and the per-op trace (history lives with the session)."""
