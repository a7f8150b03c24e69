"""Run, inside one image's virtualenv, every path that image runs up to its first I/O.

    <image venv>/bin/python tests/image_probe.py airflow|worker|quantize     (from the repository root)

Stdlib and `pipeline` only: it runs in the clean environment that tests/test_images.py and
scripts/setup.sh build from the image's extras and its base's freeze. What "every path" means:
from each image's entry points (the pod command lines its Dockerfile serves, the init containers,
the DAG files and the plugin), follow every import statement, module-level and inside functions,
through `pipeline`; then import each module reached and execute each import statement found in a
reached function. A module's functions are all followed once the module is reached (no call
graph: an over-approximation), except in the CLI's modules, whose handlers are entry points named
per image; a function this image never runs is left out only by name, with the reason, in
`NOT_HERE`. Then the checks that need more than an import: promote's manifest validation,
the served-answers check's lm-eval model, the registry's Postgres driver, the DAG bag, the plugin.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ImagePaths:
    """What one image runs: entry scopes ("module:function", or "module" for a whole file)."""

    entries: tuple[str, ...]
    # "module:function" -> why this image never runs it (another image's pod does)
    not_here: dict[str, str] = field(default_factory=dict)
    # top-level package -> why the clean venv cannot hold it (a GPU build); its imports are skipped
    absent: dict[str, str] = field(default_factory=dict)
    checks: tuple[str, ...] = ()


_POD_COMMANDS = (
    # pods.cli_args: evaluate --side, stage, fetch, benchmark, remeasure; manifests' init containers:
    # fetch (S3 copy) and verify-staged (S3 streaming)
    "pipeline.cli.measure:_evaluate",
    "pipeline.cli.measure:_benchmark",
    "pipeline.cli.measure:_remeasure",
    "pipeline.cli.artifacts:_stage",
    "pipeline.cli.artifacts:_fetch",
    "pipeline.cli.artifacts:_verify_staged",
)
_QUANTIZE_ONLY = "quantize runs in the quantize image's pod (docker/quantize.Dockerfile), never in this one"
_LOCAL_ONLY = "a heavy stage of the local DAG; in production it runs in a pod (worker or quantize image)"
_VLLM = "vLLM for ROCm (the base image's own build) cannot install here; no CPU build of 0.11.2 stands in"

IMAGES: dict[str, ImagePaths] = {
    "worker": ImagePaths(
        entries=("pipeline.cli", *_POD_COMMANDS),
        not_here={
            # flow.quantize/flow.stage reach the quantizer; pods pass --artifact to stage, and
            # pods.image_for sends the quantize step to the quantize image
            "pipeline.stages.quantize:run_method": _QUANTIZE_ONLY,
            "pipeline.stages.fp8_stream:convert": _QUANTIZE_ONLY,
            "pipeline.stages.fp8_stream:_build_config": _QUANTIZE_ONLY,
            "pipeline.stages.fp8_stream:_plan_shard": _QUANTIZE_ONLY,
            "pipeline.stages.fp8_stream:_stamp_formats": _QUANTIZE_ONLY,
            "pipeline.entry.airflow_platform:AirflowPlatform.notify": "alerts go out from the Airflow tasks "
            "(rebenchmark's judge), never from a pod",
        },
        absent={"vllm": _VLLM},
        checks=("registry_postgres",),
    ),
    "quantize": ImagePaths(
        entries=("pipeline.cli", "pipeline.cli.model:_quantize"),
        checks=(),
    ),
    "airflow": ImagePaths(
        entries=(
            "dags.model_release",
            "dags.model_release_k8s",
            "dags.rebenchmark",
            "dags.rollback",
            "plugins.model_releases",
        ),
        not_here={
            # the heavy stages of the local DAG (model_release, `execution: local`); a production spec
            # runs them as pods of model_release_k8s, in the worker and quantize images
            "pipeline.stages.quantize:run_method": _LOCAL_ONLY,
            "pipeline.stages.quantize:_llmcompressor_logs_to_stderr": _LOCAL_ONLY,
            "pipeline.stages.quantize:numeric_check": _LOCAL_ONLY,
            "pipeline.stages.quantize:verify_fp8": _LOCAL_ONLY,
            "pipeline.stages.fp8_stream": _LOCAL_ONLY,
            "pipeline.stages.dequant": _LOCAL_ONLY,
            "pipeline.stages.tiny_model": _LOCAL_ONLY,
        },
        checks=("registry_postgres", "manifest_validation", "served_answers", "dag_bag", "plugin"),
    ),
}


# ---------------------------------------------------------------- the static walk


@dataclass(frozen=True)
class Site:
    scope: str  # "module" or "module:function"
    line: int
    module: str  # what is imported
    name: str | None  # `from module import name`
    optional: bool = False  # inside a `try` that handles ImportError: the code runs without it


def _path_of(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _ours(module: str) -> bool:
    return module.split(".")[0] in ("pipeline", "dags", "plugins") and _path_of(module) is not None


def _handles_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    caught = ("ImportError", "ModuleNotFoundError", "Exception", "BaseException")
    return any(isinstance(n, ast.Name) and n.id in caught for n in names)


def _scopes(module: str) -> dict[str, list[Site]]:
    """Each scope of a module ("module", "module:func", "module:Class.method") and its imports."""
    path = _path_of(module)
    assert path is not None, module
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: dict[str, list[Site]] = {module: []}

    def visit(node: ast.AST, scope: str, prefix: str, optional: bool = False) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = f"{module}:{prefix}{child.name}"
                out.setdefault(inner, [])
                visit(child, inner, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, scope, f"{prefix}{child.name}.", optional)  # class bodies run at import
            elif isinstance(child, ast.Try) and any(_handles_import_error(h) for h in child.handlers):
                for stmt in child.body:
                    visit(ast.Module(body=[stmt], type_ignores=[]), scope, prefix, True)
                for rest in (*child.handlers, *child.orelse, *child.finalbody):
                    visit(rest if isinstance(rest, ast.AST) else rest, scope, prefix, optional)
            elif isinstance(child, ast.Import):
                out[scope] += [Site(scope, child.lineno, a.name, None, optional) for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                if base == "__future__":
                    continue
                out[scope] += [Site(scope, child.lineno, base, a.name, optional) for a in child.names]
            else:
                visit(child, scope, prefix, optional)

    visit(tree, module, "")
    return out


def walk(image: ImagePaths) -> tuple[list[str], list[Site]]:
    """Modules reached and the import sites to execute, from the image's entry points."""
    scopes_of: dict[str, dict[str, list[Site]]] = {}
    seen: set[str] = set()
    todo = list(image.entries)
    modules: list[str] = []
    sites: list[Site] = []
    while todo:
        scope = todo.pop()
        if scope in seen or scope in image.not_here or scope.split(":")[0] in image.not_here:
            continue
        seen.add(scope)
        module = scope.split(":")[0]
        if module not in scopes_of:
            scopes_of[module] = _scopes(module)
            modules.append(module)
            todo.append(module)
            if not module.startswith("pipeline.cli"):  # a CLI module's handlers are entry points
                todo += [s for s in scopes_of[module] if ":" in s]
            parent = module.rpartition(".")[0]
            if parent and _path_of(parent):
                todo.append(parent)  # a package's __init__ runs before its modules
        if scope not in scopes_of[module]:
            raise SystemExit(f"tests/image_probe.py: no scope {scope!r} (renamed? update IMAGES)")
        for site in scopes_of[module][scope]:
            sites.append(site)
            for target in (site.module, f"{site.module}.{site.name}" if site.name else None):
                if target and _ours(target):
                    todo.append(target)
    return modules, sites


