"""Every exception the package raises, in one module, so a reader sees the whole tree at once.

An error a user can fix derives from `ReleaseError`: its message is one line naming the file, field
or object, and the CLI prints it without a traceback. Anything else is a bug and keeps its traceback.
The module that raises each one is named after it.

The tree:

* ReleaseError
  + SpecError              - the spec or a file it names is invalid (core.specs)
  + ArtifactError          - an artifact is missing or does not match its manifest (core, stages)
  + MeasurementError       - a results record could not say which code measured it (core.measurements)
  + EngineFailed           - an engine did not come up or died (stages.serving)
    - EngineStopped        - it was stopped from outside: cancelled, not failed
  + MeasurementCancelled   - a re-benchmark's engine was stopped from outside (release.rebenchmark)
  + KubernetesError        - the API server answered with an error status (k8s)
  + ClusterUnreachable     - the API server did not answer (k8s)
  + PreflightFailed        - the cluster lacks something the release needs (k8s.preflight)
  + LeaseHeld              - another controller holds the model's lock (k8s.lease)
  + LeaseLost              - this controller lost the model's lock mid-rollout (k8s.lease)
  + PrometheusError        - a rollout step's query failed (release.analysis)
  + NotMigrated            - the registry's schema is behind this code (release.migrations)
  + UnknownRelease         - no release of that id in the registry (release.registry)
  + PromotionRefused       - a gate or the approval is missing; nothing deployed (release.promote)
  + DeployFailed           - the rollout failed and was undone (release.promote)
  + LocalDeployFailed      - the local target could not serve a release (release.local_target, _engines, _front)
  + RolloutAborted         - a step failed its check; traffic went back (release)
  + RolloutFailed          - a rollout could not go on; undone like an abort (release, k8s)
  + SmokeFailed            - the new servers did not answer a smoke completion (k8s.deploy)
  + AnswersWorse           - the new release's served answers failed a step's check (k8s, release)
  + GateFailed             - the accuracy or SLO gate said no (entry.flow)
  + AirflowError           - Airflow's REST API refused or did not answer (airflow.rest)
* StreamCancelled          - control flow inside stages.fp8_stream: never leaves it

`pipeline.core` is the lowest layer, so every layer may import from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ReleaseError(Exception):
    """A problem the user can act on; its message is one line naming the file, field or object."""


# ---------------------------------------------------------------- spec, artifacts, measurements


class SpecError(ReleaseError):
    """A release spec (or a file it refers to) is invalid; carries one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class ArtifactError(ReleaseError):
    """An artifact on disk or in storage is missing, incomplete or does not match its manifest."""


class MeasurementError(ReleaseError):
    """A results record that would not say which code measured it (a dirty tree whose diff could not be taken)."""


# ---------------------------------------------------------------- engines


class EngineFailed(ReleaseError):
    """The engine did not come up (bad flag, OOM, crash); carries the last log lines."""


class EngineStopped(EngineFailed):
    """An engine process was asked to stop from outside (SIGTERM or SIGINT: a shutdown, a cancelled
    task): the measurement was cancelled, which is not evidence that anything is broken. SIGKILL is
    not among them: the OOM killer sends it."""


class MeasurementCancelled(ReleaseError):
    """The re-benchmark's engine was stopped from outside: record a cancellation, alert nobody."""


class StreamCancelled(Exception):
    """Control flow, not an error: one FP8 stream worker failed, so the others stop at their next
    chunk; the function that started them drops these and raises the real error."""


# ---------------------------------------------------------------- Kubernetes


class KubernetesError(ReleaseError):
    """The API server answered with an error status."""

    def __init__(self, message: str, status: int):
        self.status = status
        super().__init__(message)


class ClusterUnreachable(ReleaseError):
    """No answer from the API server (refused, timed out, TLS): nothing was changed."""


class PreflightFailed(ReleaseError):
    """The cluster lacks something the release needs; the message has one line per missing piece."""


class LeaseHeld(ReleaseError):
    """Another controller holds the model's Lease (named in the message)."""

    def __init__(self, message: str, holder: str):
        self.holder = holder
        super().__init__(message)


class LeaseLost(ReleaseError):
    """This controller no longer holds the model's lock (its Lease was taken over or lapsed): it makes
    no further write, undoes nothing (the new holder owns the model now) and stops."""


# ---------------------------------------------------------------- registry and promotion


class PrometheusError(ReleaseError):
    """A Prometheus query of a rollout step did not answer, was refused, or did not return one series."""


class NotMigrated(ReleaseError):
    """The registry's schema is behind this code and the URL's role may not change it."""


class UnknownRelease(ReleaseError):
    """No release of that id in the registry."""


class PromotionRefused(ReleaseError):
    """A gate or the approval is missing; nothing was deployed."""


class DeployFailed(ReleaseError):
    """The rollout failed; the previous release (if any) was restored."""


class LocalDeployFailed(ReleaseError):
    """The local target could not serve a release (a smoke completion, the front's config, a replica
    that died); the message says which."""


class RolloutAborted(ReleaseError):
    """A rollout step failed (its analysis, its served answers, a reviewer's Abort) and traffic went
    back to the live release, on either target; `steps` holds the step analyses up to the failed one."""

    def __init__(self, message: str, steps: Sequence[Any] = ()):
        super().__init__(message)
        self.steps = list(steps)


class RolloutFailed(ReleaseError):
    """A rollout could not go on (no room in the spare budget, a server that never became Ready, a
    route it could not set); the controller undoes it like an abort."""


class SmokeFailed(ReleaseError):
    """The new release's servers did not answer a smoke completion before taking any traffic."""


class AnswersWorse(ReleaseError):
    """The new release's served answers failed a step's accuracy check before it took that step's
    share: traffic goes back to the live release at once."""


# ---------------------------------------------------------------- gates and Airflow


class GateFailed(ReleaseError):
    """A gate said no; the message carries the per-task table so the task log shows why."""


class AirflowError(ReleaseError):
    """Airflow's REST API refused a request or did not answer (login, a call, a run that never finished)."""
