"""`tessera plan` through the real console script: flags, memory sizes, warnings, errors, help."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from planner.plan.kinds import ScheduleKind

ROOT = Path(__file__).resolve().parents[2]
TINY = ["plan", "examples/models/gpt.py:gpt_tiny", "--input", "32:int64", "--batch-size", "8", "--gpus", "2"]


def tessera(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m planner`` runs the same entry point as the ``tessera`` console script."""
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("tessera: error: "), result.stderr
    return result.stderr


@pytest.mark.parametrize(("mem", "message"), [
    ("16", "memory size '16' has no unit; write it with one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"),
    ("-16GB", "memory size '-16GB' must be positive"),
])
def test_memory_sizes_need_a_unit_and_a_sign_that_makes_sense(mem: str, message: str) -> None:
    assert message in _one_error_line(tessera(*TINY, "--mem", mem))


def test_profile_on_a_gpu_this_machine_lacks_is_one_line() -> None:
    message = "needs the GPU on this machine, but it has no 'A100-40GB'"
    assert message in _one_error_line(tessera(*TINY, "--mem", "8GB", "--device", "A100-40GB", "--profile"))


def test_a_budget_above_the_device_memory_is_one_warning_line() -> None:
    result = tessera(*TINY, "--mem", "2TB", "--device", "V100-16GB")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("tessera: warning:")]
    assert warnings == ["tessera: warning: the budget 2.0 TiB per GPU exceeds the V100-16GB's 16.0 GiB; "
                        "planning for it anyway (is --mem right?)"]


def test_the_reserve_is_subtracted_and_shown() -> None:
    result = tessera(*TINY, "--mem", "1GB", "--reserve", "256MB")
    assert result.returncode == 0, result.stderr
    assert "1.0 GiB budget each less 256.0 MiB reserved: 768.0 MiB usable" in result.stdout
    assert "of 768.0 MiB usable" in result.stdout
    assert "leaves nothing" in _one_error_line(tessera(*TINY, "--mem", "1GB", "--reserve", "2GB"))


def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    """A folder given as -o is refused before the search; a plan saved where it cannot be written says where, in
    one line (it was a traceback naming the temporary file)."""
    from cost_models.errors import PlanFileError
    from planner.plan import Plan

    said = _one_error_line(tessera(*TINY, "--mem", "1GB", "-o", str(tmp_path)))
    assert f"cannot write the plan to {str(tmp_path)!r}: it is a folder; give a file name" in said
    made = tessera(*TINY, "--mem", "1GB", "-o", str(tmp_path / "plan.json"))
    assert made.returncode == 0, made.stderr
    plan = Plan.load(tmp_path / "plan.json")
    with pytest.raises(PlanFileError, match=f"cannot write the plan to {str(tmp_path)!r}: Is a directory"):
        plan.save(tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["plan.json"]  # no temporary file left


@pytest.mark.parametrize("limit", ["0", "-5"])
def test_non_positive_time_limits_are_refused(limit: str) -> None:
    message = _one_error_line(tessera(*TINY, "--mem", "1GB", "--time-limit", limit))
    assert f"the time limit must be a number of seconds > 0, got {float(limit)!r}" in message


def test_help_names_the_global_batch_and_shows_defaults() -> None:
    plan_help, profile_help = tessera("plan", "--help"), tessera("profile", "--help")
    assert plan_help.returncode == profile_help.returncode == 0
    text = " ".join(plan_help.stdout.split())
    assert "global batch per training step" in text and "samples per micro-batch" not in text
    for default in ("(default V100-16GB)", "(default 60)", "(default 5% of MEM", "(default min(GPUS, 8))"):
        assert default in text, default
    profile_text = " ".join(profile_help.stdout.split())
    assert "samples in the traced batch" in profile_text and "(default cpu)" in profile_text


UNTRACEABLE = '''
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # depends on values: neither torch.fx nor torch.export captures it
            return self.inner(x)
        return x


def model():
    return nn.Sequential(Gate(), nn.Linear(8, 2))
'''


def test_an_untraceable_model_is_one_line_and_verbose_shows_torch_output(tmp_path: Path) -> None:
    (tmp_path / "untraceable.py").write_text(UNTRACEABLE)
    args = ["plan", "untraceable.py:model", "--input", "8", "--batch-size", "4", "--gpus", "2",
            "--mem", "1GB"]
    quiet = tessera(*args, cwd=tmp_path)
    assert "cannot trace Sequential" in _one_error_line(quiet) and quiet.stdout == ""
    assert "(--verbose prints the details)" in quiet.stderr
    verbose = tessera(*args, "--verbose", cwd=tmp_path)
    assert verbose.returncode == 2 and "def forward" in verbose.stderr
    assert verbose.stderr.splitlines()[-1].startswith("tessera: error: cannot trace Sequential")


def _progress_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tessera: ") and " error: " not in line
            and "warning:" not in line]


