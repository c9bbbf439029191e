"""plan(): the Plan it returns, the plan file, the simulator's agreement, and every error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from cost_models.errors import InvalidArgument, PlanFileError, PlanInfeasible, UnknownDevice
from examples.models.gpt import gpt_50b, gpt_tiny
from examples.models.resnet import resnet50
from examples.models.unet import unet_small
from planner import Plan, plan, trace
from planner.cli import main
from planner.schedules.actions import parse_programs
from planner.schedules.validate import validate
from planner.simulation import simulate_plan

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def resnet_graph():
    return trace(resnet50(), torch.empty(1, 3, 224, 224, device="meta"))


@pytest.fixture(scope="module")
def resnet_plan(resnet_graph) -> Plan:
    return plan(resnet50(), gpus=8, mem="8GB", batch_size=64, device="V100-16GB",
                example_inputs=torch.empty(1, 3, 224, 224, device="meta"), graph=resnet_graph,
                builder="examples/models/resnet.py:resnet50")


def test_plan_covers_every_node_once_in_order(resnet_plan: Plan, resnet_graph) -> None:
    names = [name for stage in resnet_plan.stages for name in stage.nodes]
    assert names == [node.name for node in resnet_graph]
    assert resnet_plan.num_stages * resnet_plan.data_parallel == 8
    layout = resnet_plan.layout
    ranks = sorted(rank for stage in range(layout.num_stages) for replica in range(layout.data_parallel)
                   for rank in layout.ranks_of(stage, replica))
    assert ranks == list(range(8)) and len(resnet_plan.programs) == 8
    training = resnet_plan.training
    assert training.micro_batch_size * training.num_microbatches * resnet_plan.data_parallel == 64
    assert resnet_plan.model.fingerprint == resnet_graph.fingerprint
    assert [row.name for row in resnet_plan.layers] == names


def test_programs_validate(resnet_plan: Plan) -> None:
    validate(parse_programs(resnet_plan.programs), resnet_plan.layout,
             edges={(t.src_stage, t.dst_stage) for t in resnet_plan.transfers})


def test_simulation_agrees_with_the_solver_objective(resnet_plan: Plan) -> None:
    simulated = simulate_plan(resnet_plan)
    assert simulated.step_ms == pytest.approx(resnet_plan.predicted.step_ms)
    assert simulated.step_ms == pytest.approx(resnet_plan.solver.objective, rel=0.05)


@pytest.mark.parametrize("mem", ["2GB", "3GB", "6GB"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_memory_never_exceeds_the_budget(mem: str, schedule: str) -> None:
    model, x = unet_small(), torch.empty(1, 3, 512, 512, device="meta")
    result = plan(model, gpus=4, mem=mem, batch_size=16, example_inputs=x, device="A100-40GB",
                  schedules=(schedule,))
    budget = result.cluster.mem_bytes
    assert max(simulate_plan(result).peak_mem_bytes) <= budget
    assert max(result.predicted.peak_mem_bytes) <= budget


def test_plan_file_round_trip(resnet_plan: Plan, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    resnet_plan.save(path)
    assert Plan.load(path) == resnet_plan
    data = json.loads(path.read_text())
    for key in ("schema_version", "model", "cluster", "training", "schedule", "layout",
                "stages", "layers", "programs", "predicted", "solver"):
        assert key in data
    assert data["model"]["builder"] == f"{ROOT / 'examples/models/resnet.py'}:resnet50"  # resolves anywhere
    assert data["model"]["builder_relative"] == "examples/models/resnet.py:resnet50"  # as given
    assert set(data["solver"]) >= {"name", "status", "objective", "gap", "wall_s", "configs_tried", "why"}
    assert data["stages"][0]["offload"]["optimizer_state"] == "gpu"


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not valid JSON"),
    ('{"schema_version": 99}', "schema_version is 99"),
    ('{"schema_version": 1, "model": {}}', "malformed"),
    ('{"schema_version": 3, "model": {}}', "malformed: plan has unknown|malformed: plan lacks"),
    ('[1, 2]', "must be a JSON object"),
])
def test_corrupt_plan_files_are_clear_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(PlanFileError, match=message):
        Plan.load(path)


def _tiny(**overrides):
    arguments = dict(gpus=2, mem="1GB", batch_size=8, device="V100-16GB",
                     example_inputs=torch.empty(1, 32, dtype=torch.long, device="meta"))
    arguments.update(overrides)
    return plan(gpt_tiny(), **arguments)


@pytest.mark.parametrize(("overrides", "error", "message"), [
    ({"gpus": 0}, InvalidArgument, "gpus must be"),
    ({"mem": "lots"}, InvalidArgument, "cannot parse memory size 'lots'"),
    ({"mem": "-4GB"}, InvalidArgument, "memory size .-4GB. must be positive"),
    ({"mem": 0}, InvalidArgument, "must be positive"),
    ({"mem": "16"}, InvalidArgument, "memory size '16' has no unit"),  # 16 bytes is an int: 16
    ({"host_mem": "64"}, InvalidArgument, "memory size '64' has no unit"),
    ({"mem": "16i"}, InvalidArgument, "cannot parse memory size '16i'; write a number with one of B, KB"),  # it
    ({"mem": "16PB"}, InvalidArgument, "cannot parse memory size '16PB'"),  # was 16 bytes; an unlisted unit
    ({"mem": "16Ki"}, InvalidArgument, "cannot parse memory size '16Ki'"),
    ({"reserve": "-1"}, InvalidArgument, "memory size '-1' must be positive"),  # it said: write e.g. '-1GB'
    ({"device": "TPU-v9"}, UnknownDevice, "TPU-v9"),
    ({"batch_size": 8, "micro_batch_sizes": (3,)}, InvalidArgument, "batch size 8 cannot be split"),
    ({"batch_size": 0}, InvalidArgument, "batch_size must be"),
    ({"schedules": ("pipedream-2bw",)}, InvalidArgument, "not supported"),
    ({"schedules": ("wpipe",)}, InvalidArgument, "allow_stale_weights=True"),
    ({"num_stages": 2}, InvalidArgument, r"num_stages is the list of values to search, got 2; give e.g. num_stages=\[2\]"),
    ({"data_parallel": 2}, InvalidArgument, "data_parallel is the list"),
    ({"micro_batch_sizes": 4}, InvalidArgument, "micro_batch_sizes is the list"),
])
def test_bad_arguments(overrides: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _tiny(**overrides)


def test_infeasible_budget_names_the_memory_that_would_fit() -> None:
    with pytest.raises(PlanInfeasible) as raised:
        _tiny(mem=100_000)
    need = raised.value.min_mem_bytes
    assert need > 100_000 and "stage" in raised.value.binding
    assert _tiny(mem=need).predicted.peak_mem_bytes[0] <= need  # the named budget does fit


def test_gpt_50b_without_offload_does_not_fit_16_v100_32gb() -> None:
    model = gpt_50b()
    with pytest.raises(PlanInfeasible) as raised:
        plan(model, gpus=16, mem="32GB", batch_size=4, device="V100-32GB", offload=False,  # the seed's batch
             example_inputs=torch.empty(1, 1024, dtype=torch.long, device="meta"))
    params = sum(p.numel() for p in model.parameters())
    model_state_per_gpu = 16 * params / 16  # 16 bytes per parameter (fp32 Adam) over 16 GPUs
    assert model_state_per_gpu <= raised.value.min_mem_bytes <= 1.5 * model_state_per_gpu
    assert "GiB" in str(raised.value) and "stage" in str(raised.value)


def test_cli_plan_show_simulate(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    assert main(["plan", "examples/models/gpt.py:gpt_tiny", "--input", "32:int64", "--batch-size",
                 "8", "--gpus", "2", "--mem", "1GB", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "stage" in printed and "samples/s" in printed and "why:" in printed
    assert Plan.load(out).model.builder_relative == "examples/models/gpt.py:gpt_tiny"
    assert main(["show", str(out)]) == 0 and "peak mem" in capsys.readouterr().out
    trace_file, svg_file = tmp_path / "t.json", tmp_path / "t.svg"
    assert main(["simulate", str(out), "--trace", str(trace_file), "--svg", str(svg_file)]) == 0
    assert json.loads(trace_file.read_text())["traceEvents"]
    assert svg_file.read_text().startswith("<svg")


def test_failed_plan_leaves_an_existing_plan_file_untouched(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    out.write_text("precious")
    code = main(["plan", "examples/models/gpt.py:gpt_tiny", "--input", "32:int64", "--batch-size",
                 "8", "--gpus", "2", "--mem", "10KB", "-o", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and "no plan fits" in captured.err and captured.err.count("\n") == 1
    assert out.read_text() == "precious"


@pytest.mark.parametrize(("args", "message"), [
    (["--gpus", "0"], "gpus must be"),
    (["--mem", "sixteen"], "cannot parse memory size"),
    (["--mem", "16"], "has no unit"),
    (["--device", "K80"], "unknown device 'K80'"),
])
def test_cli_plan_errors_exit_2(args: list[str], message: str, capsys) -> None:
    argv = ["plan", "examples/models/gpt.py:gpt_tiny", "--input", "32:int64", "--batch-size", "8",
            "--gpus", "2", "--mem", "1GB"]
    for flag, value in zip(args[::2], args[1::2]):
        argv[argv.index(flag) + 1 if flag in argv else len(argv):] = (
            [value] + argv[argv.index(flag) + 2:] if flag in argv else [flag, value])
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_show_of_a_corrupt_file_is_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["show", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_num_stages_restricts_the_search() -> None:
    assert _tiny(gpus=4, num_stages=(2,)).num_stages == 2
    assert _tiny(gpus=4, num_stages=(4,)).num_stages == 4
    with pytest.raises(InvalidArgument, match="must divide gpus=4"):
        _tiny(gpus=4, num_stages=(3,))


V1_PLAN = ROOT / "tests" / "data" / "plan_v1_gpt_tiny_2x2.json"


def test_a_schema_1_plan_file_is_upgraded_on_load() -> None:
    """A plan written before the layout (ranks inside each stage, one replica per rank block) loads
    with its placement as a layout and its memory split into held-all-step and per-micro-batch bytes."""
    raw = json.loads(V1_PLAN.read_text())
    plan = Plan.load(V1_PLAN)
    assert raw["schema_version"] == 1 and plan.schema_version == 3
    assert [[plan.layout.ranks_of(stage, replica)[0] for replica in range(plan.data_parallel)]
            for stage in range(plan.num_stages)] == [stage["ranks"] for stage in raw["stages"]] == [[0, 1], [2, 3]]
    assert plan.programs == tuple(tuple(program) for program in raw["programs"])
    for stage, old in zip(plan.stages, raw["stages"]):
        predicted = old["predicted"]
        assert stage.nodes == tuple(old["nodes"])
        assert stage.predicted.activation_bytes * predicted["in_flight"] == predicted["activation_bytes"]
        assert stage.predicted.static_bytes + predicted["activation_bytes"] == predicted["peak_mem_bytes"]
    assert plan.schedule.in_flight == tuple(old["predicted"]["in_flight"] for old in raw["stages"]) == (2, 1)
    from runtime import checks

    checks.check_plan(plan)  # and it still runs: the runtime accepts it
    checks.check_executable(plan)
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d.update(extra=1), r"plan has unknown fields \['extra'\]"),
    (lambda d: d["stages"][0]["predicted"].update(peak=1), r"stages\[0\].predicted has unknown fields \['peak'\]"),
    (lambda d: d["training"].pop("optimizer"), r"training lacks fields \['optimizer'\]"),
    (lambda d: d["training"].update(optimizer="lion"), "training.optimizer is 'lion', which this tessera does not "
                                                        "know; expected one of 'sgd', 'momentum', 'adam', 'adamw'"),
    (lambda d: d["schedule"].update(kind="zigzag"), "schedule.kind is 'zigzag'"),
    (lambda d: d["model"].update(precision="fp8"), "model.precision is 'fp8'"),
    (lambda d: d["stages"][0]["offload"].update(optimizer_state="tape"), r"stages\[0\].offload.optimizer_state"),
    (lambda d: d["cluster"].update(gpus="4"), "cluster.gpus must be an integer, got str '4'"),
    (lambda d: d["cluster"].update(gpus=True), "cluster.gpus must be an integer, got bool True"),
    (lambda d: d["predicted"].update(peak_mem_bytes={"0": 1}), "predicted.peak_mem_bytes must be a list"),
    (lambda d: d["layout"]["slot_ranks"][0].append([99]), r"layout: stage_slot \[.*\] must use every slot"),
    (lambda d: d.update(schema_version=4), "schema_version is 4 but this tessera reads versions 1 to 3"),
])
def test_plan_decoding_fails_closed_naming_the_field(resnet_plan: Plan, edit, message: str) -> None:
    data = json.loads(resnet_plan.to_json())
    edit(data)
    with pytest.raises(PlanFileError, match=message):
        Plan.from_dict(data)


def test_bytes_follow_the_models_dtype_unless_a_precision_is_requested() -> None:
    """A float64 model was costed as float32 (half its real bytes), so a plan that "fit" did not."""
    from cost_models.memory import Precision
    from runtime.build import default_dtype

    with default_dtype(torch.float64):
        model = gpt_tiny()
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.empty(1, 32, dtype=torch.long, device="meta")
    native = plan(model, gpus=2, mem="1GB", batch_size=8, example_inputs=tokens)
    assert native.model.precision is Precision.FP64
    assert sum(stage.predicted.param_bytes for stage in native.stages) == 8 * params
    asked = plan(model, gpus=2, mem="1GB", batch_size=8, example_inputs=tokens, precision="fp32")
    assert asked.model.precision is Precision.FP32
    assert sum(stage.predicted.param_bytes for stage in asked.stages) == 4 * params
    with pytest.raises(InvalidArgument, match="weights are bfloat16: give precision="):
        plan(gpt_tiny().to(torch.bfloat16), gpus=2, mem="1GB", batch_size=8, example_inputs=tokens)


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_one_step_figure_the_simulated_one_everywhere() -> None:
    """1F1B's ILP objective is an approximation: only the simulated step is called the step."""
    from cost_models.units import format_ms

    result = _tiny(gpus=4, batch_size=16, schedules=("1f1b",), num_stages=(4,), micro_batch_sizes=(2,))
    step, objective = format_ms(result.predicted.step_ms), format_ms(result.solver.objective)
    assert step != objective
    text = str(result)
    assert _lines(text, "step: ")[0].startswith(f"step: {step} ")
    why = _lines(text, "why: ")[0]
    assert f"has the lowest step ({step})" in why and objective not in why
    assert f"ILP objective {objective}" in _lines(text, "solver: ")[0]
    assert objective not in text.replace(f"ILP objective {objective}", "")