# ---------------------------------------------------------------- running it


def _what(site: Site) -> str:
    return f"from {site.module} import {site.name}" if site.name else f"import {site.module}"


def _run_site(site: Site) -> None:
    mod = importlib.import_module(site.module)
    if site.name and site.name != "*" and not hasattr(mod, site.name):
        importlib.import_module(f"{site.module}.{site.name}")


def _check_registry_postgres() -> None:
    from sqlalchemy import create_engine

    from pipeline.release.registry import with_driver

    # the URL as an Airflow Connection writes it, through the registry's own driver choice; the
    # driver loads when the engine is made, nothing connects until the first query
    engine = create_engine(with_driver("postgres://user:secret@127.0.0.1:1/model_release"))
    assert engine.dialect.dbapi is not None


def _check_manifest_validation() -> None:
    from pipeline.core.specs import load_spec
    from pipeline.k8s import manifests

    loaded = load_spec(ROOT / "configs" / "releases" / "qwen3-235b-a22b-fp8-mi325x.yaml")
    artifact = manifests.Artifact(s3_uri=None, nfs_path=None, manifest_hash="0" * 64)
    staging = loaded.spec.staging
    if staging.s3 is not None:
        artifact = manifests.Artifact(s3_uri=f"s3://{staging.s3.bucket}/a", nfs_path=None, manifest_hash="0" * 64)
    elif staging.nfs is not None:
        artifact = manifests.Artifact(s3_uri=None, nfs_path=f"{staging.nfs.path}/a", manifest_hash="0" * 64)
    objs = manifests.render(loaded, loaded.spec.layouts[0].name, "1", artifact, manifests.RenderOptions(servers=2))
    problems = manifests.validate(objs)
    assert not problems, problems


