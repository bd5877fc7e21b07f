"""A real RL run on the local control plane: the tiny demo task, trained by an RLJob's own pods.

The operator creates the pods; the pod runner starts each one's container command (vLLM actors and
torch trainer ranks) as a local process; the trainer announces each step's weights and the operator
carries them to the actors in barriers. Used by the demo and the end-to-end test.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.jobs import create_job, get_job, job_pods, phase, rljob
from lockstep_e2e.podrunner import running_pods
from lockstep_workers.tiny_model import create_tiny_llama

UPDATE_LINE = re.compile(r"weight update done: (\{.*\})")


def tiny_rl_job(name: str, model: Path, shared: Path, *, steps: int, actors: int, trainers: int) -> dict[str, Any]:
    """An RLJob that teaches the tiny random Llama at ``model`` the demo task, on the CPU."""
    return rljob(
        name,
        actors=actors,
        trainers=trainers,
        vllm={"dtype": "float32", "enforceEager": True, "maxModelLen": 256, "gpuMemoryUtilization": 0.2},
        model={"uri": str(model), "dtype": "float32"},
        weightSync={"volume": {"hostPath": {"path": str(shared), "type": "DirectoryOrCreate"}}},
        trainer={
            "steps": steps,
            "maxLag": 1,
            "rollout": {"promptsPerStep": 8, "samplesPerPrompt": 8, "maxTokens": 8, "temperature": 1.0},
            "objective": {
                "algorithm": "grpo",
                "learningRate": 0.003,
                "minibatches": 2,
                "truncatedImportanceSampling": {"enabled": True, "cap": 2.0},
            },
        },
        actor_env=[{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],
    )


@dataclass
class RunResult:
    job: dict[str, Any]
    steps: list[dict[str, Any]]
    """metrics.jsonl: one record per trainer step."""
    updates: dict[str, list[dict[str, Any]]]
    """actor pod -> the weight updates it logged (version, pausedAt, loadedAt, resumedAt)."""
    seconds: float


def run_tiny_rl_job(
    cluster: LocalCluster,
    kube: client.ApiClient,
    namespace: str,
    workdir: Path,
    *,
    name: str = "tiny",
    steps: int = 20,
    actors: int = 2,
    trainers: int = 2,
    timeout: float = 900.0,
    progress: Callable[[str], None] = print,
) -> RunResult:
    """Create the job, run its pods until it finishes (or ``timeout``), and collect what it recorded."""
    started = time.monotonic()
    model = create_tiny_llama(workdir / "model")
    shared = workdir / "shared"
    job = create_job(kube, namespace, tiny_rl_job(name, model, shared, steps=steps, actors=actors, trainers=trainers))
    metrics = shared / job["metadata"]["uid"] / "metrics.jsonl"
    while len(job_pods(kube, namespace, name)) < actors + trainers:
        time.sleep(0.2)
    progress(f"the operator created {actors} actor and {trainers} trainer pod(s); starting their containers")
    logs = workdir / "pods"
    with running_pods(cluster, kube, namespace, name, actors, trainers, logs):
        reported = 0
        while phase(job := get_job(kube, namespace, name)) not in ("Succeeded", "Failed"):
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"RLJob {name} did not finish within {timeout:.0f}s; pod logs in {logs}")
            records = _records(metrics)
            for record in records[reported:]:
                progress(
                    f"step {record['step']:>3}/{steps}: reward {record['reward']:.3f}, "
                    f"actors serve v{job['status'].get('weightsVersion') or 0}, lag {record['lag']:.0f}"
                )
            reported = len(records)
            time.sleep(1)
    updates = {
        pod: [json.loads(m.group(1)) for m in UPDATE_LINE.finditer((logs / f"{pod}.log").read_text())]
        for pod in (f"{name}-actor-{i}" for i in range(actors))
    }
    return RunResult(job, _records(metrics), updates, time.monotonic() - started)


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
