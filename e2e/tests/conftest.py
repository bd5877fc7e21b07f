from lockstep_e2e.fixtures import cluster, kube, lockstep, namespace

__all__ = ["cluster", "kube", "lockstep", "namespace"]
