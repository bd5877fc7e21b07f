"""Label and annotation keys: the one place they are spelled."""

from __future__ import annotations

DOMAIN = "lockstep.dev"

# Labels on every child object.
JOB = f"{DOMAIN}/job"
ROLE = f"{DOMAIN}/role"
INDEX = f"{DOMAIN}/index"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "lockstep-operator"
FIELD_MANAGER = "lockstep-operator"  # the operator's server-side apply (and every write it makes)

# Annotations on pods.
CONFIG_FINGERPRINT = f"{DOMAIN}/config-fingerprint"
TEMPLATE_HASH = f"{DOMAIN}/template-hash"
# The weight-update barrier (docs/barrier-protocol.md).
WEIGHTS = f"{DOMAIN}/weights"  # on trainer rank 0, by the trainer
INITIAL_WEIGHTS = f"{DOMAIN}/initial-weights"  # on new pods, by the operator
BARRIER = f"{DOMAIN}/barrier"  # on member pods, by the operator only
BARRIER_ACK = f"{DOMAIN}/barrier-ack"  # on member pods, by that pod only
# Train-inference parity, as the trainer measured it on its last step.
MISMATCH = f"{DOMAIN}/mismatch"  # on trainer rank 0, by the trainer
EVALUATION = f"{DOMAIN}/evaluation"  # on trainer rank 0, by the trainer: its last evaluation (spec.trainer.eval)
OUTPUT = f"{DOMAIN}/output"  # on trainer rank 0, by the trainer: the trained model it wrote last (spec.output)
PREFLIGHT = f"{DOMAIN}/preflight"  # on the preflight pod, by that pod: the parity it measured

ACTOR = "actor"
ACTOR_WORKER = "actor-worker"  # a multi-pod actor group's pods but its leader (docs/actor-groups.md)
TRAINER = "trainer"
PREFLIGHT_ROLE = "preflight"

# The operator's pod watch: only pods it created.
POD_SELECTOR = f"{MANAGED_BY}={MANAGER}"

# The operator's identity, which alone may issue barrier commands (crds/admission-barrier.yaml).
OPERATOR_NAMESPACE = "lockstep-system"
OPERATOR_SERVICE_ACCOUNT = "lockstep-operator"
OPERATOR_USERNAME = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SERVICE_ACCOUNT}"
# What a service-account token bound to a pod carries: the name and UID of that pod.
POD_NAME_EXTRA = "authentication.kubernetes.io/pod-name"
POD_UID_EXTRA = "authentication.kubernetes.io/pod-uid"
# LeaderWorkerSet's pods (multi-pod actor groups): the label it sets on each, and who creates and deletes them, which
# the barrier's admission policy lets handle Lockstep-labelled pods of a set (crds/admission-barrier.yaml).
GROUP_SET_NAME = "leaderworkerset.sigs.k8s.io/name"
STATEFULSET_CONTROLLER_USERNAME = "system:serviceaccount:kube-system:statefulset-controller"
LWS_CONTROLLER_USERNAME = "system:serviceaccount:lws-system:lws-controller-manager"
GARBAGE_COLLECTOR_USERNAME = "system:serviceaccount:kube-system:generic-garbage-collector"
# Members of this group may write every Lockstep annotation and label on Lockstep's pods, to repair one by hand
# (crds/admission-barrier.yaml; docs/barrier-protocol.md).
BREAK_GLASS_GROUP = "lockstep:break-glass"
