"""`platform` and `preflight`: what a cluster needs once, and whether it has it before a release."""

from __future__ import annotations

import argparse

from pipeline.cli.common import emit


def _platform(args: argparse.Namespace) -> int:
    from pipeline.core.errors import ReleaseError
    from pipeline.k8s import install

    loaded = _kubernetes_spec(args.spec)
    options = install.PlatformOptions(
        nfs_server=args.nfs_server,
        nfs_path=args.nfs_path,
        gateway_class=args.gateway_class,
        gateway_network=args.gateway_network,
        worker_account=args.worker_account,
    )
    objs = install.render(loaded, options)
    problems = install.validate(objs)
    if problems:
        raise ReleaseError("rendered platform install fails schema validation:\n" + "\n".join(problems))
    emit(install.to_yaml(loaded, objs, options))
    return 0


def _kubernetes_spec(path: str):
    """The spec, refused in one line where it promotes to no cluster (nothing to check or install)."""
    from pipeline.core.errors import SpecError
    from pipeline.core.specs import load_spec

    loaded = load_spec(path)
    if loaded.spec.promotion.target != "kubernetes":
        raise SpecError(
            [
                f"{loaded.path}: promotion.target is {loaded.spec.promotion.target!r}: the cluster's install and "
                "preflight are for a spec that promotes to Kubernetes"
            ]
        )
    return loaded


def _preflight(args: argparse.Namespace) -> int:
    from pipeline.core import platform
    from pipeline.k8s import preflight
    from pipeline.k8s.pods import ClusterSettings

    loaded = _kubernetes_spec(args.spec)
    api = preflight.connect(loaded, use_kubeconfig=args.kubeconfig)

    def connection(conn_id: str) -> bool | None:
        # from a shell Airflow's own connections may not be readable: an absent one is unknown, not missing
        return True if platform.current().connection(conn_id) is not None else None

    outcome = preflight.preflight(loaded, api, ClusterSettings.from_env(), args.worker_account, connection)
    passed = preflight.require(outcome)
    emit(f"preflight passed ({len(passed)} checks): {', '.join(passed)}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """This group's sub-commands, their options and handlers."""
    p = sub.add_parser(
        "platform",
        help="render (and schema-validate) the once-per-cluster install for a spec: namespaces, RBAC for the "
        "Airflow workers, the Gateway, the NFS volumes, the PodMonitor; pipe it to `kubectl apply -f -`",
    )
    p.add_argument("spec")
    p.add_argument("--nfs-server", required=True, help="the NFS share's host (DigitalOcean Network File Storage)")
    p.add_argument("--nfs-path", required=True, help="the share's export path")
    p.add_argument("--gateway-class", default="cilium", help="GatewayClass of the Gateway (default: DOKS's Cilium)")
    p.add_argument(
        "--gateway-network",
        choices=["internal", "external"],
        default="internal",
        help="the Gateway's load balancer: internal (VPC only, default) or external (put authentication in front)",
    )
    p.add_argument("--worker-account", default="airflow-worker", help="the Airflow workers' ServiceAccount")
    p.set_defaults(func=_platform)

    p = sub.add_parser(
        "preflight",
        help="check the cluster holds what a release of the spec needs before any pod starts; one line per "
        "missing piece, exit 1",
    )
    p.add_argument("spec")
    p.add_argument(
        "--kubeconfig",
        action="store_true",
        help="use KUBECONFIG (or in-cluster config) instead of the spec's Airflow connection",
    )
    p.add_argument("--worker-account", default="airflow-worker", help="the Airflow workers' ServiceAccount")
    p.set_defaults(func=_preflight)
