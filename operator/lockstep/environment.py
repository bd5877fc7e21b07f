"""What the operator sets up in the worker pods (operator/lockstep/desired.py) and the workers read: the names of
the environment variables, the ports, and the paths of the operator's own mounts, spelled once for both sides.

A job's own ``env``, ``volumes`` and ``volumeMounts`` may not take them over (``reserved_env``, ``reserved_mount``,
``reserved_volume``; the CRD refuses them with the same rules, ``api.RESERVED_ENV_RULE``, ``api.RESERVED_MOUNT_RULE``,
``api.RESERVED_VOLUME_RULE`` and ``api.RESERVED_VOLUME_MOUNT_RULE``): a user's ``LOCKSTEP_CONFIG`` would otherwise
replace the locked configuration the pod reads, behind the fingerprint it still carries, and a mount of the
``lockstep-shared`` volume would expose every job's weights. Nor may a job's ``env`` change what vLLM computes or
the code the image runs behind the ParityPolicy's lock (``locked_env``, ``api.LOCKED_ENV_RULE``)."""

from __future__ import annotations

CONFIG = "LOCKSTEP_CONFIG"
"""The job's effective configuration (a JSON file from the job's ConfigMap)."""
WEIGHT_SYNC = "LOCKSTEP_WEIGHT_SYNC"
"""spec.weightSync.backend: filesystem, nccl or gloo."""
SHARED_DIR = "LOCKSTEP_SHARED_DIR"
"""The job's own directory on the shared volume (<mount>/<job uid>); every pod with the filesystem backend, and
the trainer with a collective one."""
WEIGHTS_HOST = "LOCKSTEP_WEIGHTS_HOST"
"""Collective backends: the name of trainer rank 0, which serves the manifests and sends the weights."""
WEIGHTS_PORT = "LOCKSTEP_WEIGHTS_PORT"
"""Collective backends: the port of trainer rank 0's manifest server."""
WEIGHTS_GROUP_PORT = "LOCKSTEP_WEIGHTS_GROUP_PORT"
"""Collective backends: the rendezvous port of each barrier's transfer group."""
ACTORS_SERVICE = "LOCKSTEP_ACTORS_SERVICE"
"""The trainer: the name of the job's actor Service, whose EndpointSlices list the actors."""
ACTORS_URL = "LOCKSTEP_ACTORS_URL"
"""The trainer, outside a cluster (the operator does not set it): the actors' URLs, comma-separated."""
METRICS_PORT = "LOCKSTEP_METRICS_PORT"
"""The trainer: where rank 0 serves Prometheus metrics (0: nowhere)."""
JOB = "LOCKSTEP_JOB"
ROLE = "LOCKSTEP_ROLE"
POD_NAME = "POD_NAME"
POD_NAMESPACE = "POD_NAMESPACE"
MASTER_ADDR = "MASTER_ADDR"
"""The trainer: rank 0's stable DNS name (torch.distributed's rendezvous)."""
MASTER_PORT = "MASTER_PORT"
RANK = "RANK"
"""The trainer: this rank (torch.distributed)."""
WORLD_SIZE = "WORLD_SIZE"
"""The trainer: how many ranks (spec.trainer.replicas)."""
LOCAL_RANK = "LOCAL_RANK"
"""The trainer: which of the pod's GPUs this rank computes on (cuda:<LOCAL_RANK>); set when the pod requests
nvidia.com/gpu."""

RESERVED_PREFIX = "LOCKSTEP_"
"""Every variable of this prefix is the operator's (those it sets now, and those it may set later)."""
RESERVED_NAMES = (POD_NAME, POD_NAMESPACE, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK)
"""The other variables the operator sets: the pod's identity and torch.distributed's rendezvous. It sets no
NCCL_* variable: those are the job's own."""