def test_a_16_bit_image_model_may_be_tiled_and_a_language_model_is_not_told_about_tiles(resnet_graph) -> None:
    """A bf16 language model's plan said "no plan tiles the image" when 16-bit plans could not be tiled, having no
    image; now a 16-bit image model's plan is tiled where tiles pay (GEMS's ResNet-1001 in fp16, README)."""
    assert "tiles the image" not in str(_tiny(precision="bf16", device="A100-80GB"))
    resnet = plan(resnet50(), gpus=4, mem="16GB", batch_size=32, graph=resnet_graph, precision="bf16",
                  device="A100-80GB", example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
    assert "no plan tiles the image" not in str(resnet)


def test_a_plan_cut_short_by_the_time_limit_says_it_is_not_proven_optimal(resnet_graph) -> None:
    result = plan(resnet50(), gpus=16, mem="16GB", batch_size=256, graph=resnet_graph, time_limit_s=0.001,
                  example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
    assert not result.solver.proven_optimal and result.solver.configs_unexamined >= 1
    text = str(result)
    assert "(NOT PROVEN OPTIMAL)" in _lines(text, "solver: ")[0]
    why = _lines(text, "why: ")[0]
    assert "NOT PROVEN OPTIMAL: " in why and "the time limit (0.001 s) ended the search" in why
    assert Plan.from_dict(json.loads(result.to_json())) == result


def test_schema_2_files_without_the_newer_optional_fields_load(resnet_plan: Plan) -> None:
    data = json.loads(resnet_plan.to_json())
    del data["solver"]["configs_unexamined"], data["cluster"]["reserve_bytes"], data["tied_sums"]
    loaded = Plan.from_dict(data)
    assert loaded.solver.configs_unexamined == 0 and loaded.cluster.reserve_bytes == 0 and loaded.tied_sums == ()
    assert Plan.from_dict(json.loads(loaded.to_json())) == loaded


def test_plan_reports_progress_only_to_a_callback(capfd) -> None:
    from planner.progress import Phase

    events = []
    _tiny(progress=events.append)
    phases = [event.phase for event in events]
    assert phases[0] is Phase.TRACING and phases[-1] is Phase.ASSEMBLING
    assert Phase.COSTING in phases and Phase.SEARCHING in phases
    searching = [event for event in events if event.phase is Phase.SEARCHING]
    assert searching[-1].done == searching[-1].total > 0 and searching[-1].best_ms is not None
    assert all(0 <= event.done <= event.total for event in searching)
    capfd.readouterr()
    _tiny()  # no callback: silent
    assert capfd.readouterr().err == ""


def test_a_batch_smaller_than_the_gpus_may_use_fewer_and_says_so(resnet_graph) -> None:
    result = plan(resnet50(), gpus=16, mem="16GB", batch_size=2, graph=resnet_graph, spatial=False,
                  schedules=("gpipe", "1f1b"),  # one copy of a part per rank (GEMS runs two per rank)
                  example_inputs=torch.empty(1, 3, 224, 224, device="meta"))  # tiles could keep all 16 busy
    used = result.cluster.gpus
    assert used < 16 and result.cluster.gpus_available == 16
    assert used == result.layout.world_size == len(result.programs)
    assert used == result.num_stages * result.data_parallel
    assert f"uses {used} of 16 GPUs: a batch of 2 keeps at most 2 busy at once" in result.solver.why
    assert f"on {used} of 16 x V100-16GB" in str(result)


def test_num_stages_and_data_parallel_pick_the_layout(resnet_graph) -> None:
    result = plan(resnet50(), gpus=8, mem="16GB", batch_size=64, graph=resnet_graph, num_stages=(2,),
                  data_parallel=(2,), schedules=("gpipe", "1f1b"),  # a GEMS plan shows 2 copies x 2 stages
                  example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
    assert (result.num_stages, result.data_parallel, result.cluster.gpus) == (2, 2, 4)
    assert "uses 4 of 8 GPUs, as the stage count and data-parallel degree asked" in result.solver.why
    assert _tiny(gpus=4, data_parallel=(4,)).data_parallel == 4
    with pytest.raises(InvalidArgument, match=r"data_parallel \[3\] must divide gpus=4"):
        _tiny(gpus=4, data_parallel=(3,))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d: d["cluster"].update(gpus=-1), r"cluster.gpus is -1; it must be >= 1"),
    (lambda d: d["cluster"].update(gpus_per_node=0), r"cluster.gpus_per_node is 0"),
    (lambda d: d["cluster"].update(mem_bytes=0), r"cluster.mem_bytes is 0"),
    (lambda d: d["training"].update(micro_batch_size=0), r"training.micro_batch_size is 0; it must be >= 1"),
    (lambda d: d["training"].update(num_microbatches=0), r"training.num_microbatches is 0"),
    (lambda d: d["training"].update(global_batch_size=65),
     r"training.global_batch_size is 65, but micro_batch_size"),
    (lambda d: d["cluster"].update(gpus=9, gpus_available=16),
     r"cluster.gpus is 9 but the layout places 8 ranks"),
    (lambda d: d["programs"].pop(), r"programs has 7 rank programs but the layout places 8 ranks"),
    (lambda d: d["stages"].pop(), r"stages has \d parts but the layout has \d"),
    (lambda d: d["schedule"]["in_flight"].append(1), r"schedule.in_flight has \d entries but the layout has"),
    (lambda d: d["stages"][0].update(index=5), r"stages\[0\].index is 5; it must equal its position 0"),
    (lambda d: d["stages"][0].update(nodes=[]), r"stages\[0\].nodes is empty"),
    (lambda d: d["cluster"].update(reserve_bytes=-1), r"cluster.reserve_bytes is -1"),
    (lambda d: d["cluster"].update(gpus_available=2), r"cluster.gpus_available is 2; it must be at least"),
    (lambda d: d["transfers"].append({"src_stage": 0, "dst_stage": 99, "nbytes": 1, "ms": 0.1}),
     r"transfers\[\d+\] goes from stage 0 to 99"),
    (lambda d: d.update(tied_sums=[{"parts": [0], "names": ["w"], "nbytes": 8, "ms": 0.1}]),
     r"tied_sums\[0\].parts is \[0\]; it must list two or more different parts of 0\.\.\d+ in order"),
    (lambda d: d.update(tied_sums=[{"parts": [0, 99], "names": ["w"], "nbytes": 8, "ms": 0.1}]), r"tied_sums\[0\].parts is \[0, 99\]"),
    (lambda d: d.update(tied_sums=[{"parts": [0, 1], "names": ["w"], "nbytes": -8, "ms": 0.1}]),
     r"tied_sums\[0\] sums -8 bytes in 0.1 ms, a copy holding 0 bytes; none may be negative"),
    (lambda d: d.update(tied_sums=[{"parts": [0, 1], "names": ["w"], "nbytes": 8, "ms": 0.1, "state_bytes": -24}]),
     r"tied_sums\[0\] sums 8 bytes in 0.1 ms, a copy holding -24 bytes; none may be negative"),
])
def test_plan_invariants_are_checked_on_load_naming_the_field(resnet_plan: Plan, edit, message: str) -> None:
    data = json.loads(resnet_plan.to_json())
    edit(data)
    with pytest.raises(PlanFileError, match=message + ".*re-create the plan with `tessera plan`"):
        Plan.from_dict(data)


