"""The registry's data is typed end to end: a release's facts are a `ReleaseData` of nested records,
none holding an untyped (`Any`) field, and mypy, configured as the project runs it, refuses a
string-key read of them (`rel.data["chosen"]`) where the typed read (`rel.data.chosen`) passes."""

from __future__ import annotations

import subprocess
import sys
import types
import typing
from typing import Any

import typing_extensions
from pydantic import BaseModel

from pipeline.core.paths import PROJECT_ROOT
from pipeline.release.registry import Release


def _untyped(hint: Any, seen: set[type], where: str) -> list[str]:
    """Where `hint` holds `Any`, following records' fields, containers and unions (JSON is typed)."""
    if hint is Any:
        return [where]
    if isinstance(hint, typing_extensions.TypeAliasType):  # pydantic's JsonValue: JSON, recursive, no Any
        return []
    if isinstance(hint, type) and issubclass(hint, BaseModel):
        if hint in seen:
            return []
        seen.add(hint)
        return [
            found
            for name, field in hint.model_fields.items()
            for found in _untyped(field.annotation, seen, f"{hint.__name__}.{name}")
        ]
    return [found for arg in typing.get_args(hint) for found in _untyped(arg, seen, where)]


def test_no_record_of_a_release_holds_an_untyped_field():
    assert _untyped(Release, set(), "Release") == []
    # the walk finds one where there is one
    bad = types.new_class(
        "Bad", (BaseModel,), exec_body=lambda ns: ns.update({"__annotations__": {"x": dict[str, Any]}})
    )
    assert _untyped(bad, set(), "Bad") == ["Bad.x"]


def test_mypy_refuses_a_string_key_read_of_release_data(tmp_path):
    module = tmp_path / "reads_release_data.py"
    module.write_text(
        "from pipeline.release.registry import Registry\n"
        "\n"
        "\n"
        "def layouts(reg: Registry) -> list[object]:\n"
        "    rel = reg.get(1)\n"
        "    typed = rel.data.chosen.layout if rel.data.chosen else None\n"
        '    by_key = rel.data["chosen"]\n'
        '    by_get = rel.data.get("layout")\n'
        "    return [typed, by_key, by_get]\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(PROJECT_ROOT / "pyproject.toml"), str(module)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert [line.split(":")[1] for line in errors] == ["7", "8"], out
    assert '"ReleaseData" is not indexable' in errors[0], out
    assert '"ReleaseData" has no attribute "get"' in errors[1], out
