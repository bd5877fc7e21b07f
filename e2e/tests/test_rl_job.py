"""An RLJob learns the tiny task end to end: the operator's pods, real vLLM actors and torch trainer
ranks, weights updated in flight through barriers."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes import client

from lockstep.api import MismatchBudget
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.rl import run_tiny_rl_job
from lockstep_e2e.scrape import dashboard_metrics, exported_metrics, scrape

pytestmark = [pytest.mark.cluster, pytest.mark.vllm, pytest.mark.usefixtures("lockstep")]

STEPS = 16


def test_an_rl_job_learns_with_in_flight_weight_updates(
    cluster: LocalCluster, kube: client.ApiClient, namespace: str, tmp_path: Path, operator_metrics_port: int
) -> None:
    result = run_tiny_rl_job(cluster, kube, namespace, tmp_path, steps=STEPS, actors=2, trainers=2)
    status = result.job["status"]
    assert status["phase"] == "Succeeded", status
    assert [r["step"] for r in result.steps] == list(range(1, STEPS + 1))

    rewards = [r["reward"] for r in result.steps]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    print(f"reward {first:.3f} over the first 3 steps -> {last:.3f} over the last 3; took {result.seconds:.0f}s")
    assert last > first + 0.2, f"the reward did not rise: {rewards}"

    assert status["weightsVersion"] == STEPS, "the trainer's last weights were committed"
    history = status["barrierHistory"]
    assert history and all(b["outcome"] == "Completed" for b in history)
    for pod, updates in result.updates.items():
        versions = [u["version"] for u in updates]
        assert versions and versions[-1] == STEPS, f"{pod} ended on version {versions[-1:]}"
        assert versions == sorted(set(versions)), f"{pod} loaded a version twice or out of order: {versions}"
    for version in set.intersection(*({u["version"] for u in us} for us in result.updates.values())):
        moments = [u for us in result.updates.values() for u in us if u["version"] == version]
        assert max(u["loadedAt"] for u in moments) <= min(u["resumedAt"] for u in moments), (
            f"an actor served version {version} before every actor had loaded it"
        )

    budget = MismatchBudget().mean_abs_logprob_diff
    measured = [r for r in result.steps if r["onpolicy_token_fraction"] > 0]
    assert measured, "some steps sampled tokens under the trainer's own weights"
    worst = max(r["onpolicy_mean_abs_logprob_diff"] for r in measured)
    print(
        f"on-policy mismatch: worst step {worst:.2e} (budget {budget}); max lag {max(r['lag'] for r in result.steps)}"
    )
    assert worst <= budget
    assert max(r["lag"] for r in result.steps) <= 1, "spec.trainer.maxLag 1 bounds how stale a token can be"

    exported = exported_metrics(scrape(f"http://127.0.0.1:{operator_metrics_port}"))
    assert set(result.scraped) == {"tiny-actor-0", "tiny-actor-1", "tiny-trainer-0"}
    for text in result.scraped.values():
        exported |= exported_metrics(text)
    used = dashboard_metrics()
    assert {n for n in used if n.startswith("lockstep_trainer_")} and {
        n for n in used if n.startswith("lockstep_actor")
    }
    assert used <= exported, f"the dashboard uses metrics nobody exports: {sorted(used - exported)}"
