"""Probes that train (placeholder, filled below)."""
