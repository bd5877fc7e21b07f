"""The model architectures the verified architecture matrix (lockstep_e2e.models_matrix, docs/models.md) measured
failing: the actor and the preflight refuse to start on a model of one of them, naming it and why, rather than
serve weights other than the announced ones. The one list of them; an architecture the matrix does not cover is
not refused (it is unverified, not failed).

Also what a mixture of experts needs of the vLLM build for a job (``moe_engine_args``): a LoRA adapter, and routing
replay, need vLLM's Triton kernels, which its CPU build lacks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("lockstep.architectures")

REFUSED: dict[str, str] = {}
"""architectures entry of a config.json → why the matrix found it failing. Empty: every family of the matrix passes
(Qwen3-MoE and Mixtral were refused until their experts were published under their checkpoint's names and
repacked on reload, issue 44)."""


class UnsupportedArchitecture(ValueError):
    """The model is of an architecture the verified matrix measured failing, or a mixture of experts the job asks
    of this vLLM build what it cannot do."""


def _config(model: str) -> dict[str, Any] | None:
    """The config.json in the model directory ``model``; None when ``model`` is not a local directory with one (a
    hub name: vLLM resolves it)."""
    config = Path(model) / "config.json"
    return json.loads(config.read_text()) if config.is_file() else None


def architectures(model: str) -> list[str]:
    """The ``architectures`` of the config.json in the model directory ``model``; none when there is no such file."""
    return list((_config(model) or {}).get("architectures") or [])


EXPERT_COUNTS = ("num_experts", "moe_num_experts", "n_routed_experts", "num_local_experts")
"""The config.json keys that count a model's experts, in the order vLLM reads them (its ModelConfig.is_moe)."""


def is_moe(model: str) -> bool | None:
    """Whether ``model`` is a mixture of experts, as vLLM decides: the first of EXPERT_COUNTS its (text) config
    sets is above 0. None when there is no local config.json to tell."""
    config = _config(model)
    if config is None:
        return None
    text = config.get("text_config") or config
    count = next((text[key] for key in EXPERT_COUNTS if text.get(key) is not None), 0)
    return (max(count, default=0) if isinstance(count, list) else count) > 0


def vllm_has_triton() -> bool:
    """Whether the installed vLLM runs Triton kernels (its own test: False on the CPU build)."""
    from vllm.triton_utils import HAS_TRITON

    return bool(HAS_TRITON)


def moe_engine_args(model: str, *, lora: bool, routing_replay: bool, has_triton: bool) -> dict[str, bool]:
    """The engine arguments a job's ``routing_replay`` needs on ``model`` (``enable_return_routed_experts``), given
    whether vLLM has Triton (``vllm_has_triton``). Raises UnsupportedArchitecture, naming why and the fix, where vLLM
    cannot do what the job asks of a mixture of experts: a LoRA adapter (its MoE LoRA kernels need Triton), or
    routing replay (it returns routed experts only from its Model Runner V2, which needs Triton); never runs without.
    Replay on a dense model is moot: logged, nothing asked. A model with no local config.json may be a mixture of
    experts: replay is asked of a vLLM with Triton, which judges, and refused without."""
    moe = is_moe(model)
    if moe and not has_triton and lora:
        raise UnsupportedArchitecture(
            f"the model {model} is a mixture of experts, and vLLM's LoRA kernels for experts need Triton, which this "
            "vLLM build (the CPU build) lacks: a LoRA job (spec.trainer.lora) cannot run on it here. Run the actors' "
            "CUDA image, or remove spec.trainer.lora to train every weight"
        )
    if not routing_replay:
        return {}
    if moe is False:
        logger.info("routing replay is moot on %s, a dense model (no experts to route): it runs without", model)
        return {}
    if not has_triton:
        kind = "is a mixture of experts" if moe else "may be a mixture of experts (no local config.json says otherwise)"
        raise UnsupportedArchitecture(
            f"routing replay (spec.actors.routingReplay, or the ParityPolicy's spec.routingReplay Required): the model "
            f"{model} {kind}, and this vLLM build (the CPU build) cannot return the experts each token "
            "was routed to (vLLM returns them only from its Model Runner V2, which needs Triton). Set "
            "spec.actors.routingReplay to false (under a ParityPolicy that does not require it), or run the actors' "
            "CUDA image"
        )
    return {"enable_return_routed_experts": True}


def check_architecture(model: str) -> None:
    """Raise UnsupportedArchitecture, naming the architecture and why, when ``model`` is of one in REFUSED."""
    refused = [f"{name}: {REFUSED[name]}" for name in architectures(model) if name in REFUSED]
    if refused:
        raise UnsupportedArchitecture(
            f"the model {model} is of an architecture the verified architecture matrix (docs/models.md) measured "
            f"failing, so its actors would not serve the weights the trainer announces: {'; '.join(refused)}. "
            "Train a model of a verified family (docs/models.md)"
        )
