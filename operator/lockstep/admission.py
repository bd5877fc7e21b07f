"""Lockstep's native ValidatingAdmissionPolicies: parity enforcement, one default ParityPolicy, and who may write
what on Lockstep's pods (the barrier protocol).

Parity enforcement has ParityPolicy as its parameter.

The API server evaluates the policy once per ParityPolicy (the binding selects them all) on every RLJob CREATE,
and on every UPDATE that changes ``spec``. A ParityPolicy *applies* to a job when all of these hold:

- its ``spec.enforcement`` is ``Enforce`` (Warn and Audit are the operator's business, not admission's);
- the job names it in ``spec.parityPolicy``, or names none and the policy has ``spec.default: true``;
- the job's namespace carries every label in its ``spec.namespaceSelector.matchLabels`` (empty: every namespace).

Then every key the policy locks in ``spec.vllm`` that the job also sets in ``spec.actors.vllm`` must be equal
(maps compare as a whole, like ``lockstep.parity.effective_config``), or the request is refused with reason
``Invalid`` and a message naming the key and the locked value. One validation per field of
``api.VllmSettings``, generated from the model, so a new field is enforced without editing this file.

A policy whose ``spec.lora`` is ``Forbidden`` refuses a job that sets ``spec.trainer.lora``, and one whose
``spec.lora`` is ``Required`` a job that does not (``lora_validations``, in ``parity.lora_refusal``'s words).
Likewise a policy whose ``spec.routingReplay`` is ``Forbidden`` refuses a job that sets
``spec.actors.routingReplay``, and one whose ``spec.routingReplay`` is ``Required`` a job whose actors cannot replay
(pipeline parallel: ``routing_replay_validations``, in ``parity.routing_replay_refusal``'s words).

Whatever its enforcement, the policy a job uses refuses a job whose ``spec.actors.env`` or ``spec.trainer.env``
sets a variable that is not on its list (``env_validation``): the documented ones, those under the job's
``spec.envPrefix`` and those the policy's ``spec.env`` adds.

Whatever its enforcement, a policy a job names in ``spec.parityPolicy`` must select the job's namespace, or the
request is refused (reason ``Forbidden``): an administrator scopes which namespaces may use a policy with its
``spec.namespaceSelector``, so that no job escapes an Enforce default by naming a laxer policy.

The expressions rely on the CRDs' structural defaults (``spec.actors.vllm``, ``spec.vllm``, ``spec.default``
and ``spec.enforcement`` are always present once the API server has decoded an object).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lockstep import api, desired, environment, keys
from lockstep.api.shared import cel_literal, cel_starts_with_any, cel_strings
from lockstep.parity import lora_refusal, routing_replay_refusal
from lockstep.schema import structural_schema

NAME = "lockstep-parity-enforce"
"""Name of both the ValidatingAdmissionPolicy and its binding."""
SINGLE_DEFAULT = "lockstep-single-default-paritypolicy"
"""Name of both the ValidatingAdmissionPolicy that admits one default ParityPolicy at most, and its binding."""

ADMISSION_API_VERSION = "admissionregistration.k8s.io/v1"

_VARIABLES = [
    ("named", "has(object.spec.parityPolicy) ? object.spec.parityPolicy : ''"),
    ("selected", "variables.named == params.metadata.name || (variables.named == '' && params.spec.default)"),
    (
        "inNamespace",
        "!has(params.spec.namespaceSelector.matchLabels) || params.spec.namespaceSelector.matchLabels.all(k, "
        "has(namespaceObject.metadata.labels) && k in namespaceObject.metadata.labels && "
        "namespaceObject.metadata.labels[k] == params.spec.namespaceSelector.matchLabels[k])",
    ),
    (
        "enforced",
        f"params.spec.enforcement == '{api.Enforcement.ENFORCE.value}' && variables.selected && variables.inNamespace",
    ),
]


@dataclass(frozen=True)
class Key:
    """One field of ``api.VllmSettings`` as CEL sees it."""

    name: str
    """The camelCase name on the wire."""
    is_map: bool
    typed: bool
    """Whether the API server's CEL type checker knows the field (see ``_cel_typed``)."""


