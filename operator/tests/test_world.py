"""lockstep.world.World against a fake of its client interface: what a pass observes, what it reads from the API
server and what it takes from the caches, and the gate that judges acks."""

from __future__ import annotations

import json

from factories import job, policy
from fake_clients import FakeWorldClient, pod
from lockstep import keys
from lockstep.events import AckGate, JobKey, PassScope
from lockstep.protocol import Ack, BarrierPhase, document
from lockstep.reconcile import Observed
from lockstep.world import Unobserved, World

KEY: JobKey = ("team-a", "demo")


def world_of(*pods: dict[str, object]) -> tuple[World, FakeWorldClient]:
    client = FakeWorldClient()
    client.jobs[KEY] = {**job(), "metadata": {**job()["metadata"], "resourceVersion": "10"}}
    client.pods[KEY] = list(pods)  # type: ignore[arg-type]
    client.policies = [policy()]
    return World(client), client


def observed(world: World, scope: PassScope = PassScope.FULL) -> Observed:
    seen = world.observe(KEY, scope)
    assert isinstance(seen, Observed)
    return seen


def test_a_pass_reads_what_is_not_kept_once_then_takes_it_from_the_caches() -> None:
    world, client = world_of(pod("demo", "demo-actor-0", 20))
    first = observed(world)
    assert [p["metadata"]["name"] for p in first.pods] == ["demo-actor-0"]
    assert first.policies[0]["metadata"]["name"] == "default"
    world.job_event(KEY, json.loads(json.dumps(client.jobs[KEY])))
    observed(world)
    assert client.calls == ["get_job", "list_job_pods", "list_policies", "read_namespace"], "the second pass read none"


def test_the_job_a_pass_gets_is_its_own_copy() -> None:
    world, client = world_of()
    world.job_event(KEY, json.loads(json.dumps(client.jobs[KEY])))
    observed(world).job["spec"]["actors"]["replicas"] = 99
    assert observed(world).job["spec"]["actors"]["replicas"] == 2


def test_a_job_that_is_gone_or_whose_namespace_terminates_is_not_observed() -> None:
    world, client = world_of()
    client.namespaces["team-a"] = {"metadata": {"name": "team-a"}, "status": {"phase": "Terminating"}}
    assert world.observe(KEY, PassScope.FULL) is Unobserved.NAMESPACE_TERMINATING
    del client.jobs[KEY]
    assert world.observe(KEY, PassScope.FULL) is Unobserved.JOB_GONE


def test_an_older_version_of_the_job_does_not_replace_a_newer_one() -> None:
    world, client = world_of()
    newer = {**client.jobs[KEY], "metadata": {**client.jobs[KEY]["metadata"], "resourceVersion": "12"}}
    older = {**client.jobs[KEY], "metadata": {**client.jobs[KEY]["metadata"], "resourceVersion": "11"}}
    world.job_event(KEY, newer)
    world.job_event(KEY, older)
    assert observed(world).job["metadata"]["resourceVersion"] == "12"


def test_the_answer_to_a_status_write_is_kept_and_its_echo_is_known() -> None:
    world, client = world_of()
    written = {**client.jobs[KEY], "metadata": {**client.jobs[KEY]["metadata"], "resourceVersion": "13"}}
    world.wrote_status(KEY, written)
    assert world.caused_by_own_write(KEY, "13") and not world.caused_by_own_write(KEY, "14")
    assert observed(world).job["metadata"]["resourceVersion"] == "13"
    assert "get_job" not in client.calls


def test_a_conflict_reads_the_job_anew_and_drops_the_gate() -> None:
    world, client = world_of()
    world.job_event(KEY, json.loads(json.dumps(client.jobs[KEY])))
    world.open_gate(KEY, AckGate("uid-1/3", BarrierPhase.PAUSE, {}, {"demo-actor-0"}))
    world.reread(KEY)
    assert observed(world, PassScope.BARRIER).scope is PassScope.FULL
    assert client.calls.count("get_job") == 1


def test_a_barrier_pass_is_a_whole_one_unless_the_last_pass_left_a_gate() -> None:
    world, _ = world_of()
    assert observed(world, PassScope.BARRIER).scope is PassScope.FULL
    world.open_gate(KEY, AckGate("uid-1/3", BarrierPhase.PAUSE, {}, {"demo-actor-0"}))
    assert observed(world, PassScope.BARRIER).scope is PassScope.BARRIER
    world.drop_gate(KEY)
    assert observed(world, PassScope.BARRIER).scope is PassScope.FULL


def _ack(phase: str = "Paused") -> str:
    return document(Ack(id="uid-1/3", phase=phase))


def test_the_gate_asks_for_a_barrier_pass_at_the_last_ack_it_waits_for() -> None:
    world, _ = world_of(pod("demo", "demo-actor-0", 20), pod("demo", "demo-actor-1", 21))
    observed(world)
    assert not world.open_gate(KEY, AckGate("uid-1/3", BarrierPhase.PAUSE, {}, {"demo-actor-0", "demo-actor-1"}))
    first = pod("demo", "demo-actor-0", 22, **{keys.BARRIER_ACK: _ack()})
    assert world.pod_event(KEY, "MODIFIED", first) is None, "one member is still to answer"
    last = pod("demo", "demo-actor-1", 23, **{keys.BARRIER_ACK: _ack()})
    assert world.pod_event(KEY, "MODIFIED", last) is PassScope.BARRIER
    failed = {**last, "metadata": {**last["metadata"], "resourceVersion": "24"}, "status": {"phase": "Failed"}}
    assert world.pod_event(KEY, "MODIFIED", failed) is PassScope.FULL, "a member failed: the whole pipeline"


