"""Settings for every test under this repository."""

from hypothesis import settings

# The suite's time budget: a warning naming the slowest tests past 40 minutes; a run of no test fails (issue 33).
pytest_plugins = ["lockstep_e2e.pytest_budget"]

# Hypothesis fails an example that runs longer than its deadline (200 ms by default): a timing assertion, which a
# loaded 2-core CI machine trips at random (test_events' pod-cache property did). Timings belong in benchmarks.
settings.register_profile("lockstep", deadline=None)
settings.load_profile("lockstep")