def vllm_keys() -> list[Key]:
    """Every field of ``api.VllmSettings``, in declaration order, with what its CRD schema says about it."""
    schema = structural_schema(api.VllmSettings)["properties"]
    keys = [field.alias or name for name, field in api.VllmSettings.model_fields.items()]
    return [Key(key, schema[key].get("type") == "object", _cel_typed(schema[key])) for key in keys]


def _cel_typed(schema: dict[str, Any]) -> bool:
    """Whether Kubernetes declares a CEL type for a field with this structural schema.

    It leaves out a field whose schema, or whose items' or values' schema, has no ``type`` (such as
    ``hfOverrides``, a map of ``x-kubernetes-preserve-unknown-fields`` scalars): selecting it is then a
    type-check error ("undefined field"), though the value is there at run time.
    """
    inner = schema.get("items") or schema.get("additionalProperties")
    return "type" in schema and (not isinstance(inner, dict) or _cel_typed(inner))


def _cel_string(value: str, *, is_map: bool) -> str:
    """CEL that renders ``value`` for a message: ``processed_logprobs``, ``false``, ``{head_dtype: float32}``."""
    if is_map:
        return f"'{{' + {value}.map(k, k + ': ' + string({value}[k])).join(', ') + '}}'"
    return f"string({value})"


def validation(key: Key) -> dict[str, str]:
    """The check for one ``spec.actors.vllm`` key: refused when the applying policy locks it to another value."""
    # A field the type checker does not know is selected from a dyn() value: checked at run time only.
    locked, requested = (
        (f"params.spec.vllm.{key.name}", f"object.spec.actors.vllm.{key.name}")
        if key.typed
        else (f"dyn(params.spec.vllm).{key.name}", f"dyn(object.spec.actors.vllm).{key.name}")
    )
    path = f"spec.actors.vllm.{key.name}"
    return {
        "expression": f"!variables.enforced || !has({locked}) || !has({requested}) || {requested} == {locked}",
        "messageExpression": (
            f'"{path}: ParityPolicy \'" + params.metadata.name + "\' (" + params.spec.enforcement + ") locks it to "'
            f' + {_cel_string(locked, is_map=key.is_map)} + "; remove the key or set it to that value"'
        ),
        "message": f"{path}: an Enforce ParityPolicy locks it to another value; remove the key or set it to that value",
        "reason": "Invalid",
    }


_NAME_MARK = "\x00"
"""Where the policy's name goes in a message, rendered in CEL as params.metadata.name."""


def _requirement_check(
    field: str, requirement: api.Requirement, complies: str, refusal: Callable[[api.Requirement, str], str]
) -> dict[str, str]:
    """The check that a job meets the applying policy's ``spec.<field>`` when it is ``requirement`` (the job
    ``complies`` in CEL), refused in ``refusal``'s words."""
    before, after = refusal(requirement, _NAME_MARK).split(_NAME_MARK)
    return {
        "expression": f"!variables.enforced || params.spec.{field} != '{requirement.value}' || {complies}",
        "messageExpression": f"{cel_literal(before)} + params.metadata.name + {cel_literal(after)}",
        "message": refusal(requirement, "").replace("ParityPolicy '' ", "the ParityPolicy "),
        "reason": "Invalid",
    }


def lora_validations() -> list[dict[str, str]]:
    """The checks of ``spec.trainer.lora`` against the applying policy's ``spec.lora``: a Forbidden policy refuses a
    job that sets it, a Required one a job that does not (``parity.lora_conflict`` agrees)."""
    return [
        _requirement_check("lora", api.Requirement.FORBIDDEN, "!has(object.spec.trainer.lora)", lora_refusal),
        _requirement_check("lora", api.Requirement.REQUIRED, "has(object.spec.trainer.lora)", lora_refusal),
    ]


