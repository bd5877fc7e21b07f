"""The ``lockstep`` command line.

- ``lockstep validate FILE [--policy FILE] [--data-root DIR]``: check an RLJob offline against the schema, the
  CRD's CEL rules and a ParityPolicy, with the messages the API server and the operator would give; and its
  dataset (spec.trainer.dataset) as the trainer reads it, where its files are on this machine.
- ``lockstep render FILE [--policy FILE]``: the effective vLLM arguments and config fingerprint.
- ``lockstep status NAME [-n NAMESPACE]``: a job's phase, parity state and barrier history (uses
  $KUBECONFIG).
- ``lockstep parity-check`` and ``lockstep export`` (lockstep_workers.parity_check, lockstep_workers.export; they
  need lockstep[workers]): the mismatch per vLLM configuration; a published weights version written as a servable
  Hugging Face directory.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from lockstep import api
from lockstep.api import ParityPolicy, RLJobSpec
from lockstep.parity import EffectiveConfig, default_policy, effective_config
from lockstep.podconfig import vllm_flags
from lockstep.schema import structural_schema

_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "object", list: "array"}


def _number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def _quoted(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else _number(value)


def _schema_at(path: tuple[str | int, ...]) -> dict[str, Any]:
    node = structural_schema(RLJobSpec)
    for part in path:
        if isinstance(part, int):
            node = node["items"]
        else:
            node = node.get("properties", {}).get(part) or node.get("additionalProperties", {})
    return node


def decoded(value: Any, node: dict[str, Any]) -> Any:
    """``value`` as the API server reads it against the structural schema ``node``: a whole number written as a
    float (``16.0``) where the schema says integer is that integer; everything else as it is."""
    if isinstance(value, float) and value.is_integer() and node.get("type") == "integer":
        return int(value)
    if isinstance(value, dict):
        properties, rest = node.get("properties", {}), node.get("additionalProperties")
        return {k: decoded(v, properties.get(k) or (rest if isinstance(rest, dict) else {})) for k, v in value.items()}
    if isinstance(value, list):
        return [decoded(item, node.get("items") or {}) for item in value]
    return value


def schema_errors(spec: dict[str, Any]) -> list[str]:
    """What the API server says of an invalid spec, one line per field, in its own words: the schema,
    then the CRD's CEL rules on the defaulted spec."""
    spec = decoded(spec, structural_schema(RLJobSpec))
    try:
        validated = RLJobSpec.model_validate_json(json.dumps(spec), strict=True)
    except ValidationError as error:
        return [_api_server_message(e) for e in error.errors()]
    defaulted = validated.model_dump(mode="json", by_alias=True, exclude_none=True)
    return _cel_errors(structural_schema(RLJobSpec), defaulted, "spec")


def _cel_errors(node: dict[str, Any], value: Any, path: str) -> list[str]:
    """The x-kubernetes-validations rules at ``node`` and below that ``value`` breaks (transition rules,
    which compare with oldSelf, need an old object and are left to the API server)."""
    from celpy.adapter import json_to_cel

    def evaluate(expression: str) -> Any:
        return _cel_program(expression).evaluate({"self": json_to_cel(value)})

    errors = []
    for rule in node.get("x-kubernetes-validations", []):
        if "oldSelf" in rule["rule"]:
            continue
        if not evaluate(rule["rule"]):
            field = path + rule.get("fieldPath", "")
            kind = "Required value" if rule.get("reason") == "FieldValueRequired" else "Invalid value"
            message = str(evaluate(rule["messageExpression"])) if "messageExpression" in rule else rule["message"]
            shown = "" if isinstance(value, dict | list) else f"{_quoted(value)}: "  # a scalar is quoted, as it was
            errors.append(f"{field}: {kind}: {shown}{message}")
    for name, child in node.get("properties", {}).items():
        if isinstance(value, dict) and name in value:
            errors += _cel_errors(child, value[name], f"{path}.{name}")
    if isinstance(node.get("items"), dict) and isinstance(value, list):
        for index, item in enumerate(value):
            errors += _cel_errors(node["items"], item, f"{path}[{index}]")
    return errors


