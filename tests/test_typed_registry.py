"""The registry's data is typed end to end: a release's facts are a `ReleaseData` of nested records,
none holding an untyped (`Any`) field, and mypy, configured as the project runs it, refuses a
string-key read of them (`rel.data["chosen"]`) where the typed read (`rel.data.chosen`) passes."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import shutil
import subprocess
import sys
import types
import typing
from typing import Any

import pytest
import sqlalchemy
import typing_extensions
from pydantic import BaseModel, ValidationError

from pipeline.core.errors import ReleaseError
from pipeline.core.paths import PROJECT_ROOT
from pipeline.core.rollout import ServerStep
from pipeline.records import events
from pipeline.records.events import (
    Approved,
    GateVerdict,
    ReportWritten,
    RolloutStep,
    SloGate,
    TrendPoint,
    UnreadEvent,
    detail_of,
)
from pipeline.records.rollout import GatewaySmoke, StepAnalysis
from pipeline.records.selection import ChosenFigures
from pipeline.release import registry, step_review
from pipeline.release.registry import Event, Registry, Release, ReleaseData
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


def mypy_refusals(module) -> tuple[str, list[str]]:
    """mypy, with the project's configuration, on a module that must not type-check: (its output,
    its error lines); a module it accepts fails the calling test."""
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(PROJECT_ROOT / "pyproject.toml"), str(module)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    return out, [line for line in out.splitlines() if ": error:" in line]


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
    out, errors = mypy_refusals(module)
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
    reg.record(rel.id, ReportWritten(path="/r.html"), "pipeline", data=ReleaseData(report="/r.html"))
    with reg.engine.connect() as conn:
        stored = json.loads(conn.execute(sqlalchemy.text(f"SELECT data FROM releases WHERE id = {rel.id}")).scalar())
    assert "layout" not in stored and stored["chosen"] == before["chosen"] and stored["report"] == "/r.html"
    assert reg.get(rel.id).data == ReleaseData.model_validate({**before, "report": "/r.html"})


def _stored_row(reg: Registry, release_id: int, kind: str, detail: dict) -> None:
    """A row as an older release wrote it (the registry's own API writes only records)."""
    with reg.engine.begin() as conn:
        conn.execute(
            sqlalchemy.text(
                "INSERT INTO release_events (release_id, at, kind, actor, status_after, detail)"
                " VALUES (:r, '2026-12-01 00:00:00', :k, 'older', NULL, :d)"
            ),
            {"r": release_id, "k": kind, "d": json.dumps(detail)},
        )


def test_an_events_evidence_reads_back_as_its_record(tmp_path):
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    rel = reg.open_release("run-e", "x", "x.yaml", "", "local")
    figures = _figures("single", 12.5)
    gate = reg.record(rel.id, SloGate(passed=True, reason="single: 12.5", chosen=figures), "gate")
    assert gate.kind == "slo_gate" and isinstance(gate.detail, SloGate) and gate.detail.chosen == figures
    # stored as before the registry was typed: the fields set, the kind in its own column
    with reg.engine.connect() as conn:
        row = conn.execute(sqlalchemy.text(f"SELECT kind, detail FROM release_events WHERE id = {gate.id}")).one()
    assert row[0] == "slo_gate" and json.loads(row[1]) == {
        "passed": True,
        "reason": "single: 12.5",
        "chosen": figures.model_dump(mode="json", exclude_unset=True),
    }
    assert reg.events(rel.id)[-1] == gate
    # an SLO gate recorded before the figures were nested (flat beside the verdict) reads them nested
    _stored_row(reg, rel.id, "slo_gate", {"passed": True, "layout": "single", "rate_per_server": 3.0})
    # a kind this code no longer writes, and a row that does not fit its kind's record: kept whole, and why
    _stored_row(reg, rel.id, "note", {"said": "hello", "n": [1, 2]})
    _stored_row(reg, rel.id, "trend_point", {"max_slo_rate": 3.0})
    old, note, point = reg.events(rel.id)[-3:]
    assert isinstance(old.detail, SloGate) and old.detail.passed and old.detail.chosen is not None
    assert old.detail.chosen.rate_per_server == 3.0
    assert isinstance(note.detail, UnreadEvent) and note.detail.raw == {"said": "hello", "n": [1, 2]}
    assert "no record reads kind 'note'" in note.detail.problem
    assert isinstance(point.detail, UnreadEvent) and "verdict: Field required" in point.detail.problem
    # the audit trail shows each as stored
    trail = registry.audit_trail(reg, rel.id)
    assert "note               by older  (said=hello, n=[1, 2])" in trail and "max_slo_rate=3.0" in trail
    # narrowing to a record it is not is an error naming the event, not a silent None
    named = rf"release {rel.id}, event {point.id} \(trend_point\): not a TrendPoint: .*verdict: Field required"
    with pytest.raises(ReleaseError, match=named):
        point.detail_as(TrendPoint)
    assert old.detail_as(GateVerdict).passed


def test_a_detail_of_the_wrong_shape_is_refused_naming_the_kind_and_field(tmp_path):
    """A record refuses a field it does not declare or a wrong type; a controller's (kind, JSON)
    pair that does not fit its kind is refused naming both; the registry takes only event records."""
    with pytest.raises(ValidationError, match=r"Approved\ncoment\n  Extra inputs are not permitted"):
        Approved(coment="typo")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match=r"RolloutStep\nseconds\n  Input should be a valid number"):
        RolloutStep(step=1, fraction=1.0, old_servers=0, new_servers=1, seconds="slow")  # type: ignore[arg-type]
    step = {"step": 1, "fraction": 1.0, "old_servers": 0, "new_servers": 1, "seconds": 2.0}
    assert detail_of("rollout_step", step) == RolloutStep(**step)
    with pytest.raises(ValueError, match=r"event 'rollout_step': pased: Extra inputs are not permitted"):
        detail_of("rollout_step", {**step, "pased": True})
    with pytest.raises(ValueError, match=r"event 'traffic': at_s: Field required"):
        detail_of("traffic", {"weights": {"1": 10_000}})
    with pytest.raises(ValueError, match=r"event 'promoted': no record for this kind"):
        detail_of("promoted", {})
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    rel = reg.open_release("run-w", "x", "x.yaml", "", "local")
    for wrong in ({"comment": "ok"}, UnreadEvent(kind="approved", raw={}, problem="")):
        with pytest.raises(TypeError, match=rf"release {rel.id}: .* is no event record"):
            reg.record(rel.id, wrong, "reviewer", status="approved")  # type: ignore[arg-type]
    assert [e.kind for e in reg.events(rel.id)] == ["created"] and reg.get(rel.id).status == "candidate"


