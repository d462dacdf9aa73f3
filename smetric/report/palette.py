"""One colour per policy, in every figure the product draws.

A policy's colour is a function of its name alone, so ``simulate``, ``sweep``, ``knee``,
``reproduce``, ``grid`` and ``plan`` draw it alike whichever other policies share the
figure. Each policy of the registry has its own hue; a policy with parameters
(``linear:lam=0.3``) takes a shade of its base policy's hue, picked from the parameters,
so variants read as one family and still differ from the base.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

from matplotlib.colors import to_hex, to_rgb

# Tableau 10 without its grey, which would read as the "miss" segment of the reuse bars.
PALETTE = (
    "#2f6db5",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#b07aa1",
    "#76b7b2",
    "#edc948",
    "#9c755f",
    "#ff9da7",
)
# The project's policies first, on the most distinct hues; a name not listed here (a
# policy added later, a measured replay) hashes onto the palette.
HUES = {
    "smetric": PALETTE[0],
    "smetric_cost": PALETTE[3],
    "least_load": PALETTE[2],
    "cache_aware": PALETTE[1],
    "lmetric": PALETTE[4],
    "linear": PALETTE[7],
    "prefill_tokens": PALETTE[5],
    "round_robin": PALETTE[6],
    "session_hash": PALETTE[8],
}
# Shades of a hue for parameterised variants: towards black (negative) or white.
SHADES = (-0.45, 0.45, -0.25, 0.3, -0.6, 0.6, -0.15, 0.15)


def _stable(text: str) -> int:
    return zlib.crc32(text.encode())


def _shade(color: str, amount: float) -> str:
    target = 0.0 if amount < 0 else 1.0
    red, green, blue = (c + (target - c) * abs(amount) for c in to_rgb(color))
    return to_hex((red, green, blue))


def _candidates(spec: str) -> list[str]:
    """The colours ``spec`` may take, its own first, then what a clash falls back to."""
    base, _, params = spec.partition(":")
    base = base.strip()
    hue = HUES.get(base, PALETTE[_stable(base) % len(PALETTE)])
    start = _stable(params.strip()) % len(SHADES)
    shades = [_shade(hue, amount) for amount in SHADES[start:] + SHADES[:start]]
    others = [c for c in PALETTE if c != hue]
    return [*shades, hue, *others] if params.strip() else [hue, *others, *shades]


def policy_color(spec: str) -> str:
    """The colour of policy ``spec`` (``name`` or ``name:key=value,...``)."""
    return _candidates(spec)[0]


def policy_colors(policies: Iterable[str]) -> dict[str, str]:
    """Each policy's colour for one figure: ``policy_color``, unless two variants of one
    base policy would share a shade, when the later takes its next shade."""
    taken: set[str] = set()
    colors = {}
    for spec in dict.fromkeys(policies):
        options = _candidates(spec)
        chosen = next((c for c in options if c not in taken), options[0])
        colors[spec] = chosen
        taken.add(chosen)
    return colors
