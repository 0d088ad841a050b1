"""What every model offers the runner and the loader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ConfigError, ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.distributed.sharding import ShardSpec
from engine.forward_batch import ForwardBatch
from engine.layers.linear import ParallelLMHead, ShardedModule, VocabParallelEmbedding
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: `param[index]` (index None: the whole parameter).

    `shard`, under tensor parallelism: only this slice of the checkpoint tensor is loaded (the
    checkpoint holds the full tensor; the destination holds this rank's part).
    """

    param: torch.Tensor
    index: tuple[int | slice, ...] | None = None
    shard: ShardSpec | None = None

    def view(self) -> torch.Tensor:
        return self.param if self.index is None else self.param[self.index]


class CausalLM(nn.Module):
    """A decoder-only model over the KV pool.

    `forward` returns the final hidden states [T, hidden] of every input token; the runner picks
    rows and calls `compute_logits`. `weight_targets` maps every checkpoint tensor name the model
    needs to its destination; the loader fails on names that are missing or unexpected.
    """

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_targets(self) -> dict[str, WeightTarget]:
        raise NotImplementedError

    def tied_weights(self) -> dict[str, str]:
        """Checkpoint names that are aliases of another (a tied LM head and embedding): either
        name may be stored, and one of the two must be."""
        return {}

    def post_load(self) -> None:
        """Derive weights after loading (MLA's absorbed projections, tied heads)."""

    def set_absorbed_weight_dtype(self, name: str, device: torch.device) -> None:
        """`EngineConfig.absorbed_weight_dtype`, set before loading. Only MLA models have
        absorbed weights (W_UK, W_UV): the others accept nothing but "auto"."""
        if name != "auto":
            raise ConfigError(
                f"absorbed_weight_dtype={name!r} applies to MLA models (DeepSeek-V2/V3) only; "
                f"{type(self).__name__} has no absorbed weights"
            )


class MergedWeights(nn.Module):
    """A module whose parameters are not named as in the checkpoint: it packs several
    checkpoint tensors into one parameter (the MLP's gate and up projections, so that one GEMM
    computes both). `checkpoint_targets()` maps each checkpoint name, relative to the module,
    to its place in the parameters named by `merged_parameters()` (relative names too), which
    `default_targets` then leaves out; the module's other parameters keep their own names."""

    def merged_parameters(self) -> tuple[str, ...]:
        raise NotImplementedError

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        raise NotImplementedError


def default_targets(module: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, WeightTarget]:
    """Checkpoint names equal to parameter names (the common case), minus `skip` substrings.
    Parameters of sharded modules (parallel linears) carry their module's shard spec; those of
    `MergedWeights` modules are named by the module itself."""
    shards: dict[str, ShardSpec] = {}
    targets: dict[str, WeightTarget] = {}
    merged: set[str] = set()
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(sub, ShardedModule):
            for pname, spec in sub.shard_specs().items():
                shards[dot + pname] = spec
        if isinstance(sub, MergedWeights):
            merged |= {dot + pname for pname in sub.merged_parameters()}
            targets |= {dot + name: t for name, t in sub.checkpoint_targets().items()}
    for name, param in module.named_parameters():
        if name not in merged and not any(s in name for s in skip):
            targets[name] = WeightTarget(param.data, shard=shards.get(name))
    return targets


class DecoderLayer(nn.Module):
    """A pre-norm decoder layer: attention, then MLP, each after an RMSNorm.

    The residual stream is carried beside the hidden states (as in SGLang and vLLM): a layer
    takes (x, residual) and returns (mlp_out, residual), and the add that closes each block is
    done by the next norm (`RMSNorm.forward_add`, one kernel on CUDA), the last one by the
    model's final norm. `residual` is None for the first layer: its input is the embedding.
    Subclasses set `self_attn`, `mlp`, `input_layernorm` and `post_attention_layernorm`.
    """

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_add(x, residual)
        x = self.self_attn(positions, x, fb)
        return self.mlp_block(x, residual)

    def mlp_block(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP after its norm, which closes the attention block's residual add."""
        x, residual = self.post_attention_layernorm.forward_add(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """The body every model here shares: embedding, decoder layers, final norm.

    `make_layer(i)` builds layer i, a `DecoderLayer`.
    """

    def __init__(
        self,
        config: ModelConfig,
        parallel: ParallelState,
        rotary: RotaryEmbedding,
        make_layer: Callable[[int], DecoderLayer],
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.rotary_emb = rotary
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, fb)
        if residual is None:
            return self.norm(x)
        return self.norm.forward_add(x, residual)[0]


class DecoderOnlyLM(CausalLM):
    """`model` (a DecoderModel) plus a vocab-parallel LM head, tied to the embedding when the
    checkpoint says so. Checkpoint names are the module names (model.layers.N..., lm_head)."""

    def __init__(self, config: ModelConfig, model: DecoderModel, parallel: ParallelState) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
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
