"""Fused halo groups in the planner (cost_models.fused): the region walk the runtime shares equals the
independent chain walk on chains of windows; the chosen groups are the fastest segmentation (against
a brute force over every one); fusing is not chosen where messages are cheap; and a plan records
its groups, which the runtime's checks accept.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cost_models.comm import p2p_link, ring_allreduce_coefficients
from cost_models.devices import get_device
from cost_models.errors import SpatialError
from cost_models.fused import MAX_GROUP_BLOCKS, FusedHalos
from cost_models.graph.tracing import trace
from cost_models.halo import (
    GroupNode,
    Region,
    Window,
    balanced_edges,
    chain_needed_regions,
    group_needed_regions,
    output_edges,
    tile_region,
)
from cost_models.memory import Optimizer, get_precision
from cost_models.spatial import Grid, tile_costs, tile_geometry
from examples.models.resnet import resnet50
from planner import plan
from planner.plan import HaloMode, ScheduleKind
from planner.search.configs import SearchSpace
from planner.search.search import Search
from tests.runtime_plans import latency_bound_device


@st.composite
def window_chains(draw) -> tuple[Grid, list[tuple[Window, Window]]]:
    """A grid of 2-4 tiles over a 24-40 pixel image and 1-4 window layers that keep every tile non-empty."""
    rows, cols = draw(st.sampled_from([(1, 2), (2, 1), (2, 2), (1, 4), (4, 1)]))
    height, width = draw(st.integers(24, 40)), draw(st.integers(24, 40))
    grid = Grid(balanced_edges(height, rows), balanced_edges(width, cols))
    chain, last = [], grid
    for _ in range(draw(st.integers(1, 4))):
        kernel = draw(st.sampled_from([1, 3, 5]))
        stride = draw(st.sampled_from([1, 1, 2]))
        window = Window(kernel, stride=stride, padding=kernel // 2)
        try:  # a layer that would leave a tile without output pixels ends the chain
            last = Grid(output_edges(last.row_edges, window), output_edges(last.col_edges, window))
        except SpatialError:
            break
        chain.append((window, window))
    assume(chain)
    return grid, chain


@settings(max_examples=60, deadline=None)
@given(window_chains())
def test_the_group_walk_equals_the_chain_walk_on_chains_of_windows(case) -> None:
    grid, chain = case
    grids = [grid]
    for windows in chain:
        grids.append(Grid(output_edges(grids[-1].row_edges, windows[0]),
                          output_edges(grids[-1].col_edges, windows[1])))
    nodes = [GroupNode(f"l{i}", (f"l{i - 1}" if i else "x",), windows) for i, windows in enumerate(chain)]
    level = {"x": 0, **{f"l{i}": i + 1 for i in range(len(chain))}}
    expected = chain_needed_regions(grid, chain)
    for rank in range(grid.parts):
        needed = group_needed_regions(
            nodes, [f"l{len(chain) - 1}"], lambda name, r=rank: tile_region(grids[level[name]], r),
            lambda name: Region(0, grids[level[name]].row_edges[-1], 0, grids[level[name]].col_edges[-1]))
        assert needed["x"] == expected[rank]


def _search(device) -> tuple[Search, FusedHalos]:
    model = resnet50(width=4, num_classes=10, device="meta")
    graph = trace(model, torch.empty(1, 3, 64, 64, device="meta"))
    space = SearchSpace(gpus=3, gpus_per_node=3, mem_bytes=16 * 2**30, global_batch_size=4,
                        optimizer=Optimizer.MOMENTUM, precision=get_precision("fp32"),
                        schedules=(ScheduleKind.GPIPE,), offload=frozenset())
    search = Search(graph, device, space)
    return search, FusedHalos(graph, tile_geometry(graph, 1, 2))


@pytest.mark.parametrize("device", [latency_bound_device(), get_device("V100-16GB")],
                         ids=["latency-bound", "v100"])
def test_the_chosen_groups_are_the_fastest_segmentation(device) -> None:
    """Brute force: every set of disjoint groups over the first units' single-value cuts."""
    search, fused = _search(device)
    table, coarse = search.costs(2)
    units = [unit.nodes for unit in coarse.units][:24]
    link = p2p_link(device, same_node=True)
    allreduce = ring_allreduce_coefficients(2, link)
    per_layer = tile_costs(fused.geometry, table, link, allreduce)
    chosen = fused.choose(units, table, link, allreduce, per_layer)

    def total(groups) -> float:
        grouped = {name for group in groups for name in group.nodes}
        return sum(group.step_ms for group in groups) + sum(
            per_layer[name].fwd_ms + per_layer[name].bwd_ms for unit in units for name in unit
            if name in per_layer and name not in grouped)

    cuts = fused._single_value_cuts(units)
    spans = [(a, b) for i, a in enumerate(cuts) for b in cuts[i + 1:i + 1 + MAX_GROUP_BLOCKS]]
    groups = {span: fused.group([n for unit in units[span[0]:span[1]] for n in unit], table, link, allreduce)
              for span in spans}
    best = total(())
    for count in range(1, 4):
        for picked in itertools.combinations([span for span in spans if groups[span] is not None], count):
            if all(a[1] <= b[0] for a, b in itertools.pairwise(sorted(picked))):
                best = min(best, total([groups[span] for span in picked]))
    assert total(chosen) == pytest.approx(best, rel=1e-9)
    assert chosen or device.intra_node.latency_us < 100, "100 us per message: fusing should pay"


def test_a_plan_records_its_fused_groups_whole_units_and_every_halo_byte() -> None:
    model = resnet50(width=4, num_classes=10, device="meta")
    result = plan(model, 3, "16GB", batch_size=4, micro_batch_sizes=(2,), num_stages=(2,), data_parallel=(1,),
                  schedules=("gpipe",), precision="fp32", optimizer="momentum", reserve=0, offload=False,
                  device=latency_bound_device(), example_inputs=torch.empty(1, 3, 64, 64, device="meta"))
    spatial = result.stages[0].spatial
    assert spatial is not None and spatial.halo is HaloMode.FUSED and spatial.fused_groups
    nodes = result.stages[0].nodes
    for group in spatial.fused_groups:
        start = nodes.index(group[0])
        assert tuple(nodes[start:start + len(group)]) == group, "a group is a run of the stage's nodes"
    assert "fused halos" in str(result)
