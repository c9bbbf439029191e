"""The `tessera profile` command: the table it prints, the JSON it writes, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cost_models import CostTable
from planner.cli import main

ROOT = Path(__file__).resolve().parents[2]
RESNET = str(ROOT / "examples/models/resnet.py") + ":resnet50"


def test_profile_on_a_gpu_preset_prints_rows_and_totals(capsys, tmp_path) -> None:
    out = tmp_path / "costs.json"
    code = main(["profile", RESNET, "--input", "3x64x64", "--batch-size", "2", "--device",
                 "V100-16GB", "--model-arg", "width=8", "-o", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "conv1" in printed and "layer4_2_conv3" in printed and "Conv2d" in printed
    assert "2x8x32x32" in printed  # conv1's output shape
    assert "time per step on V100-16GB (roofline)" in printed
    table = CostTable.load(out)
    assert table.device == "V100-16GB" and table.source == "roofline" and len(table) > 100


def test_profile_on_cpu_measures_and_top_limits_rows(capsys, tmp_path) -> None:
    code = main(["profile", "examples.models.gpt:gpt_tiny", "--input", "32:int64", "--batch-size",
                 "2", "--device", "cpu", "--top", "3", "--repeats", "1", "--cache-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0 and "(3 shown)" in printed and "(measured)" in printed
    assert len([line for line in printed.splitlines() if "blocks_" in line or "linear" in line]) <= 3


@pytest.mark.parametrize(("args", "message"), [
    (["examples/models/resnet.py:nope"], "no builder function 'nope'"),
    (["missing/file.py:model"], "does not exist"),
    (["not a spec"], "malformed model spec"),
    (["examples.models.absent:model"], "cannot import"),
    ([RESNET, "--device", "T4"], "unknown device 'T4'"),
    ([RESNET, "--input", "3xax4"], "malformed input shape '3xax4'"),
    ([RESNET, "--model-arg", "width"], "malformed model argument 'width'"),
    ([RESNET, "--model-arg", "depth_multiplier=2"], "depth_multiplier"),
    ([RESNET, "--batch-size", "0"], "--batch-size must be >= 1"),
    ([RESNET, "--optimizer", "lamb", "--device", "V100-16GB"],
     "--optimizer: invalid choice: 'lamb' (choose from 'sgd', 'momentum', 'adam', 'adamw')"),
    ([RESNET, "--precision", "fp8", "--device", "V100-16GB"], "--precision: invalid choice: 'fp8'"),
])
def test_bad_input_is_one_line_and_exit_code_2(capsys, args: list[str], message: str) -> None:
    argv = ["profile", *args]
    argv += [] if "--input" in args else ["--input", "3x32x32"]
    argv += [] if "--batch-size" in args else ["--batch-size", "1"]
    argv += [] if "--device" in args else ["--device", "V100-16GB"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.err.count("\n") == 1 and captured.err.startswith("tessera: error: ")


def test_a_builder_that_raises_and_inputs_the_model_refuses_are_one_line(capfd, tmp_path: Path) -> None:
    """The builder's own error (a model checking its arguments) and an op failing on the example's shape
    each come as one line naming what failed, with nothing of torch's logging before it."""
    (tmp_path / "models.py").write_text("from torch import nn\n"
                                        "def raises(width=8):\n"
                                        "    raise ValueError('width must be even.')\n"
                                        "def mlp(width=8):\n"
                                        "    return nn.Sequential(nn.Linear(16, width), nn.ReLU())\n")
    raised = "raises() failed: ValueError: width must be even; fix the builder or its --model-arg values"
    for spec, shape, message in ((f"{tmp_path}/models.py:raises", "16", raised),
                                 (f"{tmp_path}/models.py:mlp", "17", "a and b must have same reduction dim")):
        assert main(["profile", spec, "--input", shape, "--batch-size", "1", "--device", "V100-16GB"]) == 2
        captured = capfd.readouterr()
        assert message in captured.err, captured.err
        assert captured.err.count("\n") == 1 and captured.err.startswith("tessera: error: ")


def test_a_name_a_module_lacks_suggests_the_closest_it_has(capsys) -> None:
    assert main(["profile", "torch.nn:Linaer", "--input", "16", "--batch-size", "1", "--device", "V100-16GB"]) == 2
    err = capsys.readouterr().err
    assert "torch.nn has no builder function 'Linaer'" in err and "did you mean Linear" in err and err.count("\n") == 1