@functools.cache
def _cel_program(expression: str) -> Any:
    """``expression`` compiled once, with the functions of Kubernetes' CEL that celpy lacks."""
    import celpy
    from celpy import celtypes

    def join(items: Any, separator: Any) -> Any:
        return celtypes.StringType(str(separator).join(str(item) for item in items))

    def contains(text: Any, part: Any) -> Any:
        return celtypes.BoolType(str(part) in str(text))

    environment = celpy.Environment()
    return environment.program(environment.compile(expression), functions={"join": join, "contains": contains})


def _api_server_message(error: Any) -> str:
    loc: tuple[str | int, ...] = tuple(error["loc"])
    field = "spec" + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    value, kind, node = error.get("input"), error["type"], _schema_at(loc)
    if kind == "missing":
        return f"{field}: Required value"
    if kind == "extra_forbidden":
        return f'unknown field "{field}"'
    if kind == "enum" or "enum" in node:
        supported = ", ".join(json.dumps(v) for v in node.get("enum", []))
        return f"{field}: Unsupported value: {_quoted(value)}: supported values: {supported}"
    bounds = {
        "greater_than_equal": ("greater than or equal to", "ge"),
        "greater_than": ("greater than", "gt"),
        "less_than_equal": ("less than or equal to", "le"),
        "less_than": ("less than", "lt"),
    }
    if kind in bounds:
        words, key = bounds[kind]
        limit = _number(error["ctx"][key])
        return f"{field}: Invalid value: {_quoted(value)}: {field} in body should be {words} {limit}"
    if kind == "string_pattern_mismatch":
        return f"{field}: Invalid value: {_quoted(value)}: {field} in body should match '{node.get('pattern')}'"
    if kind == "too_long":
        return f"{field}: Too many: {len(value)}: must have at most {error['ctx']['max_length']} items"
    if kind == "string_too_long":
        return f"{field}: Too long: may not be more than {error['ctx']['max_length']} bytes"
    if kind == "string_too_short":
        least = node.get("minLength")
        return f"{field}: Invalid value: {_quoted(value)}: {field} in body should be at least {least} chars long"
    given = _JSON_TYPES.get(type(value), "null")
    return f'{field}: Invalid value: "{given}": {field} in body must be of type {node.get("type")}: "{given}"'


def _load(path: Path) -> dict[str, Any]:
    try:
        document = yaml.safe_load(path.read_text())
    except OSError as error:
        raise SystemExit(f"{path}: cannot be read ({error.strerror or error})") from None
    except yaml.YAMLError as error:
        raise SystemExit(f"{path}: not valid YAML ({error})") from None
    if not isinstance(document, dict):
        raise SystemExit(f"{path}: not a YAML mapping")
    return document


def _policy(path: Path | None) -> ParityPolicy:
    return ParityPolicy.model_validate(_load(path)) if path else default_policy()


def object_errors(job: dict[str, Any]) -> list[str]:
    """What the API server says of the CRD's rules on the whole object (the job's name), in its own words."""
    rules = {"x-kubernetes-validations": list(api.RLJOB_NAME_RULES)}
    metadata = {"name": (job.get("metadata") or {}).get("name", "")}
    return _cel_errors(rules, {"metadata": metadata}, "<nil>")


def _config(job: dict[str, Any], policy: ParityPolicy) -> EffectiveConfig | list[str]:
    errors = object_errors(job) + schema_errors(job.get("spec") or {})
    if job.get("kind") != "RLJob" or job.get("apiVersion") != api.API_VERSION:
        errors.insert(
            0, f"expected apiVersion {api.API_VERSION} and kind RLJob, got {job.get('apiVersion')}/{job.get('kind')}"
        )
    if errors:
        return errors
    return effective_config(RLJobSpec.model_validate(job["spec"]), policy)


