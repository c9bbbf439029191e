"""Spatial stages in the search: part 0 on P image tiles, costed from its tile and chosen by the ILP.

The ILP over a spatial problem equals a brute force over every cut and keep/recompute/swap choice,
and the pruning bound stays below every plan (parts 0 and 1 on tiles too: the ILP then also equals the brute
force, and the bound is as tight as a hand count);
a unit that cannot run on tiles is never on part 0. The search starts from data parallelism wherever the
bounds rank it, so a search cut short is no slower.
Through plan(): the halo bytes a planned tile sends equal a count by hand; spatial=False and
--no-spatial never tile; a low-resolution ResNet-50 is not tiled; a model whose first layer or image
cannot be tiled falls back to plans without tiles and says why.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from cost_models.memory import Precision
from examples.models.resnet import resnet50
from planner import plan, trace
from planner.api import validate_space
from planner.cli import main
from planner.plan import Layout, ScheduleKind, Slicing
from planner.search.configs import configurations
from planner.search.evaluate import evaluate
from planner.search.problem import LinearCost, PipelineProblem, SpatialChoice, SpatialPart, Unit
from planner.search.search import Search
from planner.search.terms import _Family, cost_model, lower_bound
from tests.unit.test_memory_tiers import _every_plan, decided_problems, ilp_equals_brute_force


def _on_tiles(draw, units: tuple[Unit, ...], tiles: int, slicing: Slicing) -> SpatialPart:
    """``units`` on ``tiles`` tiles: each costs a drawn share of its time and saved bytes there, and only the
    first (drawn) units can be tiled."""
    tiled = []
    for unit in units:
        share = draw(st.floats(0.3, 1.0))
        saved = round(unit.activation_bytes * share)
        tiled.append(dataclasses.replace(unit, fwd_ms=unit.fwd_ms * share, bwd_ms=unit.bwd_ms * share,
                                         activation_bytes=saved, offloadable_bytes=saved,
                                         input_bytes=min(saved, unit.input_bytes)))
    return SpatialPart(SpatialChoice(tiles, slicing), tuple(tiled), draw(st.integers(1, len(units) - 1)), "")


@st.composite
def spatial_problems(draw) -> PipelineProblem:
    """A decided problem of at least two parts whose part 0 runs on 2 tiles."""
    problem = draw(decided_problems().filter(lambda p: p.num_parts >= 2))
    layout = Layout.pipeline(problem.num_parts, tiles=(2,) + (1,) * (problem.num_parts - 1))
    return dataclasses.replace(problem, layout=layout, spatial=(_on_tiles(draw, problem.units, 2, Slicing.VERTICAL),))


@st.composite
def two_spatial_problems(draw) -> PipelineProblem:
    """A decided problem of at least three parts whose parts 0 and 1 run on 4 and 2 tiles (now-dl's
    ``--num-spatial-parts 4,2``), each unit there at a drawn share of its cost."""
    problem = draw(decided_problems(max_stages=4).filter(lambda p: p.num_parts >= 3))
    spatial = (_on_tiles(draw, problem.units, 4, Slicing.SQUARE), _on_tiles(draw, problem.units, 2, Slicing.VERTICAL))
    layout = Layout.pipeline(problem.num_parts, tiles=(4, 2) + (1,) * (problem.num_parts - 2))
    return dataclasses.replace(problem, layout=layout, spatial=spatial)


@settings(max_examples=40, deadline=None)
@given(spatial_problems())
def test_spatial_ilp_equals_brute_force_and_keeps_untileable_units_off_the_tiles(problem: PipelineProblem) -> None:
    result = ilp_equals_brute_force(cost_model(problem))
    if result is not None:
        assert result.cuts[0] < problem.spatial[0].tileable_units


@settings(max_examples=40, deadline=None)
@given(two_spatial_problems())
def test_two_tiled_parts_ilp_equals_brute_force_and_keeps_untileable_units_off_their_tiles(
        problem: PipelineProblem) -> None:
    result = ilp_equals_brute_force(cost_model(problem))
    if result is not None:
        assert result.cuts[0] < problem.spatial[0].tileable_units
        assert result.cuts[1] < problem.spatial[1].tileable_units


@settings(max_examples=40, deadline=None)
@given(spatial_problems())
def test_the_lower_bound_holds_for_spatial_problems(problem: PipelineProblem) -> None:
    """Part 0's cheaper tile coefficients enter the bound through its first cut (terms._Family)."""
    costs = cost_model(problem)
    bound = lower_bound(costs)
    for evaluation in _every_plan(costs):
        assert bound <= evaluation.step_ms + 1e-9


@settings(max_examples=40, deadline=None)
@given(two_spatial_problems())
def test_the_lower_bound_holds_with_two_tiled_parts(problem: PipelineProblem) -> None:
    """Parts 0 and 1 on tiles of their own: the bound splits the units among both and the rest
    (terms._Family's ``second``), and stays below every plan."""
    costs = cost_model(problem)
    bound = lower_bound(costs)
    for evaluation in _every_plan(costs):
        assert bound <= evaluation.step_ms + 1e-9


