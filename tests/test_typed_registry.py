"""The registry's data is typed end to end: a release's facts are a `ReleaseData` of nested records,
none holding an untyped (`Any`) field, and mypy, configured as the project runs it, refuses a
string-key read of them (`rel.data["chosen"]`) where the typed read (`rel.data.chosen`) passes."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import types
import typing
from typing import Any

import pytest
import sqlalchemy
import typing_extensions
from pydantic import BaseModel

from pipeline.core.errors import ReleaseError
from pipeline.core.paths import PROJECT_ROOT
from pipeline.records.events import GateVerdict, SloGate, TrendPoint
from pipeline.records.selection import ChosenFigures
from pipeline.release.registry import Registry, Release, ReleaseData
from tests.test_registry import DEMO_DB


def _untyped(hint: Any, seen: set[type], where: str) -> list[str]:
    """Where `hint` holds `Any`, following records' fields, containers and unions (JSON is typed)."""
    if hint is Any:
        return [where]
    if isinstance(hint, typing_extensions.TypeAliasType):  # pydantic's JsonValue: JSON, recursive, no Any
        return []
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        if hint in seen:
            return []
        seen.add(hint)
        return [
            found
            for name, field in hint.model_fields.items()
            for found in _untyped(field.annotation, seen, f"{hint.__name__}.{name}")
        ]
    return [found for arg in typing.get_args(hint) for found in _untyped(arg, seen, where)]


def test_no_record_of_a_release_holds_an_untyped_field():
    assert _untyped(Release, set(), "Release") == []
    # the walk finds one where there is one
    bad = types.new_class(
        "Bad", (BaseModel,), exec_body=lambda ns: ns.update({"__annotations__": {"x": dict[str, Any]}})
    )
    assert _untyped(bad, set(), "Bad") == ["Bad.x"]


def test_mypy_refuses_a_string_key_read_of_release_data(tmp_path):
    module = tmp_path / "reads_release_data.py"
    module.write_text(
        "from pipeline.release.registry import Registry\n"
        "\n"
        "\n"
        "def layouts(reg: Registry) -> list[object]:\n"
        "    rel = reg.get(1)\n"
        "    typed = rel.data.chosen.layout if rel.data.chosen else None\n"
        '    by_key = rel.data["chosen"]\n'
        '    by_get = rel.data.get("layout")\n'
        "    return [typed, by_key, by_get]\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(PROJECT_ROOT / "pyproject.toml"), str(module)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["7", "8"], out
    assert '"ReleaseData" is not indexable' in errors[0], out
    assert '"ReleaseData" has no attribute "get"' in errors[1], out


def _figures(layout: str, rate: float) -> ChosenFigures:
    return ChosenFigures(
        layout=layout, rate_per_server=rate, per_device=rate, max_slo_rate=rate, p90_ttft_ms=100.0,
        p90_tpot_ms=10.0, load_seconds=[30.0],
    )  # fmt: skip


def test_a_flat_release_of_1b3a689_reads_nested_and_is_written_back_nested(tmp_path):
    """The demo registry of 1b3a689 keeps the chosen figures flat beside the other facts: read, they
    are a ChosenFigures; the next write stores the release's facts in today's shape."""
    db = tmp_path / "registry.db"
    shutil.copyfile(DEMO_DB, db)
    reg = Registry(f"sqlite:///{db}")
    rel = reg.releases()[0]
    assert rel.data.chosen is not None and rel.data.layout == rel.data.chosen.layout
    before = rel.data.model_dump(mode="json", exclude_unset=True)
    reg.record(rel.id, "report", "pipeline", {"path": "/r.html"}, data=ReleaseData(report="/r.html"))
    with reg.engine.connect() as conn:
        stored = json.loads(conn.execute(sqlalchemy.text(f"SELECT data FROM releases WHERE id = {rel.id}")).scalar())
    assert "layout" not in stored and stored["chosen"] == before["chosen"] and stored["report"] == "/r.html"
    assert reg.get(rel.id).data == ReleaseData.model_validate({**before, "report": "/r.html"})


def test_an_events_evidence_reads_back_as_its_record(tmp_path):
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    rel = reg.open_release("run-e", "x", "x.yaml", "", "local")
    figures = _figures("single", 12.5)
    gate = reg.record(rel.id, "slo_gate", "gate", SloGate(passed=True, reason="single: 12.5", chosen=figures))
    assert gate.detail == {
        "passed": True,
        "reason": "single: 12.5",
        "chosen": figures.model_dump(mode="json", exclude_unset=True),
    }
    assert gate.detail_as(SloGate).chosen == figures
    # an SLO gate recorded before the figures were nested (flat beside the verdict) still reads its verdict
    old = reg.record(rel.id, "slo_gate", "gate", {"passed": True, "layout": "single", "rate_per_server": 3.0})
    assert old.detail_as(GateVerdict).passed
    # evidence that does not fit its record is an error naming the event, not a silent None
    point = reg.record(rel.id, "trend_point", "rebenchmark", {"max_slo_rate": 3.0})
    named = rf"release {rel.id}, event {point.id} \(trend_point\): (?s:.*)\nverdict\n  Field required"
    with pytest.raises(ReleaseError, match=named):
        point.detail_as(TrendPoint)


def _key_reads_of_event_detail(source: str) -> list[int]:
    """Lines reading an event's `detail` by string key (`x.detail["k"]`, `x.detail.get("k")`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        target = None
        if isinstance(node, ast.Subscript):
            target = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop"):
            target = node.func.value
        if isinstance(target, ast.Attribute) and target.attr == "detail":
            found.append(node.lineno)
    return found


def test_no_event_detail_is_read_by_string_key_in_the_package():
    """An event's stored evidence is JSON; the package reads it only as its record (`Event.detail_as`)."""
    sample = 'ev.detail["passed"]\nok = ev.detail.get("step")\nev.detail_as(X).step\n'
    assert _key_reads_of_event_detail(sample) == [1, 2]  # the scan finds them where they are
    found = {
        f"{path.relative_to(PROJECT_ROOT)}:{line}"
        for path in sorted((PROJECT_ROOT / "pipeline").rglob("*.py"))
        for line in _key_reads_of_event_detail(path.read_text())
    }
    assert not found, sorted(found)
