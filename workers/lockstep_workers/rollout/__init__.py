"""Sampling, in trainer rank 0's process: the job's dataset (``dataset``), the client of the actors' HTTP API
(``client``), the producer that keeps prompt groups in flight while the trainer learns, within maxLag (``producer``),
and the scoring of completions by the job's reward functions in a pool of processes (``scoring``).

May import: actor (its wire names), weights, agent, and the trainer's learner for the rollout record it fills."""
