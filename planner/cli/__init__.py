"""The ``tessera`` command line (console script ``tessera``, also ``python -m planner``)."""

from planner.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
