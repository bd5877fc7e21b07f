"""What the operator sets up in the worker pods (operator/lockstep/desired.py) and the workers read: the names of
the environment variables, the ports, and the paths of the operator's own mounts, spelled once for both sides.

A job's own ``env``, ``volumes`` and ``volumeMounts`` may not take them over (``reserved_env``, ``reserved_mount``,
``reserved_volume``; the CRD refuses them with the same rules, ``api.RESERVED_ENV_RULE``, ``api.RESERVED_MOUNT_RULE``,
``api.RESERVED_VOLUME_RULE`` and ``api.RESERVED_VOLUME_MOUNT_RULE``): a user's ``LOCKSTEP_CONFIG`` would otherwise
replace the locked configuration the pod reads, behind the fingerprint it still carries, and a mount of the
``lockstep-shared`` volume would expose every job's weights. Nor may a job's ``env`` change what vLLM computes or
the code the image runs behind the ParityPolicy's lock (``locked_env_why``, ``api.LOCKED_ENV_RULE``): it sets only
the variables ``allowed_env`` names, and takes a credential only from a Secret (``credential``,
``api.CREDENTIAL_ENV_RULE``)."""

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
ALLOWED_ENV = (
    *ALLOWED_VLLM_ENV,
    *WORKER_ENV,
    "TZ",
    "LANG",
    "LC_ALL",
    "PYTHONUNBUFFERED",
    "PYTHONFAULTHANDLER",
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "HF_HUB_DISABLE_TELEMETRY",
    "HF_ENDPOINT",
    "HF_TOKEN",
    "TRANSFORMERS_OFFLINE",
    "GLOO_SOCKET_IFNAME",
    "TP_SOCKET_IFNAME",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "SSL_CERT_FILE",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_SDK_DISABLED",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_S3_ENDPOINT_URL",
    "DATABRICKS_HOST",
    "DATABRICKS_TOKEN",
    "DATABRICKS_CLIENT_ID",
    "DATABRICKS_CLIENT_SECRET",
    "DATABRICKS_USERNAME",
    "DATABRICKS_PASSWORD",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_ACCOUNT",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
)
"""The documented variables a job may set on its actors, preflight and trainers (docs/security.md#environment):
sizes, logs, telemetry, timeouts and places (ALLOWED_VLLM_ENV, HOME, OMP_NUM_THREADS...), the Hugging Face hub's
cache and offline mode, network proxies and CA bundles, OpenTelemetry's exporter (docs/observability.md), and the
experiment trackers' and cloud SDKs' settings and credentials (a credential only from a Secret: ``credential``).
None changes a number the actors or the trainer compute, or the code they load. Besides these: every NCCL_*
(ALLOWED_ENV_PREFIXES), every variable under the job's own spec.envPrefix, and what the job's ParityPolicy adds
(spec.env)."""
ALLOWED_ENV_PREFIXES = ("NCCL_",)
"""Families a job may set whole: NCCL's transport (the operator sets none; they move bytes, not the numbers the
actors and the trainer compare)."""

