"""What the operator sets up in its pods stays its own: a job's env, volumes and volumeMounts may not take it over
(issue 21 item 2); its env is an allow-list, and its credentials come from Secrets (issue 46 items 3 and 4). The
CRD's CEL rules and the operator's own check say the same, from one list."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from factories import NOW, REWARD, evaluate, job, policy, running
from lockstep import admission, api, environment
from lockstep.api.output import OUTPUT_PATH_WHY, USER_INFO_WHY
from lockstep.cli import _cel_errors, schema_errors
from lockstep.conditions import READY, find
from lockstep.reconcile import Observed, reconcile
from lockstep.reconcile.policy import reserved_settings, unlisted_env
from lockstep.schema import structural_schema

GPU = {"limits": {"nvidia.com/gpu": 1}}


def created_pods(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods the operator creates for a new job ``body``."""
    return reconcile(Observed(body, [], [policy()], {}, NOW)).create_pods


def rendered_pods() -> list[dict[str, Any]]:
    """Every pod the operator renders for jobs of each backend, with GPUs and without, and several ranks."""
    trainer = {"image": "t", "reward": REWARD, "replicas": 2, "resources": GPU}
    bodies = [
        job(),
        job(actors={"image": "a", "replicas": 1, "resources": GPU}, trainer=trainer),
        job(weightSync={"backend": "gloo"}, trainer=trainer),
        job(preflight={"enabled": True}),
    ]
    return [pod for body in bodies for pod in created_pods(body)]


def test_every_variable_the_operator_sets_is_reserved_or_a_default_the_job_may_replace() -> None:
    names = {e["name"] for pod in rendered_pods() for e in pod["spec"]["containers"][0]["env"]}
    assert {environment.CONFIG, environment.RANK, environment.MASTER_ADDR, environment.LOCAL_RANK} <= names
    defaults = set(environment.WORKER_ENV)
    assert [name for name in sorted(names - defaults) if not environment.reserved_env(name)] == []
    assert not any(environment.reserved_env(name) for name in defaults), "a default the job may replace"


def test_every_mount_and_volume_the_operator_adds_is_reserved() -> None:
    pods = rendered_pods()
    paths = {m["mountPath"] for pod in pods for m in pod["spec"]["containers"][0]["volumeMounts"]}
    # The writable scratch dirs (and /dev/shm for NCCL) a job may bring itself: the operator then adds none.
    replaceable = {*environment.WRITABLE_DIRS.values(), environment.SHM_DIR}
    assert [path for path in sorted(paths - replaceable) if not environment.reserved_mount(path)] == []
    assert not any(environment.reserved_mount(path) for path in replaceable)
    volumes = {v["name"] for pod in pods for v in pod["spec"]["volumes"]}
    assert all(name.startswith(environment.RESERVED_VOLUME_PREFIX) for name in volumes), volumes


def crd_errors(overrides: dict[str, Any]) -> list[str]:
    """What the CRD's rules (as the API server runs them) say of spec.actors with ``overrides``."""
    schema = structural_schema(api.RLJobSpec)["properties"]["actors"]
    return _cel_errors(schema, {"image": "a", **overrides}, "spec.actors")


PATH_PARTS = st.sampled_from(["", ".", "..", "etc", "lockstep", "var", "lib", "data", "lockstep2", "x"])


@given(st.lists(PATH_PARTS, min_size=1, max_size=6), st.booleans())
def test_the_crd_and_the_operator_refuse_the_same_mount_paths(parts: list[str], absolute: bool) -> None:
    path = ("/" if absolute else "") + "/".join(parts)
    refused = bool(crd_errors({"volumeMounts": [{"name": "v", "mountPath": path}]}))
    assert refused == environment.reserved_mount(path), path


@given(
    st.sampled_from(["LOCKSTEP_CONFIG", "LOCKSTEP_", "LOCKSTEPX", "RANK", "RANKS", "NCCL_DEBUG", "HOME", "POD_NAME"])
)
def test_the_crd_and_the_operator_refuse_the_same_variables(name: str) -> None:
    refused = bool(crd_errors({"env": [{"name": name, "value": "1"}]}))
    assert refused == environment.reserved_env(name), name