def routing_replay_validations() -> list[dict[str, str]]:
    """The checks of ``spec.actors.routingReplay`` against the applying policy's ``spec.routingReplay``: a Forbidden
    policy refuses a job that asks for it, a Required one a job whose actors cannot replay, being pipeline parallel
    (``parity.routing_replay_conflict`` agrees)."""
    group = "object.spec.actors.group"
    return [
        _requirement_check(
            "routingReplay",
            api.Requirement.FORBIDDEN,
            "!object.spec.actors.routingReplay",
            routing_replay_refusal,
        ),
        _requirement_check(
            "routingReplay",
            api.Requirement.REQUIRED,
            f"!has({group}) || {group}.pipelineParallelSize == 1",
            routing_replay_refusal,
        ),
    ]


def _rule(group: str, resources: list[str], operations: tuple[str, ...], version: str = "v1") -> dict[str, Any]:
    """A resource rule of a policy's matchConstraints: ``operations`` on ``resources`` of API ``group``."""
    return {"apiGroups": [group], "apiVersions": [version], "operations": list(operations), "resources": resources}


def _validating_policy(
    name: str, rules: list[dict[str, Any]], spec: dict[str, Any], *, parity_policies: bool = False
) -> dict[str, Any]:
    """A ValidatingAdmissionPolicy ``name`` that fails closed, on the requests ``rules`` match; ``spec`` adds its
    matchConditions, variables and validations. ``parity_policies``: every ParityPolicy is its parameter (see
    ``binding``)."""
    params = {"paramKind": {"apiVersion": api.API_VERSION, "kind": "ParityPolicy"}} if parity_policies else {}
    return {
        "apiVersion": ADMISSION_API_VERSION,
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {"failurePolicy": "Fail", **params, "matchConstraints": {"resourceRules": rules}, **spec},
    }


