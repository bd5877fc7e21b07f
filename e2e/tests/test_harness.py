"""The harness leaves no process behind: on a clean stop, on a killed test run, on a failed start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lockstep_e2e import build
from lockstep_e2e.cluster import COMPONENTS, ClusterError, LocalCluster

pytestmark = pytest.mark.cluster


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """``python -m lockstep_e2e.cluster`` in its own process, killed (with its tree) after the test."""
    process = subprocess.Popen(
        [sys.executable, "-m", "lockstep_e2e.cluster", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    yield process
    for leftover in psutil.Process(process.pid).children(recursive=True) if process.poll() is None else []:
        leftover.kill()
    process.kill()
    process.wait()


def _wait_until_up(runner: subprocess.Popen[str]) -> list[psutil.Process]:
    """Read the runner's output until the cluster is up; return the runner's child processes."""
    assert runner.stdout is not None
    output = []
    for line in runner.stdout:
        output.append(line)
        if line.startswith("cluster up"):
            break
    else:
        pytest.fail(f"the cluster process exited with {runner.wait()} before the cluster was up:\n{''.join(output)}")
    children = psutil.Process(runner.pid).children(recursive=True)
    assert {child.name() for child in children} == set(COMPONENTS)
    return children


def _all_gone(processes: list[psutil.Process]) -> list[str]:
    _, alive = psutil.wait_procs(processes, timeout=30)
    return [f"{p.pid} {p.name()}" for p in alive]


def test_clean_stop_leaves_no_process(runner: subprocess.Popen[str]) -> None:
    children = _wait_until_up(runner)
    runner.send_signal(signal.SIGINT)
    assert runner.wait(timeout=60) == 0
    assert _all_gone(children) == []


def test_killed_runner_leaves_no_process(runner: subprocess.Popen[str]) -> None:
    children = _wait_until_up(runner)
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=30)
    assert _all_gone(children) == []


def test_failed_start_stops_what_was_started_and_says_why(tmp_path: Path) -> None:
    broken = tmp_path / "bin"
    broken.mkdir()
    for name in build.BINARIES:
        (broken / name).symlink_to(build.bin_dir() / name)
    (broken / "kube-apiserver").unlink()
    (broken / "kube-apiserver").write_text("#!/bin/sh\necho 'error: simulated apiserver failure' >&2\nexit 3\n")
    (broken / "kube-apiserver").chmod(0o755)

    cluster = LocalCluster(tmp_path / "cluster", bin_dir=broken)
    with pytest.raises(ClusterError) as failure:
        cluster.start()
    message = str(failure.value)
    assert "kube-apiserver exited with code 3" in message
    assert "simulated apiserver failure" in message
    etcd = next(c for c in cluster.components if c.name == "etcd")
    assert etcd.process is not None
    assert etcd.process.poll() is not None, "etcd was left running after the failed start"


def test_missing_binaries_are_named_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"missing control-plane binaries .*make binaries"):
        LocalCluster(tmp_path, bin_dir=tmp_path / "nothing-here").start()
