"""From layouts' results to an answer: per server and per device, the best layout against the
spec's minimum, and a rate as a reader must take it (a bound, unsteady, client-bound)."""

from __future__ import annotations

from pipeline.core.specs import HardwareProfile, SloSpec
from pipeline.records.benchmark import LayoutResult, Selection


def finish(result: LayoutResult, hw: HardwareProfile) -> LayoutResult:
    if result.max_slo_rate is not None:
        # GPU layouts tile the node; a CPU engine takes the whole machine whatever its core binding
        copies = max(1, hw.devices // result.devices) if hw.kind == "gpu" else 1
        result.per_server = round(result.max_slo_rate * copies, 4)
        result.per_device = round(result.per_server / hw.devices, 4)
        if result.prediction and result.predicted_rate:
            result.prediction_error = result.prediction.error(result.max_slo_rate)
    return result


def rate_text(
    rate: float | None, bound: bool | None = False, unsteady: bool | None = False, client_bound: bool | None = False
) -> str:
    """A measured max SLO rate as a reader must take it: 'at least 373' where it is a lower bound
    (`bound_only`), '373' where a failing probe above it capped it, '-' for none; '(unsteady)' where
    its runs disagreed (`unsteady`), '(client-bound)' where the client's lag decided it."""
    if rate is None:
        return "-"
    marks = [m for m, on in (("unsteady", unsteady), ("client-bound", client_bound)) if on]
    return (f"at least {rate:.3g}" if bound else f"{rate:.3g}") + (f" ({', '.join(marks)})" if marks else "")


def select(results: list[LayoutResult], slo: SloSpec) -> Selection:
    ok = [r for r in results if r.status == "ok" and r.per_server is not None]
    if not ok:
        return Selection(best=None, passed=False, reason="no layout met the SLO at any rate", layouts=results)
    best = max(ok, key=lambda r: r.per_server or 0)
    if (best.per_server or 0) < slo.min_rate_per_server:
        return Selection(
            best=best.layout,
            passed=False,
            layouts=results,
            reason=f"best layout {best.layout} holds the SLO {'at least ' if best.bound_only else ''}up to "
            f"{rate_text(best.per_server, False, best.unsteady, best.client_bound)} req/s per server, "
            f"below the required {slo.min_rate_per_server:g}",
        )
    return Selection(
        best=best.layout,
        passed=True,
        layouts=results,
        reason=f"{best.layout}: {rate_text(best.per_server, best.bound_only, best.unsteady, best.client_bound)} "
        f"req/s per server ({best.per_device:.3g} per device)",
    )