def test_progress_on_request_and_quiet_otherwise() -> None:
    shown = tessera(*TINY, "--mem", "1GB", "--progress")
    assert shown.returncode == 0, shown.stderr
    lines = _progress_lines(shown.stderr)
    assert lines[0] == "tessera: tracing: GPT" and lines[-1].startswith("tessera: assembling")
    assert any(re.match(r"tessera: searching (\d+)/\1 configurations, best so far", line) for line in lines)
    assert "plan:" in shown.stdout
    for quiet in (tessera(*TINY, "--mem", "1GB"), tessera(*TINY, "--mem", "1GB", "-q")):  # stderr is a pipe
        assert quiet.returncode == 0 and _progress_lines(quiet.stderr) == []
    assert "not allowed with argument" in _one_error_line(tessera(*TINY, "--mem", "1GB", "-q", "--progress"))


SLOW_SOLVE = ["plan", "examples/models/gpt.py:gpt_50b", "--input", "1024:int64", "--batch-size", "8",
              "--gpus", "32", "--mem", "80GB", "--device", "A100-80GB", "--num-stages", "32",
              "--micro-batch-size", "1", "--schedule", "gpipe", "--no-offload", "--progress"]  # one ILP of about 30 s


def test_ctrl_c_inside_a_long_solve_stops_at_once_leaving_the_plan_file(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    out.write_text("precious")
    process = subprocess.Popen([sys.executable, "-m", "planner", *SLOW_SOLVE, "-o", str(out)], cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               # a shell's background job ignores SIGINT, and Python keeps it ignored
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in process.stderr:  # wait until the solver runs
            if ": solving " in line:
                break
        time.sleep(2.0)
        process.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, rest = process.communicate(timeout=60)
        waited_s = time.monotonic() - sent
    finally:
        process.kill()
    assert process.returncode == 130 and rest == "tessera: interrupted\n", rest
    # about 0.5 s to cancel HiGHS and 1 s for Python to unload torch (2 s in all on an idle machine);
    # without the cancel it waited for the solve, 20-30 s
    assert waited_s < 6.0, f"exited {waited_s:.1f} s after SIGINT"
    assert out.read_text() == "precious"


def test_num_stages_and_data_parallel_flags() -> None:
    args = ["plan", "examples/models/gpt.py:gpt_tiny", "--input", "32:int64", "--batch-size", "8",
            "--gpus", "4", "--mem", "1GB"]
    result = tessera(*args, "--num-stages", "2", "--data-parallel", "2")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("plan: 2 stages x 2 data-parallel on 4 x V100-16GB")
    assert "data_parallel [3] must divide gpus=4" in _one_error_line(tessera(*args, "--data-parallel", "3"))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("cluster.gpus", -1, "plan field cluster.gpus is -1; it must be >= 1"),
    ("training.micro_batch_size", 0, "plan field training.micro_batch_size is 0; it must be >= 1"),
    ("training.global_batch_size", 13, "plan field training.global_batch_size is 13, but micro_batch_size"),
])
@pytest.mark.parametrize("command", ["show", "simulate"])
def test_show_and_simulate_refuse_a_plan_breaking_an_invariant(tmp_path: Path, command: str, field: str,
                                                               value: int, message: str) -> None:
    data = json.loads((ROOT / "tests" / "data" / "plan_v1_gpt_tiny_2x2.json").read_text())
    section, name = field.split(".")
    data[section][name] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert message in _one_error_line(tessera(command, str(path), cwd=tmp_path))


