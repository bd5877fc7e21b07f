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