def test_the_runtime_check_is_the_plan_file_check(resnet_plan: Plan) -> None:
    import dataclasses

    from cost_models.errors import RuntimeSetupError
    from runtime import checks

    training = dataclasses.replace(resnet_plan.training, micro_batch_size=0)
    broken = dataclasses.replace(resnet_plan, training=training)
    with pytest.raises(RuntimeSetupError, match=r"plan field training.micro_batch_size is 0"):
        checks.check_plan(broken)


def test_infeasible_names_model_state_apart_from_working_memory(resnet_graph) -> None:
    """Model state is 16 B per parameter (fp32 Adam) plus buffers; the largest transient is not part of it."""
    from cost_models.units import format_bytes

    model = resnet50()
    with pytest.raises(PlanInfeasible) as raised:
        plan(model, gpus=1, mem="300MB", batch_size=1, graph=resnet_graph, reserve=0, offload=False,
             example_inputs=torch.empty(1, 3, 224, 224, device="meta"))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    state = 16 * sum(p.numel() for p in model.parameters()) + buffers
    message = str(raised.value)
    assert f"{format_bytes(state)} of model state (weights, gradients, optimizer state, buffers)" in message
    assert "of working memory (largest transient" in message and "send buffer 0 B" in message
    assert "more GPUs (more pipeline stages split the model state)" in message


