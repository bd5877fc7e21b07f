"""What runs inside Lockstep's pods, one package per process and role (docs/design.md has the map):

- ``actor``: the actor pod (``python -m lockstep_workers.actor``): vLLM V1's engine, the HTTP API the trainer samples
  from, the weight reload and its load check inside vLLM's workers, LoRA serving, actor groups' headless ranks.
- ``agent``: the barrier agent in every member pod, actor or sending trainer: the operator's commands in, acks out.
- ``weights``: how a weights version travels from the trainer to the actors: published files (safetensors on a shared
  volume, digests, staging), the collective transports (gloo, NCCL), the LoRA adapter's files.
- ``rollout``: trainer rank 0's side of sampling: the dataset, the client of the actors, the producer that keeps
  prompt groups in flight within maxLag, and the scoring of completions.
- ``trainer``: the trainer pod (``python -m lockstep_workers.trainer``): the loop, the learner and its objective,
  optimization, sharding, checkpoints, routing of MoE layers, the pod's record, tracking and traces.

Beside them, modules a job or a person names directly: ``rewards`` and ``episodes`` (the reward and rollout functions
an RLJob names, e.g. ``lockstep_workers.rewards:math_exact_match``), ``export`` (``lockstep export``), ``parity_check``
(``lockstep parity-check`` and the preflight pod), and the tiny models and text tasks of the tests and the demo.

Imports go one way: agent <- weights <- actor <- rollout <- trainer (each may import those before it); every package
reads the operator's contract only through lockstep.podconfig, lockstep.environment, lockstep.protocol and
lockstep.api."""
