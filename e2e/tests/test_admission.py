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


def denied(message: str, policy: str = admission.NAME) -> str:
    """A refusal by ``policy``, exactly (less the API server's 'rljobs.lockstep.dev "job-x" is forbidden: ')."""
    return f"ValidatingAdmissionPolicy '{policy}' with binding '{policy}' denied request: {message}"


def expected(policy: str, key: str = "logprobsMode", locked: str = "processed_logprobs") -> str:
    """The policy's refusal of a job that sets a locked key otherwise."""
    return denied(
        f"spec.actors.vllm.{key}: ParityPolicy '{policy}' (Enforce) locks it to {locked}; "
        "remove the key or set it to that value"
    )


def not_applicable(policy: str, namespace: str, labels: dict[str, str]) -> str:
    """The refusal of a job that names a policy whose namespaceSelector does not select its namespace."""
    needed = " ".join(f"{key}={value}" for key, value in labels.items())
    return denied(
        f"spec.parityPolicy: ParityPolicy '{policy}' does not apply to namespace '{namespace}' (its namespaceSelector "
        f"needs the labels {needed}); a cluster administrator may label the namespace (kubectl label namespace "
        f"{namespace} {needed}), or name a policy that selects it"
    )


PolicyFactory = Callable[..., str]


@pytest.fixture(scope="session")
def parity_admission(kube: client.ApiClient) -> None:
    """The CRDs and admission policies in crds/ (not the default ParityPolicy), server-side applied: idempotent,
    since the whole session shares the cluster. Returns once every policy was type-checked without warnings."""
    apply(kube, [document for document in manifests() if document["kind"] != "ParityPolicy"])
    registration = client.AdmissionregistrationV1Api(kube)
    for name in (admission.NAME, admission.SINGLE_DEFAULT, admission.BARRIER_POLICY):

        def checked(name: str = name) -> bool:
            vap = registration.read_validating_admission_policy(name)
            return vap.status is not None and vap.status.observed_generation == vap.metadata.generation

        wait_for(checked, f"the ValidatingAdmissionPolicy {name} to be type-checked")
        status = registration.read_validating_admission_policy(name).status
        warnings = status.type_checking.expression_warnings if status.type_checking else None
        assert not warnings, f"CEL type-check warnings in {name}: {warnings}"


@pytest.fixture
def policies(kube: client.ApiClient, parity_admission: None) -> Iterator[PolicyFactory]:
    """``policies(enforcement, default=, match_labels=, vllm=, name=, lora=, routing_replay=)`` creates a
    ParityPolicy (uniquely named unless ``name`` is given) and returns its name; the test's policies are deleted
    afterwards.

    Only one policy may be the default: ``default=True`` first unsets it on the others (the session's default
    ParityPolicy, when another test installed it), and sets it again once the test's policies are gone.
    """
    custom = client.CustomObjectsApi(kube)
    created: list[str] = []
    demoted: list[str] = []

    def create(
        enforcement: str = "Enforce",
        *,
        default: bool = False,
        match_labels: dict[str, str] | None = None,
        vllm: dict[str, Any] | None = None,
        name: str | None = None,
        lora: str | None = None,
        routing_replay: str | None = None,
    ) -> str:
        name = name or f"e2e-{enforcement.lower()}-{uuid.uuid4().hex[:8]}"
        if default:
            for other in custom.list_cluster_custom_object(api.GROUP, api.VERSION, "paritypolicies")["items"]:
                if other["spec"]["default"]:
                    demoted.append(other["metadata"]["name"])
                    set_default(kube, demoted[-1], False)
        spec: dict[str, Any] = {
            "enforcement": enforcement,
            "default": default,
            "vllm": LOCKED if vllm is None else vllm,
        }
        if match_labels is not None:
            spec["namespaceSelector"] = {"matchLabels": match_labels}
        if lora is not None:
            spec["lora"] = lora
        if routing_replay is not None:
            spec["routingReplay"] = routing_replay
        body = {"apiVersion": api.API_VERSION, "kind": "ParityPolicy", "metadata": {"name": name}, "spec": spec}

        def created_now() -> bool:
            return _admitted(
                lambda: custom.create_cluster_custom_object(api.GROUP, api.VERSION, "paritypolicies", body)
            )

        if demoted:  # the single-default policy reads its params from an informer: it refuses until it has seen
            wait_for(created_now, f"{name} to be admitted once {demoted[-1]} is no longer the default")
        else:
            custom.create_cluster_custom_object(api.GROUP, api.VERSION, "paritypolicies", body)
        created.append(name)
        return name

    yield create
    for name in created:
        custom.delete_cluster_custom_object(api.GROUP, api.VERSION, "paritypolicies", name)
    for name in demoted:  # refused until the informer has seen the test's default go
        wait_for(lambda name=name: _admitted(lambda: set_default(kube, name, True)), f"{name} to be the default again")