NUMERICS_ENV_PREFIXES = (
    VLLM_PREFIX,
    "ONEDNN_",
    "DNNL_",
    "MKLDNN_",
    "MKL_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "BLIS_",
    "ATEN_",
    "TORCH",
    "NVIDIA_",
    "CUBLAS",
    "CUDNN_",
    "NVTE_",
    "TRITON_",
    "XLA_",
)
"""Families of variables that choose kernels, precisions or reduction orders, so that the actors or the trainer would
compute other numbers than the parity lock promises: oneDNN's fp32 math mode (ONEDNN_DEFAULT_FPMATH_MODE=BF16 moved
vLLM's fp32 head on a CPU from 5.1e-6 to 1.29e-2 max |Δlogprob|), TF32 (NVIDIA_TF32_OVERRIDE,
TORCH_ALLOW_TF32_CUBLAS_OVERRIDE), MKL's and OpenMP's code paths (MKL_CBWR, KMP_DETERMINISTIC_REDUCTION), torch's CPU
capability, inductor and Triton kernels, and the VLLM_* variables not in ALLOWED_VLLM_ENV."""
CODE_LOADING_ENV_PREFIXES = ("LD_", "PYTHON", "GLIBC_")
CODE_LOADING_ENV_NAMES = ("PATH", "GCONV_PATH", "HOSTALIASES")
"""Variables that choose the code a worker loads (the images set PYTHONPATH to lockstep_workers' source):
LD_PRELOAD, LD_LIBRARY_PATH, PATH, PYTHONPATH, PYTHONHOME, PYTHONUSERBASE, PYTHONSTARTUP, PYTHONPYCACHEPREFIX... A
job's own would run other code than the image's, behind the parity lock."""
DENIED_ENV_PREFIXES = (*NUMERICS_ENV_PREFIXES, *CODE_LOADING_ENV_PREFIXES, RESERVED_PREFIX)
"""What neither spec.envPrefix nor a ParityPolicy's spec.allowedEnv may reach."""

CREDENTIAL_NAMES = (
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_PASSWORD",
    "DATABRICKS_TOKEN",
    "DATABRICKS_CLIENT_SECRET",
    "DATABRICKS_PASSWORD",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_CLIENT_SECRET",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "HF_TOKEN",
    "WANDB_API_KEY",
    "OTEL_EXPORTER_OTLP_HEADERS",
)
"""The experiment trackers' and cloud SDKs' credentials by name; ``credential`` also takes the names the
CREDENTIAL_SUFFIXES and CREDENTIAL_INFIXES describe."""
CREDENTIAL_SUFFIXES = ("_TOKEN", "_PASSWORD", "_API_KEY", "_ACCESS_KEY", "_PRIVATE_KEY")
CREDENTIAL_INFIXES = ("_SECRET",)
"""Any other variable whose name says it holds a credential: *_TOKEN, *_PASSWORD, *_API_KEY, *_SECRET*..."""


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
NUMERICS_WHY = (
    " would change the numbers the actors or the trainer compute (it chooses kernels, precisions or reduction "
    "orders, like every ONEDNN_*, MKL_*, OMP_*, TORCH*, NVIDIA_*, CUBLAS*, TRITON_* and VLLM_* variable not on the "
    "list), behind the lock of the ParityPolicy, which locks vLLM's settings as spec.actors.vllm; remove it from env"
)
"""Why a job's variable of NUMERICS_ENV_PREFIXES is refused, after its name."""
CODE_LOADING_WHY = (
    " would change the code the workers load (LD_*, PATH, PYTHON*: the image sets them), behind the lock of the "
    "ParityPolicy; remove it from env, or build an image that sets it"
)
"""Why a job's variable of CODE_LOADING_ENV_PREFIXES or CODE_LOADING_ENV_NAMES is refused, after its name."""
UNLISTED_WHY = (
    ": not on the list of variables a job may set (docs/security.md#environment): name the job's own variables "
    "under the prefix it declares in spec.envPrefix (e.g. APP_), or ask the administrator to add them to the spec.env "
    "of the ParityPolicy"
)
"""Why a job's variables that are neither locked nor allowed are refused, after their names."""
PREFIX_WHY = (
    " is, or reaches, a variable that changes the numbers the workers compute or the code they load, or one the "
    f"operator sets ({', '.join(f'{p}*' for p in DENIED_ENV_PREFIXES)}, {', '.join(CODE_LOADING_ENV_NAMES)}...): "
    "no job or policy may allow it; choose names of the job's own, e.g. under APP_"
)
"""Why spec.envPrefix, or an entry of a ParityPolicy's spec.env, is refused, after it."""


def reserved_env(name: str) -> bool:
    """Whether the operator sets (or may set) the variable ``name``, so that a job may not."""
    return name.startswith(RESERVED_PREFIX) or name in RESERVED_NAMES


