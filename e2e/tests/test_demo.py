"""The demo's metrics table reads whole in an 80-column terminal and a log file; Ctrl-C stops every process the
demo started."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from lockstep_e2e.demo import COLUMNS, STOPPING, metrics_table
from lockstep_e2e.fixtures import wait_for
from lockstep_e2e.rl import EVAL


def test_the_metrics_table_fits_80_columns_with_every_value_whole() -> None:
    widest = {
        "step": 120,
        "reward": 0.984,
        EVAL: 0.775,
        "clamp_log_ratio_new_old_indicator": 0.0123,
        "kl_new_old": -1.23e-05,
        "ess": 0.987,
        "onpolicy_mean_abs_logprob_diff": None,
        "staleness": 2,
        "seconds": 117.2,
        "actor_busy_fraction": 1.0,
    }
    assert set(widest) == {key for _, key, _, _ in COLUMNS}
    console = Console(width=80, record=True, file=io.StringIO())
    console.print(metrics_table("smollm2", [widest, {"step": 121, "reward": 0.5}]))
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 80
    table = "\n".join(lines)
    assert "…" not in table
    for shown in ("120", "0.984", "0.78", "0.012", "-1.2e-05", "0.987", "none", "117.2", "100%", "121", "0.500"):
        assert shown in table, shown


def started_by(workdir: Path) -> list[psutil.Process]:
    """The processes that name ``workdir`` in their command line or environment, or write a file under it: the
    control plane's, the operator's, and every pod's with its children (vLLM's engine core and workers, renamed, still
    write to the pod's log and inherit its KUBECONFIG)."""
    found = []
    for process in psutil.process_iter():
        try:
            texts = [*process.cmdline(), *process.environ().values(), *(f.path for f in process.open_files())]
            if process.pid != os.getpid() and any(str(workdir) in text for text in texts):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def vllm_engines(workdir: Path) -> list[psutil.Process]:
    return [process for process in started_by(workdir) if process.name().startswith("VLLM::Engine")]


@pytest.mark.cluster
@pytest.mark.vllm
def test_ctrl_c_twice_while_the_job_runs_leaves_no_process_behind(tmp_path: Path) -> None:
    """Issue 48: Ctrl-C (SIGINT to the demo's process group, as a terminal sends it) once the actors' vLLM engines
    run, and again while it stops: it exits with 130, and nothing it started is left."""
    workdir = tmp_path / "demo"
    demo = subprocess.Popen(
        [sys.executable, "-m", "lockstep_e2e.demo", "--tiny", "--workdir", str(workdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert demo.stdout is not None
        said = []
        for line in demo.stdout:
            said.append(line)
            if "starting their containers" in line:
                break
        else:
            pytest.fail(f"the demo exited with {demo.wait()} before its pods started:\n{''.join(said)}")
        wait_for(lambda: len(vllm_engines(workdir)) == 2, "the two actors' vLLM engine cores", timeout=120)
        os.killpg(demo.pid, signal.SIGINT)
        time.sleep(0.5)
        os.killpg(demo.pid, signal.SIGINT)
        rest = demo.communicate(timeout=180)[0]
        left = [f"{p.pid} {p.name()}" for p in psutil.wait_procs(started_by(workdir), timeout=10)[1]]
    finally:
        demo.kill()
        for process in started_by(workdir):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
    assert demo.returncode == 130, rest
    assert STOPPING in rest and "stopped: no process the demo started is left" in rest, rest
    assert left == [], f"left running after the demo exited: {left}"
