"""Step: the weight-update barrier (lockstep.barrier's state machine) over the pods that run, and the final
update that carries the trainer's last weights to every actor once it completed."""

from __future__ import annotations

from typing import Any

from lockstep import barrier, desired, keys, protocol
from lockstep.api import Phase, RLJobSpec, UpdateMode
from lockstep.conditions import READY
from lockstep.parity import EffectiveConfig
from lockstep.protocol import Weights
from lockstep.reconcile import budget, completion, memory
from lockstep.reconcile.children import Children
from lockstep.reconcile.context import Next, Pass, annotation, pod_phase, role
from lockstep.reconcile.reasons import Reason
from lockstep.times import parse_rfc3339


def ranks_per_member(spec: RLJobSpec, config: EffectiveConfig | None) -> int:
    """Ranks an actor takes in a transfer group: one per vLLM worker of its engine, over every pod of a group
    (spec.actors.group), else its tensor-parallel size (the effective one; the spec's while none resolves)."""
    if spec.actors.group is not None:
        return spec.actors.group.ranks
    if config is None:
        return spec.actors.vllm.tensor_parallel_size or 1
    return int(config.vllm.get("tensorParallelSize", 1))


def step(
    run: Pass,
    spec: RLJobSpec,
    live: dict[str, dict[str, Any]],
    ranks: int,
    updates: budget.Updates = budget.Updates.ALLOWED,
) -> Next:
    """Advance the barrier over ``live`` (the pods that stay); DONE when it failed the job. With a collective
    backend trainer rank 0 is a member too: it sends the weights, and each actor takes ``ranks`` ranks of the
    transfer group. While ``updates`` are held, or the actors cannot stage the announced version in their memory
    (lockstep.reconcile.memory), an open barrier goes on and no new one opens for it; ``updates`` FAILED (the
    budget ended the job) is DONE. A version whose barriers failed in a row waits before the next, and stalls
    (``run.updates_stalled``, for Ready) after lockstep.barrier.STALL_AFTER_FAILURES of them."""
    if updates is budget.Updates.FAILED:
        return Next.DONE
    rank0_name = desired.rank0_name(run.job.name)
    collective = spec.weight_sync.backend.collective
    members = {
        name: barrier.member_of(pod, reads_initial_weights=not collective)
        for name, pod in live.items()
        if (role(pod) == keys.ACTOR or (collective and name == rank0_name)) and pod_phase(pod) == "Running"
    }
    rank0 = live.get(rank0_name)
    announced = _announcement(run, rank0, collective) if rank0 is not None else None
    fits = memory.fits(run, spec, announced)
    status = run.status
    decision = barrier.step(
        job_uid=run.job.uid,
        barrier=status.barrier,
        committed=status.weights,
        # Held, or too large to stage: the open barrier goes on, and no new one opens.
        announced=announced if updates is budget.Updates.ALLOWED and fits else None,
        members=list(members.values()),
        history=status.barrier_history,
        now=run.observed.now,
        timeout_seconds=spec.weight_sync.barrier_timeout_seconds,
        on_timeout=spec.weight_sync.on_timeout,
        sender=rank0_name if collective else None,
        ranks_per_member=ranks,
        rolling=spec.weight_sync.mode is UpdateMode.ROLLING,
        opened=status.barriers_opened,
    )
    status.barrier = decision.barrier
    status.barriers_opened = decision.opened
    if decision.barrier is not None:
        run.plan.waiting_for = set(decision.barrier.members) - set(decision.acked)
    status.weights = decision.committed
    status.weights_version = decision.committed.version if decision.committed else None
    status.barrier_history = barrier.remember(status.barrier_history, decision.record)
    actors = [m.loaded_version or 0 for name, m in members.items() if role(live[name]) == keys.ACTOR]
    status.lag = announced.version - min(actors) if announced is not None and actors else None
    for note in decision.notes:
        run.event(Reason.WEIGHT_UPDATE, note)
    if (held := decision.held) is not None and held.until is not None:
        run.requeue((held.until - run.observed.now).total_seconds() + 0.5)
    elif held is not None:
        serving = f"version {committed.version}" if (committed := decision.committed) else "the initial weights"
        run.updates_stalled = (
            f"{held.words()}; no barrier opens for it again, and the actors keep serving {serving}: fix what the "
            "error names, then have the trainer announce a newer version (or recreate the job)"
        )
    for name, command in decision.commands.items():
        text = protocol.document(command)
        if annotation(live[name], keys.BARRIER) != text:
            run.plan.annotate_pods[name] = {keys.BARRIER: text}
    run.replace({name: "it was evicted from the weight update as a straggler" for name in decision.evict})
    if decision.failed:
        completion.finish_job(run, spec, Phase.FAILED, Reason.WEIGHT_UPDATE_FAILED, decision.failed)
        return Next.DONE
    if decision.barrier is not None and decision.commands:
        deadline = parse_rfc3339(decision.barrier.deadline)
        run.requeue((deadline - run.observed.now).total_seconds() + 0.5)
    return Next.CONTINUE


