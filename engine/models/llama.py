"""Llama (and Qwen2: bias on q/k/v) with grouped-query attention over the MHA KV pool.

Tensor parallelism splits the KV heads across ranks, each taking its KV heads' groups of query
heads (uneven splits allowed: 3 KV heads over 2 ranks are 2 + 1); q/k/v and gate/up are
column-parallel (each pair or triple loaded into one weight, one GEMM), o_proj and down_proj
row-parallel, the embedding and LM head vocab-parallel.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.distributed.sharding import ShardSpec
from engine.forward_batch import ForwardBatch
from engine.layers.activation import SiluAndMul
from engine.layers.attention.base import AttentionLayer
from engine.layers.linear import (
    RowParallelLinear,
)
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import (
    DecoderLayer,
    DecoderModel,
    DecoderOnlyLM,
    MergedWeights,
    WeightTarget,
)


class LlamaMLP(MergedWeights):
    """SiLU-gated MLP, intermediate features split across ranks. `reduce_results=False` leaves
    the output a per-rank partial sum (DeepSeek's shared experts: one all-reduce for the MoE).

    The gate and up projections are one weight [2 * I, H] (this rank's gate rows, then its up
    rows), loaded from the checkpoint's gate_proj and up_proj: one GEMM, then SiLU-and-multiply.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelState,
        bias: bool = False,
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        what = "MLP intermediate features"
        start, size = parallel.shard(intermediate_size, what)
        self.shard = ShardSpec(0, start, size, intermediate_size)
        self.gate_up_proj = nn.Linear(hidden_size, 2 * size, bias=bias)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, parallel, bias, reduce_results=reduce_results, what=what
        )

    def merged_parameters(self) -> tuple[str, ...]:
        return tuple(f"gate_up_proj.{name}" for name, _ in self.gate_up_proj.named_parameters())

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        size = self.shard.size
        halves = {"gate_proj": slice(0, size), "up_proj": slice(size, 2 * size)}
        return {
            f"{proj}.{name}": WeightTarget(param.data, (rows,), self.shard)
            for proj, rows in halves.items()
            for name, param in self.gate_up_proj.named_parameters()
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(MergedWeights):
    """Grouped-query attention. q, k and v are one projection `qkv_proj` (this rank's query
    rows, then its key rows, then its value rows), loaded from the checkpoint's q_proj, k_proj
    and v_proj: one GEMM instead of three."""

    def __init__(
        self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, parallel: ParallelState
    ) -> None:
        super().__init__()
        hf = config.hf_config
        d = self.head_dim = config.head_dim
        kv_heads = config.num_key_value_heads
        group = config.num_attention_heads // kv_heads  # query heads per KV head
        # This rank's KV heads, and their groups of query heads.
        self.num_kv_heads = parallel.shard(kv_heads, "KV heads")[1]
        self.num_heads = self.num_kv_heads * group
        qkv_bias = bool(
            getattr(hf, "attention_bias", False) or config.architecture == "Qwen2ForCausalLM"
        )
        h, what = config.hidden_size, "KV heads"
        start = parallel.shard(kv_heads, what)[0]
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        # Checkpoint name -> (rows of qkv_proj, this rank's slice of the checkpoint tensor).
        q_spec = ShardSpec(0, start * group * d, self.q_size, kv_heads * group * d)
        kv_spec = ShardSpec(0, start * d, self.kv_size, kv_heads * d)
        self.qkv_parts = {
            "q_proj": (slice(0, q_end), q_spec),
            "k_proj": (slice(q_end, k_end), kv_spec),
            "v_proj": (slice(k_end, None), kv_spec),
        }
        o_bias = bool(getattr(hf, "attention_bias", False))
        self.o_proj = RowParallelLinear(
            kv_heads * group * d, h, parallel, o_bias, unit=group * d, what=what
        )
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.attn = AttentionLayer(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim,
            scaling=self.head_dim**-0.5,
        )

    def merged_parameters(self) -> tuple[str, ...]:
        return tuple(f"qkv_proj.{name}" for name, _ in self.qkv_proj.named_parameters())

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        return {
            f"{proj}.{name}": WeightTarget(param.data, (rows,), spec)
            for proj, (rows, spec) in self.qkv_parts.items()
            for name, param in self.qkv_proj.named_parameters()
        }

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # views of the fused output's rows
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary[0](positions, q, k)
        out = self.attn(q, k, v, fb)
        return self.o_proj(out.reshape(t, -1))


class LlamaDecoderLayer(DecoderLayer):
    def __init__(
        self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, parallel: ParallelState
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.self_attn = LlamaAttention(config, layer_id, rotary, parallel)
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        self.mlp = LlamaMLP(config.hidden_size, hf.intermediate_size, parallel, bias=mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(DecoderOnlyLM):
    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None) -> None:
        parallel = parallel or ParallelState()
        rotary = RotaryEmbedding(config.hf_config, config.head_dim)
        model = DecoderModel(
            config, parallel, rotary, lambda i: LlamaDecoderLayer(config, i, rotary, parallel)
        )
        super().__init__(config, model, parallel)


Qwen2ForCausalLM = LlamaForCausalLM
