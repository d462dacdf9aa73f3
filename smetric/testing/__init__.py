"""Helpers for tests and benchmarks, never used by the product: driving real engines,
misbehaving engines, and the router's fault suite. They live beside the code they start
so they share its types, and stay out of the wheel: nothing else imports them."""
