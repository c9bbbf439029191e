"""Runtime pieces without processes: batches, programs, synthetic data, reports, validate, CLI."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from cost_models.errors import CheckpointError, InvalidArgument, PlanFileError, RuntimeSetupError
from cost_models.memory import Precision
from planner.cli import main
from planner.plan import Plan
from planner.reports.compare import compare
from planner.reports.run_report import RunReport
from planner.schedules.actions import Action, ActionKind
from runtime import checks
from runtime.build import rebuild_model, trace_checked
from runtime.checkpoint import Latest, check_resumable, check_writable, split_digest
from runtime.command import parse_args
from runtime.data import SyntheticData, TensorSpec, input_specs, synthetic_task
from runtime.launch import RankEnv
from runtime.memory import MemoryTracker
from runtime.microbatch import split_batch
from runtime.optim import optimizer_factory
from runtime.values import ValueKind, ValueSpec, value_specs
from tests.runtime_plans import GPT, make_plan


@pytest.fixture(scope="module")
def plan() -> Plan:
    return Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", data_parallel=2)))


def test_each_replica_takes_its_slice_in_micro_batches() -> None:
    inputs, targets = torch.arange(12).reshape(12, 1), (torch.arange(12), torch.arange(12) * 10)
    parts = split_batch(inputs, targets, global_batch_size=12, data_parallel=2, replica=1, num_microbatches=3)
    assert [p.inputs[0].flatten().tolist() for p in parts] == [[6, 7], [8, 9], [10, 11]]
    assert parts[2].targets[1].tolist() == [100, 110]
    with pytest.raises(InvalidArgument, match="global batch is 12"):
        split_batch(torch.zeros(6), None, global_batch_size=12, data_parallel=2, replica=0,
                    num_microbatches=3)


def test_programs_group_communication_runs_and_ranks_find_their_stages(plan: Plan) -> None:
    program = checks.rank_program(plan, 2)
    segments = checks.segments(program)
    runs = [s for s in segments if isinstance(s, tuple)]
    assert all(a.kind.is_communication for run in runs for a in run)
    assert [a for s in segments for a in (s if isinstance(s, tuple) else (s,))] == list(program)
    assert checks.my_stages(plan, 2) == ((1,), 0) and checks.my_stages(plan, 1) == ((0,), 1)


def test_set_up_mismatches_name_the_values_and_the_fix(plan: Plan) -> None:
    with pytest.raises(RuntimeSetupError, match=r"for 4 processes .* 3 were launched.*--nproc-per-node 4"):
        checks.check_world_size(plan, 3)
    offload = plan.programs[0] + ("0RECOMPUTE0",)
    patched = Plan.from_dict({**plan.to_dict(), "programs": [list(offload), *map(list, plan.programs[1:])]})
    with pytest.raises(RuntimeSetupError, match="RECOMPUTE"):
        checks.rank_program(patched, 0)


def test_gradients_on_the_host_need_the_step_there_and_one_copy_of_the_stage(plan: Plan) -> None:
    def with_stage_0(offload: dict[str, object]) -> dict[str, object]:
        data = plan.to_dict()
        data["stages"][0]["offload"].update(offload)
        return data

    with pytest.raises(PlanFileError, match=r"stages\[0\].offload.grads_on_host is true but its optimizer_state is "
                                            r"gpu; gradients on the host need the step on the host"):
        Plan.from_dict(with_stage_0({"grads_on_host": True}))
    replicated = Plan.from_dict(with_stage_0({"grads_on_host": True, "optimizer_state": "host"}))
    with pytest.raises(RuntimeSetupError, match="stage 0 sends its gradients to the host each backward and runs on "
                                                "2 ranks"):
        checks.check_executable(replicated)
    written = plan.to_dict()
    for stage in written["stages"]:
        del stage["offload"]["grads_on_host"]  # a plan file written before the field: gradients on the device
    assert Plan.from_dict(written) == plan


def test_the_synthetic_loss_follows_the_output_shape() -> None:
    def task(*shape: int) -> tuple[str, tuple[int, ...], int]:
        chosen = synthetic_task(ValueSpec("y", ValueKind.TENSOR, shape, torch.float32))
        return chosen.kind, chosen.target.shape, chosen.target.high
    assert task(4, 10) == ("cross_entropy", (4,), 10)
    assert task(4, 16, 512) == ("cross_entropy", (4, 16), 512)
    assert task(4, 3, 8, 8) == ("cross_entropy", (4, 8, 8), 3)
    assert task(4, 1, 8, 8)[0] == "mse" and task(4, 7, 5, 2, 2)[0] == "mse"
    with pytest.raises(RuntimeSetupError, match="one tensor"):
        synthetic_task(ValueSpec("y", ValueKind.INTS, (2,)))


def _global_batch(plan_json: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch as the plan's ranks draw it: micro-batch j = replica x M + m."""
    plan = Plan.from_dict(json.loads(plan_json))
    traced = trace_checked(rebuild_model(plan), plan)
    inputs = [(meta.shape, getattr(torch, meta.dtype)) for meta in plan.model.example_inputs]
    specs = value_specs(traced, inputs, plan.training.micro_batch_size)
    output = next(node for node in traced.graph.nodes if node.op == "output").all_input_nodes[0].name
    data = SyntheticData(input_specs(traced, specs), synthetic_task(specs[output]), seed=3)
    parts = [data.microbatch(step, replica * plan.training.num_microbatches + m)
             for replica in range(plan.data_parallel) for m in range(plan.training.num_microbatches)]
    return torch.cat([part.inputs[0] for part in parts]), torch.cat([part.targets for part in parts])


