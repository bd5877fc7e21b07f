"""The load check with tensor parallelism (issue 36's groups split one engine's layers over pods): each vLLM worker
checks the shard it holds. On a real engine of two tensor-parallel workers (vLLM's CPU build, its multiprocessing
executor on this host, as a group's pods run it across nodes), and on the shard arithmetic of each kind of
module vLLM shards, replicated key and value heads included; and a mixture-of-experts layer's experts, split by
tensor or expert parallelism, on a layer with vLLM's attributes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from lockstep_workers.actor.load_check import Shard, shard_of

PROMPT = [1, 10, 11, 12]


@dataclass
class ShardIndices:
    org_vocab_start_index: int
    org_vocab_end_index: int


@dataclass
class Sharded:
    """The attributes vLLM's parallel modules carry (LinearBase, VocabParallelEmbedding)."""

    tp_rank: int
    tp_size: int
    input_size_per_partition: int | None = None
    output_partition_sizes: list[int] | None = None
    shard_indices: ShardIndices | None = None


def test_each_rank_holds_its_rows_of_a_column_parallel_module_part_by_part() -> None:
    """gate_up_proj: two published tensors of 512 rows, 256 of each on each of 2 ranks."""
    shapes = [(512, 128), (512, 128)]
    assert [shard_of(Sharded(rank, 2, 128, [256, 256]), shapes) for rank in (0, 1)] == [
        Shard([(0, 256), (0, 256)], (0, 128)),
        Shard([(256, 512), (256, 512)], (0, 128)),
    ]


def test_ranks_share_a_key_and_value_head_when_there_are_fewer_than_ranks() -> None:
    """qkv_proj with 8 query heads and 2 key/value heads of 64 over 4 ranks: vLLM gives ranks 0-1 the first key
    and value head, ranks 2-3 the second (num_kv_head_replicas 2)."""
    shapes = [(512, 512), (128, 512), (128, 512)]
    shards = [shard_of(Sharded(rank, 4, 512, [128, 64, 64]), shapes).rows for rank in range(4)]
    assert shards == [
        [(0, 128), (0, 64), (0, 64)],
        [(128, 256), (0, 64), (0, 64)],
        [(256, 384), (64, 128), (64, 128)],
        [(384, 512), (64, 128), (64, 128)],
    ]


def test_a_row_parallel_module_holds_its_columns_and_every_row() -> None:
    assert shard_of(Sharded(1, 2, input_size_per_partition=256), [(128, 512)]) == Shard([(0, 128)], (256, 512))


def test_a_vocabulary_parallel_embedding_holds_its_rows_of_the_vocabulary() -> None:
    module = Sharded(1, 2, shard_indices=ShardIndices(128, 256))
    assert shard_of(module, [(256, 64)]) == Shard([(128, 256)], (0, 64))


def test_a_module_of_one_rank_holds_everything() -> None:
    assert shard_of(object(), [(12, 8), (4, 8)]) == Shard([(0, 12), (0, 4)], (0, 8))


def _trainer_logprobs(model_dir: Path, tokens: list[int]) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_two_tensor_parallel_workers_each_load_and_check_their_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied tiny Llama of 4 heads over 2 workers: the reload of a new version is checked on both shards, every
    published tensor covered; the engine then serves the new version's logprobs; and a check against the old
    version names a module."""
    import torch
    from vllm import LLM, SamplingParams

    from lockstep_workers.tiny_model import create_tiny_llama

    # Two workers on one host: vLLM's CPU build binds each to its own core (on two nodes each has its own).
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    old = create_tiny_llama(tmp_path / "v0", hidden_size=256, tie_word_embeddings=True)
    new = create_tiny_llama(tmp_path / "v1", hidden_size=256, tie_word_embeddings=True, seed=1)
    llm = LLM(
        model=str(old),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        seed=0,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        worker_extension_cls="lockstep_workers.actor.vllm_extension.WeightReloader",
    )
    try:
        reports = llm.collective_rpc("lockstep_reload", args=(str(new / "model.safetensors"),))
        assert reports == [{"modules": 10, "parameters": 5, "unchecked": []}] * 2, "each shard, every tensor"
        greedy = SamplingParams(max_tokens=4, temperature=0, logprobs=0)
        completion = llm.generate({"prompt_token_ids": PROMPT}, greedy)[0].outputs[0]
        tokens = list(completion.token_ids)
        served = torch.tensor(
            [candidates[token].logprob for token, candidates in zip(tokens, completion.logprobs or [], strict=True)]
        )
        assert torch.allclose(served, _trainer_logprobs(new, tokens), atol=1e-4)
        assert not torch.allclose(served, _trainer_logprobs(old, tokens), atol=1e-2), "the versions differ"
        with pytest.raises(Exception, match=r"model\.embed_tokens: its weight is not the published"):
            llm.collective_rpc("lockstep_check", args=(str(old / "model.safetensors"),))
    finally:
        llm.llm_engine.engine_core.shutdown()


HIDDEN, INTERMEDIATE, EXPERTS = 6, 8, 4


def published_experts_file(path: Path, *, fused: bool = False) -> dict[str, Any]:
    """A random mixture-of-experts layer's experts, saved under the checkpoint's names (one tensor per expert and
    projection) or transformers' fused ones; returns the per-expert tensors."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    shapes = {
        "gate_proj": (INTERMEDIATE, HIDDEN),
        "up_proj": (INTERMEDIATE, HIDDEN),
        "down_proj": (HIDDEN, INTERMEDIATE),
    }
    each = {
        f"layers.0.mlp.experts.{e}.{name}.weight": torch.randn(shape, generator=generator)
        for e in range(EXPERTS)
        for name, shape in shapes.items()
    }
    if fused:
        stacked = {
            name: torch.stack([each[f"layers.0.mlp.experts.{e}.{name}.weight"] for e in range(EXPERTS)])
            for name in shapes
        }
        save_file(
            {
                "layers.0.mlp.experts.gate_up_proj": torch.cat([stacked["gate_proj"], stacked["up_proj"]], 1),
                "layers.0.mlp.experts.down_proj": stacked["down_proj"],
            },
            path,
        )
    else:
        save_file(each, path)
    return each


