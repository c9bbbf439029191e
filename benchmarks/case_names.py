"""The command line of a benchmark that runs named cases: the names given (default: all), each checked."""

from __future__ import annotations

import argparse
from collections.abc import Iterable


def case_names(description: str, cases: Iterable[str]) -> list[str]:
    """The case names on the command line (none: every case is run), or a usage error naming the known ones."""
    known = list(cases)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"cases to run (default: all): {', '.join(known)}")
    names = parser.parse_args().names
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"unknown case {', '.join(unknown)}; choose from {', '.join(known)}")
    return names
