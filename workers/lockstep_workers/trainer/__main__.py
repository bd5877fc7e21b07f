"""``python -m lockstep_workers.trainer``: the trainer pod's process (lockstep_workers.trainer.loop)."""

from lockstep_workers.trainer.loop import main

if __name__ == "__main__":  # not in the children that multiprocessing spawns
    main()
