"""Human-readable units for bytes, FLOPs and times, and parsing of memory sizes ("16GB")."""

from __future__ import annotations

import math
import re

from cost_models.errors import InvalidArgument

_MEMORY_PATTERN = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(b|[kmgt](?:i?b)?)?\s*$", re.IGNORECASE)  # MEMORY_UNITS, or "16G"
MEMORY_UNITS = ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB")
"""Units a memory size may carry ("KB" and "KiB" both mean 1024 bytes, as GPU memory is sold)."""


def parse_mem_bytes(value: str | int | float, *, unit_required: bool = False) -> int:
    """``"16GB"`` → 16 * 2**30, ``"16GiB"`` → 16 * 2**30, a number → bytes. Rejects <= 0.

    "GB" follows how GPU memory is sold (V100-16GB holds 16 GiB), so "16GB" and "16GiB" both
    mean 16 * 2**30 bytes; write a plain number (or "B") for exact bytes. With ``unit_required``
    (the command line) a bare number is an error: "--mem 16" is far more likely a slip than 16 bytes.
    """
    if isinstance(value, bool):
        raise InvalidArgument(f"memory size {value!r} is not a size; give e.g. '16GB' or 17179869184")
    if isinstance(value, (int, float)):
        nbytes = int(value)
    else:
        nbytes = _parse_mem_text(str(value), unit_required)
    if nbytes <= 0:
        raise InvalidArgument(f"memory size {value!r} must be positive; give e.g. '16GB'")
    return nbytes


def _parse_mem_text(text: str, unit_required: bool) -> int:
    match = _MEMORY_PATTERN.match(text)
    if not match:
        raise InvalidArgument(f"cannot parse memory size {text!r}; write a number with one of "
                              f"{', '.join(MEMORY_UNITS)}, e.g. '16GB', '16GiB' or '512MB'")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    if number <= 0:
        raise InvalidArgument(f"memory size {text!r} must be positive; give e.g. '16GB'")
    if unit_required and not unit:
        raise InvalidArgument(f"memory size {text!r} has no unit; write it with one of "
                              f"{', '.join(MEMORY_UNITS)}, e.g. '{match.group(1)}GB' "
                              f"('{match.group(1)}B' for bytes)")
    prefix = unit[:1] if unit and unit[0] in "kmgt" else ""
    scale = 1024 ** ("kmgt".index(prefix) + 1) if prefix else 1
    return int(number * scale)


def format_bytes(nbytes: float, *, at_least: bool = False) -> str:
    """1536 → '1.5 KiB' (binary prefixes, as memory is counted). ``at_least``: rounded up at the last digit shown,
    for a size given as enough (1.21 GiB → '1.3 GiB': '1.2 GiB' would fall short)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            digits = 0 if unit == "B" else 1
            shown = math.ceil(nbytes * 10**digits - 1e-9) / 10**digits if at_least else nbytes
            return f"{shown:.{digits}f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def format_flops(flops: float) -> str:
    """3.1e12 → '3.10 T' (decimal prefixes, as FLOPs are counted)."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(flops) >= scale:
            return f"{flops / scale:.2f} {unit}"
    return f"{flops:.0f}"


def format_count(count: float) -> str:
    """25557032 → '25.56 M'."""
    return format_flops(count)


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``plural(1, "stage")`` → '1 stage', ``plural(3, "stage")`` → '3 stages' (or ``nouns``)."""
    return f"{count} {noun}" if count == 1 else f"{count} {nouns or noun + 's'}"


def format_ms(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:.1f} ms"