def set_default(kube: client.ApiClient, name: str, default: bool) -> None:
    client.CustomObjectsApi(kube).patch_cluster_custom_object(
        api.GROUP, api.VERSION, "paritypolicies", name, {"spec": {"default": default}}
    )


def _admitted(call: Callable[[], object], policy: str = admission.SINGLE_DEFAULT) -> bool:
    """Whether ``call`` went through; False when ``policy`` refused it (other errors raise)."""
    try:
        call()
    except ApiException as error:
        _policy_refusal(error, policy)
        return False
    return True


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


def _policy_refusal(error: ApiException, policy: str = admission.NAME) -> str:
    """``policy``'s refusal message, from "ValidatingAdmissionPolicy ..." on; any other error is raised again."""
    status = json.loads(error.body)
    message: str = status.get("message", "")
    codes = {"Invalid": 422, "Forbidden": 403}
    if codes.get(status.get("reason")) != error.status or f"ValidatingAdmissionPolicy '{policy}'" not in message:
        raise error
    # The API server prefixes 'rljobs.lockstep.dev "job-x7k2p" is forbidden: ' (even for reason Invalid, code 422).
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
    assert refused_eventually(kube, namespace, rljob(CONFLICT, policy)) == not_applicable(policy, namespace, label)

    client.CoreV1Api(kube).patch_namespace(namespace, {"metadata": {"labels": label}})
    # The namespace reaches the policy through an informer: until it has seen the label, the refusal is the old one.
    wait_for(
        lambda: refusal(kube, namespace, rljob(CONFLICT, policy)) == expected(policy),
        f"the labelled namespace to be refused with: {expected(policy)}",
    )


@pytest.mark.parametrize("enforcement", ["Warn", "Audit"])
def test_a_job_cannot_escape_the_default_by_naming_a_policy_meant_for_other_namespaces(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory, enforcement: str
) -> None:
    """Issue item 9: an administrator scopes a lax policy with its namespaceSelector, and admission holds to it."""
    label = {"lockstep.dev/e2e-lax": namespace}
    lax = policies(enforcement, match_labels=label)
    assert refused_eventually(kube, namespace, rljob(CONFLICT, lax)) == not_applicable(lax, namespace, label)
    assert refusal(kube, namespace, rljob(LOCKED, lax)) == not_applicable(lax, namespace, label)

    client.CoreV1Api(kube).patch_namespace(namespace, {"metadata": {"labels": label}})
    # The namespace reaches the policy through an informer too: admitted once it has seen the label.
    wait_for(lambda: refusal(kube, namespace, rljob(CONFLICT, lax)) is None, "the labelled namespace to be admitted")