def _with_policies(name: str, resource: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A ValidatingAdmissionPolicy on CREATE and UPDATE of lockstep.dev ``resource``, with every ParityPolicy as
    its parameter; ``spec`` adds its matchConditions, variables and validations."""
    rules = [_rule(api.GROUP, [resource], ("CREATE", "UPDATE"), api.VERSION)]
    return _validating_policy(name, rules, spec, parity_policies=True)


def policy() -> dict[str, Any]:
    """The ValidatingAdmissionPolicy (cluster-scoped), with ParityPolicy as its paramKind."""
    return _with_policies(
        NAME,
        "rljobs",
        {
            # An update that leaves the spec alone (finalizers, labels, deletion) is never refused, so a job
            # created before a conflicting policy can still be cleaned up.
            "matchConditions": [
                {"name": "spec-written", "expression": "request.operation == 'CREATE' || object.spec != oldObject.spec"}
            ],
            "variables": [{"name": name, "expression": expression} for name, expression in _VARIABLES],
            "validations": [applicable()]
            + [env_validation(role) for role in ("actors", "trainer")]
            + [validation(key) for key in vllm_keys()]
            + lora_validations()
            + routing_replay_validations(),
        },
    )


def env_validation(role: str) -> dict[str, str]:
    """The check that the variables of ``spec.<role>.env`` are on the job's list (``environment.allowed_env``: the
    documented ones, those under spec.envPrefix and those its policy's spec.env adds), for the policy the job uses,
    whatever its enforcement (``reconcile.policy.unlisted_env`` agrees). The locked and reserved ones, and
    credentials, are the CRD's rules."""
    allowance = "params.spec.env"
    allowed = " || ".join(
        [
            f"e.name in {cel_strings(environment.ALLOWED_ENV)}",
            cel_starts_with_any("e.name", environment.ALLOWED_ENV_PREFIXES),
            "(has(object.spec.envPrefix) && e.name.startsWith(object.spec.envPrefix))",
            f"(has({allowance}) && has({allowance}.names) && e.name in {allowance}.names)",
            f"(has({allowance}) && has({allowance}.prefixes) && {allowance}.prefixes.exists(p, e.name.startsWith(p)))",
        ]
    )
    env = f"object.spec.{role}.env"
    unlisted = f"{env}.filter(e, !({allowed})).map(e, e.name).join(', ')"
    return {
        "expression": f"!variables.selected || !variables.inNamespace || !has({env}) || {env}.all(e, {allowed})",
        "messageExpression": f"'spec.{role}.env: ' + {unlisted} + {cel_literal(environment.UNLISTED_WHY)}",
        "message": f"spec.{role}.env{environment.UNLISTED_WHY}",
        "reason": "Invalid",
    }


def applicable() -> dict[str, str]:
    """The check that a policy the job names selects the job's namespace (``parity.select_policy`` agrees)."""
    selector = "params.spec.namespaceSelector.matchLabels"
    labels = f"{selector}.map(k, k + '=' + {selector}[k]).join(' ')"
    namespace = "namespaceObject.metadata.name"
    return {
        "expression": "variables.named != params.metadata.name || variables.inNamespace",
        "messageExpression": (
            '"spec.parityPolicy: ParityPolicy \'" + params.metadata.name + "\' does not apply to namespace \'" + '
            f'{namespace} + "\' (its namespaceSelector needs the labels " + {labels} + "); " + '
            f"\"a cluster administrator may label the namespace (kubectl label namespace \" + {namespace} + ' ' + "
            f'{labels} + "), or name a policy that selects it"'
        ),
        "message": "spec.parityPolicy: the ParityPolicy does not select this namespace; name one that does",
        "reason": "Forbidden",
    }


def single_default_policy() -> dict[str, Any]:
    """The ValidatingAdmissionPolicy that refuses to make a ParityPolicy the default while another one is.

    Its parameters are the other ParityPolicies, as the API server's informer sees them: two policies made the
    default at the same moment can still both pass, and the operator then reports ``AmbiguousDefaultPolicy``.
    """
    return _with_policies(
        SINGLE_DEFAULT,
        "paritypolicies",
        {
            # Only a request that makes a policy the default: one that keeps it so, or unsets it, always passes.
            "matchConditions": [
                {
                    "name": "becomes-default",
                    "expression": "object.spec.default && (request.operation == 'CREATE' || !oldObject.spec.default)",
                }
            ],
            "validations": [
                {
                    "expression": "params.metadata.name == object.metadata.name || !params.spec.default",
                    "messageExpression": (
                        '"spec.default: ParityPolicy \'" + params.metadata.name + "\' is already the default, and jobs '
                        "that name no policy need exactly one; set spec.default: false on this one, or first set it to "
                        'false on \'" + params.metadata.name + "\'"'
                    ),
                    "message": "spec.default: another ParityPolicy is already the default; set spec.default: false",
                    "reason": "Invalid",
                }
            ],
        },
    )


def binding(name: str) -> dict[str, Any]:
    """The binding of policy ``name``: every ParityPolicy is a parameter; none at all means nothing to check."""
    return {
        "apiVersion": ADMISSION_API_VERSION,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"},
            "validationActions": ["Deny"],
        },
    }


def manifests() -> list[dict[str, Any]]:
    """The ParityPolicy-driven policies and their bindings, in the order to apply them."""
    return [policy(), binding(NAME), single_default_policy(), binding(SINGLE_DEFAULT)]


# -- who may write what on Lockstep's pods (docs/barrier-protocol.md, "Who may write what") ---------------------

BARRIER_POLICY = "lockstep-barrier-annotations"
OPERATOR_KEYS = (keys.BARRIER, keys.INITIAL_WEIGHTS)
"""Annotations only the operator writes."""
POD_KEYS = (keys.BARRIER_ACK, keys.WEIGHTS, keys.MISMATCH, keys.EVALUATION, keys.OUTPUT, keys.PREFLIGHT)
"""Annotations a pod writes on itself only: the only changes its own token may make."""
SERVICE_ACCOUNT_USER = "system:serviceaccount:"
"""How the API server names a service account: ``system:serviceaccount:<namespace>:<name>``."""


def _managed(side: str) -> str:
    """CEL: ``side`` (``object`` or ``oldObject``, either may be null) carries Lockstep's managed-by label."""
    labels, label = f"{side}.metadata.labels", f"'{keys.MANAGED_BY}'"
    return f"{side} != null && has({labels}) && {label} in {labels} && {labels}[{label}] == '{keys.MANAGER}'"


