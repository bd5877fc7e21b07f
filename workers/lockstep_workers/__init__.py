"""What runs inside Lockstep's pods: the vLLM actor, the trainer, the barrier agent."""
