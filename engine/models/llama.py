"""Llama (and Qwen2: bias on q/k/v) with grouped-query attention over the MHA KV pool."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.executor.forward_batch import ForwardBatch
from engine.layers.attention.base import AttentionLayer
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import CausalLM, WeightTarget, default_targets


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = config.hf_config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_bias = bool(
            getattr(hf, "attention_bias", False) or config.architecture == "Qwen2ForCausalLM"
        )
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        o_bias = bool(getattr(hf, "attention_bias", False))
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=o_bias)
        self.rotary = [rotary]  # a list so the shared module is not registered once per layer
        self.attn = AttentionLayer(
            layer_id,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.head_dim,
            scaling=self.head_dim**-0.5,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary[0](positions, q, k)
        out = self.attn(q, k, v, fb)
        return self.o_proj(out.reshape(t, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hf = config.hf_config
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        mlp_bias = bool(getattr(hf, "mlp_bias", False))
        self.mlp = LlamaMLP(config.hidden_size, hf.intermediate_size, bias=mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), fb)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.hf_config, config.head_dim)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary_emb) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(positions, x, fb)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, positions, fb):
        return self.model(input_ids, positions, fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def weight_targets(self) -> dict[str, WeightTarget]:
        return default_targets(self)

    def tied_weights(self) -> dict[str, str]:
        if self.config.tie_word_embeddings:
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    def post_load(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


Qwen2ForCausalLM = LlamaForCausalLM