def _writers_shapes() -> list[tuple[str, dict]]:
    """The (kind, JSON) pairs the controller, the targets and promotion make, each key in the order
    its writer puts it (pipeline/release/controller.py, local_target.py, k8s/deploy.py, promote.py)."""
    steps = [ServerStep(fraction=0.5, old_servers=2, new_servers=1).model_dump()]
    query = {"promql": "sum(rate(x[1m]))", "value": 0.2}
    analysis = StepAnalysis(step=1, fraction=0.5, window_s=6, passed=True, queries={"p90": query}).model_dump()
    smoked = GatewaySmoke(gateway="ns/gw", url="http://gw", release="r-2", answered_by="r-2", tries=2, text="46")
    return [
        ("deploy_started", {"target": "local", "layout": "single", "replacing": None}),
        ("deploy_started", {"release_id": "2", "live_release": "1", "live_servers": 2, "kept_servers": None,
                            "steps": steps, "front": "http://127.0.0.1:8100"}),
        ("deploy_started", {"release_id": "2", "live_release": None, "live_servers": 0, "kept_servers": 1,
                            "steps": steps, "namespace": "ns", "server": "https://k8s", "objects": ["Deployment/a"]}),
        ("smoke_test", {"ok": True, "ports": [8001], "prompt": "12+34=", "text": "46"}),
        ("smoke_test", {"ok": True, "step": 1, **smoked.model_dump()}),
        ("smoke_test", {"ok": False, "error": "no answer"}),
        ("rollout_accuracy", {"step": 1, "new_servers": 2, "skipped": "rendered before the flag: not checked"}),
        ("traffic", {"weights": {"1": 5000, "2": 5000}, "at_s": 3.2, "step": 1}),
        ("traffic", {"weights": {"1": 10_000, "2": 0}, "at_s": 4.0, "seconds": 0.5}),
        ("rollout_step", {"step": 1, "fraction": 0.5, "old_servers": 2, "new_servers": 1, "seconds": 3.0}),
        ("rollout_step", {"step": 1, "fraction": 0.5, "old_servers": 2, "new_servers": 1, "seconds": 3.0,
                          "analysis": analysis, "passed": True}),
        ("rollout_complete", {"kept_at_zero": "1", "seconds": 9.0, "all_traffic_after_s": 5.0, "servers": 2}),
        ("rollout_complete", {"keep_window": "finished by recover", "scaled_to_zero": "1"}),
        ("recovered", {"state": "nothing of the release was applied", "release_id": "2"}),
        ("recovered", {"state": "undone", "release_id": "2", "replacing": "1", "weights": {"1": 10_000},
                       "old_servers": 1, "new_servers": 1}),
        ("rollout_aborted", {"error": "step 1: p90 TTFT over", "seconds": 1.0}),
        ("rollout_failed", {"error": "engine exited", "seconds": 1.0}),
        ("scaled_to_zero", {"release": "2"}),
        ("rollback_started", {"to_release": "1", "reason": "answers worse",
                              "overload": {"servers": 1, "load_of_servers": 2, "factor": 2.0}}),
        ("rollback_started", {"reason": "p90 up", "from": 2, "was": "superseded"}),
        ("rollback_failed", {"to_release": "1", "error": "scale refused"}),
        ("rollback_failed", {"reason": "p90 up", "error": "DeployFailed: x"}),
        ("rollback_complete", {"to_release": "1", "servers": 2, "seconds": 1.5}),
        ("scale_down_delay", {"seconds": 60.0, "old_servers": 2, "until": 1_800_000_000.5}),
        ("scale_down_skipped", {"reason": "the route changed during the keep window"}),
        ("pruned", {"engines": ["release-1/engine-0.pid"]}),
        ("pruned", {"objects": ["Deployment/a"]}),
        ("stopped", {"release": 1, "drain": {"in_flight": None, "left": 0, "seconds": 0.5}, "front_failed": 0}),
        ("autoscaler_resumed", {"scaled_objects": ["a"]}),
        ("autoscaler_left_paused", {"scaled_objects": ["a"], "by": "an operator"}),
        ("autoscaler_missing", {"scaled_object": "a"}),
    ]  # fmt: skip