def keep_moving(run: Pass, spec: RLJobSpec, ranks: int) -> None:
    """While the job cannot run its pods normally, an open barrier still finishes or fails by its deadline
    (no new one opens)."""
    if run.status.barrier is not None:
        step(run, spec, run.pods, ranks, budget.Updates.HELD)


def with_committed_weights(run: Pass, pod: dict[str, Any]) -> dict[str, Any]:
    """A new pod starts from the committed weights (it joins a catch-up barrier if newer ones are in flight)."""
    if run.status.weights is not None:
        pod["metadata"]["annotations"][keys.INITIAL_WEIGHTS] = protocol.document(run.status.weights)
    return pod


def finish_training(run: Pass, spec: RLJobSpec, config: EffectiveConfig, children: Children) -> None:
    """Rank 0 has completed: carry its last announced weights to every actor (unless the ParityPolicy holds
    weight updates), then succeed; fail if that last version stalled (lockstep.barrier.held_back). An actor lost
    meanwhile is recreated so that the update has members."""
    rank0 = children.rank0
    assert rank0 is not None
    updates = budget.check(run, spec, config, rank0)
    if step(run, spec, children.pods, ranks_per_member(spec, config), updates) is Next.DONE:
        return
    if run.updates_stalled is not None:
        # The trainer is done and its last version stalled: nothing more will come to load, so the job ends.
        completion.finish_job(run, spec, Phase.FAILED, Reason.WEIGHT_UPDATE_STALLED, run.updates_stalled)
        return
    announced = _announcement(run, rank0, spec.weight_sync.backend.collective)  # reported once, by step
    final = announced.version if announced is not None else None
    committed = run.status.weights_version
    if run.status.barrier is None and (final is None or (committed or 0) >= final):
        serving = f"; every actor serves weights version {committed}" if committed else ""
        message = f"the trainer (rank 0) completed{serving}"
        completion.finish_job(run, spec, Phase.SUCCEEDED, Reason.TRAINER_SUCCEEDED, message)
        return
    for name, pod in children.pods.items():
        if role(pod) == keys.ACTOR and pod_phase(pod) == "Failed":
            run.plan.delete_pods[name] = "it failed after the trainer completed"
    run.plan.create_pods = [
        with_committed_weights(run, children.desired.pods[name])
        for name in children.missing
        if role(children.desired.pods[name]) == keys.ACTOR
    ]
    message = f"the trainer completed; carrying weights version {final} to every actor"
    run.condition(READY, True, Reason.FINAL_WEIGHT_UPDATE, message)


def _announcement(run: Pass, rank0: dict[str, Any], collective: bool) -> Weights | None:
    """The weights trainer rank 0 announced, if the operator accepts them. A refused announcement is reported
    once (an Event, and status.refusedAnnouncement), not on every pass."""
    text = annotation(rank0, keys.WEIGHTS)
    announced = barrier.announced_by(rank0)
    problem = (
        barrier.announcement_problem(
            announced, origin=desired.weights_origin(run.job, collective), committed=run.status.weights
        )
        if isinstance(announced, Weights)
        else announced
    )
    if problem is None:
        run.status.refused_announcement = None
        return announced if isinstance(announced, Weights) else None
    if run.status.refused_announcement != text:
        run.status.refused_announcement = text
        run.event(
            Reason.INVALID_WEIGHTS_ANNOUNCEMENT,
            f"{keys.WEIGHTS} on the trainer {problem}; it is ignored until the trainer announces valid weights",
            warning=True,
        )
    return None
