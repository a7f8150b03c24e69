"""Hold the planner to what earlier releases measured on the same hardware and engine.

The step-time model runs on a hardware profile's datasheet figures and efficiency factors; what
it misses on a given machine and engine version (scheduler overhead, a frontend sharing cores,
kernels slower than the roofline) shows as the ratio of measured to predicted max SLO rate. Each
benchmarked layout leaves that ratio in the registry, keyed by hardware profile, engine image and
the layout's shape; the next release's plan multiplies the planner's own rate by the median of
the last few ratios for the same key. The planner's own rate is kept beside the calibrated one,
so every later ratio is taken against the model, never against an earlier calibration.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from pydantic import BaseModel, Field

from pipeline.core.specs import Layout
from pipeline.records.plan import PredictionCheck

LAST = 5  # ratios per key: recent enough to follow an engine's changes, enough to damp one noisy run


class CalibrationKey(BaseModel):
    """What a ratio transfers across: the machine, the engine build, the layout's shape (not its name)
    and the step-time figures the planner ran on (a profiling run's, or the datasheet's): a ratio
    taken against one set of figures says nothing about another. Kept in the registry as its text."""

    hardware: str
    engine: str
    shape: str
    profile: int | None = Field(None, description="the profiling run's id; None: the datasheet's figures")

    def __str__(self) -> str:
        return f"{self.hardware} | {self.engine} | {self.shape}" + (
            f" | profile {self.profile}" if self.profile else ""
        )

    @classmethod
    def parse(cls, text: str) -> CalibrationKey:
        parts = text.split(" | ")
        if len(parts) not in (3, 4) or (len(parts) == 4 and not parts[3].startswith("profile ")):
            raise ValueError(f"not a calibration key: {text!r}")
        profile = int(parts[3].removeprefix("profile ")) if len(parts) == 4 else None
        return cls(hardware=parts[0], engine=parts[1], shape=parts[2], profile=profile)


def key(hardware: str, engine: str, layout: Layout, profile: int | None = None) -> str:
    """The text of the layout's CalibrationKey."""
    shape = f"tp{layout.tp}-ep{layout.ep}-pp{layout.pp}-dp{layout.dp}-x{layout.replicas}"
    return str(CalibrationKey(hardware=hardware, engine=engine, shape=shape, profile=profile))


class Observation(BaseModel):
    """One earlier measurement of a layout against the planner's own (uncalibrated) rate."""

    release_id: int
    layout: str
    planner_rate: float = Field(gt=0, description="req/s the step-time model predicted, before calibration")
    measured: float = Field(gt=0, description="the max SLO rate the search measured, req/s")
    predicted: float | None = Field(None, description="the rate the search started at (calibrated where it was)")
    calibrated: bool = False

    @property
    def ratio(self) -> float:
        return self.measured / self.planner_rate

    @property
    def prediction_error(self) -> float | None:
        return self.measured / self.predicted - 1 if self.predicted else None


class Calibration(BaseModel):
    """The factor applied to the planner's rate for one key, and the measurements it comes from."""

    key: str
    factor: float
    observations: list[Observation]

    def summary(self) -> str:
        evidence = ", ".join(f"release {o.release_id} {o.layout} {o.ratio:.3g}" for o in self.observations)
        return f"x{self.factor:.3g}: median of measured / planner ({evidence})"


class Measurements(BaseModel):
    """Every usable measurement of a layout against the planner, per calibration key, oldest first:
    what the next plan calibrates on and the report's planner table shows."""

    by_key: dict[str, list[Observation]] = Field(
        default_factory=dict, description="calibration key -> its measurements"
    )

    def of(self, key: str) -> list[Observation]:
        return self.by_key.get(key, [])


def observations(releases: Iterable[tuple[int, list[PredictionCheck]]]) -> Measurements:
    """Per key, the usable measurements in the registry's release records (release id, its
    `predictions`), oldest first. A layout that failed, whose answer is only a bound (probe budget,
    capacity), that the load client bound (it sent late in the runs that decided it: the ratio would be
    the client's, not the engine's) or that was recorded without a prediction (none was made, or the
    registry's record predates the one prediction record) teaches nothing and is skipped. A
    lower bound that the line through its two highest passes puts within half the resolution of the
    SLO's edge (`extrapolated`: no probe above it failed) is kept: the search's own model puts it as
    near the edge as a narrowed answer, and a factor from it errs low, where the next search climbs."""
    found: dict[str, list[Observation]] = {}
    for release_id, checks in sorted(releases, key=lambda r: r[0]):
        for check in checks:
            predicted = check.prediction
            if predicted is None or (check.bound_only and not check.extrapolated) or check.client_bound:
                continue
            if not predicted.planner_rate > 0 or not (check.max_slo_rate or 0) > 0:
                continue
            found.setdefault(predicted.calibration_key, []).append(
                Observation(
                    release_id=release_id,
                    layout=check.layout,
                    planner_rate=predicted.planner_rate,
                    measured=check.max_slo_rate,
                    predicted=predicted.predicted_max_slo_rate,
                    calibrated=predicted.calibrated,
                )
            )
    return Measurements(by_key=found)


def calibrate(found: Measurements, for_key: str, last: int = LAST) -> Calibration | None:
    """The median ratio of the last `last` measurements for `for_key`; None when there are none."""
    recent = found.of(for_key)[-last:]
    if not recent:
        return None
    return Calibration(key=for_key, factor=round(statistics.median(o.ratio for o in recent), 4), observations=recent)


def median_abs_errors(rows: list[Observation]) -> tuple[float | None, float | None]:
    """The planner's typical miss over `rows`: (its own rate, the rate each search started at)."""
    own = [abs(o.ratio - 1) for o in rows]
    used = [abs(e) for o in rows if (e := o.prediction_error) is not None]
    return (statistics.median(own) if own else None, statistics.median(used) if used else None)