def test_a_schema_1_plan_with_more_replicas_than_ranks_is_one_line(tmp_path: Path) -> None:
    data = json.loads((ROOT / "tests" / "data" / "plan_v1_gpt_tiny_2x2.json").read_text())
    data["data_parallel"] = 3
    (tmp_path / "plan.json").write_text(json.dumps(data))
    message = _one_error_line(tessera("show", "plan.json", cwd=tmp_path))
    assert "data_parallel is 3 but stages[0].ranks lists 2 ranks" in message


def test_a_plan_names_its_model_file_so_that_it_resolves_from_anywhere(tmp_path: Path) -> None:
    import dataclasses
    import warnings

    from cost_models.errors import TesseraWarning
    from cost_models.graph.model_spec import resolve_builder
    from planner.plan import Plan
    from runtime.build import rebuild_model

    out = tmp_path / "plan.json"
    result = tessera(*TINY, "--mem", "1GB", "-o", str(out))  # run from the project root, relative path
    assert result.returncode == 0, result.stderr
    plan = Plan.load(out)
    assert plan.model.builder == f"{ROOT / 'examples/models/gpt.py'}:gpt_tiny"
    assert plan.model.builder_relative == "examples/models/gpt.py:gpt_tiny"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert type(rebuild_model(plan, elsewhere)).__name__ == "GPT"  # the runtime's own rebuild, another folder
    moved = dataclasses.replace(plan, model=dataclasses.replace(plan.model, builder="/gone/gpt.py:gpt_tiny"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, used = resolve_builder(moved.model.builder_specs, ROOT)  # a copy of the project: the relative form
    assert used == "examples/models/gpt.py:gpt_tiny"
    assert [str(w.message) for w in caught if w.category is TesseraWarning] == [
        f"model file of '/gone/gpt.py:gpt_tiny' does not exist; using 'examples/models/gpt.py:gpt_tiny' "
        f"(from {ROOT})"]
    assert resolve_builder(plan.model.builder_specs, elsewhere)[1] == plan.model.builder


def test_a_schedule_that_does_not_exist_is_one_line_naming_the_families() -> None:
    result = tessera(*TINY, "--mem", "16GB", "--schedule", "pipedream", "--schedule", "1f1b")
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "argument --schedule: invalid choice: 'pipedream'" in last, result.stderr
    assert all(kind.value in last for kind in ScheduleKind), last


def test_offload_chooses_the_memory_decisions_the_search_may_make() -> None:
    """Megatron's 8.3B GPT in fp16 on one V100-32GB fits only with its gradients sent to the host."""
    args = ["plan", "examples/models/gpt.py:megatron_8_3b", "--input", "1024:int64", "--batch-size", "8",
            "--gpus", "1", "--mem", "32GB", "--device", "V100-32GB", "--precision", "fp16", "-q"]
    kept = tessera(*args, "--offload", "recompute", "--offload", "host", "--offload", "nvme")
    assert kept.returncode == 2 and "no plan fits 30.4 GiB" in _one_error_line(kept)
    sent = tessera(*args, "--offload", "recompute", "--offload", "nvme", "--offload", "grads")
    assert sent.returncode == 0, sent.stderr
    decided = "optimizer state on NVMe, step on host, gradients to host each backward"
    assert "stage 0: recompute" in sent.stdout and decided in sent.stdout, sent.stdout
    wrong = tessera(*args, "--offload", "tape")
    assert wrong.returncode == 2 and all(kind in wrong.stderr.splitlines()[-1] for kind in (
        "'recompute'", "'swap'", "'zero'", "'host'", "'nvme'", "'grads'")), wrong.stderr
    both = tessera(*args, "--offload", "host", "--no-offload")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr.splitlines()[-1], both.stderr


def test_wpipe_needs_allow_stale_weights_and_the_plan_says_what_is_stale() -> None:
    refused = _one_error_line(tessera(*TINY, "--mem", "16GB", "--schedule", "wpipe"))
    assert "schedule 'wpipe' trains the first half of the model's parts on weights one update old" in refused
    assert "--allow-stale-weights" in refused
    result = tessera(*TINY, "--mem", "16GB", "--schedule", "wpipe", "--allow-stale-weights")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("plan: 4 stages on 2 ranks x 1 data-parallel on 2 x V100-16GB")
    assert ", wpipe, " in lines[0]
    assert "stale weights (wpipe, allowed by allow_stale_weights): stages 0-1 compute each step on their weights " \
           "from before the previous update (one update late); stages 2-3 update as usual" in lines
