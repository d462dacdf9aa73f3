"""The ``smetric`` command line: a thin shell over the trace layer, simulator and reports.

Each command lives in a module of its own, imported only when the command is used
(``app.COMMANDS``), so that the command line starts fast.
"""

from smetric.cli.app import app

__all__ = ["app"]
