"""Reading a spec: YAML, then types (pydantic), then feasibility on its hardware profile, so a bad
spec fails in seconds with every problem as one line, `file: dotted.field: what is wrong`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from pipeline.core.errors import SpecError
from pipeline.core.paths import CONFIGS_DIR
from pipeline.core.specs.feasibility import feasibility_problems, generated_layouts
from pipeline.core.specs.hardware import HardwareProfile
from pipeline.core.specs.release import LoadedSpec, ReleaseSpec


def _format_loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError([f"{path}: file not found"]) from None
    return _parse_yaml(text, path)


def _parse_yaml(text: str, path: Path) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "?"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError([f"{path}: {where}: YAML syntax error: {problem}"]) from None


def _validate(model: type[BaseModel], data: Any, path: Path) -> Any:
    if not isinstance(data, dict):
        raise SpecError([f"{path}: (top level): expected a mapping, got {type(data).__name__}"])
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field (typo?)"
            problems.append(f"{path}: {_format_loc(err['loc'])}: {msg}")
        raise SpecError(problems) from None


def hardware_path(name: str, spec_path: Path) -> Path:
    """A profile next to the spec's configs tree wins over the project's own."""
    local = spec_path.resolve().parent.parent / "hardware" / f"{name}.yaml"
    return local if local.exists() else CONFIGS_DIR / "hardware" / f"{name}.yaml"


def load_hardware(name: str, spec_path: Path) -> HardwareProfile:
    path = hardware_path(name, spec_path)
    if not path.exists():
        known = sorted(p.stem for p in (CONFIGS_DIR / "hardware").glob("*.yaml"))
        raise SpecError([f"{spec_path}: hardware: unknown profile {name!r} (known: {', '.join(known)})"])
    return _validate(HardwareProfile, _read_yaml(path), path)


def load_spec(path: str | Path) -> LoadedSpec:
    """Load, type-check and feasibility-check a release spec; raise SpecError listing every problem."""
    path = Path(path)
    spec = _validate(ReleaseSpec, _read_yaml(path), path)
    hardware = load_hardware(spec.hardware, path)
    problems: list[str] = []
    local = local_source(spec.model.source, path.parent)
    if local is not None and not (local / "config.json").is_file():
        what = "not a model directory (no config.json)" if local.is_dir() else "no such directory"
        problems.append(f"{path}: model.source: {local}: {what}")
    return _checked(path, spec, hardware, hardware_path(spec.hardware, path), problems)


def load_recorded(
    spec_path: str, spec_yaml: str, hw_path: str | None, hardware_yaml: str | None, model_source: str | None
) -> LoadedSpec:
    """A spec from the texts a release recorded (pipeline/release/registry.py), with the hardware
    profile and the resolved model source it was built with: no file is read or written, so a spec
    or profile edited, moved or deleted since changes nothing. A release that recorded no profile
    (opened before they were kept) reads the one on disk now; its source stays as written."""
    path = Path(spec_path)
    spec = _validate(ReleaseSpec, _parse_yaml(spec_yaml, path), path)
    if model_source is not None:
        spec.model.source = model_source
    if hw_path is None or hardware_yaml is None:
        return _checked(path, spec, load_hardware(spec.hardware, path), hardware_path(spec.hardware, path), [])
    hardware = _validate(HardwareProfile, _parse_yaml(hardware_yaml, Path(hw_path)), Path(hw_path))
    return _checked(path, spec, hardware, Path(hw_path), [])


def resolved_source(loaded: LoadedSpec) -> str:
    """The model source as the release used it: a local directory as an absolute path (a relative
    one means nothing once the spec is read from the registry), a URI as written."""
    local = local_source(loaded.spec.model.source, loaded.path.parent)
    return str(local.resolve()) if local is not None else loaded.spec.model.source


def _checked(
    path: Path, spec: ReleaseSpec, hardware: HardwareProfile, hw_path: Path, problems: list[str]
) -> LoadedSpec:
    """Feasibility on that hardware, the defaults that depend on it and the generated layouts."""
    problems = [*(f"{path}: {field}: {msg}" for field, msg in feasibility_problems(spec, hardware)), *problems]
    floor = spec.slo.confirm_floor_seconds
    if spec.workload.confirm_seconds is not None and spec.workload.confirm_seconds < floor:
        problems.append(
            f"{path}: workload.confirm_seconds: {spec.workload.confirm_seconds:g} s is below the floor of "
            f"{floor:.1f} s the SLO sets (slo.max_p90_ttft_ms / (0.9 x slo.resolution): a queue growing at the "
            "resolution's overload takes that long to push the p90 TTFT past its limit); raise it or leave it out"
        )
    if spec.capacity is not None and hardware.price_per_server_hour is None:
        problems.append(
            f"{hw_path}: price_per_server_hour: missing, and {path.name} asks for a cost "
            "(capacity:); set the operator's price of one server-hour in USD"
        )
    if problems:
        raise SpecError(problems)
    if spec.evaluation.tensor_parallel_size is None:  # the weights fit where the widest layout fits them
        spec.evaluation.tensor_parallel_size = max(layout.tp for layout in spec.layouts)
    spec.layouts = [*spec.layouts, *generated_layouts(spec, hardware)]
    return LoadedSpec(path=path.resolve(), spec=spec, hardware=hardware)


def local_source(source: str, spec_dir: Path) -> Path | None:
    """A local model source as a path (relative ones from the spec's directory); None for a URI."""
    if "://" in source:
        return None
    path = Path(source).expanduser()
    return path if path.is_absolute() else spec_dir / path
