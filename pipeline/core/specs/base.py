"""What every section of the spec shares: unknown keys are errors, and durations are written `90s`, `45m`, `2h`."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from pipeline.core.errors import ReleaseError

DURATION_PATTERN = re.compile(r"^(\d+)([smhd])$")


class Strict(BaseModel):
    """Unknown keys are errors: a typo in a spec must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid")


def duration_seconds(text: str) -> int:
    match = DURATION_PATTERN.match(text)
    if match is None:
        raise ReleaseError(f"{text!r}: not a duration like 90s, 45m, 2h")
    number, unit = match.groups()
    return int(number) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