def test_plain_mounts_elsewhere_pass_and_a_mount_over_the_operators_is_named() -> None:
    assert environment.reserved_mount("/etc/lockstep") and environment.reserved_mount("etc/lockstep/x")
    assert environment.reserved_mount("/etc/../var/lib/lockstep") and environment.reserved_mount("/var//lib/lockstep")
    assert not environment.reserved_mount("/etc/lockstep2") and not environment.reserved_mount("/data/models")
    mounts = [{"name": "a", "mountPath": "/models"}, {"name": "b", "mountPath": "/var/lib/lockstep/other-job"}]
    refusal = f"mountPath /var/lib/lockstep/other-job{environment.RESERVED_MOUNT_WHY}"
    assert crd_errors({"volumeMounts": mounts}) == [
        f'spec.actors.volumeMounts[1].mountPath: Invalid value: "/var/lib/lockstep/other-job": {refusal}'
    ]


def test_a_job_that_takes_over_the_operators_settings_runs_no_pods_and_says_which() -> None:
    """A job the CRD would refuse today, created before the rule (or past admission): its pods go, and the Ready
    condition names each setting in the CRD's words."""
    body = job()
    pods = [running(pod) for pod in created_pods(body)]
    env = [{"name": "LOCKSTEP_CONFIG", "value": "/var/tmp/mine.json"}, {"name": "LOCKSTEP_SHARED_DIR", "value": "/"}]
    body["spec"]["actors"]["env"] = env
    body["spec"]["trainer"]["volumeMounts"] = [{"name": "mine", "mountPath": "/etc/lockstep"}]
    plan = reconcile(Observed(body, pods, [policy()], {}, NOW))
    assert set(plan.delete_pods) == {p["metadata"]["name"] for p in pods} and not plan.create_pods
    ready = find(plan.status.conditions, READY)
    assert ready is not None and (ready.status.value, ready.reason) == ("False", "InvalidSpec")
    assert ready.message == (
        f"the RLJob spec is invalid: spec.actors.env[0].name: LOCKSTEP_CONFIG{environment.RESERVED_ENV_WHY}; "
        f"spec.actors.env[1].name: LOCKSTEP_SHARED_DIR{environment.RESERVED_ENV_WHY}; "
        f"spec.trainer.volumeMounts[0].mountPath: mountPath /etc/lockstep{environment.RESERVED_MOUNT_WHY}; "
        "no pods run until it is fixed"
    )


@given(st.sampled_from(["lockstep-shared", "lockstep-tmp", "lockstep-config", "lockstep-", "lockstep", "models", "x"]))
def test_the_crd_and_the_operator_refuse_the_same_mounted_volumes(name: str) -> None:
    refused = bool(crd_errors({"volumeMounts": [{"name": name, "mountPath": "/mnt/all"}]}))
    assert refused == environment.reserved_volume(name), name


def test_a_mount_of_the_shared_volume_whole_or_of_another_jobs_directory_is_refused_saying_why() -> None:
    """Issue 37 item 3: spec.actors.volumeMounts could name lockstep-shared, mounting every job's weights
    read-write (whole, or another job's by subPath); the reserved-name rule covered volumes only."""
    whole = {"name": "lockstep-shared", "mountPath": "/mnt/all"}
    other = {"name": "lockstep-shared", "mountPath": "/mnt/other", "subPath": "uid-of-another-job"}
    why = f"volume lockstep-shared{environment.RESERVED_VOLUME_MOUNT_WHY}"
    assert crd_errors({"volumeMounts": [{"name": "models", "mountPath": "/models"}, whole, other]}) == [
        f'spec.actors.volumeMounts[1].name: Invalid value: "lockstep-shared": {why}',
        f'spec.actors.volumeMounts[2].name: Invalid value: "lockstep-shared": {why}',
    ]
    assert "the weights of every job" in why and "/var/lib/lockstep/<job uid>" in why
    body = job()
    body["spec"]["actors"]["volumeMounts"] = [whole]
    plan = reconcile(Observed(body, [], [policy()], {}, NOW))
    ready = find(plan.status.conditions, READY)
    assert not plan.create_pods and ready is not None and ready.reason == "InvalidSpec"
    assert f"spec.actors.volumeMounts[0].name: {why}" in ready.message


