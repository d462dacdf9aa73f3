"""Helpers for driving real engines from tests and benchmarks (not used by the router)."""