def test_the_tile_is_costed_with_its_share_and_an_untileable_unit_cannot_be_on_it() -> None:
    whole = Unit(("a",), 4.0, 8.0, 0, 0, 1000, 0, (), 0, 0, 0, 1000, 0)
    tile = dataclasses.replace(whole, fwd_ms=2.5, bwd_ms=4.5, activation_bytes=600, offloadable_bytes=600)
    free = LinearCost(0.0, 0.0)
    problem = PipelineProblem((whole, whole, whole), (10, 10), (), Layout.pipeline(2, tiles=(2, 1)),
                              ScheduleKind.GPIPE, 1, (1, 1), (free,), (free, free), 10**6,
                              spatial=(SpatialPart(SpatialChoice(2, Slicing.VERTICAL), (tile, tile, whole), 2, ""),))
    costs = cost_model(problem)
    one, two = evaluate(costs, (0,)), evaluate(costs, (1,))
    assert (one.parts[0].fwd_ms, one.parts[0].bwd_ms, two.parts[0].fwd_ms) == (2.5, 4.5, 5.0)
    assert (one.parts[1].fwd_ms, one.parts[0].activation_bytes) == (8.0, 600)  # the rest runs whole
    assert one.fits(problem.mem_bytes) and two.fits(problem.mem_bytes)
    untiled = dataclasses.replace(problem, spatial=(dataclasses.replace(problem.spatial[0], tileable_units=1),))
    assert not evaluate(cost_model(untiled), (1,)).fits(problem.mem_bytes)  # unit 1 cannot be tiled


def test_a_search_cut_short_is_no_slower_than_data_parallelism_alone() -> None:
    """ResNet-50 at 224x224 on 8 GPUs, whose data-parallel plan is 3x faster than any tiled pipeline. A search
    its time limit stops at once keeps the plan it started from (Search.seed). That plan came from the first
    configurations by bound, all tiled pipelines while their bound priced every unit at part 0's tiles: it was
    a 99 ms pipeline against data parallelism's 31 ms."""
    x = torch.empty(1, 3, 224, 224, device="meta")
    options = {"gpus": 8, "mem": "16GB", "batch_size": 64, "example_inputs": x, "device": "V100-16GB"}
    cut_short = plan(resnet50().to("meta"), time_limit_s=0.01, **options)
    alone = plan(resnet50().to("meta"), num_stages=(1,), spatial=False, **options)
    assert cut_short.predicted.step_ms <= alone.predicted.step_ms * (1 + 1e-9)


def test_the_seed_tries_data_parallelism_wherever_it_ranks() -> None:
    """Search.seed, the plan the search starts from: with every one-stage configuration ranked after all the
    others, it is still no slower than the best of their plans (each one's only partition)."""
    graph = trace(resnet50().to("meta"), torch.empty(1, 3, 224, 224, device="meta"))
    space, spec = validate_space(8, "16GB", 64, "V100-16GB", None, "adam", Precision.FP32, None, None, 60.0)
    search = Search(graph, spec, space)
    configs = search.distinct(configurations(space, len(search.costs(1)[1].units), search.tilings()))
    ranked = sorted(configs, key=search.lower_bound)  # as the search ranks them
    alone = [config for config in ranked if config.num_stages == 1 and not config.spatial]
    others = [config for config in ranked if config not in alone]
    plans = [search._kept_seed(config) for config in alone if search.fits(config)]
    best_alone = min(candidate.objective_ms for candidate in plans if candidate is not None)
    seed = search.seed(others + alone)
    assert seed is not None and seed.objective_ms <= best_alone


def test_two_tiled_parts_bound_splits_the_units_among_them() -> None:
    """Hand-computed: four units costing 1 each on part 0's tiles, 2 on part 1's and 4 on the third part.
    The largest part is at least 4 (units 0-1 | 2 | 3, or 0 | 1-2 | 3); the total at least 7 (units 0-2 on
    part 0, part 1 left empty by the relaxation, unit 3 on the rest). Each unit's cheapest coefficient alone
    would bound them at 4/3 and 4."""
    family = _Family(0.0, 3, (1.0,) * 4, (4.0,) * 4, second=(2.0,) * 4)
    assert (family.max_bound(), family.sum_bound()) == (4.0, 7.0)


class _TwoConvs(nn.Module):
    """Two 3x3 convolutions (3 -> 4 -> 4 channels) and a classifier: halos are hand-countable."""

    def __init__(self, size: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.head = nn.Linear(4 * size * size, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv2(torch.relu(self.conv1(x)))).flatten(1))


