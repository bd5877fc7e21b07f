"""lockstep.controller.Shell acting on what an apply came to: its parts over fakes of their client interfaces, passes
run on the caller's thread."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kubernetes import client

from factories import job, policy
from fake_clients import FakeApplierClient, FakeWorldClient, refusal
from lockstep.controller import Shell
from lockstep.events import JobKey

KEY: JobKey = ("team-a", "demo")


class Inline:
    """An executor that runs each task at once, in order, on the caller's thread."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        fn(*args)

    def map(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> Iterator[Any]:
        return iter([fn(item) for item in items])


class Setup:
    def __init__(self) -> None:
        self.reads = FakeWorldClient()
        body = job()
        body["metadata"]["resourceVersion"] = "10"
        self.reads.jobs[KEY] = body
        self.reads.policies = [policy()]
        self.writes = FakeApplierClient()
        self.wakes: list[float] = []
        shell = Shell(client.ApiClient())
        shell.world._client = self.reads
        shell.applier._client = self.writes
        shell._passes = shell.applier._pod_writers = Inline()  # type: ignore[assignment]
        shell.queue.wake_in = lambda _key, seconds: self.wakes.append(seconds)  # type: ignore[method-assign]
        self.shell = shell

    def calls(self) -> list[str]:
        return [call for call, _ in self.writes.writes]


def test_a_status_write_that_conflicts_is_one_more_pass_on_the_job_read_anew_which_posts_the_events() -> None:
    run = Setup()
    run.writes.fail["patch_job_status", "demo"] = refusal(409)
    run.shell.request(*KEY)
    calls = run.calls()
    assert calls.count("patch_job_status") == 2
    assert run.reads.calls.count("get_job") == 2, "the job is read anew"
    first_write, second_write = (i for i, call in enumerate(calls) if call == "patch_job_status")
    events = [i for i, call in enumerate(calls) if call == "post_event"]
    assert events and all(i > second_write for i in events), "Events only after the status write that succeeded"
    assert calls[first_write + 1 : second_write].count("create_pod") == 0, "the pods created once"
    assert run.shell.queue._running == set() and run.shell.queue._dirty == {}


def test_a_refused_pod_is_one_more_pass_at_once_that_reports_it_on_the_job() -> None:
    run = Setup()
    run.writes.fail["create_pod", "demo-preflight"] = refusal(403, 'pods "demo-preflight" is forbidden: quota')
    run.writes.fail["create_pod", "demo-actor-0"] = refusal(403, 'pods "demo-actor-0" is forbidden: quota')
    run.shell.request(*KEY)
    written = run.writes.status_patches
    assert len(written) == 1, "the pass that was refused wrote no status"
    ready = next(c for c in written[0]["status"]["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "ChildRejected" and "quota" in ready["message"]
    assert run.reads.calls.count("read_namespace") == 2, "the namespace is read again: it may be terminating"
    assert "post_event" in run.calls()


def finished(ttl: int) -> dict[str, Any]:
    now = dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    body = job(ttlSecondsAfterFinished=ttl, status={"phase": "Succeeded", "finishedTime": now})
    body["metadata"]["resourceVersion"] = "10"
    return body


def test_a_written_pass_wakes_the_job_when_its_plan_asks() -> None:
    run = Setup()
    run.reads.jobs[KEY] = finished(ttl=3600)
    run.shell.request(*KEY)
    assert len(run.wakes) == 1 and 0 < run.wakes[0] <= 3600, "woken when its ttlSecondsAfterFinished ends"
    assert "delete_job" not in run.calls()


def test_a_job_past_its_ttl_is_deleted_after_its_status_and_not_woken() -> None:
    run = Setup()
    run.reads.jobs[KEY] = finished(ttl=0)
    run.shell.request(*KEY)
    assert run.calls()[-1] == "delete_job" and run.wakes == []


def test_a_job_that_is_gone_is_forgotten() -> None:
    run = Setup()
    run.shell.request(*KEY)
    del run.reads.jobs[KEY]
    run.shell.world.job_event(KEY, None)
    run.shell.request(*KEY)
    assert KEY not in run.shell.world._pods and KEY not in run.shell.applier._applied_children
