"""The one way the project writes HTML: Jinja templates with autoescape, so every value from a spec,
a registry, an engine log or an lm-eval task is text, never markup."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2

__all__ = ["environment"]


def environment(templates: Path, filters: dict[str, Callable[..., Any]] | None = None) -> jinja2.Environment:
    """An environment over one package's `templates/` folder: autoescaped, strict about missing values."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(templates),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(filters or {})
    return env