def test_the_synthetic_global_batch_is_the_same_under_plans_that_cut_it_differently() -> None:
    pipeline = make_plan(GPT, ["blocks_1_ln_1"], schedule="gpipe", microbatches=8, micro_batch_size=1)
    data_parallel = make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", data_parallel=2, microbatches=2)
    for step in (0, 5):
        (inputs, targets), (other_inputs, other_targets) = (_global_batch(pipeline, step),
                                                            _global_batch(data_parallel, step))
        assert inputs.shape == (8, 32) and torch.equal(inputs, other_inputs)
        assert torch.equal(targets, other_targets)


def test_synthetic_micro_batches_depend_only_on_seed_step_and_index() -> None:
    data = SyntheticData((TensorSpec((2, 5), torch.int64, 9),),
                         synthetic_task(ValueSpec("y", ValueKind.TENSOR, (2, 3), torch.float32)), seed=1)
    first, again, other = data.microbatch(4, 2), data.microbatch(4, 2), data.microbatch(4, 3)
    assert torch.equal(first.inputs[0], again.inputs[0]) and torch.equal(first.targets, again.targets)
    assert not torch.equal(first.inputs[0], other.inputs[0])
    assert int(first.inputs[0].max()) < 9
    assert torch.equal(data.microbatch(4, 2, inputs=False).targets, first.targets)


def test_optimizers_by_name() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert type(optimizer_factory("adamw")(params)).__name__ == "AdamW"
    with pytest.raises(InvalidArgument, match="lamb"):
        optimizer_factory("lamb")


def _report(plan: Plan, **changes: object) -> RunReport:
    values = {"plan_fingerprint": plan.model.fingerprint, "world_size": 4, "device": "cpu",
              "global_batch_size": 16, "start_step": 0, "step_ms": (90.0, 40.0, 60.0),
              "losses": (3.0, 2.5, 2.0), "peak_mem_bytes": (100, 100, 200, 200), "memory_measure": "test",
              "held_mem_bytes": (90,) * 4}
    values.update(changes)
    return RunReport(**values)  # type: ignore[arg-type]


def test_a_report_round_trips_and_excludes_the_warm_up_step(plan: Plan, tmp_path: Path) -> None:
    report = _report(plan)
    report.save(tmp_path / "run.json")
    assert RunReport.load(tmp_path / "run.json") == report
    assert report.median_step_ms == 50.0 and report.samples_per_s == pytest.approx(16 / 0.05)