def _forced(model: nn.Module, size: int, **options) -> object:
    """A plan on 3 GPUs with 2 stages: only stage 0 on 2 tiles + 1 rank uses them all."""
    return plan(model.double(), gpus=3, mem="16GB", batch_size=4, micro_batch_sizes=(2,), num_stages=(2,),
                data_parallel=(1,), schedules=("gpipe",), precision="fp64", offload=False,
                example_inputs=torch.empty(1, 3, size, size, dtype=torch.float64), **options)


def test_the_planned_halo_bytes_equal_a_count_by_hand() -> None:
    """Vertical strips of a 16x16 image: a 3x3 convolution's tile sends its border column, 16 rows x
    C_in channels x 8 bytes x 2 samples, forward, and the same back as the gradient of the halo it
    received, except the first convolution, whose halo is of the input image (no gradient)."""
    result = _forced(_TwoConvs(), 16)
    spec = result.stages[0].spatial
    assert spec is not None and (spec.parts, spec.slicing, spec.height, spec.width) == (2, Slicing.VERTICAL, 16, 16)
    channels = {"conv1": 3, "conv2": 4}
    expected = sum((1 if name == "conv1" else 2) * 16 * channels[name] * 8 * 2 for name in channels
                   if name in result.stages[0].nodes)
    assert expected > 0
    assert spec.halo_bytes == (expected, expected)
    assert "stage 0: 2 tiles (vertical), per-layer halos, ranks 0-1" in str(result)
    assert "stage 0 on 2 tiles (vertical) bought the fit or the speed: no plan without tiles fits" in result.solver.why


def test_spatial_false_and_no_spatial_never_tile(capsys) -> None:
    assert _forced(_TwoConvs(), 16).stages[0].spatial is not None
    untiled = plan(_TwoConvs().double(), gpus=3, mem="16GB", batch_size=4, precision="fp64", offload=False,
                   spatial=False, example_inputs=torch.empty(1, 3, 16, 16, dtype=torch.float64))
    assert all(stage.spatial is None for stage in untiled.stages)
    command = ["plan", "examples/models/resnet.py:resnet50", "--model-arg", "width=4", "--input", "3x64x64",
               "--gpus", "3", "--mem", "16GB", "--batch-size", "4", "--num-stages", "2", "--data-parallel", "1",
               "--precision", "fp32", "--no-offload", "-q"]
    assert main(command) == 0
    assert "tiles (vertical)" in capsys.readouterr().out
    assert main([*command, "--no-spatial"]) != 0  # only tiles use 3 GPUs in 2 stages of 1 replica
    assert "num_stages [2] must divide gpus=3" in capsys.readouterr().err


def test_a_low_resolution_resnet_is_not_tiled() -> None:
    result = plan(resnet50(), gpus=8, mem="16GB", batch_size=64,
                  example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
    assert all(stage.spatial is None for stage in result.stages)


class _FlattenFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(3 * 16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.flatten(1))


def test_an_untileable_first_layer_or_image_falls_back_and_says_why() -> None:
    flat = plan(_FlattenFirst(), gpus=4, mem="16GB", batch_size=4, offload=False,
                example_inputs=torch.empty(1, 3, 16, 16))
    assert all(stage.spatial is None for stage in flat.stages)
    assert "no plan tiles the image: the model's first layer cannot run on" in flat.solver.why
    tiny = plan(_TwoConvs(1), gpus=4, mem="16GB", batch_size=4, offload=False,
                example_inputs=torch.empty(1, 3, 1, 1))
    assert all(stage.spatial is None for stage in tiny.stages)
    assert "no plan tiles the image: cannot split 1 pixels into 2 tiles" in tiny.solver.why
    two = plan(_TwoConvs(16), gpus=2, mem="16GB", batch_size=4, offload=False, example_inputs=torch.empty(1, 3, 16, 16))
    assert "no plan tiles the image: tiles need 3+ GPUs" in two.solver.why  # (it said nothing)


def test_two_consecutive_spatial_stages_are_planned_with_half_the_tiles_after() -> None:
    """7 GPUs in 3 stages of 1 replica: only 4 tiles, then 2, then one rank use them all (now-dl's
    --num-spatial-parts 4,2); stage 1's grid cuts the values it receives (their own size)."""
    result = plan(resnet50(width=4, num_classes=10), gpus=7, mem="16GB", batch_size=4, micro_batch_sizes=(2,),
                  num_stages=(3,), data_parallel=(1,), precision="fp32", offload=False,
                  example_inputs=torch.empty(1, 3, 64, 64, device="meta"))
    first, second = result.stages[0].spatial, result.stages[1].spatial
    assert first is not None and second is not None and result.stages[2].spatial is None
    assert (first.parts, second.parts, [len(result.layout.ranks_of(s, 0)) for s in range(3)]) == (4, 2, [4, 2, 1])
    assert (first.height, first.width) == (64, 64) and second.height == second.width < 64
    assert len(second.halo_bytes) == 2 and min(second.halo_bytes) > 0
    assert "stage 1: 2 tiles" in str(result) and "stage 1 on 2 tiles" in result.solver.why
