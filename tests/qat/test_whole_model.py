"""Merging tensor-parallel shards into the whole model's tensors (what the end-of-training export of a tensor-
parallel run loads on rank 0), against shards cut from a whole model the way megatron-core lays them out."""

from __future__ import annotations

import pytest
import torch

from nemo_fp4qat.qat.parallel.whole_model import merge_tensor_parallel_shards

TP = 2
# whole-model name -> (partition dim, gated fc1); anything else is replicated
RULES = {
    "embedding.word_embeddings.weight": (0, False),  # vocabulary-parallel
    "decoder.layers.0.self_attention.linear_qkv.weight": (0, False),  # column-parallel
    "decoder.layers.0.self_attention.linear_proj.weight": (1, False),  # row-parallel
    "decoder.layers.0.mlp.linear_fc1.weight": (0, True),  # column-parallel, gate rows then up rows
    "decoder.layers.0.mlp.linear_fc2.weight": (1, False),
    "output_layer.weight": (0, False),
}


def _whole() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "embedding.word_embeddings.weight": (32, 8),
        "decoder.layers.0.self_attention.linear_qkv.weight": (24, 8),
        "decoder.layers.0.self_attention.linear_proj.weight": (8, 16),
        "decoder.layers.0.mlp.linear_fc1.weight": (24, 8),
        "decoder.layers.0.mlp.linear_fc2.weight": (8, 12),
        "output_layer.weight": (32, 8),
        "decoder.layers.0.input_layernorm.weight": (8,),
        "decoder.layers.0.mlp.linear_fc1.weight_quantizer._amax": (24, 1),  # per output channel
        "decoder.layers.0.self_attention.linear_proj.input_quantizer._pre_quant_scale": (16,),  # per input channel
    }
    whole = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    whole["decoder.layers.0.mlp.linear_fc2.input_quantizer._amax"] = torch.tensor(3.5)  # per tensor, synced
    return whole


def _shard(whole: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors as megatron-core holds them (written out here, not through the merge's rules)."""
    fc1 = "decoder.layers.0.mlp.linear_fc1"
    out = {}
    for key, t in whole.items():
        if key.startswith(fc1 + "."):  # the gated fc1 and its per-channel amax: [gate_r; up_r]
            gate, up = t.chunk(2, 0)
            out[key] = torch.cat([gate.chunk(TP, 0)[rank], up.chunk(TP, 0)[rank]])
        elif key.endswith("_pre_quant_scale"):  # the row-parallel layer's input channels
            out[key] = t.chunk(TP, 0)[rank]
        elif key in RULES:
            out[key] = t.chunk(TP, RULES[key][0])[rank]
        else:
            out[key] = t.clone()
    return out


def test_shards_merge_back_into_the_whole_model():
    whole = _whole()
    merged = merge_tensor_parallel_shards([_shard(whole, r) for r in range(TP)], RULES)
    assert merged.keys() == whole.keys()
    for key, t in whole.items():
        assert torch.equal(merged[key], t), key


def test_one_shard_is_the_whole_model():
    whole = _whole()
    assert merge_tensor_parallel_shards([whole], RULES) == whole


def test_a_replicated_tensor_that_differs_across_ranks_is_named():
    whole = _whole()
    shards = [_shard(whole, r) for r in range(TP)]
    shards[1]["decoder.layers.0.input_layernorm.weight"][0] += 1e-3
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.input_layernorm\.weight: its tensor-parallel shards"):
        merge_tensor_parallel_shards(shards, RULES)


def test_a_buffer_that_does_not_follow_its_layer_is_named():
    whole = _whole()
    shards = [_shard(whole, r) for r in range(TP)]
    for r, s in enumerate(shards):  # per-block amax of another layout: differs, but not per channel
        s["decoder.layers.0.self_attention.linear_qkv.weight_quantizer._amax"] = torch.full((5, 1), float(r))
    with pytest.raises(ValueError, match=r"linear_qkv\.weight_quantizer\._amax: .*do not follow"):
        merge_tensor_parallel_shards(shards, RULES)
