"""Each production image runs what it is built for: its Dockerfile installs one extra of
pyproject.toml against its base's committed freeze, and every path the image runs (pod command
lines, init containers, DAG files, plugin, promotion's checks, the registry on Postgres) gets past
its imports in a clean virtualenv resolved the same way (scripts/setup.sh images).

No Docker engine here, so two stand-ins where a GPU build cannot install (scripts/setup.sh does the
substitution, tests/image_probe.py names what it skips):
- a base's ROCm torch pin (torch==2.9.0 in docker/base/rocm-vllm.txt) -> the CPU torch==2.13.0
  that pip takes from local disk;
- vLLM 0.11.2 for ROCm -> nothing: no build of it installs on this CPU machine, so the few `vllm`
  imports are listed as skipped in the probe's output (pods run `vllm serve` as a program).
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tomllib

import pytest

from pipeline.core.paths import PROJECT_ROOT
from tests import image_probe

DOCKER = PROJECT_ROOT / "docker"
VENVS = PROJECT_ROOT / ".venv-images"
DOCKERFILES = {"airflow": "airflow", "worker-rocm": "worker", "quantize": "quantize"}  # file -> probe's image


def _arg(text: str, name: str) -> str | None:
    found = re.search(rf"^ARG {name}=(\S+)$", text, re.M)
    return found.group(1) if found else None


def _stamp(base: str, extra: str) -> str:
    """scripts/setup.sh's stamp of an image venv: what decides its packages (pyproject.toml, the base
    file, the extra), so a comment in a Dockerfile rebuilds nothing."""
    data = (PROJECT_ROOT / "pyproject.toml").read_bytes() + (PROJECT_ROOT / base).read_bytes() + f"{extra}\n".encode()
    return hashlib.sha256(data).hexdigest()[:16]


def test_each_dockerfile_installs_one_extra_against_its_committed_base():
    extras = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in sorted(DOCKERFILES, key=lambda n: not (DOCKER / f"{n}.Dockerfile").is_file()):
        assert (DOCKER / f"{name}.Dockerfile").is_file(), f"docker/{name}.Dockerfile: missing"
        text = (DOCKER / f"{name}.Dockerfile").read_text()
        extra, base = _arg(text, "EXTRA"), _arg(text, "BASE_FREEZE")
        assert extra in extras, f"docker/{name}.Dockerfile: ARG EXTRA={extra} is no extra of pyproject.toml"
        assert base and (PROJECT_ROOT / base).is_file(), f"docker/{name}.Dockerfile: ARG BASE_FREEZE={base}: no file"
        installs = re.findall(r"pip install[^\n]*", text.replace("\\\n", " "))
        assert len(installs) == 1, f"docker/{name}.Dockerfile: one pip install, the extra's, got {installs}"
        assert '--constraint "${BASE_FREEZE}"' in installs[0] and "[${EXTRA}]" in installs[0]
        assert "--no-deps" not in text  # nothing installed beside the list that the list does not hold
        # the base is checked against the committed freeze before anything is installed on it
        assert text.index('docker/check-base.sh "${BASE_FREEZE}"') < text.index("pip install")
        image = re.search(r"^# image: (\S+)$", (PROJECT_ROOT / base).read_text(), re.M).group(1)
        assert image.split("@")[0] == _from_image(text), f"{base}: names {image}, the Dockerfile builds FROM another"
    assert sorted(p.name for p in DOCKER.glob("*.Dockerfile")) == sorted(f"{n}.Dockerfile" for n in DOCKERFILES)


def _from_image(text: str) -> str:
    ref = re.search(r"^FROM (\S+)$", text, re.M).group(1)
    while "${" in ref:  # an ARG's default may name another ARG
        ref = re.sub(r"\$\{(\w+)\}", lambda m: _arg(text, m.group(1)) or "?", ref)
    return ref


def test_check_base_refuses_a_stand_in_and_a_base_that_moved(tmp_path):
    script = DOCKER / "check-base.sh"
    stand_in = subprocess.run(["sh", script, DOCKER / "base" / "airflow.txt"], capture_output=True, text=True)
    assert stand_in.returncode == 1 and "a stand-in, not this base's freeze" in stand_in.stderr
    here = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout
    recorded = tmp_path / "base.txt"
    recorded.write_text("# image: example@sha256:0\n" + here)
    env = {"PATH": f"{PROJECT_ROOT / '.venv' / 'bin'}:/usr/bin:/bin"}  # python3 is this venv's: its packages
    assert subprocess.run(["sh", script, recorded], env=env, capture_output=True).returncode == 0
    recorded.write_text("# image: example@sha256:0\n" + here.replace("PyYAML==", "PyYAML==0.0.0.dev0+"))
    moved = subprocess.run(["sh", script, recorded], env=env, capture_output=True, text=True)
    assert moved.returncode == 1 and "this base's packages differ" in moved.stderr and "pyyaml" in moved.stderr


def test_the_probe_leaves_out_only_functions_that_exist_and_import_something():
    for name, image in image_probe.IMAGES.items():
        modules, _ = image_probe.walk(image)
        assert modules, name
        for scope in image.not_here:
            module, _, func = scope.partition(":")
            scopes = image_probe._scopes(module)
            assert scope in scopes, f"{name}: not_here names {scope}, which does not exist"
            assert func == "" or scopes[scope], f"{name}: not_here names {scope}, which imports nothing"


@pytest.mark.parametrize("dockerfile", sorted(DOCKERFILES))
def test_image_runs_every_path_up_to_its_first_io(dockerfile):
    text = (DOCKER / f"{dockerfile}.Dockerfile").read_text() if (DOCKER / f"{dockerfile}.Dockerfile").is_file() else ""
    if not (_arg(text, "EXTRA") and _arg(text, "BASE_FREEZE")):
        pytest.fail(
            f"docker/{dockerfile}.Dockerfile: no ARG EXTRA and BASE_FREEZE: it installs no extra of pyproject.toml"
        )
    venv = VENVS / dockerfile
    want = _stamp(_arg(text, "BASE_FREEZE"), _arg(text, "EXTRA"))
    stamp = venv / ".setup-stamp"
    if not stamp.is_file() or stamp.read_text().strip() != want:
        pytest.fail(f"{venv} is missing or stale: run scripts/setup.sh images (make test does)")
    out = subprocess.run(
        [venv / "bin" / "python", PROJECT_ROOT / "tests" / "image_probe.py", DOCKERFILES[dockerfile]],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg", "HOME": str(venv)},
    )
    start = out.stdout.find("{\n")
    assert start >= 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout[start:])
    assert result["failed"] == [], "\n".join(result["failed"])
    assert out.returncode == 0
    assert result["modules"] > 20 and result["sites"] > 200  # the walk reached the code, not just the CLI
