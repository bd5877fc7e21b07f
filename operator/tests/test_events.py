"""Which pod events need a reconcile pass (lockstep.events), and the status merge patch (controller)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from lockstep import keys
from lockstep.applier import merge_patch
from lockstep.events import AckGate, AckVerdict, PassScope, PodCache, PodFacts, pass_for
from lockstep.protocol import PROTOCOL, BarrierPhase


def pod(name: str = "a", *, phase: str = "Running", uid: str = "u1", **annotations: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": uid,
            "labels": {keys.ROLE: keys.ACTOR},
            "annotations": {"kubectl.kubernetes.io/last-applied": "x", **annotations},
            "managedFields": [{"manager": "kubelet"}],
        },
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def ack(phase: str = "Updated", *, barrier: str = "job/1/1", **extra: Any) -> str:
    return json.dumps({"protocol": PROTOCOL, "id": barrier, "phase": phase, **extra})


def gate(*waiting: str) -> AckGate:
    return AckGate("job/1/1", BarrierPhase.UPDATE, {}, set(waiting))


def test_an_event_that_changes_nothing_a_pass_reads_needs_no_pass() -> None:
    before = PodFacts.of(pod())
    noise = pod(**{"kubectl.kubernetes.io/last-applied": "y"})
    noise["metadata"]["managedFields"] = []
    assert pass_for(before, PodFacts.of(noise), None, "a") is None
    cache = PodCache()
    cache.observe("ADDED", pod())
    cache.annotate("a", {keys.BARRIER: "the operator's command"})
    command = cache.facts("a")
    assert pass_for(command, PodFacts.of(pod(**{keys.BARRIER: "the operator's command"})), None, "a") is None, (
        "the echo of the operator's own write"
    )
    for changed in (pod(phase="Failed"), pod(uid="u2"), pod(**{keys.WEIGHTS: "{}"})):
        assert pass_for(before, PodFacts.of(changed), gate("a"), "a") is PassScope.FULL
    assert pass_for(None, before, gate("a"), "a") is PassScope.FULL, "new"
    assert pass_for(before, None, gate("a"), "a") is PassScope.FULL, "deleted"


def test_acks_wait_for_the_last_one_and_errors_pass_at_once() -> None:
    waiting = gate("a", "b")
    plain = PodFacts.of(pod("a"))
    assert pass_for(plain, PodFacts.of(pod("a", **{keys.BARRIER_ACK: ack()})), waiting, "a") is None
    assert waiting.waiting == {"b"}
    assert pass_for(plain, PodFacts.of(pod("b", **{keys.BARRIER_ACK: ack("Resumed")})), waiting, "b") is None
    assert pass_for(plain, PodFacts.of(pod("b", **{keys.BARRIER_ACK: ack(barrier="job/0/1")})), waiting, "b") is None
    last = pass_for(plain, PodFacts.of(pod("b", **{keys.BARRIER_ACK: ack()})), waiting, "b")
    assert last is PassScope.BARRIER, "the last one: a pass of the barrier step alone"
    assert not waiting.waiting
    failed = pass_for(plain, PodFacts.of(pod("a", **{keys.BARRIER_ACK: ack(error="OSError")})), gate("a", "b"), "a")
    assert failed is PassScope.BARRIER, "an error: at once"
    assert pass_for(plain, PodFacts.of(pod("c", **{keys.BARRIER_ACK: ack()})), None, "c") is None, (
        "no barrier open: an ack alone is nothing to act on"
    )
    both = pod("a", phase="Failed", **{keys.BARRIER_ACK: ack()})
    assert pass_for(plain, PodFacts.of(both), gate("a"), "a") is PassScope.FULL, "an ack and more: the whole pipeline"


def test_one_pass_for_two_requests_runs_the_wider_scope() -> None:
    assert PassScope.BARRIER.join(None) is PassScope.BARRIER
    assert PassScope.BARRIER.join(PassScope.BARRIER) is PassScope.BARRIER
    assert PassScope.BARRIER.join(PassScope.FULL) is PassScope.FULL
    assert PassScope.FULL.join(PassScope.BARRIER) is PassScope.FULL


def test_the_gate_judges_each_ack() -> None:
    waiting = AckGate("job/1/1", BarrierPhase.UPDATE, {"b": 1}, {"a", "b", "c"})
    assert waiting.on_ack("a", ack(error="OSError")) is AckVerdict.NEEDS_PASS
    assert waiting.on_ack("a", "{not json") is AckVerdict.NEEDS_PASS, "the pass reports it"
    assert waiting.on_ack("b", ack()) is AckVerdict.IGNORED, "b was asked again: it answers retry 1"
    assert waiting.on_ack("b", ack(retry=1)) is AckVerdict.ANSWERS
    assert waiting.on_ack("b", ack(retry=1)) is AckVerdict.IGNORED, "counted once"
    assert waiting.on_ack("x", ack()) is AckVerdict.IGNORED, "not a member"
    assert waiting.on_ack("a", ack()) is AckVerdict.ANSWERS
    assert waiting.on_ack("c", ack()) is AckVerdict.NEEDS_PASS and not waiting.waiting


def test_the_merge_patch_holds_only_what_changed() -> None:
    old = {"phase": "Running", "barrier": {"phase": "Update", "members": {"a": "1", "b": "2"}}, "lag": 1}
    new = {"phase": "Running", "barrier": {"phase": "Resume", "members": {"a": "1"}}}
    assert merge_patch(old, new) == {"barrier": {"phase": "Resume", "members": {"b": None}}, "lag": None}
    assert merge_patch(old, old) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3),
    max_leaves=10,
)
documents = st.dictionaries(st.text(max_size=2), json_values, max_size=4)


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies it."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


def without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    return value


@given(documents, documents)
def test_applying_the_merge_patch_gives_the_new_status(old: dict[str, Any], new: dict[str, Any]) -> None:
    new = without_nulls(new)  # a status is written without nulls
    patch = merge_patch(old, new)
    assert apply_merge_patch(old, patch or {}) == new


def _version(name: str, revision: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": str(revision)}, "status": {}}


@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.booleans()), min_size=1, max_size=12),
    st.data(),
)
def test_the_pod_cache_ends_as_the_cluster_whatever_order_a_list_and_create_answers_arrive_in(
    changes: list[tuple[str, bool]], data: st.DataObject
) -> None:
    """The cluster changes pods one revision at a time (``alive`` False: deleted); the watch delivers the
    changes in order, while a LIST (taken at some revision) and the answers to creations arrive at any point."""
    watch: list[tuple[int, str, dict[str, Any]]] = []  # (revision, event type, pod)
    created: list[dict[str, Any]] = []
    state: dict[str, int] = {}
    history: list[dict[str, int]] = [{}]
    for revision, (name, alive) in enumerate(changes, start=1):
        if alive:
            if name not in state:
                created.append(_version(name, revision))
            state[name] = revision
            watch.append((revision, "MODIFIED", _version(name, revision)))
        elif name in state:
            del state[name]
            watch.append((revision, "DELETED", _version(name, revision)))
        history.append(dict(state))
    end = len(changes) + 1
    listed_at = data.draw(st.integers(0, len(changes)), label="the LIST's revision")
    listed = [_version(n, r) for n, r in history[listed_at].items()]
    # Nothing arrives before it happened; the watch keeps its order, with any lag, and may miss changes made
    # before the LIST (a restarted watch: the LIST of the next resync is what repairs them).
    lag = data.draw(st.floats(0, end), label="the watch's lag")
    missed = data.draw(st.sets(st.integers(1, listed_at)) if listed_at else st.just(set()), label="missed")
    arrivals: list[tuple[float, Any]] = [
        (revision + lag, (kind, pod)) for revision, kind, pod in watch if revision not in missed
    ]
    arrivals.append((data.draw(st.floats(listed_at, end), label="LIST arrives"), "list"))
    for answer in created:
        revision = int(answer["metadata"]["resourceVersion"])
        arrivals.append((data.draw(st.floats(revision, end), label="answer arrives"), ("ADDED", answer)))
    cache = PodCache()
    for _at, item in sorted(arrivals, key=lambda arrival: arrival[0]):
        if item == "list":
            cache.merge_list(listed, str(listed_at))
        else:
            cache.observe(*item)
    assert cache.listed
    assert {n: int(p["metadata"]["resourceVersion"]) for n, p in cache.pods.items()} == state


def test_the_pod_cache_keeps_the_operators_own_writes_until_the_watch_brings_them() -> None:
    cache = PodCache()
    cache.merge_list([pod("a")], "")
    cache.annotate("a", {keys.BARRIER: "command"})
    cache.deleting("b", "2026-12-01T00:00:00Z")  # not kept: nothing to mark
    assert cache.facts("a") is not None and cache.facts("a").annotation(keys.BARRIER) == "command"  # type: ignore[union-attr]
    cache.deleting("a", "2026-12-01T00:00:00Z")
    assert cache.facts("a").deleting and "managedFields" not in cache.pods["a"]["metadata"]  # type: ignore[union-attr]
    assert set(cache.pods) == {"a"}
