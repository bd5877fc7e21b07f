"""The local demo: a real control plane, Lockstep installed, the operator running, and an RLJob that
trains a tiny random Llama on the CPU after a preflight parity check, on the text task: which of two digits is
larger, from a jsonl dataset in the repository through a chat template, scored by the built-in math_exact_match
and evaluated greedily on held-out rows every 5 steps. The operator's pods run as
local processes (the preflight pod, then two vLLM actors and two torch trainer ranks); the trainer
announces new weights every step and the operator carries each to the actors in an in-flight
barrier. Ends with the job's status, a metrics table and a PNG plot.

``python -m lockstep_e2e.demo [--steps N] [--keep]`` (``make demo`` builds what it needs first).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kubernetes import client
from rich.console import Console
from rich.table import Table

from lockstep_e2e import build
from lockstep_e2e.barrier_time import barrier_times
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.install import REPO, install, start_operator
from lockstep_e2e.jobs import condition
from lockstep_e2e.rl import EVAL, RunResult, plot, run_tiny_rl_job, step_time, update_seconds
from lockstep_workers.text_task import EVAL_ROWS

NAMESPACE = "demo"
JOB = "tiny"
STEPS = 61
TUNED = {
    "rollout": {"promptsPerStep": 32, "samplesPerPrompt": 16, "maxTokens": 1, "temperature": 1.0},
    "objective": {"learningRate": 3e-4},
}
"""The demo's spec.trainer settings over the text task's (lockstep_e2e.rl.TEXT_TASK), so that it learns the task in
STEPS steps (the last evaluation measures version 60). The answer is one token, and maxTokens 1 scores just it. A
random model says the right digit about once in 48 tries: groups of 16 give most prompts a correct sample to
reinforce, and 32 prompts a step (almost half the 70 training rows) give the rare small answers a chance every step.
At the task's own learning rate (3e-3) the model collapses onto always answering 9 (right a fifth of the time, and
then every sample of a group scores alike, so nothing is left to learn from); at 7e-4 it learns fast, then drifts
off the rows it got right (0.9-1.0 at step 40, 0.7-0.8 at step 80); at 3e-4 it keeps climbing. Chosen with the
real learner on this task offline (one-token sampling in torch from weights one version stale): at 3e-4 with 32
prompts the eval reward at version 60 was 0.90-1.00 over four seeds, with 16 prompts 0.85-0.90 at version 80."""


def step(message: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {message}", flush=True)


def kubectl(cluster: LocalCluster, *args: str) -> None:
    command = ["kubectl", *args]
    print(f"\n$ {' '.join(command)}", flush=True)
    subprocess.run([str(build.bin_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", *args], check=True)


def _median_ms(seconds: Iterable[float]) -> str:
    return f"{statistics.median(seconds) * 1000:.0f} ms"


def metrics_table(result: RunResult) -> Table:
    table = Table(title=f"RLJob {JOB}: the trainer's metrics per step (metrics.jsonl)")
    columns = (
        ("step", "step", "{:.0f}"),
        ("reward", "reward", "{:.3f}"),
        ("eval (v step-1)", EVAL, "{:.2f}"),
        ("clip rate", "clamp_log_ratio_new_old_indicator", "{:.3f}"),
        ("KL new/old", "kl_new_old", "{:.1e}"),
        ("ESS", "ess", "{:.3f}"),
        ("masked", "rollout_is_masked_fraction", "{:.3f}"),
        ("|Δlogprob| on-policy", "onpolicy_mean_abs_logprob_diff", "{:.1e}"),
        ("lag", "staleness", "{:.0f}"),
        ("s", "seconds", "{:.1f}"),
        ("learning s", "learn_seconds", "{:.2f}"),
        ("waiting s", "rollout_wait_seconds", "{:.2f}"),
        ("actors busy", "actor_busy_fraction", "{:.0%}"),
    )
    for title, _, _ in columns:
        table.add_column(title, justify="right")
    for record in result.steps:
        table.add_row(*(_cell(record, key, form) for _, key, form in columns))
    return table


def _cell(record: dict[str, Any], key: str, form: str) -> str:
    """A metric as the table shows it: blank where the step has no such metric, "none" where it measured nothing."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workdir", type=Path, default=REPO / "out" / "demo", help="cluster state and logs")
    parser.add_argument("--steps", type=int, default=STEPS, help="trainer steps (one weight update each)")
    parser.add_argument("--keep", action="store_true", help="keep the cluster running until Ctrl-C")
    options = parser.parse_args()
    workdir: Path = options.workdir
    if workdir.exists():
        subprocess.run(["rm", "-rf", str(workdir)], check=True)
    workdir.mkdir(parents=True)

    with demo_cluster(workdir) as (cluster, api):
        client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))
        step(
            f"applying RLJob {JOB} ({workdir / 'rljob.yaml'}): a tiny random Llama learns which of two digits is "
            f"larger, {options.steps} steps; vLLM starts up in each actor first (about a minute on 2 cores)"
        )
        result = run_tiny_rl_job(
            cluster,
            api,
            NAMESPACE,
            workdir,
            name=JOB,
            steps=options.steps,
            timeout=900.0 + 10.0 * options.steps,  # 1-6 s a step here, and the preflight and vLLM start
            progress=step,
            preflight={"enabled": True},
            text=True,
            trainer=TUNED,
        )
        status = result.job["status"]
        if preflight := status.get("preflight"):
            step(
                f"preflight parity check: mean |Δlogprob| {preflight['meanAbsLogprobDiff']:.2e}, after an "
                f"in-flight update with shared prompts {preflight['sharedPrefixMeanAbsLogprobDiff']:.2e}"
            )
        outcome = condition(result.job, "Ready").get("message", "")
        step(f"RLJob {JOB} {status['phase']} after {result.seconds:.0f}s: {outcome}")
        kubectl(cluster, "get", "paritypolicies")
        kubectl(cluster, "get", "rljobs", "-n", NAMESPACE)
        history = (
            "{range .status.barrierHistory[*]}{'version '}{.version}{'  '}{.outcome}{'  '}{.seconds}s"
            "{'  slowest: '}{.slowestPod}{'\\n'}{end}"
        )
        kubectl(cluster, "get", "rljob", JOB, "-n", NAMESPACE, "-o", f"jsonpath={history}")
        if times := barrier_times(cluster.audit_events(), NAMESPACE, JOB, result.updates):
            step(
                f"a barrier took {_median_ms(t.beyond_own_work for t in times)} beyond the actors' own pause, "
                f"load and resume ({_median_ms(t.own_work for t in times)}): the operator "
                f"{_median_ms(t.operator for t in times)}, the agents {_median_ms(t.agents for t in times)}, the "
                f"API server's 4 writes in a row {_median_ms(t.api_server for t in times)} (medians of "
                f"{len(times)} barriers, from the API server's audit log)"
            )
        Console().print(metrics_table(result))
        if result.steps:
            step(
                f"the pipeline (spec.trainer.maxLag {result.job['spec']['trainer']['maxLag']}): "
                f"{step_time(result.steps, update_seconds(cluster, NAMESPACE, result)).said()}"
            )
        rewards = [r["reward"] for r in result.steps]
        step(f"reward {rewards[0]:.3f} at step 1 -> {rewards[-1]:.3f} at step {len(rewards)}")
        curve = ", ".join(f"v{r['step'] - 1} {r[EVAL]:.2f}" for r in result.steps if EVAL in r)
        step(f"eval reward (greedy, {EVAL_ROWS} held-out rows) by weights version: {curve}")
        step(f"plot of reward, clip rate, KL and ESS: {plot(result.steps, workdir / 'rl-metrics.png')}")
        if status["phase"] != "Succeeded":
            raise SystemExit(f"the job did not succeed; pod logs in {workdir / 'pods'}")
        if options.keep:
            print(f"\nThe cluster keeps running: export KUBECONFIG={cluster.kubeconfig}  (Ctrl-C stops it)")
            signal.signal(signal.SIGTERM, signal.default_int_handler)
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()


if __name__ == "__main__":
    main()
