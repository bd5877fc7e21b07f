"""Step: the job's pods and children against what its spec asks for. Children are applied, pods the spec no
longer asks for go, drifted or changed pods are replaced, missing ones created (after a restart's backoff), and
the job is Running once every pod is ready."""

from __future__ import annotations

import re
from typing import Any

from lockstep import desired, keys
from lockstep.api import Phase, RLJobSpec
from lockstep.conditions import PARITY_LOCKED, READY
from lockstep.parity import EffectiveConfig
from lockstep.reconcile import completion, ownership, restarts, summary, weights
from lockstep.reconcile.children import Children, Desired
from lockstep.reconcile.context import Pass, role
from lockstep.reconcile.reasons import Reason


def wanted(
    run: Pass, spec: RLJobSpec, config: EffectiveConfig, placements: desired.Placements | None = None
) -> Desired:
    return Desired(
        {p["metadata"]["name"]: p for p in desired.pods(run.job, spec, config, placements, run.observed.trainer_env)},
        desired.preflight_pod(run.job, spec, config, placements) if spec.preflight.enabled else None,
        desired.actor_groups(run.job, spec, config, placements) if spec.actors.group is not None else None,
        {p["metadata"]["name"]: p for p in desired.group_pods(run.job, spec, config, placements)},
    )


def apply_children(run: Pass, spec: RLJobSpec, config: EffectiveConfig, pods: Desired) -> None:
    """The job's other children: its pods' identity and access, its effective config, its Services, its
    NetworkPolicy (removed when the spec turns it off)."""
    run.plan.children = [
        *desired.worker_access(run.job, [p["metadata"]["name"] for p in pods.running if role(p) != keys.ACTOR_WORKER]),
        desired.config_map(run.job, spec, config),
        *desired.services(run.job),
    ]
    if spec.network_policy.enabled:
        run.plan.children.append(desired.network_policy(run.job, spec))
    else:
        run.plan.remove_children.append(("NetworkPolicy", desired.network_policy_name(run.job.name)))


QUOTA_REFUSAL = re.compile(r"exceeded quota: ([^,\s]+)")
"""How the API server names the ResourceQuota that refused an object."""


def refusing_quotas(rejected: dict[str, str]) -> list[str]:
    """The ResourceQuotas that refused one of the job's pods (``rejected``: object → the API server's message)."""
    found = (QUOTA_REFUSAL.search(message) for what, message in rejected.items() if what.startswith("Pod "))
    return sorted({match.group(1) for match in found if match is not None})


def report_rejected(run: Pass, spec: RLJobSpec, config: EffectiveConfig) -> None:
    """The API server refused a child of this spec: say so, create nothing more until the spec changes, and
    keep an open barrier moving for the pods that run. A ResourceQuota that refused a pod makes the job release
    every pod it has (release_for_quota)."""
    refused = "; ".join(f"{what}: {message}" for what, message in sorted(run.observed.rejected.items()))
    quotas = refusing_quotas(run.observed.rejected)
    if quotas:
        release_for_quota(run, spec, quotas, refused)
        return
    run.plan.children = []
    if run.status.phase is not Phase.RUNNING:
        run.status.phase = Phase.PENDING
    run.condition(
        READY,
        False,
        Reason.CHILD_REJECTED,
        f"the API server refused what this RLJob asks for ({refused}); fix the RLJob's spec (or what refused "
        "it: a quota, an admission policy). The operator tries again when the spec changes, and every minute",
    )
    weights.keep_moving(run, spec, weights.ranks_per_member(spec, config))