def _changed_keys(field: str) -> str:
    """CEL: the keys of ``metadata.<field>`` (a string map) that a request sets, changes or removes.

    Every key of ``object`` on CREATE (``oldObject`` is null); none on DELETE (``object`` is null).
    """
    new, old = f"object.metadata.{field}", f"oldObject.metadata.{field}"
    differs = f"oldObject == null || !has({old}) || !(k in {old}) || {old}[k] != {new}[k]"
    written = f"(!has({new}) ? [] : {new}.filter(k, {differs}))"
    removed = f"(oldObject == null || !has({old}) ? [] : {old}.filter(k, !has({new}) || !(k in {new})))"
    return f"request.operation == 'DELETE' ? [] : {written} + {removed}"


def _same(field: str) -> str:
    """CEL: an optional field of ``metadata`` is the same on ``oldObject`` and ``object`` (on UPDATE)."""
    new, old = f"object.metadata.{field}", f"oldObject.metadata.{field}"
    return f"has({new}) == has({old}) && (!has({new}) || {new} == {old})"


def _extra(key: str) -> str:
    """CEL: the first value of the caller's ``userInfo.extra[key]``, '' when absent (a client certificate has none)."""
    extra = "request.userInfo.extra"
    return f"has({extra}) && '{key}' in {extra} && size({extra}['{key}']) > 0 ? {extra}['{key}'][0] : ''"


_IS_BREAK_GLASS = f"has(request.userInfo.groups) && '{keys.BREAK_GLASS_GROUP}' in request.userInfo.groups"
"""CEL: the caller is a member of the break-glass group."""

_VIA = (
    "(has(request.subResource) && request.subResource != '' ? "
    "' (through ' + request.resource.resource + '/' + request.subResource + ')' : '')"
)
"""CEL: the subresource a request writes through, for the messages (' (through pods/status)'), else ''."""


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{item}'" for item in items) + "]"


_CONTROLLED_BY_STATEFUL_SET = (
    "has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, "
    "has(r.controller) && r.controller == true && r.kind == 'StatefulSet' && r.apiVersion == 'apps/v1')"
)
"""CEL: the pod a request creates is controlled by a StatefulSet (what the StatefulSet controller creates)."""


POD_SUBRESOURCES = ("status",)
"""The pod subresources whose writes keep metadata changes (the status strategy resets only the spec and owner
references): the barrier policy covers them as it covers the pod itself. ``binding`` copies its own annotations and
labels onto the pod, and has its own policy (``binding_policy``); the others (``ephemeralcontainers``, ``resize``,
``eviction``, ``exec``, ...) change no metadata."""