def validate(args: argparse.Namespace) -> int:
    policy = _policy(args.policy)
    config = _config(_load(args.file), policy)
    if isinstance(config, list):
        print(f"{args.file}: refused by the API server:", *config, sep="\n  ")
        return 1
    name, enforcement = policy.metadata.get("name", ""), config.enforcement.value
    if config.refused:
        print(f"{args.file}: refused by the API server:", *config.refusals(), sep="\n  ")
        return 1
    for difference in config.differences():
        print(f"{args.file}: ParityPolicy {name!r} ({enforcement}) differs: {difference}")
    dataset = RLJobSpec.model_validate(_load(args.file)["spec"]).trainer.dataset
    problems = dataset_problems(dataset, args.data_root) if dataset else []
    if problems:
        print(f"{args.file}: the trainer would refuse spec.trainer.dataset:", *problems, sep="\n  ")
        return 1
    print(f"{args.file}: valid under ParityPolicy {name!r} ({enforcement}); fingerprint {config.fingerprint}")
    return 0


def dataset_problems(dataset: api.Dataset, root: Path | None) -> list[str]:
    """Why the trainer would refuse the files of ``dataset`` (their paths are the trainer pod's; under ``root``
    when given, as on a local copy of the volume). Files not on this machine are left to the trainer, with a note."""
    try:
        from lockstep_workers.rollout.dataset import DatasetError, read_rows
    except ImportError as error:
        print(f"spec.trainer.dataset not checked: install lockstep[workers] to read datasets here ({error})")
        return []
    problems = []
    for field, path in (("train", dataset.train), ("eval", dataset.eval)):
        if path is None:
            continue
        local = root / path.lstrip("/") if root else Path(path)
        try:
            if not local.exists():
                print(f"spec.trainer.dataset: {local} is not on this machine; the trainer checks it when it starts")
                continue
            read_rows(str(local), dataset)
        except DatasetError as error:
            problems.append(str(error))
        except OSError as error:  # a name too long for this filesystem, a directory it may not read, ...
            print(
                f"spec.trainer.dataset.{field}: {local} cannot be read on this machine ({error.strerror or error}); "
                "the trainer checks it when it starts"
            )
    return problems


def render(args: argparse.Namespace) -> int:
    config = _config(_load(args.file), _policy(args.policy))
    if isinstance(config, list):
        print(*config, sep="\n")
        return 1
    print(f"# ParityPolicy {config.policy!r}; fingerprint {config.fingerprint}")
    print(" ".join(vllm_flags(config.vllm_settings)))
    return 0


def status(args: argparse.Namespace) -> int:
    from kubernetes import client, config

    config.load_kube_config()
    custom = client.CustomObjectsApi()
    job: dict[str, Any] = custom.get_namespaced_custom_object(  # type: ignore[assignment]
        api.GROUP, api.VERSION, args.namespace, api.RLJOBS, args.name
    )
    print(describe_status(f"{args.namespace}/{args.name}", job.get("status") or {}))
    return 0


