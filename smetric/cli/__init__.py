"""The ``smetric`` command line: a thin shell over the trace layer, simulator and reports."""

from smetric.cli import (
    analyze,
    demo,
    engine,
    grid,
    knee,
    model,
    pick,
    plan,
    replay,
    report,
    reproduce,
    serve,
    simulate,
    trace,
)
from smetric.cli.app import app

__all__ = [
    "analyze",
    "app",
    "demo",
    "engine",
    "grid",
    "knee",
    "model",
    "pick",
    "plan",
    "replay",
    "report",
    "reproduce",
    "serve",
    "simulate",
    "trace",
]
