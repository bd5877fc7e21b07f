"""lockstep.applier.Applier against a fake of its client interface: the order of a plan's writes, and the outcome
each way a write can go (applied, refused, a name taken, a conflict)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from factories import job
from fake_clients import FakeApplierClient, FakeWorldClient, pod, refusal
from lockstep import keys
from lockstep.api import BarrierStatus, RLJobStatus
from lockstep.applier import Applied, Applier, Conflict, Rejected
from lockstep.events import JobKey, PassScope
from lockstep.protocol import BarrierPhase
from lockstep.reconcile import Observed, Plan
from lockstep.reconcile.context import Event
from lockstep.world import World

KEY: JobKey = ("team-a", "demo")


class Inline:
    """An executor that runs each task at once, in order, on the caller's thread."""

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        return iter([fn(item) for item in items])


def child(kind: str, name: str) -> dict[str, Any]:
    return {"kind": kind, "metadata": {"name": name, "namespace": "team-a"}}


def the_job() -> dict[str, Any]:
    body = job()
    body["metadata"]["resourceVersion"] = "10"
    return body


def setup(*pods: dict[str, Any]) -> tuple[Applier, FakeApplierClient, World]:
    world_client = FakeWorldClient()
    world_client.jobs[KEY] = the_job()
    world_client.pods[KEY] = list(pods)
    world = World(world_client)
    assert isinstance(world.observe(KEY, PassScope.FULL), Observed)  # the pods are listed, as a pass leaves them
    client = FakeApplierClient()
    return Applier(client, world, Inline()), client, world  # type: ignore[arg-type]


def a_plan(**fields: Any) -> Plan:
    return Plan(status=RLJobStatus(observed_generation=1), **fields)


def test_a_plans_writes_go_in_order_and_its_events_only_after_its_status() -> None:
    applier, client, _ = setup(pod("demo", "demo-actor-0", 20), pod("demo", "demo-actor-1", 21))
    plan = a_plan(
        children=[child("ConfigMap", "demo"), child("Role", "demo")],
        remove_children=[("NetworkPolicy", "demo-old")],
        delete_pods={"demo-actor-0": "drift"},
        annotate_pods={"demo-actor-1": {keys.BARRIER: "{}"}},
        workload_status={"demo-workload": {"status": {}}},
        create_pods=[pod("demo", "demo-actor-2", 0)],
        events=[Event("Normal", "Created", "pods created")],
        requeue_after=30.0,
    )
    outcome = applier.apply(KEY, the_job(), plan)
    assert isinstance(outcome, Applied) and outcome.requeue_after == 30.0 and outcome.gate is None
    assert [call for call, _ in client.writes] == [
        "apply",
        "apply",
        "delete_child",
        "delete_pod",
        "annotate_pod",
        "patch_workload_status",
        "create_pod",
        "patch_job_status",
    ]
    assert client.status_patches[0]["metadata"] == {"resourceVersion": "10"}
    applier.announce(KEY, the_job(), outcome)
    assert client.writes[-1] == ("post_event", "Created")


def test_pod_writes_are_in_the_world_before_they_are_sent() -> None:
    applier, client, world = setup(pod("demo", "demo-actor-0", 20), pod("demo", "demo-actor-1", 21))
    seen: dict[str, dict[str, Any]] = {}

    def look(call: str, name: str) -> None:
        if call in ("delete_pod", "annotate_pod"):
            observed = world.observe(KEY, PassScope.FULL)
            assert isinstance(observed, Observed)
            seen[call] = next(p for p in observed.pods if p["metadata"]["name"] == name)

    client.on_call = look
    plan = a_plan(delete_pods={"demo-actor-0": "drift"}, annotate_pods={"demo-actor-1": {keys.BARRIER: "{}"}})
    assert isinstance(applier.apply(KEY, the_job(), plan), Applied)
    assert seen["delete_pod"]["metadata"]["deletionTimestamp"]
    assert seen["annotate_pod"]["metadata"]["annotations"][keys.BARRIER] == "{}"


def test_children_unchanged_are_not_sent_again_unless_one_was_deleted_or_a_pod_is_created() -> None:
    applier, client, _ = setup()
    plan = a_plan(children=[child("ConfigMap", "demo")])
    for _ in range(2):
        applier.apply(KEY, the_job(), plan)
    assert [call for call, _ in client.writes].count("apply") == 1
    applier.child_deleted(KEY)
    applier.apply(KEY, the_job(), plan)
    assert [call for call, _ in client.writes].count("apply") == 2
    applier.apply(KEY, the_job(), a_plan(children=[child("ConfigMap", "demo")], create_pods=[pod("demo", "p", 0)]))
    assert [call for call, _ in client.writes].count("apply") == 3, "a pod about to be created needs its children"
    applier.reapply_all()
    applier.apply(KEY, the_job(), plan)
    assert [call for call, _ in client.writes].count("apply") == 4


