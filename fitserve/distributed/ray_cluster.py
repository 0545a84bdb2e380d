"""The Ray cluster that --distributed-executor-backend ray places ranks on (worker/ray_ranks.py).

Ray is optional (`pip install "fitserve[ray]"`): it is imported here, only when the backend is ray. The
engine joins the cluster that `ray start` runs (RAY_ADDRESS, or the latest one started on this host), as
vLLM does, else it starts a local one, and logs which.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import ModuleType

logger = logging.getLogger("fitserve")

INSTALL_FIX = 'pip install "fitserve[ray]" (or pip install ray)'


def import_ray() -> ModuleType:
    """Ray's module, or a clear error naming the fix when it is not installed."""
    try:
        import ray
    except ImportError:
        raise RuntimeError(
            f"--distributed-executor-backend ray needs Ray, which is not installed: {INSTALL_FIX}, or drop "
            "the flag to run the ranks as processes of this host"
        ) from None
    return ray


def ray_installed() -> bool:
    try:
        import_ray()
    except RuntimeError:
        return False
    return True


def connect_ray() -> ModuleType:
    """Joins the running cluster (`ray start`, or RAY_ADDRESS), else starts a local one; a process that
    already joined one (ray.init before the engine) keeps it. This process's SIGTERM handler is kept: the
    server's own shutdown must still run."""
    ray = import_ray()
    if ray.is_initialized():
        logger.info("Ray: using the cluster this process joined (%s)", _describe(ray))
        return ray
    on_main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if on_main_thread else None
    try:
        try:
            ray.init(address="auto")
            logger.info("Ray: joined the running cluster (%s)", _describe(ray))
        except ConnectionError:
            ray.init()
            logger.info("Ray: no cluster running, started a local one (%s)", _describe(ray))
    finally:
        if on_main_thread and sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)
    return ray


def _describe(ray: ModuleType) -> str:
    resources = ray.cluster_resources()
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    return f"{nodes} node(s), {resources.get('CPU', 0):g} CPUs, {resources.get('GPU', 0):g} GPUs"


def cluster_gpus(ray: ModuleType) -> int:
    """GPUs the cluster has in all (free or not)."""
    return int(ray.cluster_resources().get("GPU", 0))
