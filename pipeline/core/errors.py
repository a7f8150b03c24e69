"""Errors a user can fix. Anything else is a bug and keeps its traceback."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ReleaseError(Exception):
    """A problem the user can act on; its message is one line naming the file, field or object."""


class SpecError(ReleaseError):
    """A release spec (or a file it refers to) is invalid; carries one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class ArtifactError(ReleaseError):
    """An artifact on disk or in storage is missing, incomplete or does not match its manifest."""


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


class MeasurementError(ReleaseError):
    """A results record that would not say which code measured it (a dirty tree whose diff could not be taken)."""


class LeaseLost(ReleaseError):
    """This controller no longer holds the model's lock (its Lease was taken over or lapsed): it makes
    no further write, undoes nothing (the new holder owns the model now) and stops."""