def test_a_child_deleted_while_its_pass_applies_them_is_applied_again_by_the_next() -> None:
    applier, client, _ = setup()
    client.on_call = lambda call, name: applier.child_deleted(KEY) if name == "Role demo" else None
    plan = a_plan(children=[child("ConfigMap", "demo"), child("Role", "demo")])
    applier.apply(KEY, the_job(), plan)
    client.on_call = lambda call, name: None
    applier.apply(KEY, the_job(), plan)
    assert [call for call, _ in client.writes].count("apply") == 4


def test_a_child_gone_since_its_pass_read_it_ends_the_pass_as_a_conflict() -> None:
    """A child applied onto the object its pass read (its uid) that is gone meanwhile: nothing else of the plan is
    written, and the next pass, on what it reads anew, applies the children again."""
    applier, client, _ = setup(pod("demo", "demo-actor-0", 20))
    read = {**child("Workload", "demo"), "metadata": {**child("Workload", "demo")["metadata"], "uid": "uid-w"}}
    client.fail["apply", "Workload demo"] = refusal(409, 'uid mismatch: the provided object specified uid "uid-w"')
    plan = a_plan(children=[read], delete_pods={"demo-actor-0": "drift"}, create_pods=[pod("demo", "p", 0)])
    assert applier.apply(KEY, the_job(), plan) == Conflict()
    assert client.writes == [("apply", "Workload demo")]
    assert isinstance(applier.apply(KEY, the_job(), a_plan(children=[child("Workload", "demo")])), Applied)
    assert client.writes[1] == ("apply", "Workload demo"), "applied again, though its pass had sent it"


def test_a_child_another_of_its_name_replaced_ends_the_pass_as_a_conflict_not_a_refusal() -> None:
    applier, client, _ = setup()
    read = {
        **child("LeaderWorkerSet", "demo"),
        "metadata": {**child("LeaderWorkerSet", "demo")["metadata"], "uid": "u"},
    }
    client.fail["apply", "LeaderWorkerSet demo"] = refusal(422, "metadata.uid: Invalid value: field is immutable")
    assert applier.apply(KEY, the_job(), a_plan(children=[read])) == Conflict()
    client.fail["apply", "LeaderWorkerSet demo"] = refusal(422, "spec.replicas: must be greater than or equal to 0")
    refused = applier.apply(KEY, the_job(), a_plan(children=[read]))
    assert isinstance(refused, Rejected) and "spec.replicas" in refused.refused["LeaderWorkerSet demo"]


def test_a_refused_child_creates_no_pod_and_writes_no_status() -> None:
    applier, client, _ = setup()
    client.fail["apply", "Role demo"] = refusal(422, 'Role.rbac "demo" is invalid')
    plan = a_plan(children=[child("Role", "demo")], create_pods=[pod("demo", "demo-actor-0", 0)])
    outcome = applier.apply(KEY, the_job(), plan)
    assert outcome == Rejected(1, {"Role demo": 'Role.rbac "demo" is invalid'}, [])
    assert [call for call, _ in client.writes] == ["apply"]


def test_a_refused_pod_is_named_with_the_api_servers_status_when_it_gives_no_message() -> None:
    applier, client, _ = setup()
    client.fail["create_pod", "demo-actor-0"] = refusal(400)
    outcome = applier.apply(KEY, the_job(), a_plan(create_pods=[pod("demo", "demo-actor-0", 0)]))
    assert outcome == Rejected(1, {"Pod demo-actor-0": "400 Bad Request"}, [])


def test_an_error_that_is_no_refusal_raises() -> None:
    applier, client, _ = setup()
    client.fail["create_pod", "demo-actor-0"] = refusal(500)
    with pytest.raises(Exception, match="500"):
        applier.apply(KEY, the_job(), a_plan(create_pods=[pod("demo", "demo-actor-0", 0)]))


def test_a_created_pod_is_kept_from_the_answer() -> None:
    applier, _, world = setup()
    assert isinstance(applier.apply(KEY, the_job(), a_plan(create_pods=[pod("demo", "demo-actor-0", 0)])), Applied)
    assert world.has_pod(KEY, "demo-actor-0")


def test_a_pod_name_held_by_a_pod_not_labelled_as_the_jobs_is_reported_by_the_next_pass() -> None:
    applier, client, world = setup()
    client.fail["create_pod", "demo-actor-0"] = refusal(409)
    stranger = pod("demo", "demo-actor-0", 30)
    stranger["metadata"]["labels"] = {}
    client.existing["demo-actor-0"] = stranger
    outcome = applier.apply(KEY, the_job(), a_plan(create_pods=[pod("demo", "demo-actor-0", 0)]))
    assert outcome == Rejected(1, {}, ["demo-actor-0"])
    assert world.taken(KEY) == {"demo-actor-0"}
    assert "patch_job_status" not in [call for call, _ in client.writes]