LOCKED_PROBES = [
    "VLLM_ATTENTION_BACKEND",
    "VLLM_BATCH_INVARIANT",
    "VLLM_USE_FLASHINFER_SAMPLER",
    "VLLM_FLOAT32_MATMUL_PRECISION",
    "VLLM_PLUGINS",
    "VLLM_",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_LOGGING_LEVEL",
    "VLLM_CPU_KVCACHE_SPACEX",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TORCHINDUCTOR_FREEZING",
    "CUBLAS_WORKSPACE_CONFIG",
    "MKL_CBWR",
    "OMP_NUM_THREADS",
    "OMP_SCHEDULE",
    "KMP_DETERMINISTIC_REDUCTION",
    "ATEN_CPU_CAPABILITY",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "PATH",
    "PATHX",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONUSERBASE",
    "PYTHONPYCACHEPREFIX",
    "PYTHONSTARTUP",
    "PYTHON_GIL",
    "PYTHONUNBUFFERED",
    "NCCL_DEBUG",
    "XVLLM_ATTENTION_BACKEND",
    "APP_SEED",
    "HOME",
]


@given(st.sampled_from(LOCKED_PROBES))
def test_the_crd_and_the_operator_refuse_the_same_numerics_and_code_variables(name: str) -> None:
    """Issue 46 item 3: variables that change the workers' numerics or the code they load are refused whatever the
    job's policy, each with its reason."""
    errors = crd_errors({"env": [{"name": name, "value": "1"}]})
    why = environment.locked_env_why(name)
    assert bool(errors) == (why is not None), name
    if why is not None:
        assert errors == [f'spec.actors.env[0].name: Invalid value: "{name}": {name}{why}']


def test_the_issues_probes_are_refused_as_numerics_or_code_loading() -> None:
    numerics = ["ONEDNN_DEFAULT_FPMATH_MODE", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "MKL_CBWR"]
    code = ["LD_PRELOAD", "PATH", "PYTHONUSERBASE", "PYTHONPYCACHEPREFIX", "PYTHONPATH"]
    assert [environment.locked_env_why(name) for name in numerics] == [environment.NUMERICS_WHY] * len(numerics)
    assert [environment.locked_env_why(name) for name in code] == [environment.CODE_LOADING_WHY] * len(code)
    allowed = ["VLLM_CPU_KVCACHE_SPACE", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "HOME", "NCCL_SOCKET_IFNAME"]
    assert [
        name for name in allowed if environment.locked_env_why(name) or not environment.allowed_env(name, None)
    ] == []


@given(
    st.sampled_from(
        [
            "APP_",
            "LD_",
            "L",
            "P",
            "PY",
            "PYTHON_",
            "TORCH_",
            "T",
            "VLLM_",
            "LOCKSTEP_",
            "RAN",
            "OMP_",
            "CUBLASLT_",
            "HF_",
            "MY_APP_",
            "PATH_",
            "PAT",
        ]
    )
)
def test_the_crd_and_the_operator_refuse_the_same_env_prefixes(prefix: str) -> None:
    """A job's spec.envPrefix, or a policy's, may reach no locked or reserved variable."""
    schema = structural_schema(api.RLJobSpec)["properties"]["envPrefix"]
    errors = _cel_errors(schema, prefix, "spec.envPrefix")
    assert bool(errors) == environment.reaches_locked_env(prefix, prefix=True), prefix
    if errors:
        assert errors == [f'spec.envPrefix: Invalid value: "{prefix}": {prefix}{environment.PREFIX_WHY}']


