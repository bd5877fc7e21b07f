"""A real RL run on the local control plane: a tiny demo task, trained by an RLJob's own pods: the target words
(prompts of random words; a reward on token ids), or the text task (a dataset in the repository, a chat template, the
built-in math_exact_match reward and evaluation during training; lockstep_workers.text_task).

The operator creates the pods; the pod runner starts each one's container command (vLLM actors and
torch trainer ranks) as a local process; the trainer announces each step's weights and the operator
carries them to the actors in barriers. Used by the demo and the end-to-end test.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from lockstep import keys
from lockstep_e2e.barrier_time import update_latencies
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.install import REPO
from lockstep_e2e.jobs import create_job, get_job, job_pods, phase, rljob
from lockstep_e2e.podrunner import JobPods, local_volume, run_to_completion, running_pods
from lockstep_workers import text_task
from lockstep_workers.tiny_model import create_tiny_llama

UPDATE_LINE = re.compile(r"weight update done: (\{.*\})")
TEXT_TASK_DATASET = REPO / "examples" / "datasets" / "larger"
TEXT_TASK = {
    "reward": "lockstep_workers.rewards:math_exact_match",
    "dataset": {
        "train": str(TEXT_TASK_DATASET / "train.jsonl"),
        "eval": str(TEXT_TASK_DATASET / "eval.jsonl"),
        "rewardFields": ["answer"],
    },
    "eval": {"everySteps": 5},
    "rollout": {"promptsPerStep": 8, "samplesPerPrompt": 8, "maxTokens": 2, "temperature": 1.0},
}
"""spec.trainer fields of the text task (the pods run on this machine, so the dataset's paths are its own)."""


def merged(fields: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with those of ``over``: a mapping is merged into the mapping it replaces, any other value replaces."""
    both = dict(fields)
    for name, value in over.items():
        old = both.get(name)
        both[name] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
    return both


def tiny_rl_job(
    name: str,
    model: Path,
    shared: Path,
    *,
    steps: int,
    actors: int,
    trainers: int,
    trainer: dict[str, Any] | None = None,
    dtype: str = "float32",
    group: dict[str, Any] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """An RLJob that teaches the tiny random Llama at ``model`` the target words task, on the CPU, in ``dtype`` on
    both sides, or with ``trainer`` (spec.trainer fields, e.g. TEXT_TASK) another: a field that is a mapping, such as
    rollout or objective, is merged into the default's, any other replaces it; ``group``: spec.actors.group;
    ``spec`` adds or replaces top-level spec fields (by default weights go through files on ``shared``)."""
    spec.setdefault("weightSync", {"volume": {"hostPath": {"path": str(shared), "type": "DirectoryOrCreate"}}})
    defaults = {
        "steps": steps,
        "maxLag": 1,
        "checkpointEverySteps": 1,
        "rollout": {"promptsPerStep": 8, "samplesPerPrompt": 8, "maxTokens": 8, "temperature": 1.0},
        "objective": {
            "algorithm": "grpo",
            "learningRate": 0.003,
            "minibatches": 2,
            "rolloutCorrection": {"mode": "truncate", "upper": 2.0},
        },
    }
    job = rljob(
        name,
        actors=actors,
        trainers=trainers,
        vllm={"dtype": dtype, "enforceEager": True, "maxModelLen": 256, "gpuMemoryUtilization": 0.2},
        model={"uri": str(model), "dtype": dtype},
        trainer=merged(defaults, trainer or {}),
        actor_env=[{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],
        **spec,
    )
    if group is not None:
        job["spec"]["actors"]["group"] = group
    return job


@dataclass
class RunResult:
    job: dict[str, Any]
    steps: list[dict[str, Any]]
    """metrics.jsonl: one record per trainer step."""
    updates: dict[str, list[dict[str, Any]]]
    """actor pod -> the weight updates it logged (version, pausedAt, loadedAt, resumedAt, and how long its own
    pause, load and resume took: pauseSeconds, loadSeconds, resumeSeconds)."""
    scraped: dict[str, str]
    """pod -> its last Prometheus scrape while the job ran (actors, trainer rank 0)."""
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
    timeout: float = 540.0,
    progress: Callable[[str], None] = print,
    watch: Callable[[dict[str, Any], JobPods], None] | None = None,
    before_start: Callable[[dict[str, Any]], None] | None = None,
    text: bool = False,
    trainer: dict[str, Any] | None = None,
    model: Path | None = None,
    dtype: str = "float32",
    group: dict[str, Any] | None = None,
    **spec: Any,
) -> RunResult:
    """Create the job (its manifest also written to ``workdir/rljob.yaml``; ``spec`` adds top-level spec fields;
    ``text``: the text task; ``trainer``: spec.trainer fields over the task's, merged as tiny_rl_job merges them;
    ``model``: a model directory to train instead of a tiny random one made for the task, in ``dtype``; ``group``:
    spec.actors.group, each of the ``actors`` a group of pods that LeaderWorkerSet creates),
    run its pods until it finishes, and collect what it recorded. ``timeout`` is below test_rl_job's 600 s, so that a
    stalled run fails with the ending of every pod's log; ``before_start`` sees the job once its pods exist, before
    their containers start; ``watch`` sees the job and its pods every second. With ``preflight: {enabled: true}``
    the preflight pod runs first; a job it stops has no other pods."""
    started = time.monotonic()
    if model is None:
        model = text_task.create_model(workdir / "model") if text else create_tiny_llama(workdir / "model")
    shared = workdir / "shared"
    trainer = merged(TEXT_TASK if text else {}, trainer or {})
    manifest = tiny_rl_job(
        name,
        model,
        shared,
        steps=steps,
        actors=actors,
        trainers=trainers,
        trainer=trainer,
        dtype=dtype,
        group=group,
        **spec,
    )
    (workdir / "rljob.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    job = create_job(kube, namespace, manifest)
    logs = workdir / "pods"
    # On the shared volume; with a collective backend and no volume, in trainer rank 0's emptyDir.
    metrics = [
        shared / job["metadata"]["uid"] / "metrics.jsonl",
        local_volume(logs, f"{name}-trainer-0", "lockstep-shared") / job["metadata"]["uid"] / "metrics.jsonl",
    ]
    logs.mkdir(parents=True, exist_ok=True)
    if spec.get("preflight", {}).get("enabled"):
        checker = f"{name}-preflight-0"
        while not any(p.metadata.name == checker for p in job_pods(kube, namespace, name)):
            time.sleep(0.2)
        progress(f"the operator created {checker}: checking train-inference parity before training")
        code = run_to_completion(cluster, kube, namespace, checker, logs / f"{checker}.log", timeout)
        progress(f"{checker} exited with {code}")
        # One status write records the result and, when it is over budget, the Failed phase.
        while (outcome := get_job(kube, namespace, name)).get("status", {}).get("preflight") is None:
            if phase(outcome) == "Failed":
                break
            time.sleep(0.2)
        if phase(outcome) == "Failed":
            return RunResult(outcome, [], {}, {}, time.monotonic() - started)

    def training_pods() -> int:
        roles = [(p.metadata.labels or {}).get(keys.ROLE) for p in job_pods(kube, namespace, name)]
        return sum(1 for role in roles if role in (keys.ACTOR, keys.TRAINER))

    while training_pods() < actors + trainers:
        time.sleep(0.2)
    progress(f"the operator created {actors} actor and {trainers} trainer pod(s); starting their containers")
    if before_start is not None:
        before_start(job)
    scraped: dict[str, str] = {}
    with running_pods(cluster, kube, namespace, name, actors, logs) as pods:
        reported = 0
        while phase(job := get_job(kube, namespace, name)) not in ("Succeeded", "Failed"):
            scraped |= pods.scrape_metrics()
            if time.monotonic() - started > timeout:
                raise TimeoutError(
                    f"RLJob {name} did not finish within {timeout:.0f}s; pod logs in {logs}, ending:\n"
                    + pods.log_tails()
                )
            records = _records(metrics)
            for record in records[reported:]:
                evaluated = f"eval reward {record[EVAL]:.3f} (v{record['step'] - 1}), " if EVAL in record else ""
                progress(
                    f"step {record['step']:>3}/{steps}: {evaluated}reward {record['reward']:.3f}, "
                    f"actors serve v{job['status'].get('weightsVersion') or 0}, staleness {record['staleness']:.0f}"
                )
            reported = len(records)
            if watch is not None:
                watch(job, pods)
            time.sleep(1)
        progress(f"RLJob {name} {phase(job)}; stopping its pods' local processes (vLLM shuts down)")
    updates = {
        pod: [json.loads(m.group(1)) for m in UPDATE_LINE.finditer((logs / f"{pod}.log").read_text())]
        for pod in (f"{name}-actor-{i}" for i in range(actors))
    }
    return RunResult(job, _records(metrics), updates, scraped, time.monotonic() - started)


def _records(candidates: list[Path]) -> list[dict[str, Any]]:
    """The trainer's metrics.jsonl records, from the first of ``candidates`` that exists."""
    for path in candidates:
        if path.exists():
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return []


@dataclass(frozen=True)
class StepTime:
    """Where the trainer's steps went (medians over the steps after the first, from metrics.jsonl), against the
    parts a serial loop runs one after another: the actors generating (their busy fraction of the step), learning,
    gathering the weights to publish (the write itself runs in the background), and the weight update that carries
    them to the actors (from the trainer's announcement to the last actor resumed)."""

    step: float
    generating: float
    learning: float
    gathering: float
    updating: float
    actor_busy: float
    stale_samples_dropped: int

    @property
    def parts(self) -> float:
        return self.generating + self.learning + self.gathering + self.updating

    @property
    def longest(self) -> float:
        """The longer of the two sides a pipeline overlaps: generating, and learning with publishing."""
        return max(self.generating, self.learning + self.gathering + self.updating)

    def said(self) -> str:
        return (
            f"a step took {self.step:.2f}s (median), {self.step / self.parts:.2f}x the sum of its parts "
            f"({self.parts:.2f}s, as a serial loop runs them: the actors generating {self.generating:.2f}s, learning "
            f"{self.learning:.2f}s, gathering the weights {self.gathering:.2f}s, the weight update "
            f"{self.updating:.2f}s) and {self.step / self.longest:.2f}x the longer of generating and learning with "
            f"its update; the actors were busy {self.actor_busy:.0%} of the time"
        )


def step_time(records: list[dict[str, Any]], updating: float) -> StepTime:
    """The steady state of a run's ``records`` (metrics.jsonl): every step after the first (vLLM warms up in it);
    ``updating``: a weight update's median time (lockstep_e2e.barrier_time)."""
    steady = records[1:] or records

    def median(value: Callable[[dict[str, Any]], float]) -> float:
        return statistics.median(value(r) for r in steady)

    return StepTime(
        step=median(lambda r: r["seconds"]),
        generating=median(lambda r: r.get("actor_busy_fraction", 0.0) * r["seconds"]),
        learning=median(lambda r: r["learn_seconds"]),
        gathering=median(lambda r: r.get("publish_gather_seconds", 0.0)),
        updating=updating,
        actor_busy=median(lambda r: r.get("actor_busy_fraction", 0.0)),
        stale_samples_dropped=int(sum(r.get("stale_samples_dropped", 0.0) for r in records)),
    )


def update_seconds(cluster: LocalCluster, namespace: str, result: RunResult) -> float:
    """A weight update's median time in ``result``'s run, from the trainer's announcement to the last actor resumed
    (the API server's audit log and the actors' update records); 0 without a completed one."""
    name = result.job["metadata"]["name"]
    latencies = update_latencies(cluster.audit_events(), namespace, name, result.updates)
    return statistics.median(latencies) if latencies else 0.0


EVAL = "eval_reward"
PLOTTED = (
    ("reward", "reward (and eval reward, greedy, on the eval split)"),
    ("clamp_log_ratio_new_old_indicator", "clip rate"),
    ("kl_new_old", "KL(new || old)"),
    ("ess", "ESS of rollout→trainer weights"),
)


def plot(steps: list[dict[str, Any]], path: Path) -> Path:
    """Reward, clip rate, KL and ESS over the steps, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(PLOTTED), figsize=(4 * len(PLOTTED), 3.2), constrained_layout=True)
    x = [r["step"] for r in steps]
    for axis, (key, title) in zip(axes, PLOTTED, strict=True):
        axis.plot(x, [r[key] for r in steps], marker="o", markersize=3)
        if key == "reward" and (evaluated := [r for r in steps if EVAL in r]):
            # Each evaluation measured the weights its step started from: version step - 1.
            axis.plot([r["step"] - 1 for r in evaluated], [r[EVAL] for r in evaluated], marker="s", label="eval")
            axis.legend()
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
