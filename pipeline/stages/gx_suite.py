"""The accuracy gate's expectations, validated by great-expectations (1.x API, in memory).

One row per task; the suite says what a trustworthy comparison looks like: every configured
task present, sample counts as configured, no missing values, scores in [0, 1], recovery at
or above each task's minimum, candidate at or above its floor.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.files import atomic_json, atomic_write
from pipeline.core.html import environment

RESULT_FORMAT = {"result_format": "COMPLETE"}
logging.getLogger("great_expectations").setLevel(logging.WARNING)  # its INFO lines drown the task log


@dataclass
class Validation:
    success: bool
    result: dict[str, Any]
    failures: list[str] = field(default_factory=list)


_PAGES = environment(Path(__file__).parent / "templates")
SERVED_COLUMNS = ["in_process", "difference", "max_difference"]


def _frame(tasks, served: bool = False):
    import pandas as pd

    columns = [
        "task",
        "metric",
        "baseline",
        "candidate",
        "recovery",
        "min_recovery",
        "floor",
        "samples_baseline",
        "samples_candidate",
        "expected_samples",
    ] + (SERVED_COLUMNS if served else [])
    rows = [{c: getattr(t, c) for c in columns} for t in tasks]
    return pd.DataFrame(rows, columns=columns).astype(
        {c: "float64" for c in ["recovery", "baseline", "candidate"] + (SERVED_COLUMNS if served else [])}
    )


def _suite(configured: list[str], served: bool = False):
    import great_expectations as gx
    import great_expectations.expectations as gxe

    suite = gx.ExpectationSuite(name="served_accuracy" if served else "accuracy_gate")
    if served:  # the served model answers as the candidate did in-process on the same items
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column="in_process"))
        suite.add_expectation(
            gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="max_difference", column_B="difference", or_equal=True)
        )
    suite.add_expectation(gxe.ExpectColumnDistinctValuesToEqualSet(column="task", value_set=configured))
    for column in ("baseline", "candidate", "recovery"):
        suite.add_expectation(gxe.ExpectColumnValuesToNotBeNull(column=column))
    for column in ("baseline", "candidate"):
        suite.add_expectation(gxe.ExpectColumnValuesToBeBetween(column=column, min_value=0, max_value=1))
    for column in ("samples_baseline", "samples_candidate"):
        suite.add_expectation(gxe.ExpectColumnPairValuesToBeEqual(column_A=column, column_B="expected_samples"))
    suite.add_expectation(
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="recovery", column_B="min_recovery", or_equal=True)
    )
    suite.add_expectation(
        gxe.ExpectColumnPairValuesAToBeGreaterThanB(column_A="candidate", column_B="floor", or_equal=True)
    )
    return suite


def validate(tasks, configured: list[str], served: bool = False) -> Validation:
    """`served`: the serving-path table (candidate = the served score), with its in-process columns."""
    import great_expectations as gx

    frame = _frame(tasks, served)
    context = gx.get_context(mode="ephemeral")
    source = context.data_sources.add_pandas("accuracy")
    batch = (
        source.add_dataframe_asset("results")
        .add_batch_definition_whole_dataframe("all")
        .get_batch(batch_parameters={"dataframe": frame})
    )
    suite = context.suites.add(_suite(configured, served))
    result = batch.validate(suite, result_format=RESULT_FORMAT)
    payload = result.to_json_dict()
    failures = []
    names = list(frame["task"])
    for item in result.results:
        if item.success:
            continue
        config = item.expectation_config
        assert config is not None  # every result of a suite run carries its expectation
        kind = config.type
        kwargs = config.kwargs
        details = item.result or {}
        if kind == "expect_column_distinct_values_to_equal_set":
            observed = set(details.get("observed_value") or [])
            for missing in sorted(set(configured) - observed):
                failures.append(f"{missing}: configured task missing from the results ({kind})")
            for extra in sorted(observed - set(configured)):
                failures.append(f"{extra}: task not in the spec ({kind})")
            continue
        what = kwargs.get("column") or f"{kwargs.get('column_A')} vs {kwargs.get('column_B')}"
        indices = details.get("unexpected_index_list") or []
        rows = [names[i] if isinstance(i, int) and i < len(names) else str(i) for i in indices] or ["(table)"]
        for task in rows:
            row = frame[frame["task"] == task].to_dict("records")
            values = {
                k: row[0][k]
                for k in (kwargs.get("column_A"), kwargs.get("column_B"), kwargs.get("column"))
                if k and row
            }
            shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())
            failures.append(f"{task}: {what} fails {kind} ({shown})")
    return Validation(success=bool(result.success), result=payload, failures=failures)


@dataclass
class Published:
    """A validated table, published: the verdict, one line per failure naming its task, the files."""

    passed: bool
    failures: list[str]
    json_path: Path
    html_path: Path


def publish(tasks, configured: list[str], out_dir: Path, name: str, served: bool = False) -> Published:
    """Validate the per-task table (`validate`), write the result as `name`.json and a page as
    `name`.html under `out_dir`, and name every failed task once (its own reason when no
    expectation named it): the gate and the serving-path check say what failed the same way."""
    validation = validate(tasks, configured, served)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out_dir / f"{name}.json", out_dir / f"{name}.html"
    atomic_json(json_path, validation.result)
    atomic_write(html_path, render_html(validation, tasks))
    failures = list(validation.failures)
    for t in tasks:
        if not t.passed and not any(f.startswith(t.task + ":") for f in failures):
            failures.append(f"{t.task}: {t.reason}")
    return Published(validation.success and all(t.passed for t in tasks), failures, json_path, html_path)


def render_html(validation: Validation, tasks) -> str:
    """A small self-contained page: the table and each expectation's outcome."""
    checks = [
        {
            "type": r["expectation_config"]["type"],
            "arguments": json.dumps({k: v for k, v in r["expectation_config"]["kwargs"].items() if k != "batch_id"}),
            "success": r["success"],
        }
        for r in validation.result.get("results", [])
    ]
    page = _PAGES.get_template("accuracy_gate.html.j2")
    return page.render(verdict="PASSED" if validation.success else "FAILED", tasks=tasks, checks=checks)