def test_only_one_policy_may_be_the_default(kube: client.ApiClient, policies: PolicyFactory) -> None:
    """Issue item 11: a second default would stall every job that names no policy (AmbiguousDefaultPolicy)."""
    custom = client.CustomObjectsApi(kube)
    nowhere = {"lockstep.dev/e2e-default": uuid.uuid4().hex}  # selects no namespace: no other test is affected
    first = policies(default=True, match_labels=nowhere)
    message = denied(
        f"spec.default: ParityPolicy '{first}' is already the default, and jobs that name no policy need exactly "
        f"one; set spec.default: false on this one, or first set it to false on '{first}'",
        admission.SINGLE_DEFAULT,
    )
    second = f"e2e-second-{uuid.uuid4().hex[:8]}"
    body = {
        "apiVersion": api.API_VERSION,
        "kind": "ParityPolicy",
        "metadata": {"name": second},
        "spec": {
            "enforcement": "Audit",
            "default": True,
            "vllm": LOCKED,
            "namespaceSelector": {"matchLabels": nowhere},
        },
    }
    refusals: list[str] = []

    def create_refused() -> bool:
        try:
            custom.create_cluster_custom_object(api.GROUP, api.VERSION, "paritypolicies", body)
        except ApiException as error:
            refusals.append(_policy_refusal(error, admission.SINGLE_DEFAULT))
            return True
        custom.delete_cluster_custom_object(api.GROUP, api.VERSION, "paritypolicies", second)  # the informer lags
        return False

    wait_for(create_refused, "a second default ParityPolicy to be refused")
    assert refusals[-1] == message
    # Making an existing policy the default is refused alike; keeping or unsetting it is not checked.
    warn = policies("Warn", match_labels=nowhere)
    with pytest.raises(ApiException) as refused:
        set_default(kube, warn, True)
    assert _policy_refusal(refused.value, admission.SINGLE_DEFAULT) == message
    set_default(kube, first, True)
    set_default(kube, first, False)
    wait_for(lambda: _admitted(lambda: set_default(kube, warn, True)), f"{warn} to become the default")


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


# -- spec.trainer.lora: the CRD's rules, and the policy's spec.lora ----------------------------------------------

ADAPTER: dict[str, Any] = {"rank": 8, "targetModules": ["q_proj", "v_proj"]}


def lora_rljob(lora: dict[str, Any] | None, policy: str | None = None, backend: str = "filesystem") -> dict[str, Any]:
    """``rljob`` with the locked settings, and ``spec.trainer.lora`` when ``lora`` is given."""
    job = rljob(LOCKED, policy)
    if lora is not None:
        job["spec"]["trainer"]["lora"] = lora
    if backend != "filesystem":
        job["spec"]["weightSync"] = {"backend": backend}
    return job


def invalid(call: Callable[[], object]) -> str:
    """The API server's message for a request the CRD's schema or CEL rules refuse (422 Invalid)."""
    with pytest.raises(ApiException) as refused:
        call()
    status = json.loads(refused.value.body)
    assert (refused.value.status, status.get("reason")) == (422, "Invalid"), refused.value.body
    return str(status["message"])


LORA_BACKEND = (
    "spec.trainer.lora needs spec.weightSync.backend filesystem: each version of a LoRA job is an adapter file the "
    "actors read from spec.weightSync.volume, and the nccl and gloo transfers send every weight of the model; use "
    "backend filesystem with a volume, or remove spec.trainer.lora"
)
LORA_IMMUTABLE = (
    "spec.trainer.lora is immutable while the RLJob exists, and so is whether it is set: the actors were started "
    "for it and the trainer's checkpoints and committed weights are of that adapter (or of every weight); delete the "
    "RLJob and create it again with the spec.trainer.lora you want"
)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_lora_job_over_a_collective_backend_is_refused(
    kube: client.ApiClient, namespace: str, parity_admission: None, backend: str
) -> None:
    custom, args = client.CustomObjectsApi(kube), (api.GROUP, api.VERSION, namespace, "rljobs")
    message = invalid(lambda: custom.create_namespaced_custom_object(*args, lora_rljob(ADAPTER, backend=backend)))
    assert f"spec.trainer.lora: Invalid value: {LORA_BACKEND}" in message
    # The same job without the adapter is admitted over that backend.
    created = custom.create_namespaced_custom_object(*args, lora_rljob(None, backend=backend))
    custom.delete_namespaced_custom_object(*args, created["metadata"]["name"])


