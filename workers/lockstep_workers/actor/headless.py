"""A worker pod of an actor group (docs/actor-groups.md): vLLM's headless ranks of the engine whose API and barrier
agent run on the group's leader (lockstep_workers.actor).

It takes the actor's own command line (lockstep.podconfig.actor_args with ``--group``), so its ranks run with the
same locked settings, the same weight-reload extension and weight-transfer engine, and its place in the group from
LeaderWorkerSet (``LWS_WORKER_INDEX``, ``LWS_LEADER_ADDRESS``); then vLLM's own headless launch runs them until the
group goes. Weights reach these ranks through the leader's engine (its collective_rpc and transfer group), never
through this process.

Run as ``python -m lockstep_workers.actor.headless --model=... --group=...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from lockstep import environment
from lockstep_workers.actor.group import node_of, placement
from lockstep_workers.actor.server import backend_of, command_line, engine_args, lora_engine


def main() -> None:
    options, applied, config = command_line()
    if options.group is None:
        raise SystemExit("lockstep_workers.actor.headless runs a worker pod of an actor group: it needs --group")
    node = node_of(os.environ, options.group)
    if node.rank == 0:
        raise SystemExit(
            f"{environment.GROUP_WORKER_INDEX}=0 is the group's leader, which runs python -m lockstep_workers.actor"
        )
    lora = lora_engine(config)
    arguments = engine_args(options.model, applied, backend_of(os.environ), lora, placement(options.group, node))
    from vllm.entrypoints.cli.serve import run_headless

    # vLLM's headless launch reads its engine arguments from a parsed command line: these, field by field.
    fields = {field.name: getattr(arguments, field.name) for field in dataclasses.fields(arguments)}
    run_headless(argparse.Namespace(**{"api_server_count": 1, "reasoning_parser_plugin": None, **fields}))


if __name__ == "__main__":
    main()
