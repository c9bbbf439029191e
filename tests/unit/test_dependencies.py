"""pyproject's lower bounds admit only releases that have every API the code calls."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LP_PROBLEM_SINCE = {
    "add_variable": (3, 3, 1),  # pulp 3.3.0 has neither: the ILP failed with AttributeError there
    "get_constraint_by_name": (3, 3, 1),
    "solve": (1, 0),
    "status": (1, 0),
    "sol_status": (2, 0),
    "objective": (1, 0),
    "solverModel": (2, 0),  # set by the HiGHS API (3.3.0 has it too): the highspy model, to cancel a solve
    "constraints": (3, 3, 1),  # called: the rows as a list (earlier releases had a dict here); read with the next
    "variables": (1, 0),  # two to hand HiGHS the model as pulp's HiGHS API would (buildSolverModel)
    "sense": (1, 0),
}
"""Every attribute planner/search/ilp.py reads on a pulp.LpProblem, and the release that has it."""


def _minimum(package: str) -> tuple[int, ...]:
    match = re.search(rf'"{package}>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, f"pyproject.toml gives no lower bound for {package}"
    return tuple(int(part) for part in match.group(1).split("."))


def _on_problem(value: ast.expr) -> bool:
    """``lp.x``, ``self.lp.x`` or ``model.problem.x``: the ILP module's names for its pulp.LpProblem."""
    if isinstance(value, ast.Name):
        return value.id == "lp"
    return isinstance(value, ast.Attribute) and (value.attr == "lp" or (
        value.attr == "problem" and isinstance(value.value, ast.Name) and value.value.id == "model"))


HIGHS_SINCE = {
    "startSolve": (1, 8),  # the threaded solve Ctrl-C cancels: highspy 1.7.2 has none of these
    "wait": (1, 8),
    "cancelSolve": (1, 8),
    "HandleUserInterrupt": (1, 8),
    "getModelStatus": (1, 8),  # a solve error, solved again with a stricter tolerance (pulp's HiGHS API calls
    "setOptionValue": (1, 8),  # both, as every highspy it supports has them)
    "addVars": (1, 8),  # the model handed over in arrays (buildSolverModel); highspy 1.8.0 takes them as called
    "changeColsCost": (1, 8),
    "changeColsIntegrality": (1, 8),
    "addRows": (1, 8),
}
"""Every attribute planner/search/ilp.py uses on highspy's Highs model, and the release that has it."""


def test_highspys_lower_bound_has_every_method_the_interruptible_solve_calls() -> None:
    tree = ast.parse((ROOT / "planner" / "search" / "ilp.py").read_text())
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == "highs"}
    assert used, "ilp.py no longer names its highspy model `highs`: update this test"
    unrecorded = used - set(HIGHS_SINCE)
    assert not unrecorded, f"record since which highspy release Highs has {sorted(unrecorded)}"
    needed = max(HIGHS_SINCE[name] for name in used)
    allowed = _minimum("highspy")
    assert allowed >= needed, f"pyproject allows highspy {allowed} but ilp.py needs {needed}"


def test_pulps_lower_bound_has_every_problem_attribute_the_ilp_reads() -> None:
    tree = ast.parse((ROOT / "planner" / "search" / "ilp.py").read_text())
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _on_problem(node.value)}
    unrecorded = used - set(LP_PROBLEM_SINCE)
    assert not unrecorded, f"record since which pulp release LpProblem has {sorted(unrecorded)}"
    needed = max(LP_PROBLEM_SINCE[name] for name in used)
    assert _minimum("pulp") >= needed, f"pyproject allows pulp {_minimum('pulp')} but the ILP needs {needed}"