@pytest.mark.parametrize(
    ("before", "patch"),
    [
        (None, {"spec": {"trainer": {"lora": ADAPTER}}}),  # added
        (ADAPTER, {"spec": {"trainer": {"lora": None}}}),  # removed (a merge patch's null)
        (ADAPTER, {"spec": {"trainer": {"lora": {"rank": 16}}}}),  # changed
        (ADAPTER, {"spec": {"trainer": {"lora": {"targetModules": ["q_proj"]}}}}),  # changed
    ],
    ids=["added", "removed", "rank changed", "targetModules changed"],
)
def test_spec_trainer_lora_cannot_be_added_removed_or_changed(
    kube: client.ApiClient, namespace: str, parity_admission: None, before: Any, patch: dict[str, Any]
) -> None:
    custom, args = client.CustomObjectsApi(kube), (api.GROUP, api.VERSION, namespace, "rljobs")
    name = custom.create_namespaced_custom_object(*args, lora_rljob(before))["metadata"]["name"]
    message = invalid(lambda: custom.patch_namespaced_custom_object(*args, name, patch))
    assert f"spec.trainer.lora: Invalid value: {LORA_IMMUTABLE}" in message
    assert custom.get_namespaced_custom_object(*args, name)["spec"]["trainer"].get("lora") == (
        None if before is None else {**before, "alpha": 32, "dropout": 0, "trainLmHead": False}
    )
    # Other fields of spec.trainer still change.
    custom.patch_namespaced_custom_object(*args, name, {"spec": {"trainer": {"steps": 7}}})
    custom.delete_namespaced_custom_object(*args, name)


def lora_refusal(requirement: str, policy: str) -> str:
    """An Enforce policy's refusal of a job that breaks its spec.lora, word for word."""
    if requirement == "Forbidden":
        return denied(
            f"spec.trainer.lora: ParityPolicy '{policy}' (Enforce) forbids LoRA adapters (its spec.lora is "
            "Forbidden); remove spec.trainer.lora to train every weight, or name a ParityPolicy whose spec.lora is "
            "Allowed"
        )
    return denied(
        f"spec.trainer.lora: ParityPolicy '{policy}' (Enforce) requires a LoRA adapter (its spec.lora is Required); "
        "set spec.trainer.lora (e.g. {rank: 16}, with spec.weightSync.backend filesystem), or name a ParityPolicy "
        "whose spec.lora is Allowed"
    )


def test_a_policy_that_forbids_lora_refuses_a_lora_job_and_admits_full_fine_tuning(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory
) -> None:
    policy = policies(lora="Forbidden")
    assert refused_eventually(kube, namespace, lora_rljob(ADAPTER, policy)) == lora_refusal("Forbidden", policy)
    assert refusal(kube, namespace, lora_rljob({}, policy)) == lora_refusal("Forbidden", policy)
    assert refusal(kube, namespace, lora_rljob(None, policy)) is None


def test_a_policy_that_requires_lora_refuses_full_fine_tuning_and_admits_a_lora_job(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory
) -> None:
    policy = policies(lora="Required")
    assert refused_eventually(kube, namespace, lora_rljob(None, policy)) == lora_refusal("Required", policy)
    assert refusal(kube, namespace, lora_rljob(ADAPTER, policy)) is None


@pytest.mark.parametrize("enforcement", ["Warn", "Audit"])
def test_warn_and_audit_policies_admit_a_job_that_breaks_their_lora_requirement(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory, enforcement: str
) -> None:
    forbids, requires = policies(enforcement, lora="Forbidden"), policies(enforcement, lora="Required")
    sentinel(kube, namespace, policies)
    assert refusal(kube, namespace, lora_rljob(ADAPTER, forbids)) is None
    assert refusal(kube, namespace, lora_rljob(None, requires)) is None


def test_a_policy_that_forbids_routing_replay_refuses_a_replaying_job(
    kube: client.ApiClient, namespace: str, policies: PolicyFactory
) -> None:
    policy = policies(routing_replay="Forbidden")
    replaying = rljob({}, policy)
    replaying["spec"]["actors"]["routingReplay"] = True
    assert refused_eventually(kube, namespace, replaying) == denied(
        f"spec.actors.routingReplay: ParityPolicy '{policy}' (Enforce) forbids routing replay (its spec.routingReplay "
        "is Forbidden); set spec.actors.routingReplay to false, or name a ParityPolicy whose spec.routingReplay is "
        "Allowed"
    )
    assert refusal(kube, namespace, rljob({}, policy)) is None