CONFIG_MOUNT = "/etc/lockstep"
"""The job's effective configuration (its ConfigMap), read-only."""
CONFIG_FILE = "effective-config.json"
"""The ConfigMap's key, and file, holding the job's PodConfig (lockstep.podconfig)."""
CONFIG_PATH = f"{CONFIG_MOUNT}/{CONFIG_FILE}"
"""Where a pod reads its PodConfig; the value of ``CONFIG``."""
SHARED_MOUNT = "/var/lib/lockstep"
"""The job's own directory of spec.weightSync.volume is mounted at ``<SHARED_MOUNT>/<job uid>``."""
RESERVED_MOUNTS = (CONFIG_MOUNT, SHARED_MOUNT)
"""Paths a job may not mount anything at or under."""
RESERVED_VOLUME_PREFIX = "lockstep-"
"""The names of the volumes the operator adds to a pod; a job's own volumes take other names."""
WORKER_HOME = "/home/lockstep"
"""The worker images' home (images/). The root filesystem is read-only; the pods mount a fresh emptyDir here, for
what vLLM, torch, Triton, CUDA and Hugging Face write under it (~/.cache, ~/.config, ~/.triton, ~/.nv)."""
WRITABLE_DIRS = {"lockstep-tmp": "/tmp", "lockstep-home": WORKER_HOME}
"""Volume name → path of the emptyDirs every worker container writes in, its root filesystem being read-only (GPU
pods also get /dev/shm, SHM_DIR). A mount of the role's own at one of these paths replaces the operator's."""
SHM_DIR = "/dev/shm"
WORKER_ENV = {"HOME": WORKER_HOME}
"""Environment defaults of every worker container (so that a custom image's home is the writable one too). A
variable of the same name in the role's env replaces the default."""

ACTOR_PORT = 8000
"""The actor's HTTP API (lockstep_workers.actor)."""
ACTOR_PORT_NAME = "http"
"""The actor Service's port, by which the trainer finds the actors' port in the Service's EndpointSlices."""
RENDEZVOUS_PORT = 29500
"""The trainer: torch.distributed's rendezvous on rank 0 (``MASTER_PORT``)."""
TRAINER_METRICS_PORT = 9400
"""The trainer: rank 0's Prometheus metrics (``METRICS_PORT``)."""
MANIFEST_PORT = 9500
"""Collective backends: trainer rank 0 serves each version's manifest here (``WEIGHTS_PORT``,
lockstep_workers.weights.transfer)."""
TRANSFER_GROUP_PORT = 9501
"""Collective backends: the rendezvous of each barrier's transfer group, on trainer rank 0 (``WEIGHTS_GROUP_PORT``)."""
GROUP_RENDEZVOUS_PORT = 29510
"""Actor groups: torch.distributed's rendezvous of the engine's ranks, on the group's leader (vLLM's master_port)."""
GROUP_ENGINES_PORT = 29511
"""Actor groups with data parallelism: the leader's handshake with the other pods' engines (vLLM's
data_parallel_rpc_port)."""
GROUP_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
"""Actor groups: the leader pod's address, which LeaderWorkerSet sets in every pod of a group."""
GROUP_WORKER_INDEX = "LWS_WORKER_INDEX"
"""Actor groups: the pod's place in its group, 0 for the leader, which LeaderWorkerSet sets in every pod."""


VLLM_PREFIX = "VLLM_"
"""vLLM's environment variables: many choose kernels, backends and precisions (VLLM_ATTENTION_BACKEND,
VLLM_BATCH_INVARIANT, VLLM_USE_FLASHINFER_SAMPLER, VLLM_FLOAT32_MATMUL_PRECISION, VLLM_PLUGINS...), and every vLLM
release adds more, so a job may set only those in ALLOWED_VLLM_ENV."""
ALLOWED_VLLM_ENV = (
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_PREFIX",
    "VLLM_LOGGING_COLOR",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOG_STATS_INTERVAL",
    "VLLM_DISABLE_LOG_LOGO",
    "VLLM_NO_USAGE_STATS",
    "VLLM_DO_NOT_TRACK",
    "VLLM_ENGINE_READY_TIMEOUT_S",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
    "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    "VLLM_CACHE_ROOT",
    "VLLM_HOST_IP",
)
"""The vLLM variables a job may set: they size memory and threads, set logs, telemetry, timeouts and the cache's
place, and change no number vLLM computes."""
CODE_PATH_NAMES = ("PYTHONPATH", "PYTHONHOME")
"""Variables that choose the Python code a worker runs (the images set PYTHONPATH to lockstep_workers' source): a
job's own would run other code than the image's, behind the parity lock."""

