"""Full-size models trace and cost on the meta device without allocating their weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from trace_cost import measure  # noqa: E402  (the benchmark's subprocess runner)

GIB_MIB = 1024


@pytest.mark.slow
@pytest.mark.parametrize(("name", "params"), [("gpt_50b", 50_355_707_904),
                                              ("resnet1001_1024", 10_327_706)])
def test_full_size_model_traces_in_under_2_gib(name: str, params: int) -> None:
    row = measure(name)
    assert row["params"] == params
    assert row["peak_rss_mib"] < 2 * GIB_MIB, row
    if name == "gpt_50b":  # 2 FLOPs per parameter per token, 1024 tokens, forward only
        assert row["fwd_tflop"] == pytest.approx(2 * params * 1024 / 1e12, rel=0.05)
