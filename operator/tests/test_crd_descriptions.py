"""Every field of the generated CRDs has a description, so `kubectl explain` says what each one does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from lockstep import crds


def fields(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, schema) of every field below ``node``: properties, list items' and map values' properties."""
    for name, child in (node.get("properties") or {}).items():
        yield f"{path}.{name}", child
        yield from fields(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from fields(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from fields(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("crd", [crds.rljob_crd(), crds.paritypolicy_crd()], ids=["RLJob", "ParityPolicy"])
def test_every_field_has_a_description(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    found = dict(fields(schema, crd["spec"]["names"]["kind"]))
    assert len(found) > 20, "the walk reaches the nested fields"
    # metadata is the API server's own (ObjectMeta): a CRD may not describe it.
    missing = [
        path
        for path, field in found.items()
        if not str(field.get("description", "")).strip() and path != f"{crd['spec']['names']['kind']}.metadata"
    ]
    assert not missing, (
        f"{len(missing)} of {len(found)} fields have no description (lockstep.api's Field(description=...)): {missing}"
    )


def shown(value: Any) -> str:
    """A default as kubectl users write it: false, 0.2, gspo."""
    return value if isinstance(value, str) else json.dumps(value)


@pytest.mark.parametrize("crd", [crds.rljob_crd(), crds.paritypolicy_crd()], ids=["RLJob", "ParityPolicy"])
def test_every_description_of_a_field_with_a_default_says_it(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    defaulted = {path: field for path, field in fields(schema, "") if field.get("default") not in (None, "", [], {})}
    assert defaulted
    silent = [
        path for path, field in defaulted.items() if f"Default: {shown(field['default'])}." not in field["description"]
    ]
    assert not silent, f"descriptions that do not give the field's default: {silent}"


def test_the_walk_finds_nested_list_and_map_fields() -> None:
    schema = crds.rljob_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    found = dict(fields(schema, "RLJob"))
    assert "RLJob.spec.actors.env[].name" in found
    assert "RLJob.status.barrierHistory[].phaseSeconds" in found
    assert "RLJob.spec.actors.resources.limits" in found