def test_a_gate_judges_at_once_the_acks_that_came_while_the_pass_ran() -> None:
    acked = pod("demo", "demo-actor-0", 20, **{keys.BARRIER_ACK: _ack()})
    world, _ = world_of(acked)
    observed(world)
    assert world.open_gate(KEY, AckGate("uid-1/3", BarrierPhase.PAUSE, {}, {"demo-actor-0"}))
    assert not world.open_gate(KEY, None), "no phase waits: acks alone ask for no pass"
    assert (
        world.pod_event(KEY, "MODIFIED", {**acked, "metadata": {**acked["metadata"], "resourceVersion": "21"}}) is None
    )


def test_a_pass_sees_the_members_in_the_order_their_acks_came() -> None:
    world, _ = world_of(pod("demo", "demo-actor-0", 20), pod("demo", "demo-actor-1", 21))
    observed(world)
    world.pod_event(KEY, "MODIFIED", pod("demo", "demo-actor-1", 22, **{keys.BARRIER_ACK: _ack()}))
    world.pod_event(KEY, "MODIFIED", pod("demo", "demo-actor-0", 23, **{keys.BARRIER_ACK: _ack()}))
    assert [p["metadata"]["name"] for p in observed(world).pods] == ["demo-actor-1", "demo-actor-0"]


def test_writes_about_to_be_made_are_seen_before_their_echo() -> None:
    world, _ = world_of(pod("demo", "demo-actor-0", 20), pod("demo", "demo-actor-1", 21))
    observed(world)
    world.expect_writes(KEY, {"demo-actor-0": {keys.BARRIER: "pause"}}, ["demo-actor-1"])
    actor_0, actor_1 = observed(world).pods
    assert actor_0["metadata"]["annotations"][keys.BARRIER] == "pause"
    assert actor_1["metadata"]["deletionTimestamp"]


def test_a_pod_list_replaces_what_the_watch_delivered_and_names_the_jobs_known() -> None:
    world, client = world_of(pod("demo", "demo-actor-0", 20))
    observed(world)
    known = world.pods_listed([pod("other", "other-actor-0", 30)], "31")
    assert known == {KEY, ("team-a", "other")}
    assert observed(world).pods == [], "the list at a later revision did not have demo-actor-0"
    world.relist_pods(KEY)
    assert [p["metadata"]["name"] for p in observed(world).pods] == ["demo-actor-0"]
    assert client.calls.count("list_job_pods") == 2


def test_refusals_are_observed_at_their_generation_only() -> None:
    world, client = world_of()
    assert observed(world).rejected == {}
    world.refused(KEY, 1, {"Pod demo-actor-0": "forbidden"})
    assert observed(world).rejected == {"Pod demo-actor-0": "forbidden"}
    assert client.calls.count("read_namespace") == 2, "a refusal reads the namespace again (it may be terminating)"
    world.refused(KEY, 0, {"Pod demo-actor-0": "forbidden"})
    assert observed(world).rejected == {}


def test_a_taken_name_is_observed_until_the_resync() -> None:
    world, client = world_of()
    world.name_taken(KEY, "demo-actor-0", {"name": "demo-actor-0"})
    world.refused(KEY, 1, {"Pod demo-actor-1": "forbidden"})
    assert world.taken(KEY) == {"demo-actor-0"}
    assert observed(world).taken == {"demo-actor-0": {"name": "demo-actor-0"}}
    client.jobs[KEY]["metadata"]["managedFields"] = [{"manager": "kubectl"}]
    jobs = world.resync()
    assert [j["metadata"]["name"] for j in jobs] == ["demo"] and "managedFields" not in jobs[0]["metadata"]
    seen = observed(world)
    assert seen.taken == {} and seen.rejected == {}
    assert client.calls.count("list_policies") == 2, "the resync reads the policies anew"


def test_a_kueue_pass_reads_the_workloads_and_the_flavors_of_an_admitted_one() -> None:
    world, client = world_of()
    world.kueue = True
    client.workloads = [{"metadata": {"name": "w"}, "status": {}}]
    assert observed(world).kueue is not None
    assert "list_resource_flavors" not in client.calls
    client.workloads = [{"metadata": {"name": "w"}, "status": {"admission": {"clusterQueue": "q"}}}]
    client.flavors = [{"metadata": {"name": "gpu"}, "spec": {"nodeLabels": {"a": "b"}}}]
    view = observed(world).kueue
    assert view is not None and view.workloads == client.workloads
    assert client.calls.count("list_resource_flavors") == 1


def test_a_forgotten_job_is_read_anew() -> None:
    world, client = world_of(pod("demo", "demo-actor-0", 20))
    world.job_event(KEY, json.loads(json.dumps(client.jobs[KEY])))
    observed(world)
    world.forget(KEY)
    observed(world)
    assert client.calls.count("get_job") == 1 and client.calls.count("list_job_pods") == 2
