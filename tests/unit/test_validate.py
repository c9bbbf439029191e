"""`tessera validate`: per-rank checks of a plan against a doctored run report, the worst marked,
and the exit status under --tolerance (no processes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost_models.units import format_bytes
from planner.cli import main
from planner.plan import Plan, SpatialSpec
from planner.reports.compare import (
    WORST_MARK,
    checks,
    compare,
    predicted_halo_bytes,
    predicted_p2p_bytes,
    verdict,
)
from planner.reports.run_report import RunReport
from tests.runtime_plans import GPT, RESNET, make_plan


@pytest.fixture(scope="module")
def plan() -> Plan:
    return Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b")))


def _measured(plan: Plan, peak_scale: float = 1.0, rank_1_step_scale: float = 1.0) -> RunReport:
    """A report measuring exactly what the plan predicts, but rank 1's peak memory and step time
    scaled (the first step of each rank is the warm-up, excluded, so it is made wildly off)."""
    step = plan.predicted.step_ms
    peaks = list(plan.predicted.peak_mem_bytes)
    peaks[1] = round(peaks[1] * peak_scale)
    return RunReport(plan.model.fingerprint, 2, "cpu", plan.training.global_batch_size, 0,
                     (step * 9, step, step), (3.0, 2.9, 2.8), tuple(peaks), "test",
                     rank_step_ms=((step * 9, step, step), (step * 9, step * rank_1_step_scale, step)))


def test_errors_are_per_rank_in_percent_and_the_worst_is_marked(plan: Plan) -> None:
    measured = _measured(plan, peak_scale=1.25, rank_1_step_scale=1.5)
    found = {check.label: check for check in checks(plan, measured)}
    assert set(found) == {"step time (slowest rank)", "samples/s", "rank 0 step time", "rank 0 peak memory",
                          "rank 1 step time", "rank 1 peak memory"}
    assert found["rank 1 step time"].error_pct == pytest.approx(25.0)  # median of 1.5 and 1 step: 1.25
    assert found["rank 1 peak memory"].error_pct == pytest.approx(25.0, abs=1e-3)
    assert found["rank 0 peak memory"].error_pct == 0.0 and found["step time (slowest rank)"].error_pct == 0.0
    table = compare(plan, _measured(plan, peak_scale=1.4)).splitlines()
    marked = [line for line in table if line.endswith(WORST_MARK)]
    assert len(marked) == 1 and marked[0].startswith("rank 1 peak memory") and "+40.0%" in marked[0]
    assert any(line.startswith("not checked: the bubble") for line in table)


def test_a_verdict_names_the_worst_check_above_the_tolerance(plan: Plan) -> None:
    found = checks(plan, _measured(plan, peak_scale=1.25, rank_1_step_scale=1.3))
    predicted = plan.predicted.peak_mem_bytes[1]
    assert verdict(found, 25.0) is None
    assert verdict(found, 10.0) == (
        f"rank 1 peak memory is off by +25.0% (predicted {format_bytes(predicted)}, measured "
        f"{format_bytes(round(predicted * 1.25))}), above the tolerance of 10%; 2 of 6 checks are beyond it")


def test_validate_exits_1_above_the_tolerance_only(plan: Plan, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    plan.save(tmp_path / "plan.json")
    _measured(plan, peak_scale=0.5).save(tmp_path / "run.json")
    files = [str(tmp_path / "plan.json"), str(tmp_path / "run.json")]
    assert main(["validate", *files]) == 0
    assert "-50.0%" in capsys.readouterr().out
    assert main(["validate", *files, "--tolerance", "60"]) == 0
    assert main(["validate", *files, "--tolerance", "10"]) == 1
    out, err = capsys.readouterr()
    assert "rank 1 peak memory" in out and err.count("\n") == 1
    assert err.startswith("tessera: validate: rank 1 peak memory is off by -50.0%")
    assert main(["validate", *files, "--tolerance", "-5"]) == 2
    assert capsys.readouterr().err == ("tessera: error: --tolerance must be a percentage >= 0, got -5; "
                                       "e.g. --tolerance 10\n")


def test_each_tiles_halo_bytes_are_checked_on_its_ranks() -> None:
    """4 square tiles x 2 replicas (ranks 0-3 and 4-7), 2 micro-batches; the plan's per-tile halo
    bytes set by hand, the runtime's counts doctored on rank 5."""
    spec = SpatialSpec(4, "square", "per-layer", height=64, width=64)
    tiled = Plan.from_dict(json.loads(make_plan(RESNET, ["layer1_1_conv1"], schedule="1f1b", data_parallel=2,
                                                microbatches=2, spatial={0: spec})))
    halos = dataclasses.replace(spec, halo_bytes=(100, 200, 300, 400))
    first = dataclasses.replace(tiled.stages[0], spatial=halos)
    tiled = dataclasses.replace(tiled, stages=(first, *tiled.stages[1:]))
    assert predicted_halo_bytes(tiled) == (200, 400, 600, 800, 200, 400, 600, 800, 0, 0)
    sent = (200, 400, 600, 800, 200, 500, 600, 800, 0, 0)
    report = RunReport(tiled.model.fingerprint, 10, "cpu", tiled.training.global_batch_size, 0, (1.0,),
                       (1.0,), tiled.predicted.peak_mem_bytes, "test", halo_bytes_sent=sent)
    found = {check.label: check for check in checks(tiled, report) if check.metric == "halo bytes sent"}
    assert sorted(found) == [f"rank {rank} halo bytes sent" for rank in range(8)]  # 8, 9 send nothing
    assert found["rank 5 halo bytes sent"].error_pct == pytest.approx(25.0)
    assert verdict(list(found.values()), 20.0).startswith("rank 5 halo bytes sent is off by +25.0%")