def test_validate_puts_predictions_beside_measurements(plan: Plan, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    text = compare(plan, _report(plan))
    assert text.count("peak memory") == 4 and "step time" in text and "%" in text
    with pytest.raises(PlanFileError, match="plan that was run"):
        compare(plan, _report(plan, plan_fingerprint="0" * 64))
    for changed in ({"world_size": 2, "peak_mem_bytes": (100, 100), "held_mem_bytes": (90, 90)},
                    {"global_batch_size": 8}):  # the same model, run by another plan
        with pytest.raises(PlanFileError, match=r"the run report is of \d ranks at batch \d+ but the plan runs 4 at "
                                                r"batch 16; give the plan that was run"):
            compare(plan, _report(plan, **changed))
    plan.save(tmp_path / "plan.json")
    _report(plan).save(tmp_path / "run.json")
    assert main(["validate", str(tmp_path / "plan.json"), str(tmp_path / "run.json")]) == 0
    assert "rank 3 peak memory" in capsys.readouterr().out


def test_tessera_run_checks_the_plan_then_starts_torchruns_agent(plan: Plan, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr("planner.cli.run_command.supervise", lambda command: calls.append(command) or 0)
    plan.save(tmp_path / "plan.json")
    assert main(["run", str(tmp_path / "plan.json"), "--steps", "3", "--", "--seed", "2"]) == 0
    command = calls[0]
    assert command[1:4] == ["-m", "runtime.agent", "--standalone"]
    assert command[command.index("--nproc-per-node") + 1] == "4" and command[-2:] == ["--seed", "2"]
    assert main(["show", str(tmp_path / "plan.json"), "--", "--seed", "2"]) == 2
    assert main(["run", str(tmp_path / "plan.json"), "--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400",
                 "--rdzv-backend", "static", "--node-rank", "1"]) == 0
    command = calls[1]
    assert command[command.index("--nproc-per-node") + 1] == "2"
    assert command[3:13] == ["--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "10.0.0.1:29400",
                             "--node-rank", "1", "--nproc-per-node", "2"]


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "3"], "but --nproc 3 x 1 node(s) launches 3; run with --nproc 4"),
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint"),
    (["--nnodes", "3", "--rdzv-endpoint", "h:1"], "do not split evenly over --nnodes 3"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "1"],
     "--node-rank is for --rdzv-backend static"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-backend", "static"], "needs --node-rank"),
])
def test_tessera_run_refuses_a_launch_that_cannot_work_before_starting_it(
        plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        args: list[str], message: str) -> None:
    monkeypatch.setattr("planner.cli.run_command.supervise", lambda command: pytest.fail("launched"))
    plan.save(tmp_path / "plan.json")
    assert main(["run", str(tmp_path / "plan.json"), *args]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_runtime_flags_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    options, device = parse_args(["plan.json", "--steps", "5", "--fail-at-step", "2", "--fail-rank", "1"])
    assert (options.steps, options.fail_at_step, options.fail_rank, device) == (5, 2, 1, "auto")
    with pytest.raises(RuntimeSetupError, match="--steps"):
        parse_args(["plan.json"])
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeSetupError, match="torchrun"):
        RankEnv.from_environ()


def test_a_checkpoint_folder_that_cannot_be_written_is_refused_before_any_step(tmp_path: Path) -> None:
    """Found at the first checkpoint, it cost the steps before it and printed a traceback per rank."""
    from cost_models.errors import CheckpointError

    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match=r"--checkpoint-dir .*a-file/ck cannot be written \(Not a directory\); "
                                              r"give a writable folder") as refused:
        check_writable(tmp_path / "a-file" / "ck")
    assert refused.value.same_on_every_rank  # rank 0 says it once
    check_writable(tmp_path / "new" / "ck")  # made, and nothing left in it
    assert list((tmp_path / "new" / "ck").iterdir()) == []


