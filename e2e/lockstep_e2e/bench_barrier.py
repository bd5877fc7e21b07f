"""Benchmark: barrier coordination overhead, from weights announced to every actor resumed, with a
no-op weight load, next to the API server's own floor and a direct-HTTP baseline measured in the same run.

``python -m lockstep_e2e.bench_barrier [--sizes 8 64 256 1024] [--repeats 5] [--quick]``
(``make bench-barrier``; ``--quick``: 8 and 64 actors, 3 barriers each).

Lockstep: kwok actor pods whose agents are asyncio coroutines in this process. Each writes its acks
with a service-account token bound to its own pod (so the admission policy treats it as that pod),
each in a task of its own as soon as it sees its command (real agents answer independently); to stay
light, one watch on the job's pods feeds them all (a real agent watches only its own pod). The
harness watches the job for the new ``status.weightsVersion``.
Floor: the barrier's minimum pod writes (a command and an ack per member and phase: 4N) sent by one
well-behaved client, each round to all N pods at once with at most 64 in flight: what the API server
itself needs, whatever coordinates it.
Baseline: one process calling N loopback HTTP endpoints directly, pause then update then resume,
each phase to all N at once — the way PipelineRL pushes weight updates to its vLLM servers.
Also, once: the cost of the barrier admission policy to pods Lockstep does not manage (200 patches of an
unrelated pod, with and without the policy's binding).
Prints a table and writes JSON. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import ssl
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from kubernetes import client

from lockstep import api as lockstep_api
from lockstep import keys
from lockstep.admission import BARRIER_POLICY
from lockstep.protocol import ACK_FOR, PROTOCOL, Ack, Command, document
from lockstep_e2e.benchmarks import operator_lab, operator_requests_since, write_results
from lockstep_e2e.cluster import LocalCluster
from lockstep_e2e.install import REPO, pod_client, raw, service_account_token
from lockstep_e2e.jobs import create_job, get_job, rljob

FLOOR_IN_FLIGHT = 64


@dataclass
class Result:
    actors: int
    repeats: int
    lockstep_p50_s: float
    lockstep_p95_s: float
    floor_p50_s: float
    baseline_p50_s: float
    baseline_p95_s: float
    operator_requests_per_barrier: float
    operator_peak_rss_mib: float


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))], 3)


class Agents:
    """Coroutine agents for every actor of one job, acking with their own pod-bound tokens."""

    def __init__(self, cluster: LocalCluster, api: client.ApiClient, namespace: str, pods: list[dict[str, Any]]):
        self.server = api.configuration.host
        self.namespace = namespace
        self.tokens = {
            p["metadata"]["name"]: service_account_token(api, namespace, p["spec"]["serviceAccountName"], pod=p)
            for p in pods
        }
        # The harness's own watch (one for all agents) uses a cluster-admin token.
        self.watch_token = service_account_token(api, keys.OPERATOR_NAMESPACE, keys.OPERATOR_SERVICE_ACCOUNT)
        self.ssl = ssl.create_default_context(cafile=str(cluster.workdir / "pki" / "ca.crt"))
        self.done: dict[str, str] = {}
        self.answering: set[asyncio.Task[None]] = set()

    async def run(self, selector: str, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                url = f"{self.server}/api/v1/namespaces/{self.namespace}/pods"
                params = {"watch": "true", "labelSelector": selector, "timeoutSeconds": "30"}
                headers = {"Authorization": f"Bearer {self.watch_token}"}
                async with session.get(url, params=params, headers=headers, ssl=self.ssl) as response:
                    async for line in response.content:
                        if stop.is_set():
                            return
                        pod = json.loads(line)["object"]
                        text = (pod["metadata"].get("annotations") or {}).get(keys.BARRIER)
                        if text and pod["metadata"]["name"] in self.tokens:
                            command = Command.model_validate_json(text)
                            task = asyncio.create_task(self.answer(session, pod["metadata"]["name"], command))
                            self.answering.add(task)
                            task.add_done_callback(self.answering.discard)

    async def floor(self, session: aiohttp.ClientSession, pods: list[str]) -> float:
        """Seconds for the barrier's minimum pod writes (4 rounds of one write per pod) from one client."""
        limit = asyncio.Semaphore(FLOOR_IN_FLIGHT)
        headers = {"Authorization": f"Bearer {self.watch_token}", "Content-Type": "application/merge-patch+json"}

        async def write(pod: str, value: str) -> None:
            url = f"{self.server}/api/v1/namespaces/{self.namespace}/pods/{pod}"
            body = json.dumps({"metadata": {"annotations": {"bench.lockstep.dev/floor": value}}})
            async with limit, session.patch(url, data=body, headers=headers, ssl=self.ssl) as response:
                response.raise_for_status()

        started = time.monotonic()
        for round_ in range(4):
            await asyncio.gather(*(write(pod, f"{started}-{round_}") for pod in pods))
        return time.monotonic() - started

    async def until_version(self, session: aiohttp.ClientSession, job: str, version: int) -> None:
        """Return once the job's status.weightsVersion is ``version`` (a watch, not polling)."""
        url = f"{self.server}/apis/{lockstep_api.GROUP}/{lockstep_api.VERSION}/namespaces/{self.namespace}/rljobs"
        headers = {"Authorization": f"Bearer {self.watch_token}"}
        params = {"watch": "true", "fieldSelector": f"metadata.name={job}", "timeoutSeconds": "300"}
        async with session.get(url, params=params, headers=headers, ssl=self.ssl) as response:
            async for line in response.content:
                if (json.loads(line)["object"].get("status") or {}).get("weightsVersion") == version:
                    return
        raise TimeoutError(f"weights version {version} did not reach every actor of {job} in 300 s")

    async def answer(self, session: aiohttp.ClientSession, pod: str, command: Command) -> None:
        """A no-op engine: ack each phase at once, once."""
        answer = Ack(id=command.id, phase=ACK_FOR[command.phase], loaded_version=command.version, retry=command.retry)
        ack = document(answer)
        if self.done.get(pod) == ack:
            return
        self.done[pod] = ack
        url = f"{self.server}/api/v1/namespaces/{self.namespace}/pods/{pod}"
        headers = {"Authorization": f"Bearer {self.tokens[pod]}", "Content-Type": "application/merge-patch+json"}
        body = json.dumps({"metadata": {"annotations": {keys.BARRIER_ACK: ack}}})
        async with session.patch(url, data=body, headers=headers, ssl=self.ssl) as response:
            response.raise_for_status()


