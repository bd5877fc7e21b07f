"""Tiny random causal LMs of each architecture family in the verified matrix (lockstep_e2e.models_matrix,
docs/models.md): the family's own Hugging Face config class with what sets it apart (qkv bias, q/k norms, logit
soft-capping, scaled embeddings, fused projections, experts), small enough for vLLM and torch on a CPU, with the
word-level tokenizer of lockstep_workers.tiny_model. Nothing is downloaded.

Every family has 2 layers, hidden size 128, 2 query heads of 64 (the CPU attention kernel rejects smaller heads) and
one KV head (grouped-query attention), a 256-word vocabulary, and an untied lm_head scaled for peaky logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep_workers.tiny_model import save_tokenizer, vocabulary

HIDDEN = 128
HEAD_DIM = 64
LAYERS = 2
VOCABULARY = 256
HEAD_SCALE = 4.0
"""An untied lm_head's factor (> 1: peakier logits, as a trained model's; the sampled tokens are not all
near-uniform). A tied head is left as it is: its logits already favour the input token (the residual stream carries
its embedding), and scaled they make a random model repeat it with probability ~1, which no comparison can test."""


@dataclass(frozen=True)
class Family:
    """One architecture family: its transformers config and model classes and the config fields that make it
    itself."""

    name: str
    architecture: str
    """The ``architectures`` entry of its config.json (what vLLM and the actor dispatch on), which is also its
    transformers model class."""
    config_class: str
    features: str
    """What sets it apart, in words (docs/models.md)."""
    fields: dict[str, Any] = field(default_factory=dict)
    tied: bool = False
    mixture_of_experts: bool = False


_ATTENTION = {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": HEAD_DIM}

FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaForCausalLM", "LlamaConfig", "untied head", _ATTENTION),
    Family(
        "llama-tied",
        "LlamaForCausalLM",
        "LlamaConfig",
        "head tied to the embeddings",
        _ATTENTION,
        tied=True,
    ),
    Family("qwen2", "Qwen2ForCausalLM", "Qwen2Config", "q/k/v biases", _ATTENTION),
    Family(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        "q/k RMS norms, tied head",
        _ATTENTION,
        tied=True,
    ),
    Family(
        "gemma2",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        "final logit soft-capping (0.5: a tiny tied head's logits are under 1, far below Gemma 2's 30), attention "
        "soft-capping 50, scaled embeddings, (1 + w) norms, sliding window 32 on every other layer, tied head",
        {**_ATTENTION, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": 32, "final_logit_softcapping": 0.5},
        tied=True,
    ),
    Family(
        "gemma3",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        "q/k norms, scaled embeddings, (1 + w) norms, sliding window 32 with its own RoPE base, tied head",
        {
            **_ATTENTION,
            "query_pre_attn_scalar": HEAD_DIM,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        tied=True,
    ),
    Family("mistral", "MistralForCausalLM", "MistralConfig", "untied head", _ATTENTION),
    Family(
        "phi3",
        "Phi3ForCausalLM",
        "Phi3Config",
        "fused qkv_proj and gate_up_proj in the checkpoint",
        {"num_attention_heads": 2, "num_key_value_heads": 1},
    ),
    Family(
        "qwen3-moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        "4 experts, top-2, q/k norms",
        {**_ATTENTION, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
        mixture_of_experts=True,
    ),
    Family(
        "mixtral",
        "MixtralForCausalLM",
        "MixtralConfig",
        "4 experts, top-2",
        {**_ATTENTION, "num_local_experts": 4, "num_experts_per_tok": 2},
        mixture_of_experts=True,
    ),
    Family(
        "olmoe",
        "OlmoeForCausalLM",
        "OlmoeConfig",
        "4 experts, top-2, no renormalisation of the top-k probabilities, q/k norms over all heads",
        {**_ATTENTION, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False},
        mixture_of_experts=True,
    ),
    Family(
        "qwen2-moe",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        "4 experts, top-2, a shared expert behind a sigmoid gate, q/k/v biases",
        {
            **_ATTENTION,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
        },
        mixture_of_experts=True,
    ),
)
"""The families of the verified matrix, in its order."""


def family(name: str) -> Family:
    """The family called ``name`` (FAMILIES); raises KeyError naming the known ones."""
    for candidate in FAMILIES:
        if candidate.name == name:
            return candidate
    raise KeyError(f"no tiny model family {name!r}; the families are: {', '.join(f.name for f in FAMILIES)}")


def create_tiny_model(family: Family, directory: Path, *, seed: int = 0, dtype: str = "float32") -> Path:
    """Write a random model of ``family`` (config, safetensors weights as Hugging Face saves them, tokenizer) to
    ``directory`` and return it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    vocab = vocabulary(VOCABULARY)
    special = {"bos_token_id": vocab["<s>"], "eos_token_id": vocab["</s>"], "pad_token_id": vocab["<unk>"]}
    config_class: Callable[..., Any] = getattr(transformers, family.config_class)
    config = config_class(
        vocab_size=VOCABULARY,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        max_position_embeddings=1024,
        tie_word_embeddings=family.tied,
        dtype=dtype,
        **special,
        **family.fields,
    )
    model = getattr(transformers, family.architecture)(config)
    if not family.tied:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    model = model.to(getattr(torch, dtype))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory, vocab)
    return directory
