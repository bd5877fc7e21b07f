"""Desired children of an RLJob: pure functions from (job, effective config) to manifests.

Pods are named deterministically (``<job>-actor-<i>``, ``<job>-trainer-<rank>``), so creating
one twice is a harmless 409 and reconciliation is idempotent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from lockstep import environment, keys
from lockstep.api import API_VERSION, PodOverrides, RLJobSpec, Training
from lockstep.environment import (
    ACTOR_PORT,
    ACTOR_PORT_NAME,
    CONFIG_FILE,
    CONFIG_MOUNT,
    MANIFEST_PORT,
    RENDEZVOUS_PORT,
    SHARED_MOUNT,
    SHM_DIR,
    TRAINER_METRICS_PORT,
    TRANSFER_GROUP_PORT,
    WORKER_ENV,
    WRITABLE_DIRS,
)
from lockstep.origin import WEIGHTS_DIRECTORY, TrainerManifest, WeightsFiles, WeightsOrigin
from lockstep.parity import EffectiveConfig
from lockstep.podconfig import PodConfig, actor_args

WORKER_UID = 10001
"""The uid and gid Lockstep's worker images run as (images/); the pods' fsGroup, so volumes they write are theirs."""
GPU = "nvidia.com/gpu"


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


@dataclass(frozen=True)
class Placement:
    """Node labels and tolerations a role's pods must carry beside their own (Kueue's admitted flavors)."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


Placements = Mapping[str, Placement]
"""Role → the placement of its pods (a role not named: none)."""


def _placement(placements: Placements | None, role: str) -> Placement:
    return (placements or {}).get(role) or Placement()


def pod_name(job: str, role: str, index: int) -> str:
    return f"{job}-{role}-{index}"


def rank0_name(job: str) -> str:
    """Trainer rank 0's pod: it announces the weights and, with a collective backend, sends them."""
    return pod_name(job, keys.TRAINER, 0)


def config_map_name(job: str) -> str:
    return f"{job}-config"


def actor_service_name(job: str) -> str:
    return f"{job}-actors"


def trainer_service_name(job: str) -> str:
    return f"{job}-trainer"


def worker_account_name(job: str) -> str:
    return f"{job}-worker"


def worker_access(job: JobRef, pod_names: list[str]) -> list[dict[str, Any]]:
    """The identity the job's pods run as: it may read and patch the job's own pods, and list and watch the
    namespace's EndpointSlices (where the trainer finds the actors), and nothing else.

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
                },
                # The trainer finds the actors in their Service's EndpointSlices (lockstep_workers.rollout.client). RBAC
                # cannot name slices by label: it reads the namespace's, and asks only for the job's by selector.
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
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


def pod_config(spec: RLJobSpec, config: EffectiveConfig) -> PodConfig:
    """What the job's pods run with (lockstep.podconfig.load_pod_config reads it in each). The document's lora is
    spec.trainer.lora, which the pods read in training.lora."""
    return PodConfig.model_validate(
        {
            "fingerprint": config.fingerprint,
            "policy": config.policy,
            **{key: value for key, value in config.document().items() if key != "lora"},
            "mismatchBudget": config.mismatch_budget,
            "training": spec.trainer.training(),
            "output": spec.output,
        }
    )


def config_map(job: JobRef, spec: RLJobSpec, config: EffectiveConfig) -> dict[str, Any]:
    """The job's PodConfig, for the pods (mounted at environment.CONFIG_MOUNT) and for people."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": job.metadata(config_map_name(job.name)),
        "data": {CONFIG_FILE: pod_config(spec, config).text()},
    }


def services(job: JobRef) -> list[dict[str, Any]]:
    """A ClusterIP Service in front of the actors; a headless one giving trainer pods stable DNS names."""
    actors = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": job.metadata(actor_service_name(job.name), keys.ACTOR),
        "spec": {
            "selector": job.labels(keys.ACTOR),
            "ports": [{"name": ACTOR_PORT_NAME, "port": ACTOR_PORT, "targetPort": ACTOR_PORT}],
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
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}],
        },
    }
    return [actors, trainer]


