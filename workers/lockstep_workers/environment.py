"""The environment variables the operator sets on the worker pods (operator/lockstep/desired.py): their names,
spelled once for the worker side."""

from __future__ import annotations

CONFIG = "LOCKSTEP_CONFIG"
"""The job's effective configuration (a JSON file from the job's ConfigMap)."""
WEIGHT_SYNC = "LOCKSTEP_WEIGHT_SYNC"
"""spec.weightSync.backend: filesystem, nccl or gloo."""
SHARED_DIR = "LOCKSTEP_SHARED_DIR"
"""The job's own directory on the shared volume (<mount>/<job uid>); every pod with the filesystem backend, and
the trainer with a collective one."""
WEIGHTS_HOST = "LOCKSTEP_WEIGHTS_HOST"
"""Collective backends: the name of trainer rank 0, which serves the manifests and sends the weights."""
WEIGHTS_PORT = "LOCKSTEP_WEIGHTS_PORT"
"""Collective backends: the port of trainer rank 0's manifest server."""
WEIGHTS_GROUP_PORT = "LOCKSTEP_WEIGHTS_GROUP_PORT"
"""Collective backends: the rendezvous port of each barrier's transfer group."""
ACTORS_SERVICE = "LOCKSTEP_ACTORS_SERVICE"
"""The trainer: the name of the job's actor Service, whose EndpointSlices list the actors."""
ACTORS_URL = "LOCKSTEP_ACTORS_URL"
"""The trainer, outside a cluster (the operator does not set it): the actors' URLs, comma-separated."""
METRICS_PORT = "LOCKSTEP_METRICS_PORT"
"""The trainer: where rank 0 serves Prometheus metrics (0: nowhere)."""
POD_NAME = "POD_NAME"
POD_NAMESPACE = "POD_NAMESPACE"
RANK = "RANK"
"""The trainer: this rank (torch.distributed)."""
WORLD_SIZE = "WORLD_SIZE"
"""The trainer: how many ranks (spec.trainer.replicas)."""
LOCAL_RANK = "LOCAL_RANK"
"""The trainer: which of the pod's GPUs this rank computes on (cuda:<LOCAL_RANK>); set when the pod requests
nvidia.com/gpu."""
