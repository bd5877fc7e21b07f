"""The verified architecture matrix: each family of lockstep_workers.tiny_models, served by the real actor (vLLM V1 on
the CPU, the locked settings in fp32) and recomputed by the trainer's Policy (fp32 head), with every check measured.

``python -m lockstep_e2e.models_matrix [--families NAME ...] [--out out/benchmarks/models.json] [--docs
docs/models.md] [--no-lora]`` (``make models-matrix``). Per family, one engine does the full-weight checks:

1. **pre-update**: the engine samples from the base model; the trainer's recompute (``learner.token_logprobs``
   with ``Policy(fp32_head=True)``) of the same tokens, mean and max |Δlogprob|;
2. **filesystem**: an in-flight update (pause, load the published version from the verified file, resume), as a
   filesystem job's actor does it, then the same comparison with the trainer's updated weights, and the load check's
   report (modules compared through their kernels, other parameters, published tensors left unchecked);
3. **gloo**: the next version sent by a trainer rank 0 over gloo into vLLM's weight-transfer engine, then the same
   comparison and the load check on the engine's state against the sent file.

Each published version is the trainer's own: the Hugging Face model's parameters moved by ``UPDATE_SIZE`` of their
spread, gathered with ``sharding.full_state_dict`` (the names and layout the trainer publishes). Then a second
engine with vLLM's LoRA adapters: the adapter's target modules as ``lora.target_modules`` resolves them (the
defaults: every linear module of the decoder layers), a random adapter loaded through the actor's LoRA path, and
vLLM's logprobs under it against PEFT's. NCCL needs GPUs: not run here.

Prints each family's row as it finishes; writes the raw numbers to ``--out`` (the families not run keep the results
``--out`` already holds) and the table of every family in it into ``--docs`` (between its generated-table markers).
Not a test: a failed check is recorded with its error, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import os
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.api import LoraSettings, WeightSyncBackend
from lockstep.protocol import TransferGroup, Weights
from lockstep_workers.actor.architectures import REFUSED, UnsupportedArchitecture, moe_engine_args, vllm_has_triton
from lockstep_workers.tiny_models import FAMILIES, Family, create_tiny_model, family

if TYPE_CHECKING:
    import torch

    from lockstep_workers.rollout.record import Rollout
    from lockstep_workers.trainer.learner import Policy

REPO = Path(__file__).resolve().parents[2]

TEMPERATURE = 0.7
PROMPTS = 4
SAMPLES = 2
TOKENS = 40
"""Per check, PROMPTS x SAMPLES completions of TOKENS tokens (longer than the sliding windows, 32)."""
UPDATE_SIZE = 0.2
"""How far each published version moves every parameter, as a fraction of its spread (the parity check's)."""
THRESHOLD = 1e-4
"""The largest mean |Δlogprob| (fp32, both sides) that passes."""
DOCS_BEGIN = "<!-- models-matrix: begin generated table -->"
DOCS_END = "<!-- models-matrix: end generated table -->"
NOT_RUN = "not run"
REFUSED_HERE = "refused on this vLLM build"
"""A check of what the actor refuses to start on with this vLLM build (architectures.moe_engine_args: LoRA on a
mixture of experts without Triton), with why: not a failure."""


@dataclasses.dataclass
class Comparison:
    """The engine's processed logprobs of its sampled tokens against the trainer's recompute of them."""

    tokens: int
    mean_abs_diff: float
    max_abs_diff: float

    @property
    def passed(self) -> bool:
        return self.mean_abs_diff <= THRESHOLD


COMPARISONS = ("pre_update", "filesystem", "gloo", "lora")
"""The FamilyResult fields that hold a Comparison once measured."""


@dataclasses.dataclass
class FamilyResult:
    family: str
    architecture: str
    features: str
    parameters: int
    pre_update: Comparison | str = NOT_RUN
    filesystem: Comparison | str = NOT_RUN
    filesystem_load_check: dict[str, Any] | str = NOT_RUN
    gloo: Comparison | str = NOT_RUN
    gloo_load_check: dict[str, Any] | str = NOT_RUN
    nccl: str = f"{NOT_RUN}: NCCL needs two CUDA GPUs and a CUDA build of vLLM (this machine has neither)"
    lora_modules: list[str] | str = NOT_RUN
    lora: Comparison | str = NOT_RUN
    seconds: float | None = None
    """Wall time of all its checks; None until they ran."""

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> FamilyResult:
        """The result ``dataclasses.asdict`` wrote (keys it does not have, such as ``failures``, are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in record.items() if key in names}
        for name in COMPARISONS:
            if isinstance(values.get(name), dict):
                values[name] = Comparison(**values[name])
        return cls(**values)

    def failures(self) -> list[str]:
        """Each check that did not pass, with why."""
        failed = []
        for name in COMPARISONS:
            value = getattr(self, name)
            if isinstance(value, Comparison) and not value.passed:
                failed.append(f"{name}: mean |Δlogprob| {value.mean_abs_diff:.2e} > {THRESHOLD:g}")
            elif isinstance(value, str) and not value.startswith(REFUSED_HERE):
                failed.append(f"{name}: {value}")
        for name in ("filesystem_load_check", "gloo_load_check"):
            value = getattr(self, name)
            if isinstance(value, str):
                failed.append(f"{name}: {value}")
            elif value["unchecked"]:
                failed.append(f"{name}: {len(value['unchecked'])} published tensors unchecked")
        if isinstance(self.lora_modules, str):
            failed.append(f"lora_modules: {self.lora_modules}")
        return failed


def _error(error: BaseException) -> str:
    """A failed check's record: the exception's type and first line."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"failed: {type(error).__name__}: {first}"[:400]


def _progress(name: str, started: float, what: str) -> None:
    print(f"  [{name} {time.monotonic() - started:6.1f} s] {what}", flush=True)


def moved(causal_lm: torch.nn.Module, seed: int) -> None:
    """Move every parameter of ``causal_lm`` by UPDATE_SIZE of its spread, in place (a tied head with its
    embeddings): the trainer's next version."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in causal_lm.parameters():
            spread = parameter.float().std() if parameter.numel() > 1 else parameter.abs().float()
            parameter.add_(torch.randn(parameter.shape, generator=generator) * spread * UPDATE_SIZE)


def publish_version(causal_lm: torch.nn.Module, directory: Path, version: int) -> Weights:
    """Publish ``causal_lm``'s weights as the trainer does (``sharding.full_state_dict``, then ``weights.publish``)."""
    from lockstep_workers.trainer import sharding
    from lockstep_workers.weights.files import publish

    return publish(sharding.full_state_dict(causal_lm), directory, version=version)


def compare(policy: Policy, rollouts: Sequence[Rollout]) -> Comparison:
    """The trainer's recompute of the rollouts' tokens against the engine's logprobs."""
    import torch

    from lockstep_workers.trainer.learner import token_logprobs

    with torch.no_grad():
        recomputed, _, _ = token_logprobs(policy, rollouts, TEMPERATURE)
    trainer = torch.cat([recomputed[row, : len(r.completion)] for row, r in enumerate(rollouts)]).double()
    engine = torch.tensor([v for r in rollouts for v in r.logprobs], dtype=torch.float64)
    delta = (trainer - engine).abs()
    return Comparison(len(engine), float(delta.mean()), float(delta.max()))


async def sample(actor: Any, version: int, seed: int) -> list[Rollout]:
    """PROMPTS x SAMPLES completions; raises if a token was sampled under another version than ``version``."""
    from lockstep_workers.parity_check import random_prompts
    from lockstep_workers.rollout.record import Rollout
    from lockstep_workers.tiny_models import VOCABULARY

    prompts = random_prompts(PROMPTS, 5, VOCABULARY, seed=seed)
    sampling = {"temperature": TEMPERATURE, "max_tokens": TOKENS, "ignore_eos": True}

    async def one(group: int, prompt: list[int], number: int) -> Rollout:
        body = await actor.generate(prompt, {**sampling, "seed": seed * 1000 + number})
        return Rollout(prompt, body["token_ids"], body["logprobs"], group, body["weights_versions"])

    rollouts = await asyncio.gather(
        *(one(i, p, i * SAMPLES + s) for i, p in enumerate(prompts) for s in range(SAMPLES))
    )
    served = {v for r in rollouts for v in r.versions}
    if served != {version}:
        raise RuntimeError(f"the engine sampled under weights versions {sorted(served)}, not {version}")
    return list(rollouts)


def _gloo_sender(weights_dir: Path, version: int, rendezvous: str, errors: list[BaseException | None]) -> None:
    """Trainer rank 0: send the published ``version`` to the group (one actor)."""
    from lockstep_workers.weights.files import version_path
    from lockstep_workers.weights.transfer import manifest_of, send

    path = version_path(weights_dir, version)
    try:
        send(path, manifest_of(path, version, rendezvous), TransferGroup(rank_offset=0, world_size=2), _GLOO)
        errors.append(None)
    except BaseException as error:  # reported by the receiving side's check
        errors.append(error)


_GLOO = WeightSyncBackend.GLOO


async def full_weight_checks(
    result: FamilyResult, model_dir: Path, causal_lm: Any, workdir: Path, started: float
) -> None:
    """Checks 1-3 on one engine (filesystem and gloo updates both reach it: it has the gloo transfer engine)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from lockstep_e2e.cluster import free_port
    from lockstep_workers.actor.server import Actor, applied_settings, engine_args
    from lockstep_workers.tiny_model import cpu_vllm_settings
    from lockstep_workers.trainer.learner import Policy
    from lockstep_workers.weights.files import WeightsDirectory, local_path
    from lockstep_workers.weights.transfer import ManifestServer, StagedTransfer, manifest_uri

    policy = Policy(causal_lm, fp32_head=True)
    weights_dir = workdir / "weights"
    llm = AsyncLLM.from_engine_args(engine_args(str(model_dir), applied_settings(cpu_vllm_settings()), _GLOO))
    actor = Actor(llm, backend=_GLOO)
    _progress(result.family, started, "vLLM is up (full weights, gloo transfer engine)")

    async def load_check(weights: Weights) -> dict[str, Any]:
        [report, *_] = await llm.collective_rpc("lockstep_check", args=(str(local_path(weights)),))
        return dict(report)

    try:
        try:
            result.pre_update = compare(policy, await sample(actor, 0, seed=1))
        except Exception as error:
            result.pre_update = _error(error)
        _progress(result.family, started, f"pre-update: {_cell(result.pre_update)}")

        try:  # the filesystem transport: the verified file, loaded and checked in the worker (lockstep_reload)
            moved(causal_lm, seed=11)
            first = publish_version(causal_lm, weights_dir, 1)
            await actor.pause()
            with WeightsDirectory(weights_dir).read(first) as verified:
                await actor.load(first, verified)
            await actor.resume()
            result.filesystem = compare(policy, await sample(actor, 1, seed=2))
        except Exception as error:
            result.filesystem = _error(error)
            if actor.updating:
                await actor.resume()
        try:
            result.filesystem_load_check = await load_check(first)
        except Exception as error:
            result.filesystem_load_check = _error(error)
        _progress(result.family, started, f"filesystem update: {_cell(result.filesystem)}")

        try:  # gloo: trainer rank 0 in a thread of this process, the actor's workers receive
            moved(causal_lm, seed=12)
            second = publish_version(causal_lm, weights_dir, 2)
            http_port, rendezvous = free_port(), f"127.0.0.1:{free_port()}"
            server = ManifestServer(weights_dir, http_port, rendezvous)
            try:
                announced = second.model_copy(update={"uri": manifest_uri("127.0.0.1", http_port, 2)})
                staged = await asyncio.to_thread(
                    StagedTransfer.fetch, announced, TransferGroup(rank_offset=1, world_size=2)
                )
                await actor.pause()
                sent: list[BaseException | None] = []
                sender = threading.Thread(target=_gloo_sender, args=(weights_dir, 2, rendezvous, sent), daemon=True)
                sender.start()
                await actor.load(announced, staged)
                await asyncio.to_thread(sender.join)
                await actor.resume()
            finally:
                server.close()
            if sent != [None]:
                raise RuntimeError(f"the trainer's send failed: {sent}")
            result.gloo = compare(policy, await sample(actor, 2, seed=3))
        except Exception as error:
            result.gloo = _error(error)
        try:
            result.gloo_load_check = await load_check(second)
        except Exception as error:
            result.gloo_load_check = _error(error)
        _progress(result.family, started, f"gloo update: {_cell(result.gloo)}")
    finally:
        llm.shutdown()


async def lora_check(result: FamilyResult, model_dir: Path, workdir: Path, started: float) -> None:
    """The default LoRA adapter's target modules, resolved on the trainer's model; a random adapter of them loaded
    into vLLM through the actor's LoRA path; vLLM's logprobs under it against PEFT's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm.v1.engine.async_llm import AsyncLLM

    from lockstep_workers.actor.adapters import LoraEngine
    from lockstep_workers.actor.server import Actor, applied_settings, engine_args
    from lockstep_workers.parity_check import random_adapter
    from lockstep_workers.tiny_model import cpu_vllm_settings
    from lockstep_workers.trainer.learner import Policy
    from lockstep_workers.weights import lora
    from lockstep_workers.weights.files import WeightsDirectory, local_path, publish

    settings = LoraSettings()
    try:
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        result.lora_modules = lora.target_modules(settings, base)
        tensors, metadata = random_adapter(model_dir, settings, scale=0.05, seed=1)
        adapter = publish(tensors, workdir / "adapters", version=1, metadata=metadata)
    except Exception as error:
        result.lora_modules = _error(error)
        result.lora = f"{NOT_RUN}: the target modules did not resolve"
        return
    try:
        moe_engine_args(str(model_dir), lora=True, routing_replay=False, has_triton=vllm_has_triton())
    except UnsupportedArchitecture as refusal:
        result.lora = f"{REFUSED_HERE}: vLLM's LoRA kernels for experts need Triton, which it lacks"
        _progress(result.family, started, f"LoRA adapter: the actor refuses it here: {refusal}")
        return
    engine = LoraEngine(settings, max_lag=1)
    llm = AsyncLLM.from_engine_args(engine_args(str(model_dir), applied_settings(cpu_vllm_settings()), lora=engine))
    actor = Actor(llm, lora=engine)
    _progress(result.family, started, "vLLM is up (LoRA adapters)")
    try:
        await actor.pause()
        with WeightsDirectory(local_path(adapter).parent).read(adapter) as verified:
            await actor.load(adapter, verified)
        await actor.resume()
        rollouts = await sample(actor, 1, seed=4)
        lora.inject(base, lora.adapter_config(settings, base))
        missing, unexpected = base.load_state_dict(lora.live_names(load_file(str(local_path(adapter)))), strict=False)
        if unexpected or [n for n in missing if "lora_" in n]:
            raise RuntimeError(f"the adapter does not fit PEFT's model: {unexpected[:3]} {missing[:3]}")
        result.lora = compare(Policy(base.eval(), fp32_head=True), rollouts)
    except Exception as error:
        result.lora = _error(error)
    finally:
        llm.shutdown()
    _progress(result.family, started, f"LoRA adapter: {_cell(result.lora)}")


def run_family(chosen: Family, workdir: Path, *, with_lora: bool = True) -> FamilyResult:
    """Every check of one family (one full-weights engine, then one LoRA engine)."""
    import torch
    from transformers import AutoModelForCausalLM

    started = time.monotonic()
    model_dir = create_tiny_model(chosen, workdir / "model")
    causal_lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    parameters = sum(p.numel() for p in causal_lm.parameters())
    result = FamilyResult(chosen.name, chosen.architecture, chosen.features, parameters)
    _progress(chosen.name, started, f"a random {chosen.architecture}, {parameters} parameters, in {model_dir}")
    try:
        asyncio.run(full_weight_checks(result, model_dir, causal_lm, workdir, started))
    except Exception as error:  # the engine did not start
        traceback.print_exc()
        result.pre_update = _error(error)
    gc.collect()
    if with_lora:
        try:
            asyncio.run(lora_check(result, model_dir, workdir, started))
        except Exception as error:
            traceback.print_exc()
            result.lora = _error(error)
        gc.collect()
    else:
        result.lora = f"{NOT_RUN}: --no-lora"
    result.seconds = time.monotonic() - started
    return result


def _cell(value: Comparison | str) -> str:
    """A comparison's mean (max), or a failed check's error with vLLM's wrapper around a worker's error left out,
    cut at CELL characters."""
    if isinstance(value, Comparison):
        return f"{value.mean_abs_diff:.1e} ({value.max_abs_diff:.1e})"
    _, wrapped, inner = value.partition("Worker failed with error '")
    if wrapped:
        value = "failed in vLLM's worker: " + inner.split("', please check")[0]
    return value if len(value) <= CELL else value[: CELL - 1] + "…"


def _check_cell(value: dict[str, Any] | str) -> str:
    if isinstance(value, str):
        return _cell(value)
    return f"{value['modules']}/{value['parameters']}/{len(value['unchecked'])}"


HEADER = (
    "family",
    "architecture",
    "before any update",
    "after a filesystem update",
    "after a gloo update",
    "load check, filesystem; gloo",
    "LoRA targets",
    "LoRA in vLLM vs PEFT",
    "s",
    "verdict",
)
"""The table's columns: the four comparisons are mean (max) |Δlogprob|; the load check is modules compared through
their kernels / other parameters compared / published tensors left unchecked."""


CELL = 100
"""The most characters of a failed check's error in a table cell (the whole of it is in --out)."""


def verdict(result: FamilyResult) -> str:
    """Verified, or the failed checks and whether the actor refuses the architecture (architectures.REFUSED); a
    disagreement between the two says what to change."""
    failed = [failure.split(":", 1)[0] for failure in result.failures()]
    refused = result.architecture in REFUSED
    if not failed:
        return f"verified{' but refused: take it out of architectures.REFUSED' if refused else ''}"
    return f"{'refused' if refused else 'FAILED, not refused: add it to architectures.REFUSED'} ({', '.join(failed)})"


def table_row(result: FamilyResult) -> list[str]:
    """``result`` as one row of the table (HEADER's columns)."""
    modules = result.lora_modules if isinstance(result.lora_modules, str) else ", ".join(result.lora_modules)
    return [
        result.family,
        result.architecture,
        _cell(result.pre_update),
        _cell(result.filesystem),
        _cell(result.gloo),
        f"{_check_cell(result.filesystem_load_check)}; {_check_cell(result.gloo_load_check)}",
        _cell(modules),
        _cell(result.lora),
        NOT_RUN if result.seconds is None else f"{result.seconds:.0f}",
        verdict(result),
    ]


def markdown(results: Sequence[FamilyResult]) -> str:
    """The results as a markdown table (HEADER's columns, one row each)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in table_row(r)) + " |" for r in results]
    return "\n".join(lines)


def merged(previous: Sequence[FamilyResult], latest: Sequence[FamilyResult]) -> list[FamilyResult]:
    """Every family of either, the latest result of each, in FAMILIES' order (a family no longer in FAMILIES is
    dropped)."""
    by_name = {r.family: r for r in [*previous, *latest]}
    return [by_name[f.name] for f in FAMILIES if f.name in by_name]


def previous_results(path: Path) -> list[FamilyResult]:
    """The families of an earlier run's ``--out`` file; none when there is no such file."""
    if not path.exists():
        return []
    return [FamilyResult.from_json(record) for record in json.loads(path.read_text())["families"]]


