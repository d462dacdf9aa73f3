"""The ``smetric`` command line: a thin shell over the trace layer, simulator and reports."""

from smetric.cli import analyze, serve, simulate, trace
from smetric.cli.app import app

__all__ = ["analyze", "app", "serve", "simulate", "trace"]