def onto(child: dict[str, Any], observed: Mapping[str, Any] | None) -> dict[str, Any]:
    """``child`` as applied onto ``observed``, the object of its name its pass read (None: the pass read none): with
    that object's uid, which the API server takes as a precondition, so that a pass computed before the object was
    deleted (or made anew) never creates it again; the write is answered 409 (422 for another uid) instead."""
    if observed is None:
        return child
    return {**child, "metadata": {**child["metadata"], "uid": observed["metadata"]["uid"]}}


def network_policy_name(job: str) -> str:
    return f"{job}-isolation"


def network_policy(job: JobRef, spec: RLJobSpec) -> dict[str, Any]:
    """Ingress to the job's pods from its own pods only (every port), and from spec.networkPolicy.metricsFrom to
    the metrics ports; the pods select by the labels every child of the job carries."""
    own = {"podSelector": {"matchLabels": job.labels()}}
    ingress: list[dict[str, Any]] = [{"from": [own]}]
    if spec.network_policy.metrics_from:
        ports = [{"protocol": "TCP", "port": port} for port in (ACTOR_PORT, TRAINER_METRICS_PORT)]
        ingress.append({"from": spec.network_policy.metrics_from, "ports": ports})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": job.metadata(network_policy_name(job.name)),
        "spec": {"podSelector": own["podSelector"], "policyTypes": ["Ingress"], "ingress": ingress},
    }