def test_each_writers_evidence_is_stored_as_it_made_it():
    """A (kind, JSON) pair read as its record is stored back the same, keys in the writer's order: the
    audit trail shows an event as its writer made it, whichever writer of a shared kind it was."""
    for kind, made in _writers_shapes():
        assert list(detail_of(kind, made).stored().items()) == list(made.items()), kind


def _string_constants(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _string_constants(node.body) + _string_constants(node.orelse)
    return []


def _reads_events(node: ast.AST) -> bool:
    """An expression that yields registry events: `reg.events(...)`, `last_event(...)`, or one over them."""
    return any(
        isinstance(call, ast.Call)
        and (
            (isinstance(call.func, ast.Attribute) and call.func.attr == "events")
            or (isinstance(call.func, ast.Name) and call.func.id == "last_event")
        )
        for call in ast.walk(node)
    )


def _kinds_in(source: str) -> set[str]:
    """Event kinds a module writes or reads by name: literal `(kind, detail)` pairs appended to an
    `events` list (a `kind = ...` chosen between names there too), the kinds
    `last_event(reg, id, kind, ...)` looks for, and `e.kind == kind` / `e.kind in (kinds)` where `e`
    is an event read from the registry."""
    tree = ast.parse(source)
    found: set[str] = set()
    events_named = set()  # names bound to registry events
    for node in ast.walk(tree):
        if isinstance(node, ast.comprehension | ast.For) and _reads_events(node.iter):
            events_named |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Assign | ast.NamedExpr) and _reads_events(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            events_named |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    appends = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append":
            owner = node.func.value
            if (isinstance(owner, ast.Name) and owner.id == "events") or (
                isinstance(owner, ast.Attribute) and owner.attr == "events"
            ):
                appends = True
                if node.args and isinstance(node.args[0], ast.Tuple) and len(node.args[0].elts) == 2:
                    found.update(_string_constants(node.args[0].elts[0]))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "last_event":
            found.update(k for arg in node.args[2:] for k in _string_constants(arg))
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Attribute)
            and node.left.attr == "kind"
            and isinstance(node.left.value, ast.Name)
            and node.left.value.id in events_named
        ):
            for right in node.comparators:
                found.update(_string_constants(right))
                if isinstance(right, ast.Tuple | ast.List | ast.Set):
                    found.update(k for elt in right.elts for k in _string_constants(elt))
    if appends:  # the controller's `kind = "rollout_aborted" if ... else "rollout_failed"`
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "kind" for t in node.targets):
                found.update(_string_constants(node.value))
    return found


