"""The acks step (lockstep.reconcile.acks): a pass asked for by barrier acks alone."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from factories import NOW, job, policy
from lockstep import keys
from lockstep.api import Phase
from lockstep.events import PassScope
from lockstep.protocol import ACK_FOR, PROTOCOL, BarrierPhase
from lockstep.reconcile import Observed, reconcile
from reconcile_helpers import announce, settle, status_of

ack_moves = st.sampled_from(["answer"] * 4 + ["none", "error", "stale", "unreadable"])  # mostly barriers that end


@settings(max_examples=200)
@given(
    backend=st.sampled_from(["filesystem", "gloo"]),
    on_timeout=st.sampled_from(["FailJob", "EvictStraggler"]),
    rounds=st.lists(
        st.tuples(
            st.lists(ack_moves, min_size=3, max_size=3),
            st.sampled_from([0, 1, 700]),
            st.sampled_from(["works", "announces", "completes"]),
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_a_pass_for_acks_alone_decides_what_the_whole_pipeline_decides(
    backend: str, on_timeout: str, rounds: list[tuple[list[str], int, str]]
) -> None:
    """Whatever the members ack, a pass of the barrier step alone (PassScope.BARRIER, asked for only when nothing
    but acks changed since a pass that stepped the barrier) plans what a pass of the whole pipeline plans, apart
    from the children it re-applies."""
    weight_sync: dict[str, Any] = {"onTimeout": on_timeout}
    if backend == "gloo":
        weight_sync["backend"] = "gloo"
    body, pods = settle(job(weightSync=weight_sync))
    announce(pods[2], 3)
    now, stepped = NOW, False
    for moves, seconds, trainer in [([], 0, "works"), *rounds]:  # the first pass opens the barrier
        observed = Observed(body, pods, [policy()], {}, now)
        whole = reconcile(observed)
        if stepped:
            alone = reconcile(dataclasses.replace(observed, scope=PassScope.BARRIER))
            assert status_of(alone) == status_of(whole)
            for field in ("annotate_pods", "delete_pods", "create_pods", "events", "requeue_after", "waiting_for"):
                assert getattr(alone, field) == getattr(whole, field), field
        body = {**body, "status": status_of(whole)}
        if whole.status.phase in (Phase.FAILED, Phase.SUCCEEDED):
            return
        for pod in pods:
            name, annotations = pod["metadata"]["name"], pod["metadata"]["annotations"]
            annotations.update(whole.annotate_pods.get(name, {}))
            if name in whole.delete_pods:  # its replacement runs: a pod event, which asks for the whole pipeline
                pod["metadata"]["uid"] += "-new"
                annotations.pop(keys.BARRIER, None)
                annotations.pop(keys.BARRIER_ACK, None)
        for pod, move in zip(pods, moves, strict=False):
            text = pod["metadata"]["annotations"].get(keys.BARRIER)
            if text is None or move == "none":
                continue
            command = json.loads(text)
            ack = {
                "protocol": PROTOCOL,
                "id": command["id"] if move != "stale" else "uid-1/0/1",
                "phase": ACK_FOR[BarrierPhase(command["phase"])],
                "loadedVersion": command["version"] if move == "answer" else None,
                "retry": command.get("retry", 0),
            }
            if move == "error":
                ack["error"] = "OSError: the volume is gone"
            pod["metadata"]["annotations"][keys.BARRIER_ACK] = "{not json" if move == "unreadable" else json.dumps(ack)
        if trainer == "announces":  # newer weights: a pod event, which asks for the whole pipeline
            announce(pods[2], 4 + len(body["status"].get("barrierHistory", [])))
        elif trainer == "completes":  # so is this one; the acks after it come to a job in its final update
            pods[2]["status"] = {**pods[2]["status"], "phase": "Succeeded"}
        stepped = whole.waiting_for is not None and not whole.delete_pods and trainer == "works"
        now += dt.timedelta(seconds=seconds)