def test_a_checkpoint_is_resumable_only_by_its_model_and_cut_and_with_steps_left(plan: Plan) -> None:
    saved = Latest(20, plan.model.fingerprint, split_digest(plan), ("idx", "blocks_1_ln_1"))
    check_resumable(saved, plan, 21, Path("ck"))
    check_resumable(dataclasses.replace(saved, split=None), plan, 21, Path("ck"))  # written before splits
    for changed, steps, message in [({}, 20, "at step 20, so --steps 20 leaves nothing to train"),
                                    ({}, 5, "pass --steps above 20"),
                                    ({"fingerprint": "f" * 64}, 21, "of another model"),
                                    ({"split": "0" * 16}, 21, "cuts the model into 2 stages starting at")]:
        with pytest.raises(CheckpointError, match=message) as refused:
            check_resumable(dataclasses.replace(saved, **changed), plan, steps, Path("ck"))
        assert refused.value.same_on_every_rank  # so rank 0 alone prints it


def test_held_bytes_count_saved_activations_until_their_backward() -> None:
    layer = torch.nn.Linear(256, 256)
    tracker = MemoryTracker(torch.device("cpu"), lambda: list(layer.parameters()))
    x = torch.randn(64, 256)
    with tracker.profiling():
        with tracker.saving((0, 0)):
            y = torch.relu(layer(x))
        tracker.sample([y])
        params = sum(p.numel() * 4 for p in layer.parameters())
        assert tracker.held_bytes >= params + 2 * x.numel() * 4  # x and relu's output are saved
        tracker.release((0, 0))
        y.sum().backward()
    assert tracker.peak_bytes >= tracker.held_bytes
    with tracker.saving((0, 1)):  # outside a profiled step nothing is tracked
        torch.relu(layer(x))
    assert not tracker.saved


def test_the_memory_meter_keeps_no_split_backwards_graph_alive() -> None:
    """A profiled step's saved-tensor hooks must not tie a graph into a cycle: ZB-H1's I runs only part of
    the graph with the graph kept, its W another part, and what neither ran is freed by reference counts
    alone, which a node holding its own saved output (tanh's) through the hook would defeat."""
    import gc
    import weakref

    from runtime.split_backward import backward_input, backward_weight

    first, second = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    weights = [*first.parameters(), *second.parameters()]
    tracker = MemoryTracker(torch.device("cpu"), lambda: weights)
    with tracker.profiling():
        received = torch.randn(4, 16, requires_grad=True)  # a stage's input from the stage before
        with tracker.saving((0, 0)):
            hidden = torch.tanh(first(received))  # tanh saves its own output
            loss = second(hidden).square().sum()
        saved = weakref.ref(hidden)
        backward_weight(weights, backward_input([loss], [None], [received], weights))
        tracker.release((0, 0))
        del hidden, loss
        gc.collect()
        assert saved() is None, "the step's graph outlived its backward"
    assert all(weight.grad is not None for weight in weights) and received.grad is not None


def test_what_the_plan_says_a_split_backward_keeps_is_what_the_runtimes_input_gradient_keeps() -> None:
    """The plan's split_kept_bytes of a later stage (the output gradients of its nodes computing with
    weights, planner/search/problem.py) against the runtime: the bytes of the gradients its I hands to its W
    (runtime/split_backward.py) for one micro-batch of the planned size, on the stage the runtime builds."""
    from runtime.build import split_stages
    from runtime.split_backward import backward_input

    plan = Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="zb-h1", micro_batch_size=3)))
    model = rebuild_model(plan)
    modules = split_stages(trace_checked(model, plan), model, plan)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.copy_(torch.randn_like(tensor.double()) * 0.1 if tensor.is_floating_point() else 0)
    tokens = torch.zeros(plan.training.micro_batch_size, 32, dtype=torch.long)
    (hidden,) = _as_tuple(modules[0](tokens))
    received = hidden.detach().requires_grad_()
    tied = model.wte.weight  # the head reads the embedding's weight: the stage's second input
    logits = _as_tuple(modules[1](received, tied))[0]
    loss = logits.square().mean()
    groups = backward_input([loss], [None], [received], [*modules[1].parameters(), tied])
    kept = {grad.untyped_storage().data_ptr(): grad.untyped_storage().nbytes()
            for group in groups for grads in group["grads"] for grad in grads if grad is not None}
    assert plan.stages[0].predicted.split_kept_bytes == 0  # its W is its whole backward
    assert plan.stages[1].predicted.split_kept_bytes == sum(kept.values()) > 0


