"""The trainer pod's processes (``python -m lockstep_workers.trainer``, one per rank): the loop (``loop``: sample,
learn, publish, evaluate, record), beside it the model and its resumption (``model``), what rank 0 samples and how it
is scored (``sampling``), evaluation (``evaluation``), the step's metrics (``metrics``) and spec.output (``output``);
the learner and its objective (``learner``, ``objective``, ``shaping``, ``optimization``), the model's shards and
checkpoints (``sharding``, ``checkpoint``), routing in MoE layers (``routing``), the pod's record and announcements
(``pod``), tracking and traces (``tracking``, ``traces``).

May import: rollout, weights, agent (never actor: the trainer reaches the actors over HTTP and the barrier)."""
