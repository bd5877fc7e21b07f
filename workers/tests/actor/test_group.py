"""An actor group's pods (lockstep_workers.actor.group): each pod's place from LeaderWorkerSet's variables, and vLLM's
engine arguments for it; the actor runs on the leader only."""

from __future__ import annotations

import re

import pytest

from lockstep import environment
from lockstep.api import ActorGroup, VllmSettings
from lockstep.podconfig import actor_args, parse_actor_args
from lockstep_workers.actor.group import Node, node_of, placement

LWS = {environment.GROUP_LEADER_ADDRESS: "job-actor-0.job-actors", environment.GROUP_WORKER_INDEX: "1"}


def test_ranks_spread_over_the_pods_meet_at_the_leader() -> None:
    group = ActorGroup(pods=2, tensor_parallel_size=8, pipeline_parallel_size=2)
    assert placement(group, node_of(LWS, group)) == {
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 2,
        "enable_expert_parallel": False,
        "distributed_executor_backend": "mp",
        "nnodes": 2,
        "node_rank": 1,
        "master_addr": "job-actor-0.job-actors",
        "master_port": environment.GROUP_RENDEZVOUS_PORT,
    }


def test_with_data_parallelism_each_pod_runs_whole_engines_the_leaders_from_rank_0() -> None:
    group = ActorGroup(pods=2, tensor_parallel_size=8, data_parallel_size=4, expert_parallel=True)
    common = {
        "tensor_parallel_size": 8,
        "pipeline_parallel_size": 1,
        "enable_expert_parallel": True,
        "distributed_executor_backend": "mp",
        "data_parallel_size": 4,
        "data_parallel_size_local": 2,
        "data_parallel_address": "leader",
        "data_parallel_rpc_port": environment.GROUP_ENGINES_PORT,
    }
    assert placement(group, Node(0, "leader")) == common, "no start rank: vLLM would balance across nodes itself"
    assert placement(group, Node(1, "leader")) == common | {"data_parallel_start_rank": 2}


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({environment.GROUP_WORKER_INDEX: "1"}, f"{environment.GROUP_LEADER_ADDRESS} is not set"),
        ({environment.GROUP_LEADER_ADDRESS: "leader"}, f"{environment.GROUP_WORKER_INDEX} is not set"),
        (LWS | {environment.GROUP_WORKER_INDEX: "2"}, "not a pod of a group of 2 (0 to 1)"),
        (LWS | {environment.GROUP_WORKER_INDEX: "-1"}, "not a pod of a group of 2"),
    ],
)
def test_a_pod_without_its_place_in_the_group_stops_saying_which_variable(environ: dict[str, str], named: str) -> None:
    with pytest.raises(SystemExit, match=re.escape(named)):
        node_of(environ, ActorGroup(pods=2, tensor_parallel_size=2))


def test_every_pod_of_a_group_gets_the_same_command_line_with_its_split() -> None:
    group = ActorGroup(pods=4, tensor_parallel_size=4, pipeline_parallel_size=2)
    args = actor_args("/models/base", 8000, VllmSettings(max_model_len=512), group)
    assert parse_actor_args(args).group == group
    assert parse_actor_args(actor_args("/models/base", 8000, VllmSettings())).group is None


def test_the_actor_runs_on_the_leader_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from lockstep.podconfig import ActorArgs
    from lockstep_workers.actor.server import leader_placement

    group = ActorGroup(pods=2, tensor_parallel_size=2)
    options = ActorArgs("/models/base", 8000, VllmSettings(), group)
    for name, value in LWS.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match=r"the group.s other pods run python -m lockstep_workers\.actor\.headless"):
        leader_placement(options)
    monkeypatch.setenv(environment.GROUP_WORKER_INDEX, "0")
    assert leader_placement(options) == placement(group, Node(0, LWS[environment.GROUP_LEADER_ADDRESS]))
    assert leader_placement(ActorArgs("/models/base", 8000, VllmSettings())) is None, "a single-pod actor"