def _as_tuple(value: object) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def test_actions_the_runtime_does_not_run_yet_are_named() -> None:
    assert ActionKind.RECOMPUTE not in checks.SUPPORTED  # recomputation runs inside B, not as an action
    assert {ActionKind.SWAP_OUT, ActionKind.SWAP_IN} <= checks.SUPPORTED
    assert checks.segments((Action(0, ActionKind.F, 0),)) == [Action(0, ActionKind.F, 0)]


def test_the_runtime_executes_recompute_swap_zero_and_tiers_and_host_params_only_as_zero_3_shards(plan: Plan) -> None:
    from planner.plan import OffloadSpec, ParamTier, StateTier

    def offloaded(spec: OffloadSpec) -> Plan:
        return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], offload=spec),
                                                 *plan.stages[1:]))

    for executed in (OffloadSpec(recompute=(("blocks_0_ln_2", "blocks_0_mlp_fc"),), swap=("blocks_0_attn_qkv",)),
                     OffloadSpec(zero_stage=1), OffloadSpec(zero_stage=3, optimizer_state=StateTier.NVME),
                     OffloadSpec(optimizer_state=StateTier.HOST, swap=("blocks_0_attn_qkv",)),
                     OffloadSpec(zero_stage=3, optimizer_state=StateTier.HOST, params=ParamTier.HOST)):
        checks.check_executable(offloaded(executed))
    sharded = offloaded(OffloadSpec(zero_stage=2, optimizer_state=StateTier.HOST))
    for precision in (Precision.FP16, Precision.BF16):  # mixed precision composes with every tier
        checks.check_executable(dataclasses.replace(sharded, model=dataclasses.replace(plan.model,
                                                                                       precision=precision)))
    with pytest.raises(RuntimeSetupError, match=r"^stage 0 keeps its parameters on the host with ZeRO stage 0 .*"
                                                r"re-plan stage 0 with ZeRO-3 and the optimizer on the host or NVMe"):
        checks.check_executable(offloaded(OffloadSpec(params=ParamTier.HOST, swap=("blocks_0_attn_qkv",))))
    with pytest.raises(RuntimeSetupError, match=r"^stage 0 keeps its parameters on the host with ZeRO stage 3 and "
                                                r"the optimizer on the gpu"):
        checks.check_executable(offloaded(OffloadSpec(zero_stage=3, params=ParamTier.HOST)))
    mirrored = Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="gems-master", microbatches=2,
                                                   offload=[OffloadSpec(zero_stage=3)] * 2)))
    with pytest.raises(RuntimeSetupError, match=r"^stage 0 shards its parameters \(ZeRO-3\) over 2 ranks that run it "
                                                r"for 2 model copies in opposite directions \(GEMS-MASTER\)"):
        checks.check_executable(mirrored)  # (measured: the two ranks' layer gathers time out waiting for each other)
    one_copy = Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b", offload=[
        OffloadSpec(zero_stage=3, optimizer_state=StateTier.HOST, params=ParamTier.HOST), OffloadSpec()])))
    with pytest.raises(RuntimeSetupError, match=r"^stage 0 keeps its parameters on the host as ZeRO-3 shards but "
                                                r"runs on one rank"):
        checks.check_executable(one_copy)


