"""Desired children of an RLJob: pure functions from (job, effective config) to manifests.

Pods are named deterministically (``<job>-actor-<i>``, ``<job>-trainer-<rank>``), so creating
one twice is a harmless 409 and reconciliation is idempotent.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from lockstep import keys
from lockstep.api import API_VERSION, PodOverrides, RLJobSpec
from lockstep.parity import EffectiveConfig, vllm_cli_args

ACTOR_PORT = 8000
TRAINER_PORT = 29500
TRAINER_METRICS_PORT = 9400
WEIGHTS_PORT = 9500
"""Collective backends: trainer rank 0 serves each version's manifest here (lockstep_workers.transfer)."""
WEIGHTS_GROUP_PORT = 9501
"""Collective backends: the rendezvous of each barrier's transfer group, on trainer rank 0."""
CONFIG_MOUNT = "/etc/lockstep"
CONFIG_FILE = "effective-config.json"
SHARED_MOUNT = "/var/lib/lockstep"


@dataclass(frozen=True)
class JobRef:
    """Identity of the owning RLJob."""

    name: str
    namespace: str
    uid: str

    def owner_reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": "RLJob",
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    def labels(self, role: str | None = None) -> dict[str, str]:
        labels = {keys.MANAGED_BY: keys.MANAGER, keys.JOB: self.name, "app.kubernetes.io/instance": self.name}
        if role:
            labels[keys.ROLE] = role
        return labels

    def metadata(self, name: str, role: str | None = None) -> dict[str, Any]:
        return {
            "name": name,
            "namespace": self.namespace,
            "labels": self.labels(role),
            "ownerReferences": [self.owner_reference()],
        }


def pod_name(job: str, role: str, index: int) -> str:
    return f"{job}-{role}-{index}"


def config_map_name(job: str) -> str:
    return f"{job}-config"


def actor_service_name(job: str) -> str:
    return f"{job}-actors"


def trainer_service_name(job: str) -> str:
    return f"{job}-trainer"


def worker_account_name(job: str) -> str:
    return f"{job}-worker"


def worker_access(job: JobRef, pod_names: list[str]) -> list[dict[str, Any]]:
    """The identity the job's pods run as: it may read and patch the job's own pods and nothing else.

    RBAC cannot say "only your own pod, only your ack annotation": the ValidatingAdmissionPolicy in
    crds/admission-barrier.yaml narrows each patch to the caller's own pod and its own keys.
    """
    name = worker_account_name(job.name)
    rbac = "rbac.authorization.k8s.io"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": job.metadata(name)},
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "Role",
            "metadata": job.metadata(name),
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["pods"],
                    "resourceNames": sorted(pod_names),
                    "verbs": ["get", "list", "watch", "patch"],
                }
            ],
        },
        {
            "apiVersion": f"{rbac}/v1",
            "kind": "RoleBinding",
            "metadata": job.metadata(name),
            "roleRef": {"apiGroup": rbac, "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
        },
    ]


def config_map(job: JobRef, config: EffectiveConfig) -> dict[str, Any]:
    """The effective configuration, for people and for the pods (mounted at /etc/lockstep)."""
    document = {
        "fingerprint": config.fingerprint,
        "policy": config.policy,
        "mismatchBudget": config.mismatch_budget.model_dump(mode="json", by_alias=True),
        **config.document(),
    }
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": job.metadata(config_map_name(job.name)),
        "data": {
            CONFIG_FILE: json.dumps(document, indent=2, sort_keys=True),
            "vllm-args": " ".join(vllm_cli_args(config.vllm)),
        },
    }


def services(job: JobRef) -> list[dict[str, Any]]:
    """A ClusterIP Service in front of the actors; a headless one giving trainer pods stable DNS names."""
    actors = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": job.metadata(actor_service_name(job.name), keys.ACTOR),
        "spec": {
            "selector": job.labels(keys.ACTOR),
            "ports": [{"name": "http", "port": ACTOR_PORT, "targetPort": ACTOR_PORT}],
        },
    }
    trainer = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": job.metadata(trainer_service_name(job.name), keys.TRAINER),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": job.labels(keys.TRAINER),
            "ports": [{"name": "rendezvous", "port": TRAINER_PORT, "targetPort": TRAINER_PORT}],
        },
    }
    return [actors, trainer]


def pods(job: JobRef, spec: RLJobSpec, config: EffectiveConfig) -> list[dict[str, Any]]:
    """Every pod the job should have, actors first."""
    actors = [actor_pod(job, spec, config, index) for index in range(spec.actors.replicas)]
    trainers = [trainer_pod(job, spec, config, rank) for rank in range(spec.trainer.replicas)]
    return actors + trainers


def preflight_pod(job: JobRef, spec: RLJobSpec, config: EffectiveConfig) -> dict[str, Any]:
    """The pod that checks train-inference parity under the job's effective configuration before training;
    it writes what it measured on itself (lockstep.dev/preflight) and exits."""
    rollout = spec.trainer.rollout
    container = {
        "name": keys.PREFLIGHT_ROLE,
        "image": spec.actors.image,
        "command": ["python", "-m", "lockstep_workers.parity_check"],
        "args": [
            "--preflight",
            f"--model={spec.model.uri}",
            f"--prompts={spec.preflight.prompts}",
            f"--samples={spec.preflight.samples_per_prompt}",
            f"--tokens={rollout.max_tokens}",
            f"--temperature={rollout.temperature}",
            f"--top-p={rollout.top_p}",
        ],
    }
    return _pod(job, spec, spec.actors, config, keys.PREFLIGHT_ROLE, 0, container, hostname=None)