def barrier_policy(
    operator_username: str = keys.OPERATOR_USERNAME, lws_controller_username: str = keys.LWS_CONTROLLER_USERNAME
) -> dict[str, Any]:
    """Who may change what on a pod Lockstep manages (labelled before or after the request), through the pod or
    any subresource that keeps metadata changes (``POD_SUBRESOURCES``).

    - ``OPERATOR_KEYS``: only ``operator_username``;
    - ``POD_KEYS``: only the pod itself, as a token bound to it (same namespace, pod name and pod UID) proves;
    - a token bound to a pod (other than the operator's) may only UPDATE its own pod, and change nothing but its
      ``POD_KEYS`` on it: no spec, no status, no labels, no other annotations, owner references or finalizers;
    - the managed-by label (what makes a pod Lockstep's, so also creating such a pod): only the operator, and, on
      a LeaderWorkerSet's pods (an actor group's), the StatefulSet controller that creates them, for a StatefulSet
      that controls the pod; which StatefulSets may carry the label in their template, ``group_sets_policy`` says
      (LeaderWorkerSet's controller's alone), so the StatefulSet controller alone mints no Lockstep pod;
    - LeaderWorkerSet's controller (``lws_controller_username``), which runs in a pod, is not held to the pod-token
      rules on a LeaderWorkerSet's pods: it deletes a group's leader to recreate the group;
    - members of ``keys.BREAK_GLASS_GROUP`` may do all of it. Anything else is left to RBAC.
    """
    own = _cel_list(POD_KEYS)
    in_a_set = " || ".join(
        f"({side} != null && has({side}.metadata.labels) && '{keys.GROUP_SET_NAME}' in {side}.metadata.labels)"
        for side in ("object", "oldObject")
    )
    variables = [
        ("annotationChanges", _changed_keys("annotations")),
        ("labelChanges", _changed_keys("labels")),
        ("isOperator", f"request.userInfo.username == '{operator_username}'"),
        ("isBreakGlass", _IS_BREAK_GLASS),
        (
            "isGroupController",
            f"({in_a_set}) && ((request.userInfo.username == '{keys.STATEFULSET_CONTROLLER_USERNAME}' && "
            f"(request.operation != 'CREATE' || {_CONTROLLED_BY_STATEFUL_SET})) || "
            f"(request.userInfo.username == '{lws_controller_username}' && request.operation != 'CREATE'))",
        ),
        ("podName", _extra(keys.POD_NAME_EXTRA)),
        ("podUid", _extra(keys.POD_UID_EXTRA)),
        (
            "isPod",
            "variables.podName != '' && !variables.isOperator && !variables.isBreakGlass && "
            "!variables.isGroupController",
        ),
        (
            "isSelf",
            "request.operation == 'UPDATE' && variables.podName == object.metadata.name && "
            "variables.podUid == object.metadata.uid && "
            f"request.userInfo.username.startsWith('{SERVICE_ACCOUNT_USER}' + object.metadata.namespace + ':')",
        ),
        (
            "podChanges",
            "(object.spec == oldObject.spec ? [] : ['spec']) + (object.status == oldObject.status ? [] : ['status']) + "
            "variables.labelChanges.map(k, 'metadata.labels[' + k + ']') + "
            f"variables.annotationChanges.filter(k, !(k in {own})).map(k, 'metadata.annotations[' + k + ']') + "
            f"({_same('ownerReferences')} ? [] : ['metadata.ownerReferences']) + "
            f"({_same('finalizers')} ? [] : ['metadata.finalizers'])",
        ),
    ]
    caller = f"request.userInfo.username + {_VIA}"
    by_operator = "variables.isOperator || variables.isBreakGlass"
    token = "' for pod ' + variables.podName + ' (uid ' + variables.podUid + ')'"
    operator_only = [
        {
            "expression": f"!('{key}' in variables.annotationChanges) || {by_operator}",
            "messageExpression": f"'{key} may be written only by the Lockstep operator ({operator_username}), "
            f"or by a member of group {keys.BREAK_GLASS_GROUP}, not by ' + {caller}",
            "reason": "Forbidden",
        }
        for key in OPERATOR_KEYS
    ]
    own_pod_only = [
        {
            "expression": f"!('{key}' in variables.annotationChanges) || variables.isSelf || variables.isBreakGlass",
            "messageExpression": f"'{key} on pod ' + object.metadata.name + "
            "' may be written only by that pod itself (a service-account token bound to it), not by ' + "
            f"{caller} + (variables.podName == '' ? '' : {token}) + "
            "'; a token is bound to a pod when its namespace, pod name and pod UID all match the pod'",
            "reason": "Forbidden",
        }
        for key in POD_KEYS
    ]
    confined = [
        {
            "expression": "!variables.isPod || variables.isSelf",
            "messageExpression": f"'a service-account token bound to a pod may only update that pod itself, not ' + "
            "request.operation + ' pod ' + request.namespace + '/' + "
            f"(object != null ? object : oldObject).metadata.name + ': ' + {caller} + {token}",
            "reason": "Forbidden",
        },
        {
            "expression": "!variables.isPod || request.operation != 'UPDATE' || size(variables.podChanges) == 0",
            "messageExpression": "'pod ' + object.metadata.namespace + '/' + object.metadata.name + "
            f"' may change only its own annotations ({', '.join(POD_KEYS)}) with its token, not ' + "
            "variables.podChanges.join(', ')",
            "reason": "Forbidden",
        },
        {
            "expression": f"!('{keys.MANAGED_BY}' in variables.labelChanges) || {by_operator} || "
            "(variables.isGroupController && request.operation == 'CREATE')",
            "messageExpression": f"'the label {keys.MANAGED_BY}={keys.MANAGER} (on pod ' + request.namespace + '/' + "
            "object.metadata.name + ') marks a pod as managed by Lockstep: only the "
            f"Lockstep operator ({operator_username}) sets or removes it (and the StatefulSet controller creates "
            "the pods of an actor group with it), or a member of group "
            f"{keys.BREAK_GLASS_GROUP}, not ' + {caller}",
            "reason": "Forbidden",
        },
    ]
    pods = ["pods", *(f"pods/{name}" for name in POD_SUBRESOURCES)]
    return _validating_policy(
        BARRIER_POLICY,
        [_rule("", pods, ("CREATE", "UPDATE", "DELETE"))],
        {
            # Old or new: removing the label in the same request does not escape the policy.
            "matchConditions": [
                {"name": "lockstep-pod", "expression": f"({_managed('object')}) || ({_managed('oldObject')})"}
            ],
            "variables": [{"name": name, "expression": expression} for name, expression in variables],
            "validations": operator_only + own_pod_only + confined,
        },
    )


