"""The tree's shape, read from the source (AST, nothing imported or run; well under a second):
benchmarks/ shares stand-ins with the tests through `testkit/`, never by importing `tests`; the
product package imports neither; and the package has one error tree, in one module, each name defined once."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ERRORS = "pipeline/core/errors.py"
# exceptions outside the ReleaseError tree: control flow, caught in the function that raised them
CONTROL_FLOW = {"StreamCancelled": "fp8_stream: stops the other workers, dropped from the errors in the same function"}


def imported_roots(path: Path) -> set[str]:
    """The top-level package of every import in a file, those inside functions included."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def offenders(folder: str, forbidden: set[str]) -> list[str]:
    return sorted(
        f"{path.relative_to(ROOT)} imports {', '.join(sorted(imported_roots(path) & forbidden))}"
        for path in (ROOT / folder).rglob("*.py")
        if imported_roots(path) & forbidden
    )


def test_benchmarks_never_import_the_tests():
    assert offenders("benchmarks", {"tests"}) == [], "share it through testkit/ instead"


def test_the_package_imports_neither_tests_nor_testkit():
    assert offenders("pipeline", {"tests", "testkit"}) == []


def test_the_detection_sees_an_import_inside_a_function(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("def main():\n    from tests.test_benchmark import mm1_run\n    import testkit.simserver\n")
    assert imported_roots(script) == {"tests", "testkit"}


def exception_classes() -> dict[str, list[tuple[str, list[str]]]]:
    """Every class in pipeline/ that subclasses an exception, transitively: name -> [(file, bases)]."""
    classes: dict[str, list[tuple[str, list[str]]]] = {}
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
                classes.setdefault(node.name, []).append((str(path.relative_to(ROOT)), bases))
    roots = {"Exception", "BaseException", "RuntimeError", "ValueError", "OSError", "KeyError", "TimeoutError"}

    def is_exception(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in roots:
            return True
        if name in seen or name not in classes:
            return False
        return any(is_exception(b, seen | {name}) for _, bases in classes[name] for b in bases)

    return {name: defs for name, defs in classes.items() if name not in roots and is_exception(name)}


def test_one_error_tree_with_each_name_defined_once():
    found = exception_classes()
    assert "ReleaseError" in found and "EngineStopped" in found  # the walk sees the tree, a grandchild included
    twice = {name: [f for f, _ in defs] for name, defs in found.items() if len(defs) > 1}
    assert twice == {}, "an exception class name defined in more than one place"

    def under_release_error(name: str) -> bool:
        return name == "ReleaseError" or any(under_release_error(b) for b in found.get(name, [("", [])])[0][1])

    outside = sorted(name for name in found if not under_release_error(name) and name not in CONTROL_FLOW)
    assert outside == [], "errors a caller may see derive from core.errors.ReleaseError"


def test_every_exception_class_is_defined_in_the_errors_module():
    """One module holds the whole tree (its docstring draws it), so a reader finds every error in one
    place and any layer can import it: `pipeline.core` is the ground floor."""
    elsewhere = {name: file for name, defs in exception_classes().items() for file, _ in defs if file != ERRORS}
    assert elsewhere == {}, f"define these in {ERRORS} and import them from there"


def test_the_errors_docstring_names_every_exception_in_the_module():
    """The tree in the docstring is the map a reader trusts: a class missing from it is a stale map."""
    tree = ast.parse((ROOT / ERRORS).read_text())
    doc = ast.get_docstring(tree) or ""
    drawn = {m[1] for m in re.finditer(r"^\s*[*+-] (\w+)", doc, re.M)}
    defined = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert defined - drawn == set() and drawn - defined == set()


def test_every_class_name_in_the_package_is_defined_once():
    """A record, protocol or error of one name in two modules is one too many for a reader (and for
    `farm-studio walk`): `Prediction` and `Verdict` each had a Protocol twin until 2026-12-06."""
    where: dict[str, list[str]] = {}
    for path in sorted((ROOT / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    assert {name: files for name, files in where.items() if len(files) > 1} == {}
