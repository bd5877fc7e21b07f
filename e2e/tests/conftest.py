from lockstep_e2e.fixtures import cluster, kube, namespace

__all__ = ["cluster", "kube", "namespace"]