def _raw_pairs(source: str) -> list[int]:
    """Lines appending a literal `(kind, JSON)` pair to an `events` list (not one made by a record's `pair()`)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "append"
        and ((isinstance(o := node.func.value, ast.Name) and o.id == "events") or getattr(o, "attr", None) == "events")
        and node.args
        and isinstance(node.args[0], ast.Tuple)
    ]


def test_every_kind_the_package_writes_or_reads_has_its_record():
    """The registry's API takes only records, each naming its kind; the rollout controller and the
    targets make their events as records too (`pair()`: the (kind, JSON) they keep until promotion
    records it), so mypy checks each field's name where it is written. No literal pair is left, and
    every kind a reader looks for by name (or a pair would name) is a member of the union."""
    sample = (
        'events.append(("traffic", {}))\nkind = "a" if x else "b"\n[e for e in reg.events(1) if e.kind in ("c",)]\n'
    )
    assert _kinds_in(sample + 'if notify.kind == "smtp": pass\n') == {"traffic", "a", "b", "c"}  # the scan finds them
    assert _raw_pairs(sample + "self.events.append(ev.Traffic(weights={}, at_s=0.0).pair())\n") == [1]
    sources = {path: path.read_text() for path in sorted((PROJECT_ROOT / "pipeline").rglob("*.py"))}
    raw = [f"{path.relative_to(PROJECT_ROOT)}:{line}" for path, text in sources.items() for line in _raw_pairs(text)]
    assert raw == []
    named = {kind: f"{path.relative_to(PROJECT_ROOT)}" for path, text in sources.items() for kind in _kinds_in(text)}
    assert {"rollback_started", "deploy_started", "recovered", "scale_down_delay", "slo_gate", "approved"} <= set(named)
    named |= {step_review.JUDGED: "step_review.JUDGED", step_review.REVIEWED: "step_review.REVIEWED"}
    assert {kind: where for kind, where in named.items() if kind not in events.KINDS} == {}
    for kind, record in events.KINDS.items():  # each record names the kind it is recorded under
        assert record.model_fields["kind"].default == kind


def test_no_record_in_pipeline_records_holds_an_untyped_field():
    """Every record of every module under pipeline/records (and the registry's Event) is typed through:
    no `Any`, no `dict[str, Any]`; JSON from outside the project is JsonValue."""
    import pipeline.records as package

    records = [Event, Release]
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"pipeline.records.{info.name}")
        records += [
            value
            for value in vars(module).values()
            if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == module.__name__
        ]
    assert len(records) > 60
    assert [where for record in records for where in _untyped(record, set(), record.__name__)] == []


def test_mypy_refuses_a_string_key_read_of_an_event_detail_and_a_free_form_write(tmp_path):
    module = tmp_path / "reads_event_detail.py"
    module.write_text(
        "from pipeline.records.events import SloGate\n"
        "from pipeline.release.registry import Registry\n"
        "\n"
        "\n"
        "def verdicts(reg: Registry) -> list[object]:\n"
        "    ev = reg.events(1)[0]\n"
        "    typed = ev.detail.passed if isinstance(ev.detail, SloGate) else None\n"
        '    by_key = ev.detail["passed"]\n'
        '    by_get = ev.detail.get("passed")\n'
        '    reg.record(1, "approved", "reviewer", {"comment": "ok"})\n'
        "    return [typed, by_key, by_get]\n"
    )
    out, errors = mypy_refusals(module)
    assert {line.split(":")[1] for line in errors} == {"8", "9", "10"}, out
    assert any(":8: error:" in e and "is not indexable" in e for e in errors), out
    assert any(":9: error:" in e and 'has no attribute "get"' in e for e in errors), out
    assert any(":10: error:" in e and "Too many positional arguments" in e for e in errors), out


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
