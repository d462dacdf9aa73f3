"""Cluster simulator: event loop, engine instances, KV tiers and the step-time model."""