def write_docs(path: Path, results: Sequence[FamilyResult], meta: dict[str, Any]) -> bool:
    """Replace the generated table between the markers of ``path``; False when it has no markers."""
    text = path.read_text() if path.exists() else ""
    if DOCS_BEGIN not in text or DOCS_END not in text:
        return False
    head, rest = text.split(DOCS_BEGIN, 1)
    _, tail = rest.split(DOCS_END, 1)
    generated = (
        f"{DOCS_BEGIN}\n<!-- made by `make models-matrix` (python -m lockstep_e2e.models_matrix); last run "
        f"{meta['date']}, vLLM {meta['vllm']}, transformers {meta['transformers']}, torch {meta['torch']} -->\n\n"
        f"{markdown(results)}\n\n{DOCS_END}"
    )
    path.write_text(head + generated + tail)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen families; 0 when every check of each passed, else 1."""
    import torch
    import transformers
    import vllm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--families", nargs="+", choices=[f.name for f in FAMILIES], default=[f.name for f in FAMILIES])
    parser.add_argument(
        "--out", type=Path, default=REPO / "out" / "benchmarks" / "models.json", help="the raw numbers (merged)"
    )
    parser.add_argument("--docs", type=Path, default=REPO / "docs" / "models.md", help="where the table goes")
    parser.add_argument("--no-docs", action="store_true", help="print the markdown table instead of writing --docs")
    parser.add_argument("--no-lora", action="store_true", help="skip the LoRA engines (half the time)")
    options = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    results = []
    for number, name in enumerate(options.families, 1):
        print(f"[{number}/{len(options.families)}] {name}", flush=True)
        with tempfile.TemporaryDirectory(prefix=f"models-matrix-{name}-") as workdir:
            result = run_family(family(name), Path(workdir), with_lora=not options.no_lora)
        results.append(result)
        row = dict(zip(HEADER, table_row(result), strict=True))
        print(f"[{number}/{len(options.families)}] {name}: {json.dumps(row, ensure_ascii=False)}", flush=True)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "threshold": THRESHOLD,
        "temperature": TEMPERATURE,
        "tokens_per_check": PROMPTS * SAMPLES * TOKENS,
        "update_size": UPDATE_SIZE,
    }
    every = merged(previous_results(options.out), results)
    options.out.parent.mkdir(parents=True, exist_ok=True)
    document = {**meta, "families": [{**dataclasses.asdict(r), "failures": r.failures()} for r in every]}
    options.out.write_text(json.dumps(document, indent=2, default=_json) + "\n")
    print(f"wrote {options.out} ({len(every)} families)")
    if options.no_docs or not write_docs(options.docs, every, meta):
        print(markdown(every))
    else:
        print(f"wrote the table into {options.docs}")
    return 0 if all(not r.failures() for r in results) else 1


def _json(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


if __name__ == "__main__":
    raise SystemExit(main())
