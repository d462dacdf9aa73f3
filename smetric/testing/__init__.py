"""Helpers for tests and benchmarks, never used by the router: driving real engines,
misbehaving engines, and the router's fault suite."""
