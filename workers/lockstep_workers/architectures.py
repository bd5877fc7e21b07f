"""The model architectures the verified architecture matrix (lockstep_e2e.models_matrix, docs/models.md) measured
failing: the actor and the preflight refuse to start on a model of one of them, naming it and why, rather than
serve weights other than the announced ones. The one list of them; an architecture the matrix does not cover is
not refused (it is unverified, not failed).
"""

from __future__ import annotations

import json
from pathlib import Path

_MOE_UPDATE = (
    "an in-flight update does not reach its experts: the trainer publishes them as transformers holds them in "
    "memory (mlp.experts.gate_up_proj and mlp.experts.down_proj, one tensor per layer), not as its checkpoints name "
    "them (one tensor per expert), and this vLLM's reload maps only the checkpoints' names"
)

REFUSED: dict[str, str] = {
    "Qwen3MoeForCausalLM": f"{_MOE_UPDATE} (it keeps the old experts: 0.11 nats off after the update), and its LoRA "
    "kernels need Triton, which vLLM's CPU build lacks",
    "MixtralForCausalLM": f"{_MOE_UPDATE} (the reload fails: no module layers.0.mlp in vLLM's MixtralModel), and its "
    "LoRA kernels need Triton, which vLLM's CPU build lacks",
}
"""architectures entry of a config.json → why the matrix found it failing."""


class UnsupportedArchitecture(ValueError):
    """The model is of an architecture the verified matrix measured failing."""


def architectures(model: str) -> list[str]:
    """The ``architectures`` of the config.json in the model directory ``model``; none when ``model`` is not a
    local directory with one (a hub name: vLLM resolves it)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return []
    return list(json.loads(config.read_text()).get("architectures") or [])


def check_architecture(model: str) -> None:
    """Raise UnsupportedArchitecture, naming the architecture and why, when ``model`` is of one in REFUSED."""
    refused = [f"{name}: {REFUSED[name]}" for name in architectures(model) if name in REFUSED]
    if refused:
        raise UnsupportedArchitecture(
            f"the model {model} is of an architecture the verified architecture matrix (docs/models.md) measured "
            f"failing, so its actors would not serve the weights the trainer announces: {'; '.join(refused)}. "
            "Train a model of a verified family (Llama, Qwen2, Qwen3, Gemma 2, Gemma 3, Mistral, Phi-3)"
        )
