"""The RLJob reconciler's functional core: what the operator read → what it should do.

``reconcile`` is pure. The kopf shell (lockstep.controller) gathers the job and its pods (as the watches
delivered them: a pass does not list the pods), the ParityPolicies and the namespace's labels
(and, with Kueue, the job's Workloads), calls it, and carries out the returned Plan.

A pass is a short pipeline of steps, each in the module named after it; a step that ends the pass says why in
the status and returns ``Next.DONE``:

1. policy: the spec parses, and a ParityPolicy gives the effective vLLM configuration; a pass asked for by
   barrier acks alone (``Observed.scope``) then steps the barrier and ends (acks);
2. pods.apply_children: the job's ServiceAccount, Role, ConfigMap, Services and NetworkPolicy;
3. queue: Kueue admits the job, and says where its pods go (jobs labelled kueue.x-k8s.io/queue-name);
4. spec.suspend stops the pods;
5. children.classify: the pods against the desired ones, once;
6. preflight: the parity check before training;
7. weights.finish_training, once trainer rank 0 completed;
8. restarts: failures, counted against spec.maxRestarts;
9. pods.converge: replacements and creations;
10. budget and weights: the trainer's measurements and the mismatch budget, then the weight-update barrier;
11. pods.readiness; then completion and summary close every pass.
"""

from __future__ import annotations

from lockstep.api import Phase
from lockstep.conditions import READY
from lockstep.events import PassScope
from lockstep.reconcile import acks, budget, completion, pods, policy, preflight, queue, restarts, summary, weights
from lockstep.reconcile.children import classify
from lockstep.reconcile.context import Event, KueueView, Next, Observed, Pass, Plan, pod_phase
from lockstep.reconcile.reasons import Reason
from lockstep.reconcile.restarts import restart_backoff_seconds

__all__ = ["Event", "KueueView", "Observed", "Plan", "reconcile", "restart_backoff_seconds"]


def reconcile(observed: Observed) -> Plan:
    """Decide what the operator does for one RLJob, given what it read."""
    run = Pass(observed)
    _steps(run)
    return summary.finish(run)


def _steps(run: Pass) -> None:
    spec = policy.valid_spec(run)
    if spec is None:
        return
    if run.status.phase in completion.FINISHED:
        completion.tidy_finished(run, spec)
        return
    restarts.carry_over(run)
    config = policy.resolve(run, spec)
    if config is None:
        weights.keep_moving(run, spec, weights.ranks_per_member(spec, None))
        return
    if run.observed.scope is PassScope.BARRIER and acks.advance_barrier(run, spec, config) is Next.DONE:
        return
    wanted = pods.wanted(run, spec, config)
    pods.apply_children(run, spec, config, wanted)
    if run.observed.rejected:
        pods.report_rejected(run, spec, config)
        return
    if run.observed.taken or run.squatters or pods.foreign_group_set(run, spec) is not None:
        pods.report_taken(run, spec, config)
        return
    placements = queue.admit(run, spec, wanted.running)
    if spec.suspend:
        completion.interrupt_barrier(run, Reason.SUSPENDED, "the job is suspended (spec.suspend)")
        run.stop_all_pods(spec, "the job is suspended")
        run.status.phase = Phase.SUSPENDED
        run.condition(READY, False, Reason.SUSPENDED, "spec.suspend is true: pods are deleted, the status is kept")
        summary.count(run, spec, {})
        return
    if placements is None:
        return
    if placements:
        wanted = pods.wanted(run, spec, config, placements)
    children = classify(run, wanted, config.fingerprint)
    if wanted.preflight is not None and preflight.run_check(run, spec, config, children) is Next.DONE:
        return
    budget.record_results(run, spec, children.rank0)
    if children.rank0 is not None and pod_phase(children.rank0) == "Succeeded":
        weights.finish_training(run, spec, config, children)
        return
    if restarts.count_losses(run, spec, children) is Next.DONE:
        return
    live = pods.converge(run, config, children)
    updates = budget.check(run, spec, config, children.rank0)
    if weights.step(run, spec, live, weights.ranks_per_member(spec, config), updates) is Next.DONE:
        return
    pods.readiness(run, spec, live)