def describe_status(name: str, state: dict[str, Any]) -> str:
    """A job's phase, conditions, barrier in flight and barrier history, in lines for a terminal."""
    weights = f"weights version {state.get('weightsVersion')}, lag {state.get('lag')}"
    lines = [f"RLJob {name}: {state.get('phase', 'Pending')}, {weights}"]
    lines.append(
        f"  restarts {state.get('restarts', 0)} (failures, against spec.maxRestarts), replacements "
        f"{state.get('replacements', 0)} (spec edits, policy changes, drift, evictions, lost Workloads)"
    )
    for condition in state.get("conditions", []):
        lines.append(f"  {condition['type']}={condition['status']} ({condition['reason']}): {condition['message']}")
    if preflight := state.get("preflight"):
        lines.append(
            f"  preflight: mean |Δlogprob| {preflight['meanAbsLogprobDiff']:.3g}, after an update with shared "
            f"prompts {preflight['sharedPrefixMeanAbsLogprobDiff']:.3g}, over {preflight['tokens']} tokens"
        )
    if mismatch := state.get("mismatch"):
        lines.append(
            f"  trainer's last parity measurement: step {mismatch['step']}, mean |Δlogprob| "
            f"{mismatch['meanAbsLogprobDiff']:.3g} on {mismatch['tokenFraction']:.0%} of its tokens"
            + (f"; {dropped} stale sample(s) dropped" if (dropped := mismatch.get("staleSamplesDropped")) else "")
        )
        if measured := mismatch.get("metrics"):
            shown = ("rollout_is_eff_sample_size", "rollout_is_masked_fraction", "k3_kl", "log_ppl_diff")
            lines.append(
                "  its rollout correction: "
                + ", ".join(f"{name} {measured[name]:.3g}" for name in shown if name in measured)
            )
    if evaluation := state.get("evaluation"):
        lines.append(
            f"  trainer's last evaluation: eval reward {evaluation['reward']:.3g} on weights version "
            f"{evaluation['version']} ({evaluation['rows']} eval rows, greedy)"
        )
    if written := state.get("output"):
        evaluated = "no evaluation ran"
        if written.get("evalReward") is not None:
            evaluated = f"last eval reward {written['evalReward']:.3g} on weights version {written['evalVersion']}"
        lines.append(
            f"  trained model (spec.output): {written['path']}, weights version {written['version']} ({evaluated}; "
            f"{written['digest'][:19]}...)"
        )
    if barrier := state.get("barrier"):
        members = f"{len(barrier['members'])} member(s)"
        lines.append(
            f"  barrier in flight: version {barrier['version']}, phase {barrier['phase']} with {members} until "
            f"{barrier['deadline']} (each member's ack is on its pod: lockstep.dev/barrier-ack)"
        )
    for record in state.get("barrierHistory", []):
        phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in record["phaseSeconds"].items())
        took = f"{record['seconds']:.2f} s ({phases})"
        outcome = f"{record['outcome']} ({record['reason']})" if record.get("reason") else record["outcome"]
        lines.append(f"  v{record['version']} {outcome} in {took}; slowest {record.get('slowestPod')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lockstep", description=__doc__.splitlines()[0] if __doc__ else None)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    for name, handler, text in (
        ("validate", validate, "check an RLJob file offline against the schema and a ParityPolicy"),
        ("render", render, "print the effective vLLM arguments of an RLJob file"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("file", type=Path)
        command.add_argument("--policy", type=Path, help="a ParityPolicy file (default: the shipped default policy)")
        command.set_defaults(handler=handler)
        if handler is validate:
            command.add_argument(
                "--data-root",
                type=Path,
                help="where the trainer's volumes are on this machine: its dataset path /data/x.jsonl is read as "
                "DIR/data/x.jsonl (default: as it is)",
            )
    command = commands.add_parser("status", help="show a job's phase, parity state and barrier history")
    command.add_argument("name")
    command.add_argument("-n", "--namespace", default="default")
    command.set_defaults(handler=status)
    for name, (_, needs, summary) in WORKER_COMMANDS.items():
        command = commands.add_parser(
            name, add_help=False, help=f"{summary} (needs {needs}, from lockstep[workers]; --help)"
        )
        command.set_defaults(handler=functools.partial(worker_command, name))
    args, rest = parser.parse_known_args(argv)
    if isinstance(args.handler, functools.partial):  # a worker command parses its own options
        sys.exit(args.handler(rest))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    sys.exit(args.handler(args))


WORKER_COMMANDS = {
    "parity-check": (
        "lockstep_workers.parity_check",
        "vLLM and torch",
        "measure the train-inference mismatch per vLLM configuration",
    ),
    "export": (
        "lockstep_workers.export",
        "torch and transformers",
        "write a published weights version as a servable Hugging Face directory",
    ),
}
"""The commands the workers' package runs (its module, what it needs, what it does), imported only when called."""


def worker_command(name: str, options: list[str]) -> int:
    """Run ``lockstep <name>`` with ``options`` from the workers' package, or say what to install."""
    module, needs, _ = WORKER_COMMANDS[name]
    try:
        main: Callable[[list[str]], int] = importlib.import_module(module).main
    except ImportError as error:
        print(f"lockstep {name} runs {needs}: install lockstep[workers] ({error})", file=sys.stderr)
        return 2
    return main(options)


if __name__ == "__main__":
    main()