CREDENTIAL_NAMES = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "DATABRICKS_TOKEN")
"""The experiment trackers' credentials (spec.trainer.tracking): a job takes them from a Secret, never inline."""


RESERVED_ENV_WHY = (
    f" is set by the Lockstep operator itself (it sets every {RESERVED_PREFIX}* variable and "
    f"{', '.join(RESERVED_NAMES)}), so a job may not: remove it from env"
)
"""Why a job's variable is refused, after its name (the CRD's message and the operator's condition say it alike)."""
RESERVED_MOUNT_WHY = (
    f": the Lockstep operator mounts {' and '.join(RESERVED_MOUNTS)} itself, and a job may mount nothing at or under "
    "them; mount elsewhere, with the path written plainly (no ., .. or //)"
)
"""Why a job's mounts are refused, after ``mountPath <their paths>``."""
RESERVED_VOLUME_WHY = f": names starting with {RESERVED_VOLUME_PREFIX} belong to the Lockstep operator; rename it"
"""Why a job's volumes are refused, after ``volume <their names>``."""
RESERVED_VOLUME_MOUNT_WHY = (
    f" belongs to the Lockstep operator (names starting with {RESERVED_VOLUME_PREFIX}): lockstep-shared holds the "
    f"weights of every job, and the pods of a job see only the directory of their own job, which the operator mounts "
    f"at {SHARED_MOUNT}/<job uid> itself; mount a volume of the job instead"
)
"""Why a job's mount of an operator volume is refused, after ``volume <its name>``."""
LOCKED_ENV_WHY = (
    f" would change what vLLM computes or the code the image runs, behind the lock of the ParityPolicy: the settings "
    f"of vLLM are spec.actors.vllm, which the policy locks, and {' and '.join(CODE_PATH_NAMES)} are set by the image; "
    f"remove it from env (the {VLLM_PREFIX}* variables a job may set: {', '.join(ALLOWED_VLLM_ENV)})"
)
"""Why a job's variable is refused by ``locked_env``, after its name."""


def reserved_env(name: str) -> bool:
    """Whether the operator sets (or may set) the variable ``name``, so that a job may not."""
    return name.startswith(RESERVED_PREFIX) or name in RESERVED_NAMES


def locked_env(name: str) -> bool:
    """Whether the variable ``name`` would change vLLM's numerics or the code a worker runs, so a job may not set
    it: a VLLM_* variable not in ALLOWED_VLLM_ENV, PYTHONPATH or PYTHONHOME."""
    return (name.startswith(VLLM_PREFIX) and name not in ALLOWED_VLLM_ENV) or name in CODE_PATH_NAMES


def reserved_volume(name: str) -> bool:
    """Whether the volume ``name`` is the operator's, so that a job may neither add nor mount a volume of that name."""
    return name.startswith(RESERVED_VOLUME_PREFIX)


UNCLEAN_PATH_PARTS = ("//", "/./", "/../")
UNCLEAN_PATH_ENDINGS = ("/.", "/..")


def reserved_mount(path: str) -> bool:
    """Whether a job may not mount anything at ``path``: it is, or is under, one of the operator's mounts, or it is
    not written plainly (``..``, ``.`` or ``//`` in it, which the container runtime resolves: a plain path is the
    only one this check can read). A relative path counts from the root, as the runtime takes it."""
    absolute = path if path.startswith("/") else f"/{path}"
    unclean = any(part in absolute for part in UNCLEAN_PATH_PARTS) or absolute.endswith(UNCLEAN_PATH_ENDINGS)
    return unclean or any(absolute == root or absolute.startswith(root + "/") for root in RESERVED_MOUNTS)


CREDENTIAL_WHY = (
    " is a credential: take it from a Secret (valueFrom.secretKeyRef), never as a value written in the RLJob, which "
    "anyone who can read the job reads"
)
"""Why a credential's inline value is refused, after its name."""
