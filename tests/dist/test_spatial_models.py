"""A ResNet stem with its first stage and an AmoebaNet cell, tiled 4 ways, equal one process; fused halos too."""

from __future__ import annotations

import pytest

from tests.dist.harness import run_ranks
from tests.dist.spatial_cases import check_models

pytestmark = pytest.mark.dist


@pytest.mark.timeout(300)
def test_resnet_stem_and_amoebanet_cell_on_four_ranks() -> None:
    results = run_ranks(check_models, 4, ("square", "vertical", "horizontal"), timeout_s=240)
    for rank, (checked, failures) in enumerate(results):
        assert failures == [], f"rank {rank}: {len(failures)} mismatches, first: {failures[:5]}"
        # 3 slicings x 3 models x (per-layer, fused) x every parameter grad and buffer: over a thousand
        assert checked >= 1000, f"rank {rank} ran only {checked} checks"