def actor_pod(job: JobRef, spec: RLJobSpec, config: EffectiveConfig, index: int) -> dict[str, Any]:
    args = [f"--model={spec.model.uri}", f"--port={ACTOR_PORT}", *vllm_cli_args(config.vllm)]
    container = {
        "name": keys.ACTOR,
        "image": spec.actors.image,
        "command": ["python", "-m", "lockstep_workers.actor"],
        "args": args,
        "ports": [{"name": "http", "containerPort": ACTOR_PORT}],
        "readinessProbe": {"httpGet": {"path": "/ready", "port": ACTOR_PORT}, "periodSeconds": 5},
    }
    return _pod(job, spec, spec.actors, config, keys.ACTOR, index, container, hostname=None)


def trainer_pod(job: JobRef, spec: RLJobSpec, config: EffectiveConfig, rank: int) -> dict[str, Any]:
    settings = spec.trainer.training().model_dump_json(by_alias=True)
    master = f"{pod_name(job.name, keys.TRAINER, 0)}.{trainer_service_name(job.name)}.{job.namespace}.svc"
    ports = [
        {"name": "rendezvous", "containerPort": TRAINER_PORT},
        {"name": "metrics", "containerPort": TRAINER_METRICS_PORT},
    ]
    env = [
        {"name": "LOCKSTEP_METRICS_PORT", "value": str(TRAINER_METRICS_PORT if rank == 0 else 0)},
        {"name": "MASTER_ADDR", "value": master},
        {"name": "MASTER_PORT", "value": str(TRAINER_PORT)},
        {"name": "WORLD_SIZE", "value": str(spec.trainer.replicas)},
        {"name": "RANK", "value": str(rank)},
        {"name": "LOCKSTEP_ACTORS_URL", "value": f"http://{actor_service_name(job.name)}:{ACTOR_PORT}"},
    ]
    if spec.weight_sync.backend.collective:  # rank 0 sends the weights: the actors reach it here
        ports += [
            {"name": "weights", "containerPort": WEIGHTS_PORT},
            {"name": "weights-group", "containerPort": WEIGHTS_GROUP_PORT},
        ]
        env += [
            {"name": "LOCKSTEP_WEIGHTS_HOST", "value": master},
            {"name": "LOCKSTEP_WEIGHTS_PORT", "value": str(WEIGHTS_PORT)},
            {"name": "LOCKSTEP_WEIGHTS_GROUP_PORT", "value": str(WEIGHTS_GROUP_PORT)},
        ]
    container = {
        "name": keys.TRAINER,
        "image": spec.trainer.image,
        "command": ["python", "-m", "lockstep_workers.trainer"],
        "args": [f"--model={spec.model.uri}", f"--settings={settings}"],
        "ports": ports,
        "env": env,
    }
    hostname = pod_name(job.name, keys.TRAINER, rank)
    return _pod(job, spec, spec.trainer, config, keys.TRAINER, rank, container, hostname=hostname)


def _pod(
    job: JobRef,
    spec: RLJobSpec,
    overrides: PodOverrides,
    config: EffectiveConfig,
    role: str,
    index: int,
    container: dict[str, Any],
    hostname: str | None,
) -> dict[str, Any]:
    name = pod_name(job.name, role, index)
    env = [
        *container.pop("env", []),
        {"name": "LOCKSTEP_JOB", "value": job.name},
        {"name": "LOCKSTEP_ROLE", "value": role},
        {"name": "LOCKSTEP_CONFIG", "value": f"{CONFIG_MOUNT}/{CONFIG_FILE}"},
        {"name": "LOCKSTEP_WEIGHT_SYNC", "value": spec.weight_sync.backend.value},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    mounts = [{"name": "lockstep-config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "lockstep-config", "configMap": {"name": config_map_name(job.name)}}]
    shared = _shared_volume(spec, role)
    if shared is not None:
        # The trainer writes weights here; the other pods only read them.
        mounts.append({"name": "lockstep-shared", "mountPath": SHARED_MOUNT, "readOnly": role != keys.TRAINER})
        volumes.append({"name": "lockstep-shared", **shared})
        env.append({"name": "LOCKSTEP_SHARED_DIR", "value": f"{SHARED_MOUNT}/{job.uid}"})
    container = {
        **container,
        "env": [*env, *(overrides.env or [])],
        "resources": overrides.resources or {},
        "volumeMounts": [*mounts, *(overrides.volume_mounts or [])],
    }
    pod_spec: dict[str, Any] = {
        # The operator, not the kubelet, restarts failed pods, so that maxRestarts counts every failure.
        "restartPolicy": "Never",
        "serviceAccountName": worker_account_name(job.name),
        "containers": [container],
        "volumes": [*volumes, *(overrides.volumes or [])],
    }
    if hostname:
        pod_spec.update(hostname=hostname, subdomain=trainer_service_name(job.name))
    for field, value in (
        ("nodeSelector", overrides.node_selector),
        ("tolerations", overrides.tolerations),
        ("affinity", overrides.affinity),
    ):
        if value:
            pod_spec[field] = value
    metadata = job.metadata(name, role)
    metadata["labels"][keys.INDEX] = str(index)
    metadata["annotations"] = {keys.CONFIG_FINGERPRINT: config.fingerprint, keys.TEMPLATE_HASH: _hash(pod_spec)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def _shared_volume(spec: RLJobSpec, role: str) -> dict[str, Any] | None:
    """The volume source of the shared weights directory for a pod of ``role``, if it has one: every pod with
    the filesystem backend; with a collective one only the trainer, which keeps its checkpoints and metrics
    there (an emptyDir when spec.weightSync.volume is unset)."""
    if not spec.weight_sync.backend.collective:
        return spec.weight_sync.volume
    if role != keys.TRAINER:
        return None
    return spec.weight_sync.volume or {"emptyDir": {}}


def _hash(document: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16]
