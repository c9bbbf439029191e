"""Mixed precision (fp16, bf16) on 2 CPU ranks equals the single-process mixed-precision loop exactly.

Exactly, not within a tolerance: the ranks run the same 16-bit operations in the same order as
the reference (tests/dist/precision_cases.py), each child and the reference on one thread (CPU
reductions such as LayerNorm's weight gradient are split by thread count). The only float64
arithmetic that differs in order is the reported mean loss (summed per rank, then across ranks),
hence its 1e-12 relative tolerance; the losses themselves are fp32 values.

GPT in 2 stages under GPipe and 1F1B, and in 1 stage x 2 replicas; fp16 starts at GradScaler's
scale 2**16, which overflows the first step's fp16 gradients, so every fp16 case also checks a
skipped step and the backoff. Also: an inf injected into one rank's gradient skips the step on
both ranks; the scale grows after ``growth_interval`` good steps; a resumed run continues exactly;
model state is 2 + 4 bytes a parameter plus fp32 optimizer state.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cost_models.memory import Optimizer, Precision, model_state_bytes
from planner.plan import OffloadSpec, ParamTier, StateTier
from tests.dist.harness import run_ranks
from tests.dist.precision_cases import MixedCase, MixedOutcome, mixed_reference, run_mixed_cases
from tests.runtime_plans import GPT, make_plan

pytestmark = pytest.mark.dist

LOSS_RTOL = 1e-12  # float64 sums in another order (see the module docstring)
CUT = ["blocks_1_ln_1"]
STAGE_0_ONLY = "blocks.0.mlp.fc.weight"  # not tied: only rank 0 (stage 0) holds it


def _plan(precision: str, schedule: str, *, replicas: int = 1, offload: list[OffloadSpec] | None = None) -> str:
    return make_plan(GPT, [] if replicas > 1 else CUT, schedule=schedule, precision=precision,
                     data_parallel=replicas, microbatches=4 // replicas, device="A100-40GB", offload=offload)


def _check(case: MixedCase, by_rank: list[MixedOutcome]) -> MixedOutcome:
    import torch

    torch.set_num_threads(1)  # as the children run (see the module docstring)
    expected = mixed_reference(case)
    seen: set[str] = set()
    for rank, outcome in enumerate(by_rank):
        np.testing.assert_allclose(outcome.losses, expected.losses, rtol=LOSS_RTOL, err_msg=f"rank {rank} losses")
        assert outcome.scales == expected.scales, f"rank {rank} loss scales"
        assert outcome.skipped == expected.skipped, f"rank {rank} skipped steps"
        for name, master in outcome.masters.items():
            np.testing.assert_array_equal(master, expected.masters[name], err_msg=f"rank {rank} master {name}")
            np.testing.assert_array_equal(outcome.weights[name], expected.weights[name],
                                          err_msg=f"rank {rank} 16-bit weight {name}")
        seen |= set(outcome.masters)
    assert seen == set(expected.masters), f"masters on no rank: {sorted(set(expected.masters) - seen)}"
    return expected


def test_mixed_precision_pipelines_and_replicas_equal_the_single_process_loop() -> None:
    cases = [MixedCase(_plan(precision, schedule, replicas=replicas))
             for precision in ("fp16", "bf16")
             for schedule, replicas in (("gpipe", 1), ("1f1b", 1), ("gpipe", 2))]
    cases.append(MixedCase(_plan("fp16", "1f1b"), growth_interval=2))
    outcomes = run_ranks(run_mixed_cases, 2, cases, timeout_s=300)
    for index, case in enumerate(cases):
        expected = _check(case, [outcomes[rank][index] for rank in range(2)])
        if json.loads(case.plan_json)["model"]["precision"] == "fp16":
            assert expected.skipped == 1 and expected.scales[0] == 2.0 ** 15  # the first step overflows
    assert cases[-1].growth_interval == 2 and _check(cases[-1], [o[-1] for o in outcomes]).scales == [
        2.0 ** 15, 2.0 ** 15, 2.0 ** 16]  # two good steps double it
    for by_rank in outcomes:  # after a step: 16-bit weights, fp32 masters and momentum, no gradients
        for outcome in by_rank:
            assert outcome.optimizer_states == Optimizer.MOMENTUM.state_count
            for precision in (Precision.FP16, Precision.BF16):
                planned = model_state_bytes(outcome.param_numel, precision, Optimizer.MOMENTUM)
                assert outcome.model_state_bytes == planned.param_bytes + planned.optimizer_bytes


def test_an_inf_on_one_rank_skips_the_step_on_every_rank_and_halves_the_scale() -> None:
    case = MixedCase(_plan("fp16", "1f1b"), init_scale=2.0 ** 10, inf_at=(1, STAGE_0_ONLY))
    by_rank = [outcome[0] for outcome in run_ranks(run_mixed_cases, 2, [case], timeout_s=120)]
    assert STAGE_0_ONLY in by_rank[0].masters and STAGE_0_ONLY not in by_rank[1].masters
    expected = _check(case, by_rank)
    assert [outcome.skipped for outcome in by_rank] == [1, 1] == [expected.skipped] * 2
    assert [outcome.scales for outcome in by_rank] == [[2.0 ** 10, 2.0 ** 9, 2.0 ** 9]] * 2


def test_a_mixed_precision_run_resumed_from_a_checkpoint_continues_exactly(tmp_path: object) -> None:
    """Masters, momentum, the scale and its growth tracker (2 good steps double it) all come back."""
    plain = MixedCase(_plan("fp16", "gpipe"), steps=4, init_scale=2.0 ** 10, growth_interval=3)
    resumed = MixedCase(plain.plan_json, steps=4, init_scale=2.0 ** 10, growth_interval=3,
                        checkpoint_dir=str(tmp_path), resume_at=2)
    outcomes = run_ranks(run_mixed_cases, 2, [plain, resumed], timeout_s=180)
    for rank in range(2):
        first, second = outcomes[rank]
        assert first.losses == second.losses and first.scales == second.scales == [2.0 ** 10] * 2 + [2.0 ** 11] * 2
        for name, master in first.masters.items():
            np.testing.assert_array_equal(second.masters[name], master, err_msg=f"rank {rank} master {name}")
            np.testing.assert_array_equal(second.weights[name], first.weights[name], err_msg=name)
    _check(plain, [outcome[0] for outcome in outcomes])


def test_mixed_precision_with_zero_and_offloaded_optimizer_state_equals_the_single_process_loop(
        tmp_path: object) -> None:
    """The stage optimizer owns the fp32 masters on every tier: ZeRO 1/2/3 over 2 replicas, masters
    and momentum on the host or paged to NVMe, under fp16 (with its skipped first step) and bf16."""
    host, nvme = StateTier.HOST, StateTier.NVME
    cases = [MixedCase(_plan(precision, "gpipe", replicas=2, offload=[spec]), nvme_dir=str(tmp_path))
             for precision, spec in (("fp16", OffloadSpec(zero_stage=1)),
                                     ("bf16", OffloadSpec(zero_stage=2, optimizer_state=host)),
                                     ("fp16", OffloadSpec(zero_stage=3)),
                                     ("bf16", OffloadSpec(zero_stage=3, optimizer_state=nvme)),
                                     ("fp16", OffloadSpec(zero_stage=3, optimizer_state=host, params=ParamTier.HOST)),
                                     ("fp16", OffloadSpec(optimizer_state=nvme)))]
    cases.append(MixedCase(_plan("fp16", "1f1b", offload=[OffloadSpec(optimizer_state=host),
                                                          OffloadSpec(optimizer_state=nvme)]),
                           nvme_dir=str(tmp_path)))
    outcomes = run_ranks(run_mixed_cases, 2, cases, timeout_s=300)
    for index, case in enumerate(cases):
        _check(case, [outcomes[rank][index] for rank in range(2)])


def test_mixed_precision_gradients_sent_to_the_host_add_up_in_fp32() -> None:
    """With gradients sent to the host each backward, each micro-batch's 16-bit gradient is added into an fp32
    sum there, where the single-process loop adds them in 16 bits on the device (which may overflow where the
    fp32 sum does not: the scale starts low enough here for neither to). Each master's change over 3 steps is
    the loop's within its 16-bit sums' rounding (2^-6 of the change; a micro-batch's gradient left out is 25%)."""
    import dataclasses

    sent = OffloadSpec(optimizer_state=StateTier.HOST, grads_on_host=True)
    cases = [MixedCase(_plan(precision, "1f1b", offload=[sent, sent]), init_scale=2.0 ** 10)
             for precision in ("fp16", "bf16")]
    outcomes = run_ranks(run_mixed_cases, 2, cases, timeout_s=300)
    for index, case in enumerate(cases):
        expected, initial = mixed_reference(case), mixed_reference(dataclasses.replace(case, steps=0))
        for rank in range(2):
            outcome = outcomes[rank][index]
            assert (outcome.scales, outcome.skipped) == (expected.scales, 0)
            np.testing.assert_allclose(outcome.losses, expected.losses, rtol=1e-3)
            for name, master in outcome.masters.items():
                change = np.abs(expected.masters[name] - initial.masters[name]).max()
                assert np.abs(master - expected.masters[name]).max() <= 2.0 ** -6 * change, name