def routed_experts(
    each: dict[str, Any], *, rank: int = 0, ranks: int = 1, held: list[int] | None = None, backend: str = "TRITON"
) -> Any:
    """A layer as vLLM's RoutedExperts holds the experts ``held`` (all by default; a subset: expert parallelism), rows
    ``rank`` of ``ranks`` of their intermediate size (tensor parallelism), in vLLM's layout, with the attributes the
    check reads; its kernel computes with those parameters, in torch."""
    import torch
    import torch.nn.functional as F

    held = list(range(EXPERTS)) if held is None else held
    rows = slice(rank * INTERMEDIATE // ranks, (rank + 1) * INTERMEDIATE // ranks)

    def weight(expert: int, name: str) -> Any:
        return each[f"layers.0.mlp.experts.{expert}.{name}.weight"]

    def apply(layer: Any, x: Any, weights: Any, routed: Any, *_: Any) -> Any:
        local = [held.index(int(expert)) for expert in routed[:, 0]]
        gate_up = torch.einsum("th,tih->ti", x, layer.w13_weight[local])
        gate, up = gate_up.chunk(2, dim=1)
        return torch.einsum("ti,thi->th", F.silu(gate) * up, layer.w2_weight[local]) * weights

    return SimpleNamespace(
        layer_name="layers.0.mlp.experts",
        ckpt_gate_proj_name="gate_proj",
        ckpt_up_proj_name="up_proj",
        ckpt_down_proj_name="down_proj",
        is_fused_checkpoint_transposed=False,
        hidden_size=HIDDEN,
        w13_weight=torch.stack([torch.cat([weight(e, "gate_proj")[rows], weight(e, "up_proj")[rows]]) for e in held]),
        w2_weight=torch.stack([weight(e, "down_proj")[:, rows] for e in held]),
        quant_method=SimpleNamespace(
            unquantized_backend=SimpleNamespace(name=backend), is_monolithic=False, apply=apply
        ),
        moe_config=SimpleNamespace(
            num_logical_experts=EXPERTS,
            activation=SimpleNamespace(value="silu"),
            is_act_and_mul=True,
            has_bias=False,
            moe_parallel_config=SimpleNamespace(
                enable_eplb=False, use_ep=len(held) < EXPERTS, dp_size=1, tp_size=ranks, tp_rank=rank
            ),
        ),
        expert_map_manager=SimpleNamespace(get_local_expert_ids=lambda: held, map_global_to_local=held.index),
    )


def test_each_tensor_parallel_rank_checks_its_rows_of_every_expert(tmp_path: Path) -> None:
    """Two ranks, each holding half of every expert's intermediate rows: both check every expert, through the kernel
    and, in vLLM's own layout, the parameters; a rank whose expert 2 has a stale up projection, or a kernel that
    reads a stale down projection, is named."""
    from safetensors import safe_open

    from lockstep_workers.actor.load_check import LoadMismatch, check_experts

    each = published_experts_file(tmp_path / "experts.safetensors")
    with safe_open(str(tmp_path / "experts.safetensors"), "pt") as published:
        names = set(published.keys())
        for rank in (0, 1):
            assert check_experts(routed_experts(each, rank=rank, ranks=2), published, names) == names
        stale = routed_experts(each, rank=1, ranks=2)
        stale.w13_weight[2, INTERMEDIATE // 2, 0] += 1  # expert 2's first up row held, a probed column
        with pytest.raises(LoadMismatch, match=r"layers\.0\.mlp\.experts: expert 2's weights are not the published"):
            check_experts(stale, published, names)
        stale.quant_method.unquantized_backend.name = "CPU"  # the layout vLLM's CPU kernel packs: only its output
        stale.w13_weight[2, INTERMEDIATE // 2, 0] -= 1
        stale.w2_weight[2] *= 1.01
        with pytest.raises(LoadMismatch, match=r"expert 2 computes with weights other than the published"):
            check_experts(stale, published, names)


def test_with_expert_parallelism_a_worker_checks_the_experts_it_holds_and_leaves_the_rest(tmp_path: Path) -> None:
    """A worker holding experts 2 and 3: it compares their parameters where vLLM keeps its layout, and leaves every
    other expert, and a fused tensor of all, unchecked (reported); its kernel, which would dispatch to the other
    workers, is not run, so with the CPU's packed layout nothing is checked, and nothing is called a mismatch."""
    from safetensors import safe_open

    from lockstep_workers.actor.load_check import check_experts

    each = published_experts_file(tmp_path / "experts.safetensors")
    published_experts_file(tmp_path / "fused.safetensors", fused=True)
    with safe_open(str(tmp_path / "experts.safetensors"), "pt") as published:
        names = set(published.keys())
        held = {name for name in names if name.startswith(("layers.0.mlp.experts.2.", "layers.0.mlp.experts.3."))}
        assert check_experts(routed_experts(each, held=[2, 3]), published, names) == held
        assert check_experts(routed_experts(each, held=[2, 3], backend="CPU"), published, names) == set()
    with safe_open(str(tmp_path / "fused.safetensors"), "pt") as published:
        names = set(published.keys())
        assert check_experts(routed_experts(each), published, names) == names, "fused: every expert held, checked"
        assert check_experts(routed_experts(each, held=[2, 3]), published, names) == set()
