"""The README's two set-up commands exist, and CI runs the test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)


def test_readme_has_exactly_two_setup_commands_and_ci_runs_the_test_one() -> None:
    blocks = _bash_blocks()
    assert len(blocks) == 2, blocks
    main_command, test_command = blocks
    assert "tessera plan" in main_command and "pytest" in test_command
    ci_lines = (ROOT / ".ci/run").read_text().splitlines()
    assert test_command in ci_lines