def _check_served_answers() -> None:
    from lm_eval.api.registry import get_model

    get_model("local-completions")  # the class promote's served-answers check builds (stages/evaluate.run_task)


def _check_dag_bag() -> None:
    import tempfile

    home = tempfile.mkdtemp()
    os.environ.update(
        AIRFLOW_HOME=home,
        AIRFLOW__CORE__DAGS_FOLDER=str(ROOT / "dags"),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__UNIT_TEST_MODE="True",
        MODEL_RELEASE_HOME=home,
    )
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(ROOT / "dags"))
    assert not bag.import_errors, bag.import_errors
    assert bag.dag_ids, "no DAGs"


def _check_plugin() -> None:
    sys.path.insert(0, str(ROOT / "plugins"))
    plugin = importlib.import_module("model_releases")
    assert any(isinstance(v, type) and v.__name__.endswith("Plugin") for v in vars(plugin).values())


CHECKS = {
    "registry_postgres": _check_registry_postgres,
    "manifest_validation": _check_manifest_validation,
    "served_answers": _check_served_answers,
    "dag_bag": _check_dag_bag,
    "plugin": _check_plugin,
}


def main(name: str) -> int:
    image = IMAGES[name]
    sys.path.insert(0, str(ROOT))
    modules, sites = walk(image)
    failed: list[str] = []
    skipped: set[str] = set()
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - each failure is reported, with its module
            failed.append(f"import {module}: {type(exc).__name__}: {exc}")
    for site in sites:
        if site.module.split(".")[0] in image.absent:
            skipped.add(f"{site.scope}:{site.line} {site.module}")
            continue
        try:
            _run_site(site)
        except ImportError as exc:
            if not site.optional:
                failed.append(f"{site.scope}:{site.line}: {_what(site)}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001
            failed.append(f"{site.scope}:{site.line}: {_what(site)}: {type(exc).__name__}: {exc}")
    for check in image.checks:
        try:
            CHECKS[check]()
        except Exception as exc:  # noqa: BLE001
            failed.append(f"check {check}: {type(exc).__name__}: {str(exc)[:300]}")
    print(
        json.dumps(
            {"image": name, "modules": len(modules), "sites": len(sites), "skipped": sorted(skipped), "failed": failed},
            indent=1,
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