def test_the_search_ranks_what_its_time_limit_allows_and_counts_the_rest_without_bounding_them() -> None:
    """Bounding every configuration took 10-20 s on ResNet-152 (1,100 of them), longer than a short time limit:
    the ranking stops at the limit, leaving the rest in listed order, and a search out of time counts as
    unexamined what it has no bound for instead of computing one (a 10 s limit had run 26 s)."""
    import time

    from cost_models.devices import get_device
    from planner.api import validate_space
    from planner.search.configs import configurations
    from planner.search.search import Search

    space, spec = validate_space(4, "1GB", 8, "V100-16GB", None, "adam", "fp32", None, None, 60.0)
    graph = trace(gpt_tiny(), torch.empty(1, 32, dtype=torch.long, device="meta"))
    search = Search(graph, get_device(spec), space)
    configs = search.distinct(configurations(space, max_stages=99))
    assert search.ranked(configs, deadline=time.perf_counter()) == configs  # out of time: none bounded
    assert search._known_bound(configs[0]) == float("-inf") and not search._bounds
    ranked = search.ranked(configs, deadline=float("inf"))
    assert sorted(ranked, key=configs.index) == configs and len(search._bounds) == len(configs)
    assert [round(search.lower_bound(c), 9) for c in ranked] == sorted(round(search.lower_bound(c), 9) for c in configs)
    assert search._known_bound(ranked[0]) == search.lower_bound(ranked[0])


