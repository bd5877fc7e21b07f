from lockstep_e2e.fixtures import cluster, kube, lockstep, namespace, operator_metrics_port

__all__ = ["cluster", "kube", "lockstep", "namespace", "operator_metrics_port"]
