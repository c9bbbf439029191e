"""cost_models.units: memory sizes in, human units out."""

from __future__ import annotations

import pytest

from cost_models.errors import InvalidArgument
from cost_models.units import format_bytes, format_flops, parse_mem_bytes


@pytest.mark.parametrize(("text", "nbytes"), [
    ("16GB", 16 * 2**30), ("16GiB", 16 * 2**30), ("16 gb", 16 * 2**30), ("512MB", 512 * 2**20),
    ("1.5TB", int(1.5 * 2**40)), (17179869184, 17179869184), ("4096", 4096), ("1k", 1024),
])
def test_parse_mem_bytes(text, nbytes: int) -> None:
    assert parse_mem_bytes(text) == nbytes


@pytest.mark.parametrize("text", ["", "sixteen", "16XB", "-1GB", "0", 0, True])
def test_bad_memory_sizes_are_rejected_with_the_value(text) -> None:
    with pytest.raises(InvalidArgument, match="memory size"):
        parse_mem_bytes(text)


def test_formatting() -> None:
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(100) == "100 B"
    assert format_flops(3.1e12) == "3.10 T"


def test_a_unit_can_be_required() -> None:
    assert parse_mem_bytes("16B", unit_required=True) == 16
    assert parse_mem_bytes(16, unit_required=True) == 16  # an int is bytes: only text needs a unit
    with pytest.raises(InvalidArgument, match="'16' has no unit; write it with one of B, KB"):
        parse_mem_bytes("16", unit_required=True)


@pytest.mark.parametrize(("text", "usable"), [("5%", 2**30 - 53687092), ("256MB", 768 * 2**20), ("0", 2**30)])
def test_a_reserve_is_a_share_or_a_size_and_mem_for_inverts_it(text: str, usable: int) -> None:
    from planner.budget import parse_reserve, usable_bytes

    reserve = parse_reserve(text)
    assert usable_bytes(2**30, reserve) == usable
    assert reserve.mem_for(usable) == 2**30
    assert usable_bytes(reserve.mem_for(usable + 1), reserve) >= usable + 1


@pytest.mark.parametrize(("text", "said"), [("150%", "got 150%;"), ("-5%", "got -5%;")])
def test_a_reserve_out_of_range_names_what_was_given_and_the_fix(text: str, said: str) -> None:
    from planner.budget import parse_reserve

    with pytest.raises(InvalidArgument) as refused:
        parse_reserve(text)
    assert said in str(refused.value) and "give e.g. --reserve 5%" in str(refused.value)
    assert "0 bytes" not in str(refused.value)


@pytest.mark.parametrize(("nbytes", "shown"), [
    (int(1.21 * 2**30), "1.3 GiB"), (int(1.2 * 2**30), "1.2 GiB"), (1023, "1023 B"), (3 * 2**20, "3.0 MiB"),
])
def test_a_size_given_as_enough_is_rounded_up(nbytes: float, shown: str) -> None:
    """'Give mem >= 12.7 GiB' for 12.74 GiB: the size shown refused again."""
    assert format_bytes(nbytes, at_least=True) == shown
    assert parse_mem_bytes(shown.replace(" ", "").replace("i", "")) >= nbytes - 0.5