def pods(
    job: JobRef,
    spec: RLJobSpec,
    config: EffectiveConfig,
    placements: Placements | None = None,
    trainer_env: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Every pod the operator creates for the job, actors first (none when they are groups: LeaderWorkerSet creates
    those, ``group_pods``); ``trainer_env``: the trainers' environment defaults."""
    single = spec.actors.group is None
    actors = [actor_pod(job, spec, config, index, placements) for index in range(spec.actors.replicas) if single]
    trainers = [trainer_pod(job, spec, config, rank, placements, trainer_env) for rank in range(spec.trainer.replicas)]
    return actors + trainers


def preflight_pod(
    job: JobRef, spec: RLJobSpec, config: EffectiveConfig, placements: Placements | None = None
) -> dict[str, Any]:
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
    placement = _placement(placements, keys.PREFLIGHT_ROLE)
    return _pod(job, spec, spec.actors, config, keys.PREFLIGHT_ROLE, 0, container, placement, hostname=None)


def actor_pod(
    job: JobRef,
    spec: RLJobSpec,
    config: EffectiveConfig,
    index: int,
    placements: Placements | None = None,
    role: str = keys.ACTOR,
) -> dict[str, Any]:
    """Actor ``index``'s pod; with spec.actors.group, the pod of a group's leader (``role`` ACTOR: the engine's API,
    the barrier agent and node 0 of the engine) or of its workers (ACTOR_WORKER: vLLM's headless ranks, the same
    arguments)."""
    container: dict[str, Any] = {"name": keys.ACTOR, "image": spec.actors.image}
    if role == keys.ACTOR_WORKER:
        container["command"] = ["python", "-m", "lockstep_workers.actor.headless"]
    else:
        container |= {
            "command": ["python", "-m", "lockstep_workers.actor"],
            "ports": [{"name": ACTOR_PORT_NAME, "containerPort": ACTOR_PORT}],
            "readinessProbe": {"httpGet": {"path": "/ready", "port": ACTOR_PORT}, "periodSeconds": 5},
        }
    container["args"] = actor_args(spec.model.uri, ACTOR_PORT, config.vllm_settings, spec.actors.group)
    if spec.weight_sync.backend.collective:  # the only manifest server an actor accepts weights from
        container["env"] = [
            {"name": environment.WEIGHTS_HOST, "value": trainer_host(job)},
            {"name": environment.WEIGHTS_PORT, "value": str(MANIFEST_PORT)},
        ]
    placement = _placement(placements, role)
    return _pod(job, spec, spec.actors, config, role, index, container, placement, hostname=None)


LEADER_WORKER_SET_GROUP, LEADER_WORKER_SET_VERSION = "leaderworkerset.x-k8s.io", "v1"
"""LeaderWorkerSet (sigs.k8s.io/lws): it creates, schedules and restarts each actor group's pods as a unit."""
LEADER_WORKER_SET = "LeaderWorkerSet"
LEADER_WORKER_SETS = "leaderworkersets"


def actor_set_name(job: str) -> str:
    """The job's LeaderWorkerSet. Group i's leader is the pod ``<job>-actor-<i>``, the name a single-pod actor has;
    its workers are ``<job>-actor-<i>-<w>``, w from 1."""
    return f"{job}-{keys.ACTOR}"


def group_pods(
    job: JobRef, spec: RLJobSpec, config: EffectiveConfig, placements: Placements | None = None
) -> list[dict[str, Any]]:
    """Every pod of the job's actor groups as LeaderWorkerSet creates it from ``actor_groups``' templates, by the
    name it gives (group i's leader ``<job>-actor-<i>``, then its workers ``<job>-actor-<i>-<w>``), labelled with
    the group's index; none without spec.actors.group. What Kueue admits, and what the pods are checked against."""
    group = spec.actors.group
    if group is None:
        return []
    pods = []
    for index in range(spec.actors.replicas):
        leader = actor_pod(job, spec, config, index, placements)
        pods.append(leader)
        for rank in range(1, group.pods):
            worker = actor_pod(job, spec, config, index, placements, keys.ACTOR_WORKER)
            worker["metadata"]["name"] = f"{leader['metadata']['name']}-{rank}"
            pods.append(worker)
    return pods


def actor_groups(
    job: JobRef, spec: RLJobSpec, config: EffectiveConfig, placements: Placements | None = None
) -> dict[str, Any]:
    """The LeaderWorkerSet of spec.actors.group: spec.actors.replicas groups of group.pods pods each. Both templates
    are the actor's pods as ``actor_pod`` renders them (Pod Security restricted, the fingerprint and template hash
    annotated); LeaderWorkerSet adds each pod's group and worker index. A pod whose container restarts restarts its
    whole group (RecreateGroupOnPodRestart): an engine that lost a rank cannot serve. A changed template replaces
    every group at once, as the operator replaces changed single-pod actors (a new fingerprint must not wait for a
    rolling update); the barrier waits for or evicts the groups being replaced, as for lost pods."""
    group = spec.actors.group
    if group is None:
        raise ValueError("actor_groups renders spec.actors.group, which is unset")
    leader = actor_pod(job, spec, config, 0, placements)
    worker = actor_pod(job, spec, config, 0, placements, keys.ACTOR_WORKER)
    return {
        "apiVersion": f"{LEADER_WORKER_SET_GROUP}/{LEADER_WORKER_SET_VERSION}",
        "kind": LEADER_WORKER_SET,
        "metadata": job.metadata(actor_set_name(job.name), keys.ACTOR),
        "spec": {
            "replicas": spec.actors.replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": spec.actors.replicas, "maxSurge": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": group.pods,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(leader),
                "workerTemplate": _pod_template(worker),
            },
        },
    }


def _pod_template(pod: dict[str, Any]) -> dict[str, Any]:
    """``pod`` as a LeaderWorkerSet's pod template: its labels but the index (LeaderWorkerSet labels each pod with
    its group and worker index), its annotations, and its spec restarting in place (restartPolicy Always, the only
    one a StatefulSet's pods take; LeaderWorkerSet then recreates the group)."""
    metadata = pod["metadata"]
    labels = {key: value for key, value in metadata["labels"].items() if key != keys.INDEX}
    return {
        "metadata": {"labels": labels, "annotations": metadata["annotations"]},
        "spec": {**pod["spec"], "restartPolicy": "Always"},
    }


def trainer_host(job: JobRef) -> str:
    """The stable DNS name of trainer rank 0 (the headless trainer Service)."""
    return f"{rank0_name(job.name)}.{trainer_service_name(job.name)}.{job.namespace}.svc"


def shared_dir(job: JobRef) -> str:
    """The job's own directory on spec.weightSync.volume (its subPath <job uid>), where its pods see it."""
    return f"{SHARED_MOUNT}/{job.uid}"


