"""An actor group's engine (spec.actors.group, docs/actor-groups.md): one vLLM engine split over the pods of a
LeaderWorkerSet group, through vLLM's own multi-node launch (its multiprocessing executor across nodes; no Ray).

The leader pod runs the actor (lockstep_workers.actor: the engine's API, the barrier agent) as node 0; each worker pod
runs lockstep_workers.actor.headless, vLLM's headless ranks, as node ``LWS_WORKER_INDEX``. Every pod of the group gets
the same command line (lockstep.podconfig.actor_args with ``--group``), so the same locked settings; ``placement`` turns
the group and the pod's place in it into vLLM's engine arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockstep import environment
from lockstep.api import ActorGroup


@dataclass(frozen=True)
class Node:
    """A pod's place in its group, as LeaderWorkerSet tells it."""

    rank: int
    """0 for the leader, 1 to pods - 1 for the workers (``LWS_WORKER_INDEX``)."""
    leader: str
    """The leader pod's address (``LWS_LEADER_ADDRESS``)."""


def node_of(environ: Mapping[str, str], group: ActorGroup) -> Node:
    """This pod's place in ``group``, from LeaderWorkerSet's variables; exits naming the variable that is missing or
    does not fit."""
    for name in (environment.GROUP_WORKER_INDEX, environment.GROUP_LEADER_ADDRESS):
        if not environ.get(name):
            raise SystemExit(
                f"{name} is not set: a pod of an actor group learns its place from LeaderWorkerSet, which sets "
                f"{environment.GROUP_WORKER_INDEX} and {environment.GROUP_LEADER_ADDRESS} in each pod it creates"
            )
    index = environ[environment.GROUP_WORKER_INDEX]
    if not index.isdigit() or int(index) >= group.pods:
        raise SystemExit(
            f"{environment.GROUP_WORKER_INDEX}={index}: not a pod of a group of {group.pods} (0 to {group.pods - 1})"
        )
    return Node(int(index), environ[environment.GROUP_LEADER_ADDRESS])


def placement(group: ActorGroup, node: Node) -> dict[str, Any]:
    """vLLM's engine arguments for ``node`` of ``group``. Tensor and pipeline parallel only: the engine's ranks
    spread over the pods, each running ``tp x pp / pods`` of them, which meet at the leader (``--nnodes``,
    ``--node-rank``, ``--master-addr``). With data parallelism: each pod runs ``dp / pods`` whole engines, the
    leader's behind its API, the others headless (``--data-parallel-size-local``, ``--data-parallel-start-rank``,
    ``--data-parallel-address``)."""
    arguments: dict[str, Any] = {
        "tensor_parallel_size": group.tensor_parallel_size,
        "pipeline_parallel_size": group.pipeline_parallel_size,
        "enable_expert_parallel": group.expert_parallel,
        "distributed_executor_backend": "mp",
    }
    if group.data_parallel_size == 1:
        return arguments | {
            "nnodes": group.pods,
            "node_rank": node.rank,
            "master_addr": node.leader,
            "master_port": environment.GROUP_RENDEZVOUS_PORT,
        }
    local = group.data_parallel_size // group.pods
    arguments |= {
        "data_parallel_size": group.data_parallel_size,
        "data_parallel_size_local": local,
        "data_parallel_address": node.leader,
        "data_parallel_rpc_port": environment.GROUP_ENGINES_PORT,
    }
    if node.rank:  # the leader's engines start at rank 0 (given, vLLM would balance load across the nodes itself)
        arguments["data_parallel_start_rank"] = node.rank * local
    return arguments