@given(st.sampled_from(["WANDB_PROJECT", "LD_PRELOAD", "PATH", "PYTHONPATH", "RANK", "LOCKSTEP_X", "ONEDNN_X", "X"]))
def test_a_policy_may_add_no_locked_name(name: str) -> None:
    schema = structural_schema(api.EnvAllowance)["properties"]["names"]
    errors = _cel_errors(schema, [name], "spec.env.names")
    assert bool(errors) == environment.reaches_locked_env(name, prefix=False), name


def test_an_unlisted_variable_is_refused_by_the_operator_unless_the_job_or_its_policy_allows_it() -> None:
    """The list is the documented names, the job's own spec.envPrefix and the policy's spec.env; anything else is
    refused before a pod runs, naming the variable and the fixes."""
    body = job()
    body["spec"]["trainer"]["env"] = [{"name": "APP_SEED", "value": "1"}, {"name": "WANDB_PROJECT", "value": "p"}]
    plan = reconcile(Observed(body, [], [policy()], {}, NOW))
    ready = find(plan.status.conditions, READY)
    assert not plan.create_pods and ready is not None and ready.reason == "InvalidSpec"
    assert ready.message == (
        f"the RLJob spec is invalid: spec.trainer.env[0].name: APP_SEED{environment.UNLISTED_WHY}; "
        f"spec.trainer.env[1].name: WANDB_PROJECT{environment.UNLISTED_WHY}; no pods run until it is fixed"
    )
    body["spec"]["envPrefix"] = "APP_"
    widening = policy()
    widening["spec"]["env"] = {"prefixes": ["WANDB_"]}
    plan = reconcile(Observed(body, [], [widening], {}, NOW))
    assert plan.create_pods and find(plan.status.conditions, READY).reason != "InvalidSpec"  # type: ignore[union-attr]


def test_the_jobs_env_is_part_of_the_fingerprint() -> None:
    """Issue 46 item 3: the effective env changes the fingerprint (and a job without env keeps its old one)."""
    body = job()
    plain = reconcile(Observed(body, [], [policy()], {}, NOW)).status.config_fingerprint
    body["spec"]["actors"]["env"] = [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "2"}]
    sized = reconcile(Observed(body, [], [policy()], {}, NOW)).status.config_fingerprint
    body["spec"]["actors"]["env"] = [{"name": "VLLM_CPU_KVCACHE_SPACE", "value": "4"}]
    resized = reconcile(Observed(body, [], [policy()], {}, NOW)).status.config_fingerprint
    assert len({plain, sized, resized}) == 3


CREDENTIAL_PROBES = [
    *environment.CREDENTIAL_NAMES,
    "DATABRICKS_CLIENT_SECRET",
    "APP_TOKEN",
    "APP_SECRET_KEY",
    "APP_DB_PASSWORD",
    "APP_API_KEY",
]