def test_the_run_report_keeps_swapped_bytes_and_reads_reports_without_them(plan: Plan) -> None:
    report = _report(plan, host_swap_bytes=(655360, 0, 786432, 0))
    assert RunReport.from_dict(json.loads(json.dumps(report.to_dict()))).host_swap_bytes == (655360, 0, 786432, 0)
    older = {key: value for key, value in report.to_dict().items() if key != "host_swap_bytes"}
    assert RunReport.from_dict(older).host_swap_bytes == ()


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"])
def test_receives_posted_one_run_ahead_keep_program_order_and_precede_their_run(kind: str) -> None:
    """Replaying the executor's loop over each rank's lowered program: every run with receives after the
    first is posted before the program reaches it (one run ahead), no run is posted twice, and the
    receives are posted in program order (what keeps each channel matching its sends)."""
    from planner.schedules import generate, lower
    from cost_models.comm import RECEIVES_POSTED_AHEAD
    from runtime.comm import ReceivesAhead

    schedule = generate(kind, 4, 8)
    edges = {(p, p + 1) for p in range(schedule.layout.num_parts - 1)}
    for program in schedule.layout.rank_programs(lower(schedule.programs, schedule.layout, edges)):
        segments = checks.segments(program)
        ahead = ReceivesAhead(segments, RECEIVES_POSTED_AHEAD["gloo"])
        posted = list(ahead.due(-1))
        for index, segment in enumerate(segments):
            if isinstance(segment, tuple) and any(a.kind.is_recv for a in segment):
                assert index in posted, f"run {index} reached before its receives were posted"
            if isinstance(segment, tuple):
                posted += ahead.due(index)
        assert posted == ahead.runs  # each run once, in program order
    assert ReceivesAhead(segments, 0).due(-1) == [] and ReceivesAhead(segments, 0).due(len(segments)) == []


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "gems-master"])
def test_the_loss_all_reduce_starts_after_the_last_forward_making_a_loss(kind: str) -> None:
    """On gloo a rank starts the step's loss all-reduce right after its last forward of a stage holding the
    loss (none follows it), a rank holding none at the step's start; on NCCL every rank where its step ends."""
    from planner.schedules import generate, lower
    from runtime.loss_reduce import start_after

    schedule = generate(kind, 4, 8)
    layout = schedule.layout
    edges = {(p, p + 1) for p in range(layout.num_parts - 1)}
    last = {stage for stage in range(layout.num_stages) if layout.part(stage) == layout.num_parts - 1}
    holding = 0
    for program in layout.rank_programs(lower(schedule.programs, layout, edges)):
        segments = checks.segments(program)
        index = start_after(segments, last, early=True)
        forwards = [i for i, s in enumerate(segments) if isinstance(s, Action) and s.kind is ActionKind.F
                    and s.stage in last]
        if forwards:
            holding += 1
            assert index == forwards[-1] and index < len(segments) - 1  # the last backwards still follow
        else:
            assert index == -1
        assert start_after(segments, last, early=False) == len(segments) - 1
    assert holding == (2 if kind == "gems-master" else 1)  # one rank per replica holds the loss


def test_a_cpu_rank_is_bound_to_its_share_of_the_cores_only_when_each_rank_gets_one() -> None:
    """In a child process (binding is process-wide): with as many ranks as cores, rank 1 runs on the second
    core alone; with more ranks than cores it keeps every core."""
    import os
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    script = ("import os, sys; from cost_models.cpu_device import pin_cpu_rank; "
              "print(sorted(pin_cpu_rank(int(sys.argv[1]), int(sys.argv[2]))), sorted(os.sched_getaffinity(0)))")

    def bound(rank: int, ranks: int) -> str:
        return subprocess.run([sys.executable, "-c", script, str(rank), str(ranks)], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).resolve().parents[2]).stdout.strip()

    if len(cores) >= 2:
        share = len(cores) // 2
        assert bound(1, 2) == f"{cores[share:2 * share]} {cores[share:2 * share]}"
    assert bound(0, len(cores) + 1) == f"{cores} {cores}"


