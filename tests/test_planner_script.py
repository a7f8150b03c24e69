"""benchmarks/planner.py's reading of a run: which pairs the measurement ranks the other way, and
whether the run orders them at all (the README's accuracy claims rest on these lines)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipeline.records.benchmark import LayoutResult

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "planner.py"
spec = importlib.util.spec_from_file_location("planner_script", SCRIPT)
assert spec and spec.loader
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def measured(*rates: float | None) -> list[LayoutResult]:
    return [
        LayoutResult(layout="x", tp=1, dp=1, ep=1, pp=1, replicas=1, devices=1, status="ok", max_slo_rate=r)
        for r in rates
    ]


def test_swapped_names_each_pair_in_the_other_order_and_only_those() -> None:
    assert script.swapped(["a", "b", "c", "d"], ["a", "b", "c", "d"]) == []
    assert script.swapped(["a", "b", "c", "d"], ["a", "c", "b", "d"]) == [("b", "c")]
    # one layout falling from first to last passes every other: each pair said once, prediction's order first
    assert script.swapped(["a", "b", "c"], ["b", "c", "a"]) == [("a", "b"), ("a", "c")]


def test_overlap_reads_each_layouts_lowest_to_highest_measurement() -> None:
    # run 14's pair: 131.7-140.3 against 133.3-144.3: this run does not order them
    assert script.overlap(measured(140.3, 131.7), measured(144.3, 133.3))
    # run 16's: 121.6-148.2 against 161.5-171.8: it does
    assert not script.overlap(measured(121.6, 148.2), measured(161.5, 171.8))
    assert script.overlap(measured(150.0), measured(140.0, 150.0))  # touching counts as overlapping
    # a measurement that found no rate counts as 0, so it widens its layout's range down to 0
    assert script.overlap(measured(None, 200.0), measured(100.0))
    assert script.extent(measured(148.2, 121.6)) == "121.6-148.2"
    assert script.extent(measured(166.6)) == "166.6"
