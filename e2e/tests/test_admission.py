"""The API server itself refuses RLJobs that break an Enforce ParityPolicy (crds/admission-parity.yaml).

The ValidatingAdmissionPolicy reads ParityPolicies through an informer, so a policy created a moment ago may
not be seen yet: a test that expects a refusal retries until it comes, and a test that expects admission first
creates a "sentinel" Enforce policy after the policies under test and waits until it refuses; the informer
delivers in order, so by then it has seen the earlier policies too and an admission is not vacuous.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from enum import StrEnum
from typing import Any, get_args

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from lockstep import admission, api
from lockstep_e2e.fixtures import wait_for
from lockstep_e2e.install import apply, manifests
from lockstep_e2e.jobs import REWARD, SHARED_VOLUME

pytestmark = pytest.mark.cluster

LOCKED: dict[str, Any] = {"enablePrefixCaching": False, "logprobsMode": "processed_logprobs"}
"""What the policies in these tests lock (the smallest coherent policy)."""

CONFLICT: dict[str, Any] = {"logprobsMode": "raw_logprobs"}


def expected(policy: str, key: str = "logprobsMode", locked: str = "processed_logprobs") -> str:
    """The policy's refusal, exactly (less the API server's 'rljobs.lockstep.dev "job-x" is forbidden: ')."""
    return (
        f"ValidatingAdmissionPolicy '{admission.NAME}' with binding '{admission.NAME}' denied request: "
        f"spec.actors.vllm.{key}: ParityPolicy '{policy}' (Enforce) locks it to {locked}; "
        "remove the key or set it to that value"
    )


PolicyFactory = Callable[..., str]


@pytest.fixture(scope="session")
def parity_admission(kube: client.ApiClient) -> None:
    """The CRDs and admission policies in crds/ (not the default ParityPolicy), server-side applied: idempotent,
    since the whole session shares the cluster. Returns once the policy was type-checked without warnings."""
    apply(kube, [document for document in manifests() if document["kind"] != "ParityPolicy"])
    registration = client.AdmissionregistrationV1Api(kube)

    def checked() -> bool:
        vap = registration.read_validating_admission_policy(admission.NAME)
        return vap.status is not None and vap.status.observed_generation == vap.metadata.generation

    wait_for(checked, "the ValidatingAdmissionPolicy to be type-checked")
    status = registration.read_validating_admission_policy(admission.NAME).status
    warnings = status.type_checking.expression_warnings if status.type_checking else None
    assert not warnings, f"CEL type-check warnings: {warnings}"


@pytest.fixture
def policies(kube: client.ApiClient, parity_admission: None) -> Iterator[PolicyFactory]:
    """``policies(enforcement, default=, match_labels=, vllm=, name=)`` creates a ParityPolicy (uniquely named
    unless ``name`` is given) and returns its name; the test's policies are deleted afterwards."""
    custom = client.CustomObjectsApi(kube)
    created: list[str] = []

    def create(
        enforcement: str = "Enforce",
        *,
        default: bool = False,
        match_labels: dict[str, str] | None = None,
        vllm: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> str:
        name = name or f"e2e-{enforcement.lower()}-{uuid.uuid4().hex[:8]}"
        spec: dict[str, Any] = {
            "enforcement": enforcement,
            "default": default,
            "vllm": LOCKED if vllm is None else vllm,
        }
        if match_labels is not None:
            spec["namespaceSelector"] = {"matchLabels": match_labels}
        body = {"apiVersion": api.API_VERSION, "kind": "ParityPolicy", "metadata": {"name": name}, "spec": spec}
        custom.create_cluster_custom_object(api.GROUP, api.VERSION, "paritypolicies", body)
        created.append(name)
        return name

    yield create
    for name in created:
        custom.delete_cluster_custom_object(api.GROUP, api.VERSION, "paritypolicies", name)


def rljob(vllm: dict[str, Any], policy: str | None = None) -> dict[str, Any]:
    """A minimal valid RLJob with a generated name (so that a create can be retried)."""
    spec: dict[str, Any] = {
        "model": {"uri": "/models/tiny"},
        "actors": {"image": "lockstep/actor:dev", "vllm": vllm},
        "trainer": {"image": "lockstep/trainer:dev", "reward": REWARD},
        "weightSync": {"volume": SHARED_VOLUME},
    }
    if policy:
        spec["parityPolicy"] = policy
    return {"apiVersion": api.API_VERSION, "kind": "RLJob", "metadata": {"generateName": "job-"}, "spec": spec}


def refusal(kube: client.ApiClient, namespace: str, job: dict[str, Any]) -> str | None:
    """Create ``job``: ``None`` when admitted, else the message of the policy's refusal (other errors raise).

    An admitted job is deleted at once, so that an operator running in the same session has nothing to do.
    """
    custom, args = client.CustomObjectsApi(kube), (api.GROUP, api.VERSION, namespace, "rljobs")
    try:
        created = custom.create_namespaced_custom_object(*args, job)
    except ApiException as error:
        return _policy_refusal(error)
    custom.delete_namespaced_custom_object(*args, created["metadata"]["name"])
    return None


def _policy_refusal(error: ApiException) -> str:
    """The policy's refusal message, from "ValidatingAdmissionPolicy ..." on; any other error is raised again."""
    status = json.loads(error.body)
    if error.status != 422 or status.get("reason") != "Invalid" or admission.NAME not in status.get("message", ""):
        raise error
    # The API server prefixes 'rljobs.lockstep.dev "job-x7k2p" is forbidden: ' (even for reason Invalid, code 422).
    message: str = status["message"]
    return message[message.index("ValidatingAdmissionPolicy") :]


def refused_eventually(kube: client.ApiClient, namespace: str, job: dict[str, Any]) -> str:
    """Retry creating ``job`` until the policy refuses it (the param informer may lag); the refusal message."""
    messages: list[str] = []

    def refuse() -> bool:
        message = refusal(kube, namespace, job)
        if message:
            messages.append(message)
        return bool(message)

    wait_for(refuse, f"the RLJob {job['spec']} to be refused")
    return messages[-1]


def sentinel(kube: client.ApiClient, namespace: str, policies: PolicyFactory) -> None:
    """Create one more Enforce policy and wait until it refuses: the informer has now seen every earlier policy."""
    refused_eventually(kube, namespace, rljob(CONFLICT, policies()))


def test_enforce_policy_refuses_a_conflicting_key(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory
) -> None:
    policy = policies()
    assert refused_eventually(kube, namespace, rljob(CONFLICT, policy)) == expected(policy)
    assert refusal(kube, namespace, rljob({"enablePrefixCaching": True}, policy)) == expected(
        policy, "enablePrefixCaching", "false"
    )


@pytest.mark.parametrize("enforcement", ["Warn", "Audit"])
def test_warn_and_audit_policies_admit_a_conflicting_key(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory, enforcement: str
) -> None:
    policy = policies(enforcement)
    sentinel(kube, namespace, policies)
    assert refusal(kube, namespace, rljob(CONFLICT, policy)) is None


def test_policy_applies_only_to_the_namespaces_it_selects(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory
) -> None:
    label = {"lockstep.dev/e2e-selected": namespace}
    policy = policies(match_labels=label)
    sentinel(kube, namespace, policies)
    assert refusal(kube, namespace, rljob(CONFLICT, policy)) is None

    client.CoreV1Api(kube).patch_namespace(namespace, {"metadata": {"labels": label}})
    assert refused_eventually(kube, namespace, rljob(CONFLICT, policy)) == expected(policy)


def test_job_that_names_no_policy_is_checked_against_the_default(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory
) -> None:
    # Selecting only this test's namespace keeps the default policy away from every other test's jobs.
    label = {"lockstep.dev/e2e-default": namespace}
    client.CoreV1Api(kube).patch_namespace(namespace, {"metadata": {"labels": label}})
    warn = policies("Warn")
    # It locks a key that a cluster-wide default (another test's) is unlikely to lock, so that this one refuses.
    default = policies(default=True, match_labels=label, vllm={**LOCKED, "seed": 1})
    assert refused_eventually(kube, namespace, rljob({"seed": 2})) == expected(default, "seed", "1")
    # A job that names a policy is checked against that one only.
    assert refusal(kube, namespace, rljob({"seed": 2}, warn)) is None


def test_job_that_sets_the_locked_values_is_admitted(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory
) -> None:
    policy = policies()
    refused_eventually(kube, namespace, rljob(CONFLICT, policy))
    assert refusal(kube, namespace, rljob(LOCKED, policy)) is None
    assert refusal(kube, namespace, rljob({**LOCKED, "maxModelLen": 512, "seed": 7}, policy)) is None


def test_update_is_checked_only_when_it_changes_the_spec(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory
) -> None:
    custom = client.CustomObjectsApi(kube)
    args = (api.GROUP, api.VERSION, namespace, "rljobs")
    later = f"e2e-later-{uuid.uuid4().hex[:8]}"
    name = custom.create_namespaced_custom_object(*args, rljob(CONFLICT, later))["metadata"]["name"]
    policies(name=later)
    refused_eventually(kube, namespace, rljob(CONFLICT, later))
    # Metadata-only updates (labels, finalizers) of a job that predates the policy still go through ...
    custom.patch_namespaced_custom_object(*args, name, {"metadata": {"labels": {"touched": "yes"}}})
    # ... a spec change must comply.
    with pytest.raises(ApiException) as refused:
        custom.patch_namespaced_custom_object(*args, name, {"spec": {"suspend": True}})
    assert _policy_refusal(refused.value) == expected(later)


def _samples(annotation: Any) -> tuple[Any, Any, str]:
    """A locked value, a conflicting one, and the locked value as the refusal message writes it."""
    kinds = {getattr(t, "__origin__", t) for t in get_args(annotation)} | {getattr(annotation, "__origin__", None)}
    enum = next((t for t in kinds if isinstance(t, type) and issubclass(t, StrEnum)), None)
    if enum:
        first, second = list(enum)[:2]
        return first.value, second.value, first.value
    if dict in kinds:
        return {"head_dtype": "float32"}, {"head_dtype": "bfloat16"}, "{head_dtype: float32}"
    if bool in kinds:
        return False, True, "false"
    if int in kinds:
        return 1, 2, "1"
    if float in kinds:
        return 0.5, 0.25, "0.5"
    raise AssertionError(f"no samples for {annotation}: teach this test the new field type")


def test_every_vllm_setting_is_enforced(kube: client.ApiClient, namespace: str, policies: PolicyFactory) -> None:
    """One policy locks every field of VllmSettings; setting any one of them otherwise is refused, naming it."""
    fields = {field.alias or name: _samples(field.annotation) for name, field in api.VllmSettings.model_fields.items()}
    policy = policies(vllm={key: locked for key, (locked, _, _) in fields.items()})
    refused_eventually(kube, namespace, rljob({"seed": fields["seed"][1]}, policy))
    for key, (locked, other, shown) in fields.items():
        assert refusal(kube, namespace, rljob({key: other}, policy)) == expected(policy, key, shown)
        assert refusal(kube, namespace, rljob({key: locked}, policy)) is None