def test_console_script_errors_have_no_traceback() -> None:
    result = subprocess.run([sys.executable, "-m", "planner", "profile", "examples/models/resnet.py:resnet50",
                             "--input", "3x32x32", "--batch-size", "1", "--device", "nope"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def _tessera(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """The real console script in a subprocess (``python -m planner`` runs the same entry point)."""
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=kwargs.pop("cwd", ROOT),
                          capture_output=True, text=True, timeout=timeout, **kwargs)


GPT_UNTIED = ["examples/models/gpt.py:gpt", "--model-arg", "hidden=64", "--model-arg", "layers=1",
              "--model-arg", "heads=4", "--model-arg", "seq_len=32", "--model-arg", "vocab=512",
              "--input", "32:int64", "--batch-size", "1", "--device", "V100-16GB"]


def test_model_arg_false_reaches_the_builder_as_false() -> None:
    untied = _tessera("profile", *GPT_UNTIED, "--model-arg", "tie_embeddings=false")
    tied = _tessera("profile", *GPT_UNTIED, "--model-arg", "tie_embeddings=true")
    assert untied.returncode == tied.returncode == 0, untied.stderr + tied.stderr
    assert "lm_head" in untied.stdout and "lm_head" not in tied.stdout


def test_ambiguous_model_arg_names_the_accepted_forms() -> None:
    result = _tessera("profile", *GPT_UNTIED, "--model-arg", "tie_embeddings=yes")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "tie_embeddings='yes' is ambiguous" in result.stderr and "true/false" in result.stderr


@pytest.mark.parametrize(("text", "value"), [
    ("false", False), ("True", True), ("none", None), ("10", 10), ("-3", -3), ("0.5", 0.5),
    ("1e-3", 1e-3), ("'false'", "false"), ('"16GB"', "16GB"), ("gelu", "gelu"),
    ("[3, 4, 6, 3]", [3, 4, 6, 3]), ("[]", []),
])
def test_model_arg_values(text: str, value) -> None:
    from cost_models.graph.model_spec import parse_model_args

    parsed = parse_model_args([f"key={text}"])["key"]
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("text", ["yes", "16GB", "1e", "0x10", "1_000", "a b", "[1, yes]"])
def test_ambiguous_model_arg_values_are_rejected(text: str) -> None:
    from cost_models.errors import InvalidArgument
    from cost_models.graph.model_spec import parse_model_args

    with pytest.raises(InvalidArgument, match="ambiguous: write true/false, none"):
        parse_model_args([f"key={text}"])


def test_calibrate_cpu_writes_a_device_file_that_plan_accepts(capsys, tmp_path) -> None:
    from cost_models.devices import get_device

    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "matmul TFLOP/s: fp64" in printed and "optimizer step: adam" in printed
    assert f"wrote {out}; plan with --device {out}" in printed
    assert "gloo TCP loopback (measured)" in printed
    spec = get_device(out)
    assert spec.fp32_tflops > 0 and spec.mem_bandwidth_gb_per_s > 0 and spec.intra_node.latency_us > 0
    assert spec.matmul_efficiency == 1.0  # measured figures, not datasheet peaks
    code = main(["plan", "examples/models/gpt.py:gpt_tiny", "--input", "32:int64", "--batch-size", "8", "--gpus",
                 "2", "--mem", "1GB", "--device", str(out), "--no-profile", "-q"])
    assert code == 0 and "x cpu (1.0 GiB budget" in capsys.readouterr().out


@pytest.mark.parametrize(("device", "message"), [
    ("tpu", "cannot calibrate device 'tpu'; give cpu, cuda or cuda:N"),
    ("cuda", "torch sees no CUDA device on this machine"),
])
def test_calibrate_what_cannot_be_measured_here_is_one_line(capsys, device: str, message: str) -> None:
    if device == "cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    assert main(["calibrate", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_model_returning_a_tuple_is_refused_by_tessera_run_in_one_line_before_launch(tmp_path: Path) -> None:
    """It planned, then every rank crashed in the synthetic loss ('tuple' object has no attribute 'dim')."""
    (tmp_path / "tupled.py").write_text(
        "import torch\n\n\nclass Tupled(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)\n\n    def forward(self, x):\n"
        "        h = self.a(x)\n        return self.b(h), h.mean()\n\n\ndef tupled():\n    return Tupled()\n")
    planned = _tessera("plan", "tupled.py:tupled", "--input", "8", "--batch-size", "4", "--gpus", "1", "--mem", "1GB",
                       "--device", "V100-16GB", "-o", "plan.json", "-q", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    ran = _tessera("run", "plan.json", "--steps", "1", cwd=tmp_path)
    assert ran.returncode == 2 and ran.stderr.count("\n") == 1, ran.stderr
    assert "returns a tuple of 2 values" in ran.stderr and "runtime.Executor" in ran.stderr


def test_a_plan_made_with_leaf_modules_records_them_and_its_model_rebuilds_without_them_given(
        tmp_path: Path) -> None:
    """`tessera run` of a plan made with --leaf refused its model ('graph fingerprint differs ... re-plan it')
    unless the run was given `-- --leaf` again: the plan file now records them and the runtime traces with them."""
    from planner.plan import Plan
    from planner.preflight import rebuild_model, trace_checked

    (tmp_path / "gated.py").write_text(
        "import torch\n\n\nclass Gate(torch.nn.Module):\n    def forward(self, x):\n"
        "        return x if x.sum() > 0 else -x\n\n\ndef gated():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 8), Gate(), torch.nn.Linear(8, 4))\n")
    planned = _tessera("plan", "gated.py:gated", "--input", "8", "--batch-size", "4", "--gpus", "1", "--mem", "1GB",
                       "--device", "V100-16GB", "--leaf", "Gate", "-o", "plan.json", "-q", cwd=tmp_path)
    assert planned.returncode == 0, planned.stderr
    made = Plan.load(tmp_path / "plan.json")
    assert made.model.leaf_modules == ("Gate",)
    traced = trace_checked(rebuild_model(made, tmp_path), made)  # no leaf modules given: the plan's
    assert any(node.op == "call_module" and node.target == "1" for node in traced.graph.nodes)
    import importlib.util

    from planner.manual import plan_with_split

    spec = importlib.util.spec_from_file_location("gated", tmp_path / "gated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    split = plan_with_split(module.gated(), example_inputs=torch.zeros(1, 8), stage_starts=["_2"], batch_size=4,
                            micro_batch_size=2, leaf_modules=[module.Gate])  # a hand-made split records them too
    assert split.model.leaf_modules == ("Gate",)
