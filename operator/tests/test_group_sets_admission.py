"""Issue 46 item 1, admission's half: only LeaderWorkerSet's controller makes a StatefulSet whose pods carry
Lockstep's label, only the operator such a LeaderWorkerSet, and the StatefulSet controller creates a Lockstep pod only
for a StatefulSet that controls it. The policies' CEL, evaluated offline."""

from __future__ import annotations

from typing import Any

import pytest

from factories import evaluate
from lockstep import admission, keys

LOCKSTEP = {keys.MANAGED_BY: keys.MANAGER, keys.JOB: "demo"}
POLICY = admission.group_sets_policy()["spec"]
USER = "system:serviceaccount:team-a:squatter"


def stateful_set(labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": "demo-actor"}, "spec": {"template": {"metadata": {"labels": labels}}}}


def group_set(labels: dict[str, str], replicas: int = 2) -> dict[str, Any]:
    template = {"metadata": {"labels": labels}}
    return {
        "metadata": {"name": "demo-actor"},
        "spec": {"replicas": replicas, "leaderWorkerTemplate": {"workerTemplate": template}},
    }


def offline(expression: str, new: dict[str, Any] | None, old: dict[str, Any] | None) -> str:
    """``expression`` with its null checks of ``object`` and ``oldObject`` decided (celpy has no ``map != null``)."""
    decided = expression.replace("oldObject != null", "true" if old is not None else "false")
    return decided.replace("(object != null", "(true" if new is not None else "(false")


def admitted(resource: str, user: str, new: dict[str, Any], old: dict[str, Any] | None = None) -> bool | None:
    """None when the policy does not match the request; else whether every validation passes."""
    request = {
        "operation": "CREATE" if old is None else "UPDATE",
        "namespace": "team-a",
        "resource": {"resource": resource},
        "userInfo": {"username": user, "groups": ["system:authenticated"]},
    }
    activation = {"object": new, "oldObject": old, "request": request}
    if not all(bool(evaluate(offline(c["expression"], new, old), **activation)) for c in POLICY["matchConditions"]):
        return None
    return all(bool(evaluate(offline(v["expression"], new, old), **activation)) for v in POLICY["validations"])


@pytest.mark.parametrize(
    ("user", "allowed"),
    [
        (USER, False),
        (keys.STATEFULSET_CONTROLLER_USERNAME, False),
        (keys.OPERATOR_USERNAME, False),
        (keys.LWS_CONTROLLER_USERNAME, True),
    ],
)
def test_only_leader_worker_sets_controller_makes_a_statefulset_of_lockstep_pods(user: str, allowed: bool) -> None:
    assert admitted("statefulsets", user, stateful_set(LOCKSTEP)) is allowed
    assert admitted("statefulsets", user, stateful_set({"app": "x"}), stateful_set(LOCKSTEP)) is allowed, (
        "nor takes the label off one"
    )
    assert admitted("statefulsets", user, stateful_set({"app": "x"})) is None, "other StatefulSets are RBAC's"


@pytest.mark.parametrize(("user", "allowed"), [(USER, False), (keys.OPERATOR_USERNAME, True)])
def test_only_the_operator_makes_or_edits_a_leader_worker_set_of_lockstep_pods(user: str, allowed: bool) -> None:
    assert admitted("leaderworkersets", user, group_set(LOCKSTEP)) is allowed
    assert admitted("leaderworkersets", user, group_set(LOCKSTEP, 3), group_set(LOCKSTEP)) is allowed
    assert admitted("leaderworkersets", user, group_set(LOCKSTEP), group_set(LOCKSTEP)) is True, "a spec unchanged"
    assert admitted("leaderworkersets", user, group_set({"app": "x"})) is None


def test_the_statefulset_controller_creates_a_lockstep_pod_only_for_a_statefulset_that_controls_it() -> None:
    variables = {v["name"]: v["expression"] for v in admission.barrier_policy()["spec"]["variables"]}
    labels = {**LOCKSTEP, keys.GROUP_SET_NAME: "demo-actor"}
    owner = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "demo-actor", "uid": "u", "controller": True}

    def group_controller(user: str, operation: str, owners: list[dict[str, Any]]) -> bool:
        pod = {"metadata": {"name": "demo-actor-1", "labels": labels, "ownerReferences": owners}}
        request = {"operation": operation, "userInfo": {"username": user}}
        old = None if operation == "CREATE" else pod
        expression = offline(variables["isGroupController"], pod, old)
        return bool(evaluate(expression, object=pod, oldObject=old, request=request))

    sts = keys.STATEFULSET_CONTROLLER_USERNAME
    assert group_controller(sts, "CREATE", [owner])
    assert not group_controller(sts, "CREATE", [])
    assert not group_controller(sts, "CREATE", [{**owner, "controller": False}])
    assert not group_controller(sts, "CREATE", [{**owner, "kind": "ReplicaSet"}])
    assert not group_controller(keys.LWS_CONTROLLER_USERNAME, "CREATE", [owner]), "it never creates pods"
    assert group_controller(keys.LWS_CONTROLLER_USERNAME, "DELETE", [owner])
