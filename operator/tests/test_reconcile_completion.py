"""The completion step (lockstep.reconcile.completion): the end of a job, and ttlSecondsAfterFinished."""

from __future__ import annotations

import datetime as dt

from factories import NOW, job, running
from lockstep.api import Phase
from reconcile_helpers import plan_for, settle, status_of


def test_trainer_success_finishes_the_job_and_ttl_deletes_it() -> None:
    body, pods = settle(job(ttlSecondsAfterFinished=30))
    pods[2] = running(pods[2], phase="Succeeded", ready=False)
    done = plan_for(body, pods)
    assert done.status.phase is Phase.SUCCEEDED and done.requeue_after == 30
    assert set(done.delete_pods) == {p["metadata"]["name"] for p in pods}
    body = {**body, "status": status_of(done)}
    assert not plan_for(body, [], now=NOW + dt.timedelta(seconds=29)).delete_job
    assert plan_for(body, [], now=NOW + dt.timedelta(seconds=30)).delete_job
