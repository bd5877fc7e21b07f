"""Shared steps of the reconciler's tests (test_reconcile*.py): a pass, a settled job, a trainer's
announcement, a barrier carried through."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from factories import NOW, policy, running
from lockstep import keys
from lockstep.conditions import find
from lockstep.protocol import PROTOCOL
from lockstep.reconcile import Observed, Plan, reconcile


def plan_for(
    body: dict[str, Any],
    pods: list[dict[str, Any]] | None = None,
    *,
    now: dt.datetime = NOW,
    policies: list[dict[str, Any]] | None = None,
    labels: dict[str, str] | None = None,
) -> Plan:
    return reconcile(Observed(body, pods or [], [policy()] if policies is None else policies, labels or {}, now))


def status_of(plan: Plan) -> dict[str, Any]:
    return plan.status.model_dump(mode="json", by_alias=True, exclude_none=True)


def settle(body: dict[str, Any], ready: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Reconcile a new job, 'run' the pods it created, reconcile again: the job as it is once running."""
    first = plan_for(body)
    pods = [running(p, ready=ready) for p in first.create_pods]
    second = plan_for({**body, "status": status_of(first)}, pods)
    return {**body, "status": status_of(second)}, pods


def condition(plan: Plan, type_: str) -> tuple[str, str]:
    found = find(plan.status.conditions, type_)
    assert found is not None
    return found.status.value, found.reason


def announce(trainer: dict[str, Any], version: int, uri: str | None = None, size: int | None = None) -> None:
    """What trainer rank 0 writes: by default weights where its backend publishes them (factories.job's uid);
    ``size``: the version's size in bytes, when given."""
    env = {e["name"]: e.get("value") for e in trainer["spec"]["containers"][0]["env"]}
    if uri is None and env["LOCKSTEP_WEIGHT_SYNC"] == "filesystem":
        uri = f"file:///var/lib/lockstep/uid-1/weights/v{version}.safetensors"
    uri = uri or f"http://{env['LOCKSTEP_WEIGHTS_HOST']}:9500/weights/{version}"
    weights = {"protocol": PROTOCOL, "version": version, "uri": uri, "digest": f"sha256:{version}"}
    trainer["metadata"]["annotations"][keys.WEIGHTS] = json.dumps(weights | ({"bytes": size} if size else {}))


def carry_barrier(
    body: dict[str, Any], pods: list[dict[str, Any]], version: int, members: int = 2, now: dt.datetime = NOW
) -> tuple[dict[str, Any], dt.datetime]:
    """Let the first ``members`` pods (the two actors; and the trainer with a collective backend) ack every
    phase of the barrier to ``version``, from ``now`` on; the job as of then, and the time."""
    for expected_phase, ack_phase in (("Update", "Updated"), ("Resume", "Resumed")):
        plan = plan_for(body, pods, now=now)
        assert set(plan.annotate_pods) == {p["metadata"]["name"] for p in pods[:members]}, "commands go to members"
        for pod in pods[:members]:
            command = json.loads(plan.annotate_pods[pod["metadata"]["name"]][keys.BARRIER])
            assert command["phase"] == expected_phase and command["version"] == version
            pod["metadata"]["annotations"][keys.BARRIER] = plan.annotate_pods[pod["metadata"]["name"]][keys.BARRIER]
            ack = {"protocol": PROTOCOL, "id": command["id"], "phase": ack_phase, "loadedVersion": version}
            pod["metadata"]["annotations"][keys.BARRIER_ACK] = json.dumps(ack)
        body = {**body, "status": status_of(plan)}
        now += dt.timedelta(seconds=1)
    return body, now


def pass_after(plan: Plan, body: dict[str, Any], pods: list[dict[str, Any]], **spec: Any) -> tuple[Plan, Any]:
    """The next pass, once the pods ``plan`` deleted are gone: (that plan, the job it leaves)."""
    body = {**body, "spec": {**body["spec"], **spec}, "status": status_of(plan)}
    left = [p for p in pods if p["metadata"]["name"] not in plan.delete_pods]
    return plan_for(body, left), body