def test_the_agent_drops_a_shutdown_grace_its_torchrun_does_not_know(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's torchrun has no --shutdown-timeout (the CUDA machines' build): `tessera run` still starts."""
    import argparse

    from runtime import agent

    argv = ["--standalone", "--nproc-per-node", "1", "--shutdown-timeout", "15", "-m", "runtime", "p.json"]
    assert agent.known_options(argv) == argv  # this torch knows it
    older = argparse.ArgumentParser()
    older.add_argument("--nproc-per-node")
    monkeypatch.setattr(agent, "get_args_parser", lambda: older)
    assert agent.known_options(argv) == ["--standalone", "--nproc-per-node", "1", "-m", "runtime", "p.json"]


def test_a_rank_that_died_without_a_word_is_named_when_the_ranks_that_said_why_had_lost_a_peer(
        capsys: pytest.CaptureFixture) -> None:
    """torchrun's first failure is the earliest whole-second timestamp, the lowest rank on a tie: the rank left
    waiting for a killed one was named, and the killed one not at all. A rank that failed of itself is the cause,
    and ranks killed beside it were stopped by the agent."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from runtime import agent
    from runtime.command import EXIT_FAILED, EXIT_PEER_LOST, EXIT_SETUP

    def failures(*exitcodes: int) -> ChildFailedError:
        return ChildFailedError("runtime", {rank: ProcessFailure(rank, 100 + rank, code, "")
                                            for rank, code in enumerate(exitcodes)})

    assert agent.failure_status(failures(EXIT_PEER_LOST, -9)) == EXIT_FAILED
    assert capsys.readouterr().err == "tessera: rank 1 (pid 101) was killed by SIGKILL\n"
    assert agent.failure_status(failures(EXIT_PEER_LOST, 7, -15)) == 7  # that rank's status; each named
    assert capsys.readouterr().err.splitlines() == ["tessera: rank 1 (pid 101) exited with status 7",
                                                    "tessera: rank 2 (pid 102) was killed by SIGTERM"]
    assert agent.failure_status(failures(EXIT_SETUP, -15)) == EXIT_SETUP  # rank 1: stopped by the agent
    assert agent.failure_status(failures(-15, EXIT_FAILED)) == EXIT_FAILED
    assert agent.failure_status(failures(EXIT_PEER_LOST, EXIT_PEER_LOST)) == EXIT_FAILED  # a hang: both timed out
    assert capsys.readouterr().err == ""


def test_a_lost_peer_is_said_in_gloos_first_sentence_without_its_source_location() -> None:
    from runtime.comm import backend_reason

    gloo = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4008: "
            "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the "
            "application code.\nException raised from ...")
    assert backend_reason(gloo) == "Read error [127.0.0.1]:4008: Connection reset by peer"
    assert backend_reason("Timed out waiting 5000ms for recv operation to complete") == \
        "Timed out waiting 5000ms for recv operation to complete"
    assert backend_reason("x" * 300) == "x" * 199 + "…"

def test_auto_runs_a_plan_made_for_cpu_ranks_on_cpu_ranks_even_beside_a_gpu() -> None:
    """A plan costed on the cpu device (gloo) is predicted for CPU ranks: ``--device auto`` keeps it there;
    a GPU plan's auto, and any explicit choice, stand."""
    from runtime.command import _device_kind
    from tests.runtime_plans import GPT, make_plan

    gpu_plan = Plan.from_dict(json.loads(make_plan(GPT, ["blocks_1_ln_1"], schedule="1f1b")))
    device = dict(gpu_plan.cluster.device, backend="gloo")
    cpu_plan = dataclasses.replace(gpu_plan, cluster=dataclasses.replace(gpu_plan.cluster, device=device))
    assert cpu_plan.cluster.backend == "gloo" and gpu_plan.cluster.backend == "nccl"
    assert _device_kind(cpu_plan, "auto") == "cpu" and _device_kind(gpu_plan, "auto") == "auto"
    assert _device_kind(cpu_plan, "cuda") == "cuda" and _device_kind(gpu_plan, "cpu") == "cpu"
