"""The committed CRD YAML is exactly what the models generate."""

from __future__ import annotations

from lockstep import crds


def test_committed_manifests_match_the_models() -> None:
    stale = [name for name, text in crds.rendered().items() if (crds.REPO / name).read_text() != text]
    assert not stale, f"{stale} are out of date; run `python -m lockstep.crds`"


def test_printer_columns_select_conditions_by_type() -> None:
    columns = {c["name"]: c["jsonPath"] for c in crds.rljob_crd()["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Parity"] == '.status.conditions[?(@.type=="ParityLocked")].status'
    assert "[0]" not in "".join(columns.values())


def test_every_cel_rule_and_message_expression_of_the_crds_compiles() -> None:
    """A message with an apostrophe inside a single-quoted CEL string makes the API server refuse the whole CRD."""
    from typing import Any

    from lockstep.cli import _cel_program

    def expressions(node: Any) -> list[str]:
        if isinstance(node, list):
            return [found for item in node for found in expressions(item)]
        if not isinstance(node, dict):
            return []
        own = [
            rule.get(key) for rule in node.get("x-kubernetes-validations", []) for key in ("rule", "messageExpression")
        ]
        return [*[e for e in own if e], *[found for value in node.values() for found in expressions(value)]]

    found = expressions(crds.rljob_crd()) + expressions(crds.paritypolicy_crd())
    assert len(found) > 20
    for expression in found:
        _cel_program(expression)  # raises CELParseError on a broken one
