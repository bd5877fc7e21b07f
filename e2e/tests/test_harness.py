"""The harness leaves no process behind: on a clean stop (within one grace period), on a killed test run, on a
failed start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lockstep_e2e import build
from lockstep_e2e.cluster import COMPONENTS, ClusterError, Component, LocalCluster

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


# A process that ignores SIGTERM; it says so once its handler is in place.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
)
POLITE = "import time; print('ready', flush=True); time.sleep(600)"


def test_stop_is_bounded_by_one_grace_period_however_many_components_hang(tmp_path: Path) -> None:
    cluster = LocalCluster(tmp_path, stop_grace_seconds=2.0)
    # Stand-ins: one that exits on SIGTERM, two that hang, and an etcd that hangs (stopped after the others).
    stand_ins = {"kwok": POLITE, "kube-scheduler": STUBBORN, "kube-apiserver": STUBBORN, "etcd": STUBBORN}
    for name, script in stand_ins.items():
        component = Component(name, [sys.executable, "-c", script], tmp_path / f"{name}.log")
        cluster.components.append(component)
        component.start()
    deadline = time.monotonic() + 30
    while not all(c.log_path.read_text().startswith("ready") for c in cluster.components):
        assert time.monotonic() < deadline, "the stand-in components did not start"
        time.sleep(0.05)

    started = time.monotonic()
    cluster.stop()
    elapsed = time.monotonic() - started

    # The promise: one grace period for all (not one each, as a stop that goes one by one takes), plus
    # a moment to kill and reap; 1 s of slack for a loaded machine.
    assert elapsed < cluster.stop_grace_seconds + 1.0, f"stop took {elapsed:.1f}s"
    codes = [c.process.returncode for c in cluster.components if c.process is not None]
    assert codes == [-signal.SIGTERM, -signal.SIGKILL, -signal.SIGKILL, -signal.SIGKILL]


def test_a_killed_pod_takes_its_children_with_it_as_a_container_does(tmp_path: Path) -> None:
    """A local pod (own_group) whose main process started a child: SIGKILL ends both (a trainer's reward
    processes must not outlive it), while SIGTERM goes to the main process alone, as the kubelet sends it."""
    child_pid = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {child_pid}; trap 'echo terminated' TERM; wait; wait"
    pod = Component("pod/x", ["bash", "-c", script], tmp_path / "pod.log", own_group=True)
    pod.start()
    deadline = time.monotonic() + 10
    while not child_pid.exists() or not child_pid.read_text().strip():
        assert time.monotonic() < deadline, "the pod did not start its child"
        time.sleep(0.05)
    child = psutil.Process(int(child_pid.read_text()))
    pod.send(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while "terminated" not in pod.log_path.read_text():
        assert time.monotonic() < deadline, "the main process did not get SIGTERM"
        time.sleep(0.05)
    assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE, "SIGTERM reached the child"
    pod.send(signal.SIGKILL)
    assert pod.process is not None and pod.process.wait(timeout=10) == -signal.SIGKILL
    assert child.wait(timeout=10) is None or not child.is_running(), "the child outlived its pod"


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