async def lockstep_barriers(
    cluster: LocalCluster, api: client.ApiClient, namespace: str, job: str, repeats: int
) -> tuple[list[float], int, list[float]]:
    """Seconds per barrier, the operator's requests over all of them, and the API server's floor per barrier."""
    core = client.CoreV1Api(api)
    listing = core.list_namespaced_pod(namespace, label_selector=f"{keys.JOB}={job}", _preload_content=False)
    pods = raw(listing)["items"]
    actors = [p for p in pods if p["metadata"]["labels"][keys.ROLE] == keys.ACTOR]
    trainer = next(p["metadata"]["name"] for p in pods if p["metadata"]["labels"][keys.ROLE] == keys.TRAINER)
    agents = Agents(cluster, api, namespace, actors)
    as_trainer = client.CoreV1Api(pod_client(api, namespace, trainer))
    stop = asyncio.Event()
    watcher = asyncio.create_task(agents.run(f"{keys.JOB}={job},{keys.ROLE}={keys.ACTOR}", stop))
    await asyncio.sleep(1)  # the watch is established
    since = dt.datetime.now(dt.UTC)
    durations = []
    directory = f"/var/lib/lockstep/{get_job(api, namespace, job)['metadata']['uid']}/weights"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for version in range(1, repeats + 1):
            uri = f"file://{directory}/v{version}.safetensors"
            weights = {"protocol": PROTOCOL, "version": version, "uri": uri, "digest": f"sha256:{version}"}
            reached = asyncio.create_task(agents.until_version(session, job, version))
            await asyncio.sleep(0.2)  # the job watch is established
            started = time.monotonic()
            await asyncio.to_thread(
                as_trainer.patch_namespaced_pod,
                trainer,
                namespace,
                {"metadata": {"annotations": {keys.WEIGHTS: json.dumps(weights)}}},
            )
            await reached
            durations.append(time.monotonic() - started)
        stop.set()
        watcher.cancel()
        await asyncio.sleep(2)  # trailing status writes
        requests = operator_requests_since(cluster, since)
        floors = [await agents.floor(session, [p["metadata"]["name"] for p in actors]) for _ in range(repeats)]
    return durations, requests, floors


