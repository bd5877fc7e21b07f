"""The workers' side of the operator-to-pod contract (issue 25 item 2): they read it through lockstep.podconfig,
lockstep.environment and lockstep.protocol, never through the operator's own modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lockstep import keys
from lockstep.protocol import PROTOCOL, Weights, document
from lockstep_workers.agent.pod_agent import initial_weights

WORKERS = (
    "actor.server",
    "agent.core",
    "agent.pod_agent",
    "parity_check",
    "rollout.client",
    "trainer.loop",
    "trainer.pod",
)


def test_the_workers_import_none_of_the_operators_rendering() -> None:
    imports = "; ".join(f"import lockstep_workers.{name}" for name in WORKERS)
    listed = f"{imports}; import json, sys; print(json.dumps([m for m in sys.modules if m.startswith('lockstep.')]))"
    found = subprocess.run([sys.executable, "-c", listed], capture_output=True, text=True, check=True, env=os.environ)
    operator_side = {"lockstep.desired", "lockstep.parity", "lockstep.reconcile", "lockstep.controller"}
    assert operator_side.isdisjoint(json.loads(found.stdout)), found.stdout


class Pods:
    """The one call initial_weights makes of the Kubernetes API, answering a pod with ``annotations``."""

    def __init__(self, annotations: dict[str, str]) -> None:
        self.annotations = annotations

    def read_namespaced_pod(self, name: str, namespace: str) -> SimpleNamespace:
        return SimpleNamespace(metadata=SimpleNamespace(annotations=self.annotations))


def test_a_pod_reads_its_initial_weights_as_a_protocol_document() -> None:
    weights = Weights(version=3, uri="/var/lib/lockstep/uid/weights/v3", digest="sha256:3")
    assert initial_weights(Pods({keys.INITIAL_WEIGHTS: document(weights)}), "team", "demo-actor-0") == weights  # type: ignore[arg-type]
    assert initial_weights(Pods({}), "team", "demo-actor-0") is None  # type: ignore[arg-type]
    other = json.dumps({**json.loads(document(weights)), "protocol": PROTOCOL + 1})
    with pytest.raises(ValueError) as refused:
        initial_weights(Pods({keys.INITIAL_WEIGHTS: other}), "team", "demo-actor-0")  # type: ignore[arg-type]
    assert str(refused.value) == (
        f"the {keys.INITIAL_WEIGHTS} annotation on pod team/demo-actor-0 speaks barrier protocol {PROTOCOL + 1}; "
        f"this version speaks {PROTOCOL}"
    )


def test_the_preflight_outside_a_preflight_pod_says_where_it_runs() -> None:
    from lockstep_workers.parity_check import Workload, preflight

    with pytest.raises(SystemExit) as refused:
        preflight(Path("/models/tiny"), Workload(), {})
    assert str(refused.value).startswith("--preflight: LOCKSTEP_CONFIG is not set"), refused.value


def test_the_trainer_reports_no_number_the_wire_documents_refuse(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 37 item 1: a NaN or infinite metric went into lockstep.dev/mismatch (the operator now refuses the
    whole report); the trainer leaves such a metric out, or reports nothing for the step, and says so."""
    from lockstep.protocol import EvalResult, Mismatch, read_document
    from lockstep_workers.trainer.pod import EVAL_REWARD, EVAL_ROWS, step_reports

    metrics = {
        "onpolicy_mean_abs_logprob_diff": 0.01,
        "onpolicy_token_fraction": 0.5,
        "stale_samples_dropped": 0.0,
        "ess": float("nan"),
        "chi2_token": float("inf"),
        "k3_kl": 0.001,
        "loss": float("nan"),
        EVAL_REWARD: 0.25,
        EVAL_ROWS: 20.0,
    }
    with caplog.at_level("WARNING", logger="lockstep.trainer"):
        mismatch, evaluation = step_reports(7, metrics)
    assert mismatch is not None and mismatch.metrics == {"k3_kl": 0.001}
    assert isinstance(read_document(document(mismatch), Mismatch), Mismatch), "the operator accepts it"
    assert evaluation == EvalResult(version=6, reward=0.25, rows=20)
    assert "metrics chi2_token, ess are not finite" in caplog.text
    diverged = {**metrics, "onpolicy_mean_abs_logprob_diff": float("nan"), EVAL_REWARD: float("nan")}
    assert step_reports(7, diverged) == (None, None)


