"""Sampling, in trainer rank 0's process: the job's dataset (``dataset``), the client of the actors' HTTP API
(``client``), the record of each sampled completion, which the trainer learns from (``record``), the producer that
keeps prompt groups in flight while the trainer learns, within maxLag (``producer``), and the scoring of completions
by the job's reward functions in a pool of processes (``scoring``).

May import: actor (its wire names), weights, agent, and the rollout functions (lockstep_workers.episodes)."""
