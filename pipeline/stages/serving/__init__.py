"""Serving a layout on this machine, in three parts:

- commands   the exact `vllm serve` command lines for a layout on a hardware profile (both modes)
- isolation  this host's side: core placement and pinning, the measurement's isolation of every
             other process (with its guardian), and the end of engine processes with their owner
- front      nginx in front of several replicas, its config and its access log's line
- engine     `LocalEngine`, which runs the commands with all of the above, and the serving copy

Callers use the package (`serving.LocalEngine`, `serving.placement`); the names below are the
modules' public ones.
"""

from __future__ import annotations

from pipeline.stages.serving.commands import (
    SERVE_PYTHON,
    SERVED_NAME,
    VLLM_CLI,
    EngineCommand,
    build_commands,
    cpu_engine_env,
    device_sets,
    engine_args,
    flag_list,
)
from pipeline.stages.serving.engine import (
    STOP_SIGNALS,
    LocalEngine,
    exit_error,
    free_port,
    healthy,
    load_split,
    serving_copy,
)
from pipeline.stages.serving.front import (
    ENGINE_KEEP_ALIVE_S,
    FRONT_LOG,
    engine_keep_alive_s,
    nginx_binary,
    write_nginx_conf,
)
from pipeline.stages.serving.isolation import (
    ENGINE_TITLES,
    GUARDIAN,
    WATCHDOG,
    Placement,
    alive_group,
    all_cores,
    die_with_parent,
    group_is_engine,
    group_members,
    isolated,
    pin,
    placement,
    project_cores,
    reap_orphans,
    registry_dir,
    stop_groups,
    watch,
)

__all__ = [
    "ENGINE_KEEP_ALIVE_S",
    "ENGINE_TITLES",
    "FRONT_LOG",
    "GUARDIAN",
    "SERVED_NAME",
    "SERVE_PYTHON",
    "STOP_SIGNALS",
    "VLLM_CLI",
    "WATCHDOG",
    "EngineCommand",
    "LocalEngine",
    "Placement",
    "alive_group",
    "all_cores",
    "build_commands",
    "cpu_engine_env",
    "device_sets",
    "die_with_parent",
    "engine_args",
    "engine_keep_alive_s",
    "exit_error",
    "flag_list",
    "free_port",
    "group_is_engine",
    "group_members",
    "healthy",
    "isolated",
    "load_split",
    "nginx_binary",
    "pin",
    "placement",
    "project_cores",
    "reap_orphans",
    "registry_dir",
    "serving_copy",
    "stop_groups",
    "watch",
    "write_nginx_conf",
]