def locked_env_why(name: str) -> str | None:
    """Why a job may never set ``name`` (NUMERICS_WHY, CODE_LOADING_WHY), whatever its policy and envPrefix; None
    when it is allowed or in no locked family."""
    if name in ALLOWED_ENV:
        return None
    if name.startswith(NUMERICS_ENV_PREFIXES):
        return NUMERICS_WHY
    if name.startswith(CODE_LOADING_ENV_PREFIXES) or name in CODE_LOADING_ENV_NAMES:
        return CODE_LOADING_WHY
    return None


def allowed_env(name: str, prefix: str | None, names: tuple[str, ...] = (), prefixes: tuple[str, ...] = ()) -> bool:
    """Whether a job may set ``name``: it is on ALLOWED_ENV or ALLOWED_ENV_PREFIXES, under the job's own ``prefix``
    (spec.envPrefix), or among the ``names`` and ``prefixes`` its ParityPolicy adds (spec.env)."""
    own = (prefix,) if prefix else ()
    return name in ALLOWED_ENV or name in names or name.startswith((*ALLOWED_ENV_PREFIXES, *own, *prefixes))


def reaches_locked_env(text: str, *, prefix: bool) -> bool:
    """Whether a prefix (``prefix``) or a name the job or its policy adds to the list reaches a locked or reserved
    variable: it is in a DENIED_ENV_PREFIXES family, or (a prefix) a family or a name begins with it."""
    names = (*CODE_LOADING_ENV_NAMES, *RESERVED_NAMES)
    if text.startswith(DENIED_ENV_PREFIXES) or text in names:
        return True
    return prefix and any(locked.startswith(text) for locked in (*DENIED_ENV_PREFIXES, *names))


def credential(name: str) -> bool:
    """Whether ``name`` holds a credential (CREDENTIAL_NAMES, CREDENTIAL_SUFFIXES, CREDENTIAL_INFIXES), which a job
    takes only from a Secret."""
    return (
        name in CREDENTIAL_NAMES
        or name.endswith(CREDENTIAL_SUFFIXES)
        or any(infix in name for infix in CREDENTIAL_INFIXES)
    )


def from_secret(variable: dict[str, object]) -> bool:
    """Whether an env entry, as in a pod, takes its value from a Secret (valueFrom.secretKeyRef) and from nowhere
    else."""
    source = variable.get("valueFrom")
    return "value" not in variable and isinstance(source, dict) and "secretKeyRef" in source


def reserved_volume(name: str) -> bool:
    """Whether the volume ``name`` is the operator's, so that a job may neither add nor mount a volume of that name."""
    return name.startswith(RESERVED_VOLUME_PREFIX)


UNCLEAN_PATH_PARTS = ("//", "/./", "/../")
UNCLEAN_PATH_ENDINGS = ("/.", "/..")


def unclean_path(absolute: str) -> bool:
    """Whether the absolute ``absolute`` is not written plainly: ``..``, ``.`` or ``//`` in it, which whoever opens
    it resolves, so that a check of its text reads another path than the one used."""
    return any(part in absolute for part in UNCLEAN_PATH_PARTS) or absolute.endswith(UNCLEAN_PATH_ENDINGS)


def reserved_mount(path: str) -> bool:
    """Whether a job may not mount anything at ``path``: it is, or is under, one of the operator's mounts, or it is
    not written plainly (``unclean_path``: the container runtime resolves it, and a plain path is the only one this
    check can read). A relative path counts from the root, as the runtime takes it."""
    absolute = path if path.startswith("/") else f"/{path}"
    return unclean_path(absolute) or any(
        absolute == root or absolute.startswith(root + "/") for root in RESERVED_MOUNTS
    )


CREDENTIAL_WHY = (
    " names a credential: take it from a Secret, with valueFrom.secretKeyRef {name: <secret>, key: <key>}, never "
    "inline or from a ConfigMap, which anyone who can read the job or the ConfigMap reads"
)
"""Why a credential not taken from a Secret is refused, after its name."""
