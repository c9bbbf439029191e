"""Spatial stages in 16 bits: the search tiles a bf16 or fp16 model's first stage, and the tiles train it as
well as an untiled 16-bit run does.

A 16-bit run cannot equal float64, and the tiles round in another order than one process (each sums its own
pixels' weight gradients; halos arrive as 16-bit copies), so neither can equal the other. What they must
equal is what 16-bit training gives: each parameter's fp32 master after one step is compared with the
float64 truth (the same initial weights, batch and optimizer, in one process), and the tiled run's error
(normwise, relative to the float64 update) must be at most twice the untiled run's plus 2**-7. Measured on
tests/small_cnn.py: bf16 tiled 0.25-9.0%, untiled 0.25-9.2% (conv1, under a batch-norm, is the worst in both);
fp16 0.03-4.5% and 0.03-4.0%. A wrong halo, tile or gradient sum gives errors of order 1; per-tile batch-norm
statistics instead of the image's, 3x the untiled error in fp16 (13% against 4%; within bf16's noise). The
search's plans (bf16 GPipe, fp16 1F1B: stage 0 on 2 tiles, a fused halo group) and a hand-made one with two
spatial stages re-tiling in bf16. Each tile rank's halo bytes equal the plan's prediction, half what the fp32
plan sends.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cost_models.graph.model_spec import build_model, load_builder
from planner import plan
from planner.plan import Plan, SpatialSpec
from runtime.build import rebuild_model
from runtime.weights import initialize
from tests.dist.harness import run_ranks
from tests.dist.precision_cases import SEED, MixedCase, MixedOutcome, reference_data, run_mixed_cases
from tests.runtime_plans import CNN, make_plan

pytestmark = pytest.mark.dist

LR = 0.05
INIT_SCALE = 256.0  # fp16's loss scale: no overflow in the step (GradScaler's 2**16 would skip it)


def _searched(precision: str, schedule: str) -> Plan:
    """The search's plan on 3 GPUs in 2 stages of 1 replica, which only stage 0 on 2 tiles + 1 rank can use."""
    model = build_model(load_builder(CNN), {}, "meta")
    return plan(model, gpus=3, mem="16GB", batch_size=4, micro_batch_sizes=(2,), num_stages=(2,), data_parallel=(1,),
                device="A100-40GB", schedules=(schedule,), precision=precision, optimizer="momentum", reserve=0,
                offload=False, example_inputs=torch.empty(1, 3, 64, 64, device="meta"), builder=CNN)


def _untiled(searched: Plan) -> str:
    """The same cut, precision and schedule without tiles (2 ranks)."""
    return make_plan(CNN, [searched.stages[1].nodes[0]], schedule=searched.schedule.kind.value, microbatches=2,
                     precision=searched.model.precision.value, device="A100-40GB")


def _truth(plan_json: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The initial weights and one float64 step's weights: the runtime's initialisation and batch, one process."""
    each = Plan.from_dict(json.loads(plan_json))
    model = initialize(rebuild_model(each), SEED)  # float32, as the masters start
    initial = {name: p.detach().double().numpy().copy() for name, p in model.named_parameters()}
    model = model.double()
    data, training = reference_data(each), each.training
    batch = data.samples(0, 0, training.global_batch_size)
    for microbatch in range(training.num_microbatches):
        rows = slice(microbatch * training.micro_batch_size, (microbatch + 1) * training.micro_batch_size)
        loss = data.task(model(batch.inputs[0][rows].double()), batch.targets[rows])
        (loss / training.num_microbatches).backward()
    return initial, {name: initial[name] - LR * p.grad.numpy() for name, p in model.named_parameters()}


def _masters(by_rank: list[MixedOutcome], tiles: int = 0) -> dict[str, np.ndarray]:
    """Every rank's masters; the first ``tiles`` ranks (one stage's tiles) must hold the same."""
    for outcome in by_rank[1:tiles]:
        for name, master in outcome.masters.items():
            np.testing.assert_array_equal(master, by_rank[0].masters[name], err_msg=f"tile masters {name}")
    found: dict[str, np.ndarray] = {}
    for outcome in by_rank:
        found.update(outcome.masters)
    return found


def _check_as_accurate(tiled_ranks: list[MixedOutcome], untiled_ranks: list[MixedOutcome], tiles: int,
                       untiled_json: str, precision: str) -> None:
    """Each parameter's master after the step is within twice the untiled run's error of float64, plus 2**-7."""
    tiled, plain = _masters(tiled_ranks, tiles), _masters(untiled_ranks)
    initial, exact = _truth(untiled_json)
    assert set(tiled) == set(plain) == set(exact)
    for name in exact:
        update = np.linalg.norm(exact[name] - initial[name])
        tiled_error = np.linalg.norm(tiled[name] - exact[name]) / update
        plain_error = np.linalg.norm(plain[name] - exact[name]) / update
        assert tiled_error <= 2 * plain_error + 2 ** -7, (
            f"{name}: the tiled {precision} step is {tiled_error:.2e} off float64, the untiled one {plain_error:.2e}")


def _run(plan_json: str, ranks: int) -> list[MixedOutcome]:
    return [outcome for (outcome,) in run_ranks(run_mixed_cases, ranks, [
        MixedCase(plan_json, steps=1, lr=LR, init_scale=INIT_SCALE)], timeout_s=240)]


@pytest.mark.parametrize(("precision", "schedule"), [("bf16", "gpipe"), ("fp16", "1f1b")])
def test_16_bit_tiles_the_search_chose_train_as_well_as_an_untiled_16_bit_run(precision: str, schedule: str) -> None:
    searched = _searched(precision, schedule)
    spatial = searched.stages[0].spatial
    assert spatial is not None and spatial.parts == 2, "the search should tile stage 0 (3 GPUs, 2 stages)"
    fp32 = _searched("fp32", schedule).stages[0].spatial
    assert fp32 is not None and spatial.halo_bytes == tuple(count // 2 for count in fp32.halo_bytes)
    untiled = _untiled(searched)
    by_rank = _run(searched.to_json(), 3)
    assert [outcome.skipped for outcome in by_rank] == [0, 0, 0]
    assert [outcome.halo_bytes_sent for outcome in by_rank] == [
        count * searched.training.num_microbatches for count in spatial.halo_bytes] + [0]
    _check_as_accurate(by_rank, _run(untiled, 2), 2, untiled, precision)


def test_16_bit_tiles_retiled_onto_a_second_spatial_stage_train_as_well_as_an_untiled_16_bit_run() -> None:
    """Stage 0 (conv1, bn1, relu1) on 2 horizontal strips, stage 1 (the pool and conv2) on 2 vertical ones: what
    crosses between them is re-tiled in bf16 (5 ranks)."""
    cut = ["pool", "conv3"]
    spatial = {0: SpatialSpec(2, "horizontal", "per-layer", height=64, width=64),
               1: SpatialSpec(2, "vertical", "per-layer", height=64, width=64)}
    common = {"schedule": "1f1b", "microbatches": 2, "precision": "bf16", "device": "A100-40GB"}
    tiled, untiled = make_plan(CNN, cut, spatial=spatial, **common), make_plan(CNN, cut, **common)
    _check_as_accurate(_run(tiled, 5), _run(untiled, 3), 2, untiled, "bf16")
