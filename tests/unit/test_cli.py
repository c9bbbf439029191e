"""The `tessera profile` command: the table it prints, the JSON it writes, one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_console_script_errors_have_no_traceback() -> None:
    result = subprocess.run([sys.executable, "-m", "planner", "profile", "examples/models/resnet.py:resnet50",
                             "--input", "3x32x32", "--batch-size", "1", "--device", "nope"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1