def test_the_memory_by_kind_adds_up_to_the_stage_peak() -> None:
    from cost_models.devices import get_device
    from planner.api import validate_space
    from planner.search.configs import configurations
    from planner.search.infeasible import stage_memory
    from planner.search.oracle import min_peak_partition
    from planner.search.search import Search

    space, spec = validate_space(4, "1GB", 8, "V100-16GB", None, "adam", "fp32", ("1f1b",), (1,), 60.0, (4,),
                                 offload=False)
    graph = trace(gpt_tiny(), torch.empty(1, 32, dtype=torch.long, device="meta"))
    search = Search(graph, get_device(spec), space)
    setup = search.setup(configurations(space, max_stages=99)[0])  # 4 stages, 8 micro-batches of 1
    floor = min_peak_partition(setup.costs).evaluation
    for stage, summary in enumerate(floor.parts):
        memory = stage_memory(setup, stage, stage, summary.first_unit, summary.last_unit)
        assert memory.total_bytes == pytest.approx(floor.slot_peak_bytes[stage], abs=1)
        assert memory.state_bytes + memory.working_bytes == pytest.approx(summary.static_bytes, abs=1)


def test_the_printed_plan_labels_what_it_shows() -> None:
    one_stage = str(_tiny(mem="1GB", data_parallel=(2,)))  # 1 stage x 2 replicas: its idle share is the all-reduce
    title = one_stage.splitlines()[0]
    assert title.startswith("plan: 1 stage x 2 data-parallel") and "1 stages" not in one_stage
    assert "batch 8 = 2 replicas x 1 micro-batch x 4 samples" in title
    step = _lines(one_stage, "step: ")[0]
    assert "idle in all-reduce: " in step and "bubble" not in step and "headroom)" in step
    assert "memory" not in _lines(one_stage, "binding: ")[0]  # 0% of the budget is not binding
    with pytest.raises(PlanInfeasible) as raised:
        _tiny(mem=100_000, offload=False)
    tight_plan = _tiny(mem=raised.value.min_mem_bytes, offload=False)  # the smallest budget that fits
    tight = str(tight_plan)
    assert "2 stages x 1 data-parallel" in tight and "bubble: " in _lines(tight, "step: ")[0]
    binding = _lines(tight, "binding: ")[0]
    bound = re.search(r"; memory of rank (\d) \((9\d|100)% of the usable budget as the search bounds it, (\d+)% at its "
                      r"predicted peak(, at its optimizer step)?\)", binding)
    assert bound, binding
    usable = tight_plan.cluster.mem_bytes - tight_plan.cluster.reserve_bytes
    peak = tight_plan.predicted.peak_mem_bytes[int(bound[1])]
    assert int(bound[3]) == round(100 * peak / usable) <= int(bound[2])  # node by node: at most the bound


