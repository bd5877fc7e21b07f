"""The actor pod's process (``python -m lockstep_workers.actor``): vLLM V1's AsyncLLM, the HTTP API the trainer samples
from (``server``), the engine arguments of the locked settings (``vllm_args``), the worker extension that reloads and
checks weights inside vLLM's worker processes (``vllm_extension``, ``load_check``), LoRA serving (``adapters``), the
architectures refused or set up apart (``architectures``), and actor groups: the leader's placement (``group``) and the
other pods' headless ranks (``headless``, ``python -m lockstep_workers.actor.headless``).

May import: agent, weights."""
