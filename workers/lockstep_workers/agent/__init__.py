"""The barrier agent, run in each member pod (the actors, and the trainer's rank 0 when it sends the weights itself):
``core`` decides what to do with a command and remembers it; ``pod_agent`` watches only its own pod and writes only its
own ack (docs/barrier-protocol.md).

May import: nothing of lockstep_workers (only the protocol, lockstep.protocol and lockstep.keys)."""
