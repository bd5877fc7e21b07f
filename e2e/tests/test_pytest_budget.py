"""The suite's time budget (lockstep_e2e.pytest_budget): past it, a warning that names the slowest tests, written
before pytest's short summary and without failing the run; a run in which no test ran does not pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import lockstep_e2e

PACKAGES = str(Path(lockstep_e2e.__file__).parents[1])
"""Where this lockstep_e2e was imported from: the subprocess imports the same plugin."""

TESTS = """
import time

import pytest


def test_slow():
    time.sleep(0.3)


def test_quick():
    pass


def test_fails():
    assert False


@pytest.mark.skip(reason="to show a run of skipped tests only")
def test_skipped():
    pass
"""


def pytest_run(directory: Path, budget_minutes: float, *arguments: str) -> subprocess.CompletedProcess[str]:
    (directory / "test_sample.py").write_text(TESTS)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "lockstep_e2e.pytest_budget",
            "-p",
            "no:cacheprovider",
            "-ra",
            *arguments,
        ],
        cwd=directory,
        env={
            **os.environ,
            "LOCKSTEP_TEST_BUDGET_MINUTES": str(budget_minutes),
            "PYTHONPATH": os.pathsep.join(p for p in (PACKAGES, os.environ.get("PYTHONPATH")) if p),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_run_over_its_budget_warns_with_the_slowest_tests_then_names_the_failures_last(tmp_path: Path) -> None:
    run = pytest_run(tmp_path, 0.001)
    assert run.returncode == 1, "the failing test fails the run, the budget does not"
    lines = run.stdout.splitlines()
    warning = next(i for i, line in enumerate(lines) if line.startswith("WARNING: the tests took"))
    named = [line.split()[-1] for line in lines[warning + 1 : warning + 5]]
    assert set(named) == {f"test_sample.py::test_{name}" for name in ("slow", "quick", "fails", "skipped")}, named
    summary = next(i for i, line in enumerate(lines) if "short test summary info" in line)
    assert summary > warning and any(line.startswith("FAILED test_sample.py::test_fails") for line in lines[summary:])


def test_the_slowest_tests_add_their_setup_call_and_teardown_and_come_slowest_first() -> None:
    """The ranking, apart from the clock (the run above only checks which tests the warning names: on a loaded
    machine a failing test's report can take longer than a sleeping one)."""
    from types import SimpleNamespace
    from typing import Any

    from lockstep_e2e.pytest_budget import slowest_tests

    phases = [("a", 0.1), ("b", 0.5), ("a", 0.3), ("c", 0.2), ("a", 0.2)]
    reports: Any = [SimpleNamespace(nodeid=nodeid, duration=seconds) for nodeid, seconds in phases]
    assert slowest_tests(reports, 2) == [("a", pytest.approx(0.6)), ("b", 0.5)]


def test_a_run_within_its_budget_says_nothing_of_it(tmp_path: Path) -> None:
    run = pytest_run(tmp_path, 40, "-k", "quick")
    assert run.returncode == 0 and "WARNING" not in run.stdout and "budget exceeded" not in run.stdout, run.stdout


def test_a_run_in_which_no_test_ran_does_not_pass(tmp_path: Path) -> None:
    run = pytest_run(tmp_path, 40, "-k", "skipped")
    assert run.returncode == 5 and "no test ran" in run.stdout, run.stdout
