from lockstep_e2e.fixtures import cluster, collector, kube, lockstep, namespace, operator_metrics_port

__all__ = ["cluster", "collector", "kube", "lockstep", "namespace", "operator_metrics_port"]