@pytest.mark.parametrize("name", CREDENTIAL_PROBES)
def test_a_credential_is_refused_inline_or_from_a_config_map_and_taken_from_a_secret(name: str) -> None:
    """Issue 46 item 4: a credential by name or pattern comes only from a Secret."""
    assert environment.credential(name)
    from_secret = {"name": name, "valueFrom": {"secretKeyRef": {"name": "mlflow", "key": "token"}}}
    inline = {"name": name, "value": "s3cret"}
    from_config_map = {"name": name, "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "token"}}}
    spec = {"envPrefix": "APP_"}
    for role in ("actors", "trainer"):
        body = job(**{role: {**job()["spec"][role], "env": [from_secret, inline, from_config_map]}})
        errors = schema_errors({**body["spec"], **spec})
        assert errors == [
            f"spec.{role}.env[{index}]: Invalid value: {name}{environment.CREDENTIAL_WHY}" for index in (1, 2)
        ]
        problems = reserved_settings(api.RLJobSpec.model_validate({**body["spec"], **spec}))
        assert problems == [f"spec.{role}.env[{index}]: {name}{environment.CREDENTIAL_WHY}" for index in (1, 2)]
    assert schema_errors({**job(trainer={**job()["spec"]["trainer"], "env": [from_secret]})["spec"], **spec}) == []


@pytest.mark.parametrize("name", ["AWS_ACCESS_KEY_ID", "AWS_WEB_IDENTITY_TOKEN_FILE", "GOOGLE_APPLICATION_CREDENTIALS"])
def test_settings_beside_credentials_may_be_inline(name: str) -> None:
    assert not environment.credential(name) and environment.allowed_env(name, None)


@pytest.mark.parametrize(
    ("uri", "refused"),
    [
        ("https://user:secret@mlflow.example.com", True),
        ("http://token@mlflow:5000/path", True),
        ("https://mlflow.example.com/a@b", False),
        ("https://mlflow.example.com", False),
        ("databricks", False),
    ],
)
def test_a_tracking_uri_with_user_info_is_refused(uri: str, refused: bool) -> None:
    trainer = {**job()["spec"]["trainer"], "tracking": {"mlflow": {"trackingUri": uri}}}
    spec = job(trainer=trainer)["spec"]
    field = "spec.trainer.tracking.mlflow.trackingUri"
    expected = [f"{field}: Invalid value: trackingUri{USER_INFO_WHY}"] if refused else []
    assert schema_errors(spec) == expected
    problems = reserved_settings(api.RLJobSpec.model_validate(spec))
    assert problems == ([f"{field}: trackingUri{USER_INFO_WHY}"] if refused else [])


@pytest.mark.parametrize(
    ("path", "refused"),
    [
        ("/models/../etc", True),
        ("/models//out", True),
        ("/models/./out", True),
        ("/models/.", True),
        ("/models/out", False),
        ("/models/out/", False),
        ("/models/..out", False),
    ],
)
def test_an_output_path_not_written_plainly_is_refused(path: str, refused: bool) -> None:
    """Issue 46, risk: spec.output accepted /models/../etc, // and /./."""
    trainer = {**job()["spec"]["trainer"], "volumeMounts": [{"name": "models", "mountPath": "/models"}]}
    spec = job(trainer=trainer, output={"path": path})["spec"]
    expected = [f'spec.output.path: Invalid value: "{path}": {path}{OUTPUT_PATH_WHY}'] if refused else []
    assert schema_errors(spec) == expected
    problems = reserved_settings(api.RLJobSpec.model_validate(spec))
    assert problems == ([f"spec.output.path: {path}{OUTPUT_PATH_WHY}"] if refused else [])


@given(
    st.lists(st.sampled_from(["APP_SEED", "WANDB_PROJECT", "HF_HOME", "NCCL_DEBUG", "MY_FLAG", "OMP_NUM_THREADS"])),
    st.sampled_from([None, "APP_", "MY_"]),
    st.sampled_from([{}, {"names": ["WANDB_PROJECT"]}, {"prefixes": ["WANDB_", "MY_"]}]),
)
def test_the_admission_policy_and_the_operator_refuse_the_same_unlisted_variables(
    names: list[str], prefix: str | None, allowance: dict[str, list[str]]
) -> None:
    """The API server refuses, for the policy a job uses, what the operator refuses (``unlisted_env``), in words
    that name each variable."""
    body = job(**({"envPrefix": prefix} if prefix else {}))
    body["spec"]["trainer"]["env"] = [{"name": name, "value": "1"} for name in names]
    widening = policy()
    widening["spec"]["env"] = allowance
    check = admission.env_validation("trainer")
    activation = {"object": body, "params": widening, "variables": {"selected": True, "inNamespace": True}}
    refused = unlisted_env(api.RLJobSpec.model_validate(body["spec"]), api.ParityPolicy.model_validate(widening))
    assert bool(evaluate(check["expression"], **activation)) is not refused
    if refused:
        unlisted = [name for name in names if any(f": {name}:" in problem for problem in refused)]
        expected = f"spec.trainer.env: {', '.join(unlisted)}{environment.UNLISTED_WHY}"
        assert evaluate(check["messageExpression"], **activation) == expected
    assert check in admission.policy()["spec"]["validations"]
    other = {**activation, "variables": {"selected": False, "inNamespace": True}}
    assert bool(evaluate(check["expression"], **other)), "only the policy the job uses checks its env"
