"""Probes on a real model (placeholder, filled below)."""