def test_a_pod_of_the_jobs_own_that_the_watch_has_not_brought_makes_the_next_pass_list() -> None:
    applier, client, world = setup()
    client.fail["create_pod", "demo-actor-0"] = refusal(409)
    client.existing["demo-actor-0"] = pod("demo", "demo-actor-0", 30)
    assert isinstance(applier.apply(KEY, the_job(), a_plan(create_pods=[pod("demo", "demo-actor-0", 0)])), Applied)
    assert world.taken(KEY) == set()
    observed = world.observe(KEY, PassScope.FULL)
    assert isinstance(observed, Observed)
    assert world._client.calls.count("list_job_pods") == 2  # type: ignore[attr-defined]


def test_a_pod_still_terminating_is_not_read() -> None:
    applier, client, world = setup(pod("demo", "demo-actor-0", 20))
    client.fail["create_pod", "demo-actor-0"] = refusal(409)
    assert isinstance(applier.apply(KEY, the_job(), a_plan(create_pods=[pod("demo", "demo-actor-0", 0)])), Applied)
    assert "read_pod" not in [call for call, _ in client.writes]
    world.observe(KEY, PassScope.FULL)
    assert world._client.calls.count("list_job_pods") == 1  # type: ignore[attr-defined]


def test_a_status_write_that_conflicts_posts_no_event() -> None:
    applier, client, world = setup()
    client.fail["patch_job_status", "demo"] = refusal(409)
    outcome = applier.apply(KEY, the_job(), a_plan(events=[Event("Normal", "Created", "pods created")]))
    assert outcome == Conflict()
    assert not world.caused_by_own_write(KEY, "201")


def test_the_written_status_is_kept_and_an_unchanged_one_not_sent() -> None:
    applier, client, world = setup()
    assert isinstance(applier.apply(KEY, the_job(), a_plan()), Applied)
    assert world.caused_by_own_write(KEY, str(client.revision))
    written = the_job()
    written["status"] = client.status_patches[0]["status"]
    assert isinstance(applier.apply(KEY, written, a_plan()), Applied)
    assert [call for call, _ in client.writes] == ["patch_job_status"]


def test_a_kueue_conflict_on_a_workload_status_is_left_to_its_watch() -> None:
    applier, client, _ = setup()
    client.fail["patch_workload_status", "w"] = refusal(409)
    assert isinstance(applier.apply(KEY, the_job(), a_plan(workload_status={"w": {}})), Applied)
    client.fail["patch_workload_status", "w"] = refusal(422)
    with pytest.raises(Exception, match="422"):
        applier.apply(KEY, the_job(), a_plan(workload_status={"w": {}}))


def test_an_open_barrier_phase_is_the_outcomes_gate() -> None:
    applier, _, _ = setup()
    now = dt.datetime(2026, 12, 1, tzinfo=dt.UTC).isoformat()
    barrier = BarrierStatus(
        id="uid-1/3",
        version=3,
        uri="/w/v3",
        digest="sha256:3",
        phase=BarrierPhase.UPDATE,
        members={"demo-actor-0": "u0", "demo-actor-1": "u1"},
        started_at=now,
        phase_started_at=now,
        deadline=now,
        retries={"demo-actor-1": 1},
    )
    plan = Plan(status=RLJobStatus(barrier=barrier), waiting_for={"demo-actor-1"})
    outcome = applier.apply(KEY, the_job(), plan)
    assert isinstance(outcome, Applied) and outcome.gate is not None
    assert (outcome.gate.barrier_id, outcome.gate.phase, outcome.gate.retries, outcome.gate.waiting) == (
        "uid-1/3",
        BarrierPhase.UPDATE,
        {"demo-actor-1": 1},
        {"demo-actor-1"},
    )
    plan.waiting_for = None
    assert applier.apply(KEY, the_job(), plan) == Applied(None, None, (), False), "no phase stepped: no gate"


def test_a_job_past_its_time_is_deleted_after_its_events_and_not_woken() -> None:
    applier, client, _ = setup()
    plan = a_plan(events=[Event("Normal", "Deleted", "ttl passed")], delete_job=True, requeue_after=5.0)
    outcome = applier.apply(KEY, the_job(), plan)
    assert isinstance(outcome, Applied) and outcome.requeue_after is None
    client.fail["post_event", "Deleted"] = refusal(403)
    applier.announce(KEY, the_job(), outcome)  # an Event that cannot be posted is only logged
    assert client.writes[-2:] == [("post_event", "Deleted"), ("delete_job", "demo")]


def test_the_status_patch_holds_only_what_changed() -> None:
    applier, client, _ = setup()
    before = the_job()
    before["status"] = RLJobStatus(observed_generation=1).model_dump(mode="json", by_alias=True, exclude_none=True)
    applier.apply(KEY, before, Plan(status=RLJobStatus(observed_generation=2)))
    assert json.loads(json.dumps(client.status_patches[0]["status"])) == {"observedGeneration": 2}