def report_taken(run: Pass, spec: RLJobSpec, config: EffectiveConfig) -> None:
    """Objects that are not this job's hold the names of children it needs, or wear its labels: pods the API server
    refused to create over, pods that are not its children (lockstep.reconcile.ownership), a LeaderWorkerSet of its
    groups' name that it did not make. Name each, with whose it is and what to do; create and adopt nothing (the job
    needs all its pods), write nothing to them, and keep an open barrier moving for the job's own pods."""
    if run.status.phase is not Phase.RUNNING:
        run.status.phase = Phase.PENDING
    owners = ownership.Owners(run.observed.owners)
    found = [
        *(f"pod {name} {_whose(run, metadata)}" for name, metadata in sorted(run.observed.taken.items())),
        *(
            f"pod {name} wears this RLJob's labels but is not its own: {ownership.whose(pod['metadata'], owners)}"
            for name, pod in sorted(run.squatters.items())
        ),
    ]
    deletions = [f"pod {name}" for name in sorted({*run.observed.taken, *run.squatters})]
    group_set = foreign_group_set(run, spec)
    if group_set is not None:
        set_name = group_set["metadata"]["name"]
        found.append(
            f"LeaderWorkerSet {set_name} was not made by this RLJob, which never adopts one: "
            f"{ownership.whose(group_set['metadata'], owners)}"
        )
        deletions.append(f"{desired.LEADER_WORKER_SET.lower()} {set_name}")
    run.condition(
        READY,
        False,
        Reason.POD_NAME_TAKEN,
        f"{'; '.join(found)}. The job needs those names for children of its own, and counts no object it did not "
        f"make: delete them (kubectl delete -n {run.job.namespace} {' '.join(deletions)}; a pod a StatefulSet made "
        "goes with its StatefulSet) and the operator creates its own within a minute, or create the job under "
        "another name",
    )
    weights.keep_moving(run, spec, weights.ranks_per_member(spec, config))


def _whose(run: Pass, metadata: dict[str, Any]) -> str:
    """Whose a pod that holds one of the job's pod names is, as its metadata tells."""
    labels = metadata.get("labels") or {}
    owners = metadata.get("ownerReferences") or []
    managers = list(dict.fromkeys(str(entry.get("manager", "?")) for entry in metadata.get("managedFields") or []))
    wanted = f"{keys.MANAGED_BY}={keys.MANAGER}, {keys.JOB}={run.job.name}"
    if any(owner.get("uid") == run.job.uid for owner in owners):
        return (
            f"is this RLJob's own pod, but its labels no longer mark it as the job's ({wanted}), so Lockstep does "
            "not see it: someone changed them"
        )
    if labels.get(keys.MANAGED_BY) == keys.MANAGER:
        return f"is labelled as a pod of RLJob {labels.get(keys.JOB)!r}, not of this one"
    owned = ", ".join(f"{owner.get('kind')} {owner.get('name')}" for owner in owners) or "nobody"
    written = f", written by {', '.join(managers)}" if managers else ""
    return f"exists and is not Lockstep's (it lacks the labels {wanted}): owned by {owned}{written}"


def foreign_group_set(run: Pass, spec: RLJobSpec) -> dict[str, Any] | None:
    """The LeaderWorkerSet of the job's groups' name when the job has groups and did not make it (never adopted)."""
    found = run.observed.group_set
    if spec.actors.group is None or found is None or ownership.made_by_job(found["metadata"], run.job):
        return None
    return found


def group_set_edits(run: Pass) -> list[str]:
    """Who else wrote the spec of the job's own LeaderWorkerSet (its managedFields: any manager but the operator's
    server-side apply, status writes aside; a scale is a write of the spec too): any field of its templates, not
    only those the operator sets, is the job's, so such a set is replaced whole."""
    found = run.observed.group_set
    if found is None or not ownership.made_by_job(found["metadata"], run.job):
        return []
    return sorted(
        {
            f"{entry.get('manager', '?')} ({entry.get('operation', '?')})"
            for entry in found["metadata"].get("managedFields") or []
            if not (entry.get("manager") == keys.FIELD_MANAGER and entry.get("operation") == "Apply")
            and entry.get("subresource") != "status"
            and "f:spec" in (entry.get("fieldsV1") or {})
        }
    )