async def baseline_barriers(actors: int, repeats: int) -> list[float]:
    """N loopback HTTP servers; one client pushes pause, update, resume to all of them."""

    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.add_routes([web.post("/pause", ok), web.post("/update_weights", ok), web.post("/resume", ok)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sites = [web.TCPSite(runner, "127.0.0.1", 0) for _ in range(actors)]
    for site in sites:
        await site.start()
    ports = [site._server.sockets[0].getsockname()[1] for site in sites]
    durations = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for version in range(repeats):
            started = time.monotonic()
            for path, body in (("pause", {}), ("update_weights", {"version": version}), ("resume", {})):
                await asyncio.gather(*(session.post(f"http://127.0.0.1:{port}/{path}", json=body) for port in ports))
            durations.append(time.monotonic() - started)
    await runner.cleanup()
    return durations


def admission_cost(api: client.ApiClient, patches: int = 200) -> tuple[float, float]:
    """Mean seconds per patch of a pod Lockstep does not manage, with the barrier policy's binding, then
    without it (restored afterwards)."""
    core = client.CoreV1Api(api)
    registration = client.AdmissionregistrationV1Api(api)
    namespace = "bench-admission"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    while not core.list_namespaced_service_account(namespace, field_selector="metadata.name=default").items:
        time.sleep(0.1)
    container = client.V1Container(name="c", image="busybox")
    pod = client.V1Pod(metadata=client.V1ObjectMeta(name="unrelated"), spec=client.V1PodSpec(containers=[container]))
    core.create_namespaced_pod(namespace, pod)

    def mean_patch_seconds() -> float:
        started = time.monotonic()
        for index in range(patches):
            body = {"metadata": {"annotations": {"example.com/n": str(index)}}}
            core.patch_namespaced_pod("unrelated", namespace, body, _preload_content=False)
        return (time.monotonic() - started) / patches

    with_policy = mean_patch_seconds()
    binding = registration.read_validating_admission_policy_binding(BARRIER_POLICY)
    registration.delete_validating_admission_policy_binding(BARRIER_POLICY)
    time.sleep(2)  # the API server's admission informer drops the binding
    without = mean_patch_seconds()
    binding.metadata = client.V1ObjectMeta(name=BARRIER_POLICY)
    registration.create_validating_admission_policy_binding(binding)
    core.delete_namespace(namespace)
    return with_policy, without


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="8 and 64 actors, 3 barriers each")
    parser.add_argument("--out", type=Path, default=REPO / "out" / "benchmarks" / "barrier.json")
    options = parser.parse_args()
    if options.quick:
        options.sizes, options.repeats = [8, 64], 3
    results = []
    with operator_lab() as (cluster, api, rss):
        core = client.CoreV1Api(api)
        with_policy, without = admission_cost(api)
        print(
            f"barrier admission policy on a pod Lockstep does not manage: {with_policy * 1000:.2f} ms per patch "
            f"with it, {without * 1000:.2f} ms without (200 patches each)",
            flush=True,
        )
        for size in options.sizes:
            namespace = f"barrier-{size}"
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
            while not core.list_namespaced_service_account(namespace, field_selector="metadata.name=default").items:
                time.sleep(0.1)
            create_job(api, namespace, rljob("bench", actors=size, trainers=1))
            while (get_job(api, namespace, "bench").get("status") or {}).get("phase") != "Running":
                time.sleep(0.5)
            rss.reset()
            ours, requests, floors = asyncio.run(lockstep_barriers(cluster, api, namespace, "bench", options.repeats))
            theirs = asyncio.run(baseline_barriers(size, options.repeats))
            result = Result(
                actors=size,
                repeats=options.repeats,
                lockstep_p50_s=percentile(ours, 0.5),
                lockstep_p95_s=percentile(ours, 0.95),
                floor_p50_s=percentile(floors, 0.5),
                baseline_p50_s=percentile(theirs, 0.5),
                baseline_p95_s=percentile(theirs, 0.95),
                operator_requests_per_barrier=round(requests / options.repeats, 1),
                operator_peak_rss_mib=round(rss.peak / 2**20, 1),
            )
            results.append(result)
            print(
                f"{size:>5} actors: lockstep p50 {result.lockstep_p50_s:6.2f} s p95 {result.lockstep_p95_s:6.2f} s"
                f" | API-server floor p50 {result.floor_p50_s:6.2f} s"
                f" | direct HTTP p50 {result.baseline_p50_s:6.3f} s p95 {result.baseline_p95_s:6.3f} s"
                f" | {result.operator_requests_per_barrier} operator requests/barrier,"
                f" peak RSS {result.operator_peak_rss_mib} MiB (mean {statistics.mean(ours):.2f} s)",
                flush=True,
            )
            core.delete_namespace(namespace)
    write_results(options.out, results)


if __name__ == "__main__":
    main()
