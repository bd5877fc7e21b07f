"""``python -m lockstep_workers.actor``: the actor pod's process (lockstep_workers.actor.server)."""

from lockstep_workers.actor.server import main

if __name__ == "__main__":  # not in the children that multiprocessing spawns
    main()
