"""The preflight step (lockstep.reconcile.preflight): the parity check before training."""

from __future__ import annotations

import json

from factories import job, running
from lockstep import keys
from lockstep.api import Phase
from lockstep.conditions import READY, find
from lockstep.protocol import PROTOCOL
from lockstep.reconcile import Plan
from reconcile_helpers import condition, plan_for, status_of


def test_preflight_runs_before_training_and_its_result_decides() -> None:
    body = job(preflight={"enabled": True})
    first = plan_for(body)
    assert [p["metadata"]["name"] for p in first.create_pods] == ["demo-preflight-0"], "only the preflight pod"
    assert first.status.phase is Phase.PENDING and condition(first, READY) == ("False", "Preflight")
    role = next(c for c in first.children if c["kind"] == "Role")
    assert "demo-preflight-0" in role["rules"][0]["resourceNames"], "it may write its result on itself"
    body = {**body, "status": status_of(first)}

    def finished(measured: float, phase: str = "Succeeded") -> Plan:
        pod = running(first.create_pods[0], phase=phase, ready=False)
        result = {
            "protocol": PROTOCOL,
            "meanAbsLogprobDiff": measured,
            "sharedPrefixMeanAbsLogprobDiff": measured / 2,
            "clipFraction": 0.0,
            "outsideTopPPerThousand": 0.0,
            "tokens": 1024,
        }
        pod["metadata"]["annotations"][keys.PREFLIGHT] = json.dumps(result)
        return plan_for(body, [pod])

    passed = finished(1e-3)
    assert passed.status.preflight is not None and passed.status.preflight.tokens == 1024
    assert len(passed.create_pods) == 3 and passed.delete_pods == {"demo-preflight-0": "the preflight check finished"}
    assert any(e.reason == "PreflightPassed" for e in passed.events)

    over = finished(0.5)
    assert over.status.phase is Phase.FAILED and not over.create_pods
    assert condition(over, "ParityLocked") == ("False", "MismatchBudgetExceeded")
    message = find(over.status.conditions, "ParityLocked").message  # type: ignore[union-attr]
    assert "plain sampling's mean |Δlogprob| 0.5 is over the budget 0.1" in message and "budget 0.1" in message

    crashed = finished(0.0, phase="Failed")
    assert crashed.status.phase is Phase.FAILED and condition(crashed, READY) == ("False", "PreflightFailed")