def test_the_bubble_is_checked_in_points_against_each_ranks_compute(plan: Plan) -> None:
    """A CPU report with busy times: the job's bubble and each rank's idle share are checked in percentage
    points. Each rank's predicted busy time is its stage's micro-batches of forward and backward plus
    its optimizer step (computed here from the plan's stage figures, not by the simulator)."""
    step, count = plan.predicted.step_ms, plan.training.num_microbatches
    busy = [count * (stage.predicted.fwd_ms + stage.predicted.bwd_ms) + stage.predicted.optimizer_ms
            for stage in plan.stages]
    idle = [1 - b / step for b in busy]
    measured = dataclasses.replace(_measured(plan), rank_busy_ms=(
        (step, busy[0], busy[0]), (step, busy[1] - 0.1 * step, busy[1] - 0.1 * step)))  # rank 1 idles 10 pt more
    found = {check.label: check for check in checks(plan, measured)}
    assert found["rank 0 idle share"].predicted == pytest.approx(idle[0], abs=1e-9)
    assert found["rank 0 idle share"].error_pct == pytest.approx(0.0, abs=1e-6)
    assert found["rank 1 idle share"].error_pct == pytest.approx(10.0, abs=1e-6)
    assert found["bubble"].predicted == pytest.approx(plan.predicted.bubble_fraction)
    assert found["bubble"].measured == pytest.approx(1 - (sum(busy) - 0.1 * step) / (2 * step))
    assert found["bubble"].error_pct == pytest.approx(5.0, abs=1e-6)  # half the ranks 10 pt idler
    table = compare(plan, measured)
    assert "+10.0 pt" in table and not any(line.startswith("not checked: the bubble") for line in table.splitlines())
    assert verdict(checks(plan, measured), 8.0).startswith("rank 1 idle share is off by +10.0 pt")


def test_each_ranks_busy_time_is_the_median_after_the_warm_up(plan: Plan) -> None:
    """RunReport.rank_median_busy_ms: per rank, the median of its busy times past the warm-up step (which is
    made wildly off); a report without busy times has none."""
    measured = dataclasses.replace(_measured(plan), rank_busy_ms=((900.0, 3.0, 5.0, 4.0), (900.0, 7.0, 7.0, 1.0)))
    assert measured.rank_median_busy_ms == (4.0, 7.0)
    assert _measured(plan).rank_median_busy_ms == ()


def test_the_schedule_replayed_on_measured_compute(plan: Plan) -> None:
    """Measured per-action times equal to the plan's own predictions replay to the plan's simulation;
    a slower measured backward on stage 1 shows up in the replayed step (simulate_measured)."""
    from planner.simulation import simulate_measured, simulate_plan

    own = [{f"{index}:F": stage.predicted.fwd_ms, f"{index}:B": stage.predicted.bwd_ms,
            f"{index}:OPTIMIZER_STEP": stage.predicted.optimizer_ms} for index, stage in enumerate(plan.stages)]
    expected = simulate_plan(plan)
    replayed = simulate_measured(plan, own)
    assert replayed.step_ms == pytest.approx(expected.step_ms)
    assert replayed.busy_ms == pytest.approx(expected.busy_ms)
    slower = [own[0], {**own[1], "1:B": own[1]["1:B"] + 1.0}]
    # stage 1 runs every micro-batch's backward: M ms more busy, and the step longer (by less: it had idled)
    slowed = simulate_measured(plan, slower)
    assert slowed.busy_ms[1] == pytest.approx(expected.busy_ms[1] + plan.training.num_microbatches)
    assert expected.step_ms < slowed.step_ms <= expected.step_ms + plan.training.num_microbatches + 1e-9
    assert slowed.step_ms >= slowed.busy_ms[1]
    measured = dataclasses.replace(_measured(plan), rank_busy_ms=((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)),
                                   rank_action_ms=tuple(own))
    found = {check.label: check for check in checks(plan, measured)}
    assert found["bubble on measured compute"].predicted == pytest.approx(expected.bubble_fraction)
    assert found["step time on measured compute"].predicted == pytest.approx(expected.step_ms)
    assert found["step time on measured compute"].measured == measured.median_step_ms
    slow_run = dataclasses.replace(measured, rank_action_ms=tuple(slower))
    found = {check.label: check for check in checks(plan, slow_run)}
    assert found["step time on measured compute"].predicted == pytest.approx(slowed.step_ms)


