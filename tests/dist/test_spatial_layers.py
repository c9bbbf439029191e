"""Tiled conv, pool and batch-norm layers on 2 and 4 gloo ranks equal the unpartitioned layers."""

from __future__ import annotations

import pytest

from runtime.spatial.window import window_spec
from tests.dist.harness import run_ranks
from tests.dist.spatial_cases import check_layers, layer_cases

pytestmark = pytest.mark.dist

# Per layer case and rank: output, input grad, one grad per parameter, 3 message checks (+1 for 1x1).
BATCH_NORM_CHECKS = (2 * 2 + 2 + 3 + 1) * 2 + (2 * 2 + 0 + 3 + 1) + 2
GATHER_CHECKS = 1


def _expected_checks(slicings: int) -> int:
    per_case = 0
    for case in layer_cases():
        parameters = len(list(case.make().parameters()))
        one_by_one = window_spec(case.make(), case.name).exchanges_nothing
        per_case += 2 + parameters + 3 + (1 if one_by_one else 0)
    return slicings * (per_case + BATCH_NORM_CHECKS + GATHER_CHECKS)


@pytest.mark.timeout(240)
def test_layers_on_two_ranks_vertical_and_horizontal() -> None:
    results = run_ranks(check_layers, 2, ("vertical", "horizontal"), timeout_s=180)
    for rank, (checked, failures) in enumerate(results):
        assert failures == [], f"rank {rank}: {len(failures)} mismatches, first: {failures[:5]}"
        assert checked == _expected_checks(2), f"rank {rank} ran {checked} checks"


@pytest.mark.timeout(300)
def test_layers_on_four_ranks_square_vertical_and_horizontal() -> None:
    results = run_ranks(check_layers, 4, ("square", "vertical", "horizontal"), timeout_s=240)
    for rank, (checked, failures) in enumerate(results):
        assert failures == [], f"rank {rank}: {len(failures)} mismatches, first: {failures[:5]}"
        assert checked == _expected_checks(3), f"rank {rank} ran {checked} checks"
