"""CustomResourceDefinitions generated from the models in ``lockstep.api``.

``python -m lockstep.crds [DIR]`` writes them to crds/ (the default); a test
fails when the committed YAML and the models disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from lockstep import admission, api
from lockstep.parity import default_policy
from lockstep.schema import structural_schema

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = "charts/lockstep"


def _resource_schema(spec: type[BaseModel], status: type[BaseModel] | None) -> dict[str, Any]:
    properties: dict[str, Any] = {
        "apiVersion": {"type": "string", "description": f"The schema version of this object: {api.API_VERSION}."},
        "kind": {"type": "string", "description": "The REST resource this object represents."},
        "metadata": {"type": "object"},  # the API server describes it; a CRD may say nothing more
        "spec": structural_schema(spec),
    }
    if status is not None:
        properties["status"] = structural_schema(status)
    return {"type": "object", "required": ["spec"], "properties": properties}


def _condition_column(name: str, condition: str) -> dict[str, str]:
    return {"name": name, "type": "string", "jsonPath": f'.status.conditions[?(@.type=="{condition}")].status'}


AGE_COLUMN = {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def rljob_crd() -> dict[str, Any]:
    return _crd(
        plural=api.RLJOBS,
        kind="RLJob",
        scope="Namespaced",
        short_names=["rlj"],
        schema={
            **_resource_schema(api.RLJobSpec, api.RLJobStatus),
            **api.validations(api.RLJOB_NAME_RULE, api.RLJOB_NAME_LABEL_RULE),
        },
        columns=[
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {
                "name": "Actors",
                "type": "string",
                "jsonPath": ".status.actors.summary",
                "description": "ready/desired actor pods",
            },
            {
                "name": "Trainer",
                "type": "string",
                "jsonPath": ".status.trainer.summary",
                "description": "ready/desired trainer pods",
            },
            {"name": "Weights", "type": "integer", "jsonPath": ".status.weightsVersion"},
            {
                "name": "Queue",
                "type": "string",
                "jsonPath": ".status.queue.localQueue",
                "description": "the Kueue LocalQueue the job waits or runs in",
            },
            _condition_column("Parity", "ParityLocked"),
            _condition_column("Ready", "Ready"),
            AGE_COLUMN,
        ],
    )


def paritypolicy_crd() -> dict[str, Any]:
    return _crd(
        plural=api.PARITY_POLICIES,
        kind="ParityPolicy",
        scope="Cluster",
        short_names=["parity"],
        schema=_resource_schema(api.ParityPolicySpec, None),
        columns=[
            {"name": "Default", "type": "boolean", "jsonPath": ".spec.default"},
            {"name": "Enforcement", "type": "string", "jsonPath": ".spec.enforcement"},
            AGE_COLUMN,
        ],
    )


def _crd(
    *,
    plural: str,
    kind: str,
    scope: str,
    short_names: list[str],
    schema: dict[str, Any],
    columns: list[dict[str, str]],
) -> dict[str, Any]:
    version: dict[str, Any] = {
        "name": api.VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
        "additionalPrinterColumns": columns,
    }
    if "status" in schema["properties"]:
        version["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": scope,
            "names": {
                "plural": plural,
                "singular": kind.lower(),
                "kind": kind,
                "shortNames": short_names,
                "categories": ["lockstep"],
            },
            "versions": [version],
        },
    }


def rendered() -> dict[str, str]:
    """Path (relative to the repository) → text of every generated manifest: crds/, and the chart's copies."""
    definitions = {
        f"{api.GROUP}_{crd['spec']['names']['plural']}.yaml": _dump(crd) for crd in (rljob_crd(), paritypolicy_crd())
    }
    parity = _dump_all(admission.manifests())
    barrier = _dump_all(admission.barrier_manifests())
    policy = _dump(default_policy().model_dump(mode="json", by_alias=True, exclude_none=True))
    files = {f"crds/{name}": text for name, text in definitions.items()}
    files |= {
        "crds/admission-parity.yaml": parity,
        "crds/admission-barrier.yaml": barrier,
        "crds/default-paritypolicy.yaml": policy,
    }
    # The chart: CRDs as they are (Helm installs crds/ first), the rest as templates.
    files |= {f"{CHART_DIR}/crds/{name}": text for name, text in definitions.items()}
    # Unfolded lines, so that no template action is split across lines.
    chart_barrier = _dump_all(
        admission.barrier_manifests(
            '{{ include "lockstep.operatorUsername" . }}', "{{ .Values.leaderWorkerSet.controllerUsername }}"
        ),
        float("inf"),
    )
    files |= {
        f"{CHART_DIR}/templates/admission-parity.yaml": _only_if("admissionPolicies", parity),
        f"{CHART_DIR}/templates/admission-barrier.yaml": _only_if("admissionPolicies", chart_barrier),
        f"{CHART_DIR}/templates/default-paritypolicy.yaml": _only_if("defaultParityPolicy", policy),
    }
    return files


def _dump(document: dict[str, Any], width: float = 120) -> str:
    header = "# Generated by `python -m lockstep.crds` from operator/lockstep/api.py. Do not edit.\n"
    return header + yaml.safe_dump(document, sort_keys=False, width=width)


def _dump_all(documents: list[dict[str, Any]], width: float = 120) -> str:
    return "---\n".join(_dump(document, width) for document in documents)


def _only_if(value: str, text: str) -> str:
    return f"{{{{- if .Values.{value} }}}}\n{text}{{{{- end }}}}\n"


def write(root: Path = REPO) -> list[Path]:
    paths = []
    for name, text in rendered().items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO):
        print(written)