def test_a_step_that_measured_no_on_policy_token_says_none_never_zero(tmp_path: Path) -> None:
    """With maxLag >= 1 a step may hold no token sampled under the trainer's weights: its on-policy mismatch is
    absent from its metrics, null in metrics.jsonl, NaN in its gauge, and not reported to the operator (which keeps
    the last measurement), never 0.0, which reads as perfect parity."""
    import json
    import math

    from lockstep import environment
    from lockstep_workers.trainer.objective import ONPOLICY_MISMATCH, Statistics
    from lockstep_workers.trainer.pod import GAUGES, PodEnvironment, record, step_reports

    stale = Statistics(
        {
            "onpolicy_tokens": 0.0,
            "onpolicy_abs_logprob_diff": 0.0,
            "tokens": 12.0,
            "spanning": 0.0,
            "samples": 4.0,
            "reward": 1.0,
            "zero_advantage_groups": 0.0,
            "groups": 1.0,
            "outside_top_p": 0.0,
            "sampled_tokens": 12.0,
        },
        {"staleness": 1.0},
    )
    metrics = stale.metrics()
    assert ONPOLICY_MISMATCH not in metrics and metrics["onpolicy_token_fraction"] == 0.0
    assert step_reports(3, metrics) == (None, None)
    env = PodEnvironment.from_environ({environment.SHARED_DIR: str(tmp_path)})
    record(env, 3, 1.0, metrics)
    [line] = env.metrics_file.read_text().splitlines()
    assert json.loads(line)[ONPOLICY_MISMATCH] is None
    assert math.isnan(GAUGES[ONPOLICY_MISMATCH]._value.get())


def test_the_trainer_announces_the_routing_metrics_it_measured_and_never_an_unmeasured_one() -> None:
    """Issue 44 part 5: an MoE step's routing_mismatch and expert_load_imbalance go with its mismatch report, which
    the operator accepts, so a budget can hold them; a step without engine routings measured no routing_mismatch
    (null in metrics.jsonl), and its report leaves it out rather than saying 0."""
    from lockstep.protocol import Mismatch, read_document
    from lockstep_workers.trainer.objective import Statistics
    from lockstep_workers.trainer.pod import step_reports
    from lockstep_workers.trainer.routing import EXPERT_LOAD_IMBALANCE, ROUTING_MISMATCH

    onpolicy = {"onpolicy_tokens": 8.0, "onpolicy_abs_logprob_diff": 0.08, "tokens": 8.0, "spanning": 0.0}
    load = {f"routing_load/0/{e}": t for e, t in enumerate([4.0, 2.0, 1.0, 1.0])}  # max 4 over mean 2: 2
    compared = Statistics({**onpolicy, **load, "routing_mismatched": 2.0, "routing_compared": 16.0}, {"staleness": 0})
    mismatch, _ = step_reports(5, compared.metrics())
    assert mismatch is not None
    assert (mismatch.metrics[ROUTING_MISMATCH], mismatch.metrics[EXPERT_LOAD_IMBALANCE]) == (0.125, 2.0)
    assert read_document(document(mismatch), Mismatch) == mismatch, "the operator accepts it"

    uncompared = Statistics({**onpolicy, **load, "routing_mismatched": 0.0, "routing_compared": 0.0}, {"staleness": 0})
    mismatch, _ = step_reports(5, uncompared.metrics())
    assert mismatch is not None and mismatch.metrics == {EXPERT_LOAD_IMBALANCE: 2.0}
