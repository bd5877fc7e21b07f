"""Benchmark: time from creating an RLJob to every one of its pods Running (kwok), the operator's
peak RSS, and the API requests the operator made per job.

``python -m lockstep_e2e.bench_apply [--out out/benchmarks/apply.json]`` (``make bench``).
Prints a table and writes the numbers as JSON. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from lockstep_e2e.benchmarks import PeakRss, operator_lab, operator_requests_since, write_results
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.install import REPO
from lockstep_e2e.jobs import create_job, rljob

SCENARIOS = ((1, 8), (1, 64), (1, 256), (50, 8))  # (jobs applied at once, actors per job)


@dataclass
class Result:
    jobs: int
    actors_per_job: int
    pods: int
    seconds_to_all_running: float
    operator_requests: int
    requests_per_job: float
    operator_peak_rss_mib: float


def run_scenario(cluster: LocalCluster, api: client.ApiClient, rss: PeakRss, jobs: int, actors: int) -> Result:
    core = client.CoreV1Api(api)
    namespace = f"bench-{jobs}x{actors}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    while not core.list_namespaced_service_account(namespace, field_selector="metadata.name=default").items:
        time.sleep(0.1)
    expected = jobs * (actors + 1)
    rss.reset()
    since = dt.datetime.now(dt.UTC)
    started = time.monotonic()
    for index in range(jobs):
        create_job(api, namespace, rljob(f"job-{index}", actors=actors, trainers=1))
    while True:
        pods = core.list_namespaced_pod(namespace, label_selector="lockstep.dev/job").items
        if len(pods) == expected and all(p.status.phase == "Running" for p in pods):
            break
        if time.monotonic() - started > 900:
            raise SystemExit(f"{namespace}: only {len(pods)} of {expected} pods after 15 minutes")
        time.sleep(0.1)
    elapsed = time.monotonic() - started
    time.sleep(2)  # let the operator finish the status writes that follow the last pod event
    requests = operator_requests_since(cluster, since)
    result = Result(
        jobs=jobs,
        actors_per_job=actors,
        pods=expected,
        seconds_to_all_running=round(elapsed, 2),
        operator_requests=requests,
        requests_per_job=round(requests / jobs, 1),
        operator_peak_rss_mib=round(rss.peak / 2**20, 1),
    )
    core.delete_namespace(namespace)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO / "out" / "benchmarks" / "apply.json")
    options = parser.parse_args()
    results: list[Result] = []
    with operator_lab() as (cluster, api, rss):
        for jobs, actors in SCENARIOS:
            result = run_scenario(cluster, api, rss, jobs, actors)
            results.append(result)
            print(
                f"{jobs:>3} job(s) x {actors:>3} actors: {result.pods:>4} pods Running in "
                f"{result.seconds_to_all_running:7.2f} s; operator {result.operator_requests} requests "
                f"({result.requests_per_job}/job), peak RSS {result.operator_peak_rss_mib} MiB",
                flush=True,
            )
    write_results(options.out, results)


if __name__ == "__main__":
    main()
