"""One Airflow pool for the work that loads engines on the embedded default's one machine.

A release run's benchmarks, its promotion and verify (a rollout serves and measures under load),
and a re-benchmark all start vLLM engines and measure them. Run side by side they measure each
other: the live-release Asset wakes a re-benchmark the moment a promotion succeeds, while the run's
verify still uses the machine. One slot serializes them across DAGs, where
`max_active_tis_per_dagrun` only serializes one run's own tasks. On Kubernetes the heavy steps are
pods on their own nodes and the pod DAGs do not use it.
"""

from __future__ import annotations

from pipeline.airflow.rest import AirflowClient
from pipeline.core.errors import AirflowError

BENCHMARK = "model_release_benchmark"
SLOTS = 1
DESCRIPTION = "model-release: one engine workload at a time on this machine (benchmarks, rollouts, re-benchmarks)"


def ensure(client: AirflowClient) -> bool:
    """Create the pool unless it exists (tasks in a missing pool are never scheduled); True if created."""
    try:
        client._call("GET", f"/pools/{BENCHMARK}")
        return False
    except AirflowError as exc:
        if " 404 " not in str(exc):
            raise
    client._call("POST", "/pools", json={"name": BENCHMARK, "slots": SLOTS, "description": DESCRIPTION})
    return True