BINDING_POLICY = "lockstep-pod-binding-metadata"
BINDING_KEYS = (*OPERATOR_KEYS, *POD_KEYS)
"""Annotations a pods/binding may not carry: the API server copies a Binding's annotations onto the pod it binds."""


def binding_policy(operator_username: str = keys.OPERATOR_USERNAME) -> dict[str, Any]:
    """Refuse a pods/binding that carries a barrier annotation (``BINDING_KEYS``) or the managed-by label, unless
    the operator or break glass sends it.

    Binding a pod (what the scheduler does, once) copies the Binding's annotations, and labels, onto the pod. The
    request's object is the Binding, not the pod, so this cannot tell whether the pod is Lockstep's: it refuses those
    keys on every binding. No scheduler sets them.
    """
    carried = (
        f"(has(object.metadata.annotations) ? object.metadata.annotations.filter(k, k in {_cel_list(BINDING_KEYS)}) "
        f": []) + (has(object.metadata.labels) && '{keys.MANAGED_BY}' in object.metadata.labels ? "
        f"['{keys.MANAGED_BY}'] : [])"
    )
    by_operator = f"request.userInfo.username == '{operator_username}' || ({_IS_BREAK_GLASS})"
    return _validating_policy(
        BINDING_POLICY,
        [_rule("", ["pods/binding"], ("CREATE",))],
        {
            "matchConditions": [{"name": "carries-lockstep-keys", "expression": f"size({carried}) > 0"}],
            "variables": [{"name": "carried", "expression": carried}],
            "validations": [
                {
                    "expression": by_operator,
                    "messageExpression": "'a pods/binding copies its annotations and labels onto the pod it binds ('"
                    " + request.namespace + '/' + object.metadata.name + '): ' + variables.carried.join(', ') + "
                    f"' may be set only by the Lockstep operator ({operator_username}) or a member of group "
                    f"{keys.BREAK_GLASS_GROUP}, not by ' + request.userInfo.username + '; bind the pod without them'",
                    "reason": "Forbidden",
                }
            ],
        },
    )


def _deny_binding(policy: str) -> dict[str, Any]:
    """The binding that applies ``policy`` everywhere, denying what it refuses."""
    return {
        "apiVersion": ADMISSION_API_VERSION,
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": policy},
        "spec": {"policyName": policy, "validationActions": ["Deny"]},
    }


GROUP_SETS_POLICY = "lockstep-group-sets"


def _template_managed(side: str, templates: tuple[str, ...]) -> str:
    """CEL: a pod template of ``side`` (``object`` or ``oldObject``, either may be null; ``templates``: their paths
    under spec) carries Lockstep's managed-by label."""
    label = f"'{keys.MANAGED_BY}'"
    checks = []
    for template in templates:
        steps = ["spec", *template.split("."), "metadata", "labels"]
        present = [f"has({side}.{'.'.join(steps[: i + 1])})" for i in range(len(steps))]
        labels = f"{side}.{'.'.join(steps)}"
        checks.append(f"({' && '.join(present)} && {label} in {labels} && {labels}[{label}] == '{keys.MANAGER}')")
    return f"({side} != null && ({' || '.join(checks)}))"