def test_a_gems_master_plans_why_line_names_its_configuration_as_its_title_does() -> None:
    """GEMS-MASTER's configuration counts its parts; its plan's title counts the two copies' stages: the
    why-line says both, in the title's words (it said "2 stages x 2 replicas" under "4 stages of 2 parts")."""
    gems = _tiny(gpus=4, schedules=("gems-master",), data_parallel=(2,))
    title, why = str(gems).splitlines()[0], gems.solver.why
    assert title.startswith("plan: 4 stages of 2 parts on 2 ranks x 2 data-parallel"), title
    assert why.startswith("4 stages of 2 parts on 2 ranks x 2 replicas, "), why


def test_configurations_running_the_same_programs_are_searched_once() -> None:
    """With one micro-batch GPipe and 1F1B generate the very same programs: the search keeps the first
    listed; with two they differ and both stay."""
    from cost_models.devices import get_device
    from planner.api import validate_space
    from planner.search.configs import configurations
    from planner.search.search import Search

    graph = trace(gpt_tiny(), torch.empty(1, 32, dtype=torch.long, device="meta"))
    for micro, expected in ((4, {"gpipe"}), (2, {"gpipe", "1f1b"})):
        space, spec = validate_space(2, "16GB", 4, "V100-16GB", None, "adam", "fp32", ("gpipe", "1f1b"), (micro,),
                                     60.0, (2,), data_parallel=(1,), offload=False)
        search = Search(graph, get_device(spec), space)
        every = configurations(space, max_stages=99)
        kept = search.distinct(every)
        assert {config.schedule.value for config in kept} == expected
        assert len(every) == 2 and len(kept) == len(expected)
        assert all(search.schedule(config).programs != search.schedule(other).programs or config == other
                   for config in kept for other in kept)