def test_the_replay_pays_each_post_what_the_run_measured_it_took() -> None:
    """On a link that costs 0.1 ms to post a message, a run that measured 0.3 ms per post replays with every
    transfer's posts three times the plan's; measured as planned, the replay is the plan's simulation."""
    from cost_models.devices import get_device
    from planner.schedules.actions import parse_programs
    from planner.schedules.simulate import simulate
    from planner.simulation import sim_costs, simulate_measured, simulate_plan

    base = get_device("V100-16GB")
    device = dataclasses.replace(base, intra_node=dataclasses.replace(base.intra_node, post_us=100.0))
    posting = Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", device=device)))
    own = [{f"{index}:F": stage.predicted.fwd_ms, f"{index}:B": stage.predicted.bwd_ms,
            f"{index}:OPTIMIZER_STEP": stage.predicted.optimizer_ms} for index, stage in enumerate(posting.stages)]
    as_planned = simulate_measured(posting, [{**times, "post": 0.1} for times in own])
    assert as_planned.step_ms == pytest.approx(simulate_plan(posting).step_ms)
    costs = sim_costs(posting.layout, posting.stages, posting.transfers, posting.schedule.kind, "gloo",
                      posting.tied_sums)
    tripled = dataclasses.replace(costs, post_ms={edge: 3 * ms for edge, ms in costs.post_ms.items()})
    expected = simulate(parse_programs(posting.programs), posting.layout, tripled)
    slow_posts = simulate_measured(posting, [{**own[0], "post": 0.2}, {**own[1], "post": 0.4}])  # mean 0.3
    assert slow_posts.step_ms == pytest.approx(expected.step_ms) and expected.step_ms > as_planned.step_ms


def test_the_replay_on_measured_compute_takes_a_split_backwards_i_as_it_was_measured(plan: Plan) -> None:
    """A ZB-H1 run measures I and W; the replay runs each I for its measured time, not that plus the
    predicted cost of splitting (split_extra_ms, which the measured I already holds): by hand, every rank
    is busy M (F + I + W) + its optimizer step."""
    from planner.manual import reschedule
    from planner.simulation import simulate_measured

    split = reschedule(plan, "zb-h1")
    stages = tuple(dataclasses.replace(stage, predicted=dataclasses.replace(stage.predicted, split_extra_ms=5.0))
                   for stage in split.stages)
    split = dataclasses.replace(split, stages=stages)
    own = [{f"{index}:F": 1.0, f"{index}:I": 2.0, f"{index}:W": 3.0, f"{index}:OPTIMIZER_STEP": 0.5}
           for index in range(len(stages))]
    replayed = simulate_measured(split, own)
    assert replayed.busy_ms == pytest.approx([split.training.num_microbatches * 6.0 + 0.5] * len(stages))


def test_pipeline_bytes_are_each_sends_transfer_and_checked_per_rank(plan: Plan) -> None:
    """By hand: on 2 stages, rank 0 sends every micro-batch's activations forward, rank 1 as many gradient
    bytes back; a run sending fewer on rank 1 shows in its check."""
    (transfer,) = plan.transfers
    per_step = transfer.nbytes * plan.training.num_microbatches
    assert predicted_p2p_bytes(plan) == (per_step, per_step)
    measured = dataclasses.replace(_measured(plan), p2p_bytes_sent=(per_step, per_step // 2))
    sent = {check.label: check.error_pct for check in checks(plan, measured) if check.metric == "pipeline bytes sent"}
    assert sent == {"rank 0 pipeline bytes sent": 0.0, "rank 1 pipeline bytes sent": -50.0}
    assert not [check for check in checks(plan, _measured(plan)) if check.metric == "pipeline bytes sent"]