def group_sets_policy(
    operator_username: str = keys.OPERATOR_USERNAME, lws_controller_username: str = keys.LWS_CONTROLLER_USERNAME
) -> dict[str, Any]:
    """Who may write the objects that mint Lockstep's pods without the operator (issue 46): a StatefulSet whose pod
    template carries Lockstep's managed-by label only LeaderWorkerSet's controller (which makes the groups' sets
    from the job's LeaderWorkerSet), and a LeaderWorkerSet whose templates carry it only the operator; members of
    ``keys.BREAK_GLASS_GROUP`` and the garbage collector (which removes owner references) as well. An update that
    leaves a LeaderWorkerSet's spec as it was (its status, labels) is anyone's that RBAC lets.

    The pod policy lets the StatefulSet controller create a Lockstep pod for a StatefulSet that controls it; so a
    namespace user with ``edit`` cannot make one through a StatefulSet or a LeaderWorkerSet of their own."""
    trusted = f"({_IS_BREAK_GLASS}) || request.userInfo.username == '{keys.GARBAGE_COLLECTOR_USERNAME}'"

    sts_templates, set_templates = (
        ("template",),
        ("leaderWorkerTemplate.leaderTemplate", "leaderWorkerTemplate.workerTemplate"),
    )
    stateful_set = "request.resource.resource == 'statefulsets'"
    caller = "request.userInfo.username"
    what = "request.resource.resource + ' ' + request.namespace + '/' + object.metadata.name"
    return _validating_policy(
        GROUP_SETS_POLICY,
        [
            _rule("apps", ["statefulsets"], ("CREATE", "UPDATE")),
            _rule(desired.LEADER_WORKER_SET_GROUP, [desired.LEADER_WORKER_SETS], ("CREATE", "UPDATE")),
        ],
        {
            "matchConditions": [
                {
                    "name": "mints-lockstep-pods",
                    "expression": f"({stateful_set} && ({_template_managed('object', sts_templates)} || "
                    f"{_template_managed('oldObject', sts_templates)})) || (!({stateful_set}) && "
                    f"({_template_managed('object', set_templates)} || "
                    f"{_template_managed('oldObject', set_templates)}))",
                }
            ],
            "validations": [
                {
                    "expression": f"!({stateful_set}) || {caller} == '{lws_controller_username}' || {trusted}",
                    "messageExpression": f"'the pod template of ' + {what} + ' carries the label {keys.MANAGED_BY}="
                    f"{keys.MANAGER}: its pods would pass for pods of a Lockstep job. Only the LeaderWorkerSet "
                    f"controller "
                    f"({lws_controller_username}) makes such StatefulSets, for the LeaderWorkerSets of Lockstep jobs, "
                    f"or a member of group {keys.BREAK_GLASS_GROUP}; not ' + {caller}",
                    "reason": "Forbidden",
                },
                {
                    "expression": f"{stateful_set} || {caller} == '{operator_username}' || {trusted} || "
                    "(request.operation == 'UPDATE' && object.spec == oldObject.spec)",
                    "messageExpression": f"'the pod templates of ' + {what} + ' carry the label {keys.MANAGED_BY}="
                    f"{keys.MANAGER}: its pods would pass for pods of a Lockstep job. Only the Lockstep operator "
                    f"({operator_username}) makes and changes the LeaderWorkerSets of Lockstep jobs, or a member of "
                    f"group {keys.BREAK_GLASS_GROUP}; not ' + {caller}",
                    "reason": "Forbidden",
                },
            ],
        },
    )


def barrier_manifests(
    operator_username: str = keys.OPERATOR_USERNAME, lws_controller_username: str = keys.LWS_CONTROLLER_USERNAME
) -> list[dict[str, Any]]:
    """The barrier policy, the pods/binding policy, the group sets' policy, and their bindings."""
    return [
        barrier_policy(operator_username, lws_controller_username),
        _deny_binding(BARRIER_POLICY),
        binding_policy(operator_username),
        _deny_binding(BINDING_POLICY),
        group_sets_policy(operator_username, lws_controller_username),
        _deny_binding(GROUP_SETS_POLICY),
    ]
