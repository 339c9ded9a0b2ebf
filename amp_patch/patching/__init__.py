"""Patch sites: finding, resolving and exactly undoing attribute patches; early-bound references."""
