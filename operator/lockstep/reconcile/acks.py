"""Step: a pass asked for by barrier acks alone (``PassScope.BARRIER``). The last pass stepped the open barrier
over the job's pods, and since then nothing but acks changed (anything else, a pod, the job, a policy or a
timer, asks for the whole pipeline), so the desired pods, the children, the pod diff and the pod counts would come
out as they did: this pass steps the barrier over the pods that run, without building any of it."""

from __future__ import annotations

from lockstep import desired, keys
from lockstep.api import RLJobSpec
from lockstep.parity import EffectiveConfig
from lockstep.reconcile import budget, weights
from lockstep.reconcile.context import Next, Pass, pod_phase, role


def advance_barrier(run: Pass, spec: RLJobSpec, config: EffectiveConfig) -> Next:
    """Step the barrier; CONTINUE (the whole pipeline decides) when the job is in a state the
    barrier alone does not cover: a child was refused, or the trainer completed (its final update ends the job)."""
    rank0 = run.pods.get(desired.rank0_name(run.job.name))
    if run.observed.rejected or (rank0 is not None and pod_phase(rank0) == "Succeeded"):
        return Next.CONTINUE
    live = {name: pod for name, pod in run.pods.items() if role(pod) in (keys.ACTOR, keys.TRAINER)}
    weights.step(run, spec, live, weights.ranks_per_member(spec, config), budget.check(run, spec, config, rank0))
    return Next.DONE