def weights_origin(job: JobRef, collective: bool) -> WeightsOrigin:
    """Where the job's pods take weights from: its weights directory (filesystem backend), or trainer rank 0's
    manifest server (nccl, gloo)."""
    if collective:
        return TrainerManifest(trainer_host(job), MANIFEST_PORT)
    return WeightsFiles(PurePosixPath(shared_dir(job)) / WEIGHTS_DIRECTORY)


def trainer_pod(
    job: JobRef,
    spec: RLJobSpec,
    config: EffectiveConfig,
    rank: int,
    placements: Placements | None = None,
    defaults: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Trainer ``rank``'s pod; ``defaults``: environment defaults beside WORKER_ENV (the operator's OTLP endpoint),
    which spec.trainer.env may replace."""
    master = trainer_host(job)
    ports = [
        {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
        {"name": "metrics", "containerPort": TRAINER_METRICS_PORT},
    ]
    env = [
        {"name": environment.METRICS_PORT, "value": str(TRAINER_METRICS_PORT if rank == 0 else 0)},
        {"name": environment.MASTER_ADDR, "value": master},
        {"name": environment.MASTER_PORT, "value": str(RENDEZVOUS_PORT)},
        {"name": environment.WORLD_SIZE, "value": str(spec.trainer.replicas)},
        {"name": environment.RANK, "value": str(rank)},
        {"name": environment.ACTORS_SERVICE, "value": actor_service_name(job.name)},
    ]
    if requests_gpu(spec.trainer):  # one rank per pod: it computes on the pod's first GPU
        env.append({"name": environment.LOCAL_RANK, "value": "0"})
    if spec.weight_sync.backend.collective:  # rank 0 sends the weights: the actors reach it here
        ports += [
            {"name": "weights", "containerPort": MANIFEST_PORT},
            {"name": "weights-group", "containerPort": TRANSFER_GROUP_PORT},
        ]
        env += [
            {"name": environment.WEIGHTS_HOST, "value": master},
            {"name": environment.WEIGHTS_PORT, "value": str(MANIFEST_PORT)},
            {"name": environment.WEIGHTS_GROUP_PORT, "value": str(TRANSFER_GROUP_PORT)},
        ]
    container = {
        "name": keys.TRAINER,
        "image": spec.trainer.image,
        "command": ["python", "-m", "lockstep_workers.trainer"],
        "args": [f"--model={spec.model.uri}"],
        "ports": ports,
        "env": env,
        # A trainer that stops (a dataset it cannot read, gradients that stay non-finite) writes why to its
        # termination message, or else says it in its last log line, which the kubelet keeps as the message; the
        # operator quotes it in the status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    hostname = pod_name(job.name, keys.TRAINER, rank)
    placement = _placement(placements, keys.TRAINER)
    training = spec.trainer.training()
    return _pod(
        job,
        spec,
        spec.trainer,
        config,
        keys.TRAINER,
        rank,
        container,
        placement,
        hostname=hostname,
        reads=training,
        defaults=defaults,
    )


def _pod(
    job: JobRef,
    spec: RLJobSpec,
    overrides: PodOverrides,
    config: EffectiveConfig,
    role: str,
    index: int,
    container: dict[str, Any],
    placement: Placement,
    hostname: str | None,
    reads: Training | None = None,
    defaults: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The pod of ``role``, its environment defaulting to WORKER_ENV and ``defaults``; its template hash covers its
    spec and what it ``reads`` of the PodConfig that the fingerprint does not cover (the trainer: its training
    settings and spec.output), so that a change of either replaces it."""
    name = pod_name(job.name, role, index)
    env = [
        *container.pop("env", []),
        {"name": environment.JOB, "value": job.name},
        {"name": environment.ROLE, "value": role},
        {"name": environment.CONFIG, "value": environment.CONFIG_PATH},
        {"name": environment.WEIGHT_SYNC, "value": spec.weight_sync.backend.value},
        {"name": environment.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": environment.POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
    ]
    mounts = [{"name": "lockstep-config", "mountPath": CONFIG_MOUNT, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "lockstep-config", "configMap": {"name": config_map_name(job.name)}}]
    for volume, (path, empty_dir) in _writable_dirs(overrides).items():
        mounts.append({"name": volume, "mountPath": path})
        volumes.append({"name": volume, "emptyDir": empty_dir})
    shared = _shared_volume(spec, role)
    if shared is not None:
        # The job's own directory on the volume, nothing else of it; the trainer writes weights there, the other
        # pods only read them.
        directory = {"mountPath": shared_dir(job), "subPath": job.uid, "readOnly": role != keys.TRAINER}
        mounts.append({"name": "lockstep-shared", **directory})
        volumes.append({"name": "lockstep-shared", **shared})
        env.append({"name": environment.SHARED_DIR, "value": shared_dir(job)})
    own_env = [variable.model_dump(by_alias=True, exclude_none=True) for variable in overrides.env or []]
    own_names = {variable["name"] for variable in own_env}
    env += [
        {"name": name, "value": value}
        for name, value in {**WORKER_ENV, **(defaults or {})}.items()
        if name not in own_names
    ]
    container = {
        **container,
        "env": [*env, *own_env],
        "resources": overrides.resources.model_dump(by_alias=True, exclude_none=True) if overrides.resources else {},
        "volumeMounts": [*mounts, *(overrides.volume_mounts or [])],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    pod_spec: dict[str, Any] = {
        # The operator, not the kubelet, restarts failed pods, so that maxRestarts counts every failure.
        "restartPolicy": "Never",
        # Pod Security "restricted"; GPUs need no privileges (the device plugin hands the pod its devices).
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": WORKER_UID,
            "runAsGroup": WORKER_UID,
            "fsGroup": WORKER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "serviceAccountName": worker_account_name(job.name),
        "containers": [container],
        "volumes": [*volumes, *(overrides.volumes or [])],
    }
    if hostname:
        pod_spec.update(hostname=hostname, subdomain=trainer_service_name(job.name))
    for key, value in (
        ("nodeSelector", {**(overrides.node_selector or {}), **placement.node_selector}),
        ("tolerations", [*(overrides.tolerations or []), *placement.tolerations]),
        ("affinity", overrides.affinity),
    ):
        if value:
            pod_spec[key] = value
    metadata = job.metadata(name, role)
    metadata["labels"][keys.INDEX] = str(index)
    template: dict[str, Any] = pod_spec
    if reads is not None:
        template = {"spec": pod_spec, "reads": reads.model_dump(mode="json", by_alias=True)}
        if spec.output is not None:  # the trainer writes there; unset, the hash stays what it was without it
            template["output"] = spec.output.model_dump(mode="json", by_alias=True)
    metadata["annotations"] = {keys.CONFIG_FINGERPRINT: config.fingerprint, keys.TEMPLATE_HASH: _hash(template)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def requests_gpu(overrides: PodOverrides) -> bool:
    """Whether the role's pods request NVIDIA GPUs (in their resources' limits or requests). Their NCCL_* settings
    are the role's own env, passed through as it is."""
    resources = overrides.resources
    return resources is not None and any(GPU in (amounts or {}) for amounts in (resources.limits, resources.requests))


def _writable_dirs(overrides: PodOverrides) -> dict[str, tuple[str, dict[str, Any]]]:
    """Volume name → (path, emptyDir) of the role's writable directories: WRITABLE_DIRS and, on GPU pods, SHM_DIR
    in memory; without those the role mounts itself."""
    dirs: dict[str, tuple[str, dict[str, Any]]] = {name: (path, {}) for name, path in WRITABLE_DIRS.items()}
    if requests_gpu(overrides):  # NCCL's shared-memory transport outgrows the runtime's 64 MiB
        dirs["lockstep-shm"] = (SHM_DIR, {"medium": "Memory"})
    own = {mount.get("mountPath") for mount in overrides.volume_mounts or []}
    return {name: (path, empty_dir) for name, (path, empty_dir) in dirs.items() if path not in own}


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