def release_for_quota(run: Pass, spec: RLJobSpec, quotas: list[str], refused: str) -> None:
    """A ResourceQuota refused some of the job's pods: the job runs all of its pods or none, so it releases those
    it got (other jobs in the namespace may use the quota) and tries again on the operator's next resync."""
    names = ", ".join(quotas)
    why = f"ResourceQuota {names} refused some of the job's pods: a job runs all its pods or none"
    completion.interrupt_barrier(run, Reason.QUOTA_EXCEEDED, why)
    run.stop_all_pods(spec, why)
    run.status.phase = Phase.PENDING
    run.condition(
        READY,
        False,
        Reason.QUOTA_EXCEEDED,
        f"ResourceQuota {names} in namespace {run.job.namespace} does not leave room for every pod of the job "
        f"({refused}). The job releases the pods it got, so that other jobs may use the quota, and tries again "
        "every minute; raise the quota, or queue the job with Kueue (label kueue.x-k8s.io/queue-name), which "
        "admits a job's pods together",
    )
    summary.count(run, spec, {})


def converge(run: Pass, config: EffectiveConfig, children: Children) -> dict[str, dict[str, Any]]:
    """Delete what the spec no longer asks for, replace what drifted or changed, create what is missing once a
    restart's backoff is over; the pods that stay (the barrier's and the readiness count's)."""
    for name in children.scaled_down:
        run.plan.delete_pods[name] = "no longer desired (scaled down)"
    for name, fingerprint in children.drifted.items():
        run.replace({name: "it ran under another parity configuration (drift)"})
        run.condition(
            PARITY_LOCKED,
            False,
            Reason.DRIFT,
            f"pod {name} runs with config {fingerprint}, not {config.fingerprint}; replacing it",
        )
    for name in children.changed:
        run.replace({name: "the pod spec changed"})
    # Pods deleted in this pass are recreated in a later one, once they are gone.
    replaced = [name for name in children.desired.pods if name in run.plan.delete_pods]
    wait = restarts.backoff_remaining(run)
    edits = group_set_edits(run)
    if edits:
        set_name = desired.actor_set_name(run.job.name)
        run.plan.remove_children.append((desired.LEADER_WORKER_SET, set_name))
        run.condition(
            PARITY_LOCKED,
            False,
            Reason.DRIFT,
            f"LeaderWorkerSet {set_name}'s spec was changed by {', '.join(edits)}, not by Lockstep: its groups may not "
            "run what the job's fingerprint says; replacing it whole",
        )
    if wait <= 0:
        run.plan.create_pods = [weights.with_committed_weights(run, children.desired.pods[n]) for n in children.missing]
        if children.desired.group_set is not None and not edits:  # LeaderWorkerSet creates the groups' pods
            run.plan.children.append(desired.onto(children.desired.group_set, run.observed.group_set))
    elif children.missing or replaced:
        run.requeue(wait)
    staying = {**children.pods, **children.groups}
    wanted = children.desired.pods.keys() | children.desired.groups.keys()
    return {name: pod for name, pod in staying.items() if name not in run.plan.delete_pods and name in wanted}


def readiness(run: Pass, spec: RLJobSpec, live: dict[str, dict[str, Any]]) -> None:
    """Running once every pod is ready; until then Ready=False, PodsNotReady (or Restarting, during its backoff).
    Every pod ready but weight updates stalled (``run.updates_stalled``): Running, Ready=False WeightUpdateStalled,
    which kstatus reads as Stalled."""
    summary.count(run, spec, live)
    if summary.all_ready(run.status):
        run.status.phase = Phase.RUNNING
        if run.updates_stalled is not None:
            run.condition(READY, False, Reason.WEIGHT_UPDATE_STALLED, run.updates_stalled)
            return
        run.condition(READY, True, Reason.ALL_PODS_READY, summary.readiness(run))
        return
    if run.old.phase is not Phase.RUNNING:
        run.status.phase = Phase.PENDING
    if restarts.backoff_remaining(run) <= 0:
        run.condition(READY, False, Reason.PODS_NOT_READY, summary.readiness(run))
