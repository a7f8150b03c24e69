"""Records at every edge: what the entry functions and the registry take and return is typed, and
the one JSON adapter (`records.edge`) turns a record into XCom's JSON and back, naming what does
not fit."""

from __future__ import annotations

import collections.abc
import importlib
import inspect
import json
import math
import typing
from typing import Any

import pytest
from pydantic import BaseModel

from pipeline.core.errors import ReleaseError
from pipeline.records import edge
from pipeline.records.benchmark import LayoutResult
from pipeline.records.release import ReleaseRef, ValidatedRelease

MODULES = [
    "pipeline.entry.flow",
    "pipeline.entry.pod_steps",
    "pipeline.entry.airflow_platform",
    "pipeline.release.registry",
]
# (qualified name, parameter or "return") -> why it may stay untyped; at most five
EXEMPT = {
    ("rebenchmark", "context"): "Airflow's task context, handed untouched to its notifiers",
    ("judge_remeasured", "context"): "Airflow's task context, handed untouched to its notifiers",
    ("AirflowPlatform.notify", "context"): "Airflow's task context, handed to its notifiers",
    ("AirflowPlatform.kubernetes_api", "return"): "a kubernetes ApiClient (the client is imported only where used)",
}
LAYOUT = {"layout": "single", "tp": 1, "dp": 1, "ep": 1, "pp": 1, "replicas": 1, "devices": 1, "status": "ok"}
UNTYPED = (dict, collections.abc.Mapping, typing.Mapping, dict)


def _public(module) -> list[tuple[str, Any]]:
    """Module-level functions and the methods of classes defined in `module`, records (pydantic
    models: data, not API) aside, whose names do not start with an underscore."""
    out = []
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            out.append((name, obj))
        elif inspect.isclass(obj) and not issubclass(obj, BaseModel):
            out += [(f"{name}.{m}", f) for m, f in vars(obj).items() if not m.startswith("_") and inspect.isfunction(f)]
    return out


def _untyped(hint: Any) -> bool:
    """Whether `hint` is, or holds, a dict, a Mapping or Any (aliases resolved)."""
    if hint is Any or hint in UNTYPED:
        return True
    origin = typing.get_origin(hint)
    if origin in UNTYPED:
        return True
    return any(_untyped(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)


def test_entry_functions_and_the_registry_take_and_return_records():
    found, used = [], set()
    for name in MODULES:
        module = importlib.import_module(name)
        for qualname, fn in _public(module):
            hints = typing.get_type_hints(fn)
            for param, hint in hints.items():
                key = (qualname, param)
                if _untyped(hint):
                    if key in EXEMPT:
                        used.add(key)
                    else:
                        found.append(f"{name}.{qualname} {param}: {hint}")
    assert not found, "untyped edges:\n" + "\n".join(found)
    assert used == set(EXEMPT), f"exemptions no longer needed: {set(EXEMPT) - used}"
    assert len(EXEMPT) <= 5


def test_the_check_sees_a_dict_behind_an_alias_and_inside_a_union():
    Alias = dict[str, Any]  # noqa: N806
    assert _untyped(Alias) and _untyped(list[Alias] | None) and _untyped(Any) and _untyped(typing.Mapping[str, int])
    assert not _untyped(list[LayoutResult] | None) and not _untyped(tuple[int, str])


def test_a_record_goes_through_xcom_json_and_back_whole():
    result = LayoutResult.model_validate(LAYOUT | {"max_slo_rate": math.inf})
    text = json.dumps(edge.to_json(result))  # what XCom stores: strict JSON
    assert "Infinity" in text and "inf" not in text.replace("Infinity", "")
    back = edge.from_json(LayoutResult, json.loads(text))
    assert back == result and math.isinf(back.max_slo_rate)


def test_what_does_not_fit_is_named_with_its_field_and_where_it_came_from():
    with pytest.raises(ReleaseError, match=r"s3://b/r.json: not a ValidatedRelease: name: Field required"):
        edge.from_json(ValidatedRelease, {"spec_path": "x.yaml", "layouts": []}, "s3://b/r.json")


def test_call_reads_the_records_a_function_takes_and_writes_the_one_it_returns():
    seen = {}

    def step(release: ValidatedRelease, results: list[LayoutResult], other: ReleaseRef | int, n: int) -> ReleaseRef:
        seen.update(release=release, results=results, other=other, n=n)
        return ReleaseRef(release_id=release.release_id or 0)

    release = {"spec_path": "x.yaml", "name": "x", "layouts": ["single"], "release_id": 7}
    layout = LAYOUT
    out = edge.call(step, release, [layout], 3, n=2)
    assert out == {"release_id": 7}  # JSON again, for XCom
    assert isinstance(seen["release"], ValidatedRelease) and isinstance(seen["results"][0], LayoutResult)
    assert seen["other"] == 3 and seen["n"] == 2  # a plain value where the hint allows one stays plain
    edge.call(step, release, [], {"release_id": 9, "status": "live"}, 1)  # another record's JSON reads as a ref
    assert seen["other"] == ReleaseRef(release_id=9)
    with pytest.raises(ReleaseError, match=r"step\(release\): not a ValidatedRelease: name: Field required"):
        edge.call(step, {"spec_path": "x.yaml", "layouts": []}, [], 1, 1)


def test_every_field_of_every_record_says_what_it_holds():
    """A record is read at an edge by someone who did not write it (a pod, a later release, a
    reviewer's tooling): every field of every public record in pipeline/records/ has a description,
    and every module lists its records in __all__."""
    import pkgutil

    import pipeline.records as package

    undescribed, unlisted = [], []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"pipeline.records.{info.name}")
        records = {
            name: obj
            for name, obj in vars(module).items()
            if inspect.isclass(obj) and issubclass(obj, BaseModel) and obj.__module__ == module.__name__
        }
        unlisted += [f"{info.name}.{name}" for name in records if name not in getattr(module, "__all__", [])]
        undescribed += [
            f"{info.name}.{name}.{field}"
            for name, record in records.items()
            for field, spec in record.model_fields.items()
            if not spec.description
        ]
    assert unlisted == [] and undescribed == []


def test_a_quantize_result_whose_numeric_check_was_skipped_hands_on_its_artifact():
    """The production case: a 235B checkpoint is too large to load on the worker, so the numeric
    check is skipped (no error figure); what the quantize task hands on still validates."""
    from pipeline.records.quantize import NumericCheck, QuantizeResult

    result = QuantizeResult(
        path="/out", manifest_hash="m", method="streaming", scheme="FP8_BLOCK", source_manifest_hash="s",
        reused=False, seconds=1.0, source_bytes=470e9, output_bytes=235e9, mb_per_s=900.0, tensors_quantized=1,
        tensors_kept=1, numeric_check=NumericCheck(skipped="470.0 GB checkpoint is too large to load on this worker"),
    )  # fmt: skip
    artifact = result.artifact()
    assert artifact.max_rel_error is None and artifact.manifest_hash == "m"
    assert edge.from_json(type(artifact), edge.to_json(artifact)) == artifact  # and crosses XCom
