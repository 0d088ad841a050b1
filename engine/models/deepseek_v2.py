"""DeepSeek-V2 / V2-Lite / V3: Multi-head Latent Attention over the latent KV pool, and MoE.

Each token stores one row per layer: the compressed latent c_kv (kv_lora_rank) and the shared
RoPE key k_pe (qk_rope_head_dim). Two attention paths read it:
- decompressing (prefill): up-project the context's latents with kv_b_proj into per-head K and V
  and run ordinary multi-head attention (head dim qk_nope + qk_rope for K, v_head_dim for V);
- absorbed (decode): fold W_UK into the query (q_nope @ W_UK -> latent space) so every head attends
  to the latent rows directly (multi-query attention, one KV head of width kv_lora_rank + rope),
  then apply W_UV to the attention output. No per-head K or V is ever materialised.

Tensor parallelism (as in SGLang): the attention heads are split across ranks (q_proj / q_b_proj
and kv_b_proj column-parallel by heads, so W_UK and W_UV are split too; o_proj row-parallel);
kv_a_proj_with_mqa, q_a_proj and the norms are replicated, so every rank computes and stores the
same full latent rows. MoE experts are split along their intermediate dim (TP-MoE), the router is
replicated, and one all-reduce sums routed plus shared experts.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.parallel_state import ParallelState
from engine.distributed.sharding import ShardSpec
from engine.forward_batch import ForwardBatch
from engine.kernels.custom_ops import mla_preamble
from engine.kernels.custom_ops_fp8 import bmm_fp8
from engine.kernels.fused_moe import SharedExperts, shared_expert_slots
from engine.kernels.mla_preamble import ABSORB_MAX_TOKENS, mla_preamble_absorb
from engine.kernels.moe_router import NORM_GATE_MAX_TOKENS, norm_gate_logits
from engine.kernels.small_gemm import small_gemm_wanted, small_matmul
from engine.layers.attention.base import AttentionLayer
from engine.layers.fp8_bmm import bmm_fp8_native, check_fp8_absorbed_weights, quantize_per_channel
from engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    linear,
)
from engine.layers.moe import Experts, TopkRouter
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import (
    DecoderLayer,
    DecoderModel,
    DecoderOnlyLM,
    MergedWeights,
    WeightTarget,
    default_targets,
)
from engine.models.llama import LlamaMLP


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(hf: Any, qk_head_dim: int) -> float:
    """1/sqrt(qk_head_dim), times YaRN's mscale^2 when the context is stretched (V2-Lite, V3)."""
    scaling = qk_head_dim**-0.5
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = _yarn_mscale(params["factor"], params["mscale_all_dim"])
        scaling *= m * m
    return scaling


class MLAAttention(MergedWeights):
    def __init__(
        self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, parallel: ParallelState
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.layer_id = layer_id
        heads = config.num_attention_heads
        self.num_heads = h = parallel.shard(heads, "attention heads")[1]  # this rank's
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = r = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_head_dim = config.head_dim
        bias = bool(getattr(hf, "attention_bias", False))
        hidden = config.hidden_size
        what = "attention heads"
        q_out = heads * qk_head_dim
        # q_proj (q_a_proj with a query LoRA) and kv_a_proj_with_mqa read the same input: one
        # GEMM computes both (SGLang's fused_qkv_a_proj_with_mqa); `checkpoint_targets` loads
        # the checkpoint's tensors into its rows. q_proj is this rank's heads, the rest whole.
        self.q_shard: ShardSpec | None = None
        if self.q_lora_rank is None:
            start = parallel.shard(heads, what)[0]
            self.q_a_size = h * qk_head_dim
            self.q_shard = ShardSpec(0, start * qk_head_dim, self.q_a_size, q_out)
        else:
            self.q_a_size = self.q_lora_rank
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, q_out, parallel, False, qk_head_dim, what
            )
        kv_a_size = r + self.qk_rope_head_dim
        self.fused_qkv_a_proj_with_mqa = nn.Linear(hidden, self.q_a_size + kv_a_size, bias=bias)
        if bias:  # q_proj has none: its rows of the bias stay zero
            nn.init.zeros_(self.fused_qkv_a_proj_with_mqa.bias)
        self.kv_a_layernorm = RMSNorm(r)
        kv_unit = self.qk_nope_head_dim + self.v_head_dim
        self.kv_b_proj = ColumnParallelLinear(r, heads * kv_unit, parallel, False, kv_unit, what)
        self.o_proj = RowParallelLinear(
            heads * self.v_head_dim, hidden, parallel, bias, unit=self.v_head_dim, what=what
        )
        self.rotary = [rotary]
        scaling = mla_softmax_scale(hf, qk_head_dim)
        self.attn_mha = AttentionLayer(layer_id, h, h, qk_head_dim, self.v_head_dim, scaling)
        self.attn_mqa = AttentionLayer(layer_id, h, 1, r + self.qk_rope_head_dim, r, scaling)
        # Filled by post_load from kv_b_proj: W_UK [H, nope, r] and W_UV [H, v, r]; with
        # `fp8_absorbed` (absorbed_weight_dtype="fp8_e4m3") both in e4m3, with fp32 scales per
        # output channel of their GEMM: [H, r] for w_kc, [H, v] for w_vc.
        self.w_kc = torch.empty(0)
        self.w_vc = torch.empty(0)
        self.fp8_absorbed = False
        self.w_kc_scale: torch.Tensor | None = None
        self.w_vc_scale: torch.Tensor | None = None
        # Tests flip this to run prefill through the absorbed path too.
        self.absorb_extend = False
        # "auto": the preamble kernel (latent norm + RoPE) and in-place query assembly on CUDA,
        # the torch code elsewhere ("triton" / "native" force one, for tests).
        self.kernel = "auto"

    def merged_parameters(self) -> tuple[str, ...]:
        fused = self.fused_qkv_a_proj_with_mqa
        return tuple(f"fused_qkv_a_proj_with_mqa.{name}" for name, _ in fused.named_parameters())

    def checkpoint_targets(self) -> dict[str, WeightTarget]:
        fused = self.fused_qkv_a_proj_with_mqa
        q_rows, kv_rows = slice(0, self.q_a_size), slice(self.q_a_size, None)
        q_name = "q_proj" if self.q_lora_rank is None else "q_a_proj"
        targets = {
            f"{q_name}.weight": WeightTarget(fused.weight.data, (q_rows,), self.q_shard),
            "kv_a_proj_with_mqa.weight": WeightTarget(fused.weight.data, (kv_rows,)),
        }
        if fused.bias is not None:
            targets["kv_a_proj_with_mqa.bias"] = WeightTarget(fused.bias.data, (kv_rows,))
            if self.q_lora_rank is not None:
                targets["q_a_proj.bias"] = WeightTarget(fused.bias.data, (q_rows,))
        return targets

    def post_load(self) -> None:
        w = self.kv_b_proj.weight.detach()
        w = w.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        self.w_kc = w[:, : self.qk_nope_head_dim].contiguous()
        self.w_vc = w[:, self.qk_nope_head_dim :].contiguous()
        self.w_kc_scale = self.w_vc_scale = None
        if self.fp8_absorbed:  # the bf16 copies are dropped (prefill reads kv_b_proj)
            self.w_kc, self.w_kc_scale = quantize_per_channel(self.w_kc, reduce_dim=1)
            self.w_vc, self.w_vc_scale = quantize_per_channel(self.w_vc, reduce_dim=2)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        fused = self.fused_qkv_a_proj_with_mqa
        q, kv_a = linear(x, fused.weight, fused.bias, self.kernel).split(
            [self.q_a_size, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1
        )
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(t, h, -1)  # a view of the fused output's rows without a query LoRA
        absorbed = fb.is_decode or self.absorb_extend
        if self.kernel == "triton" or (self.kernel == "auto" and x.is_cuda):
            out = self._forward_fused(positions, q, kv_a, absorbed, fb)
        else:
            q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
            c_kv, k_pe = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            c_kv = self.kv_a_layernorm(c_kv)
            q_pe, k_pe = self.rotary[0](positions, q_pe, k_pe.unsqueeze(1))
            latent = torch.cat([c_kv.unsqueeze(1), k_pe], dim=-1)  # [T, 1, r + rope]
            if absorbed:
                q_latent = self._q_latent_native(q_nope)
                q_abs = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, r + rope]
                out = self._attend_absorbed(q_abs, latent, fb, fused=False)
            else:
                out = self._forward_decompressed(q_nope, q_pe, latent, fb)
        return self.o_proj(out.reshape(t, h * self.v_head_dim))

    def _forward_fused(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        kv_a: torch.Tensor,
        absorbed: bool,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """The CUDA path: the latent norm, both RoPEs and the latent row in one kernel; the
        absorbed query is assembled in place (rotated q_pe and q_nope @ W_UK written into its
        columns), so nothing is concatenated. A decode step's few tokens get W_UK in the same
        launch (`mla_preamble_absorb`)."""
        rotary, norm = self.rotary[0], self.kv_a_layernorm
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        t, h, r = q.shape[0], self.num_heads, self.kv_lora_rank
        q_abs = q.new_empty(t, h, r + self.qk_rope_head_dim) if absorbed else None
        # The absorbed path's latent rows go straight into the pool (no store launch), eagerly.
        store = None
        if absorbed and not torch.compiler.is_compiling():
            store = fb.attn_backend.mla_store_target(self.layer_id, fb)
        if q_abs is not None and store is not None and self._absorb_in_preamble(q_nope):
            latent = mla_preamble_absorb(
                kv_a, q, self.w_kc, q_abs, norm.weight, norm.eps, positions, rotary.inv_freq,
                rotary.attention_scaling, rotary.interleaved, store=store,
            )  # fmt: skip
            return self._attend_absorbed(q_abs, latent.unsqueeze(1), fb, fused=True, stored=True)
        latent, q_pe = mla_preamble(
            kv_a,
            q_pe,
            norm.weight,
            norm.eps,
            positions,
            rotary.inv_freq,
            rotary.attention_scaling,
            rotary.interleaved,
            q_pe_out=None if q_abs is None else q_abs[..., r:],
            store=store,
        )
        if q_abs is None:
            return self._forward_decompressed(q_nope, q_pe, latent.unsqueeze(1), fb)
        x, dst = q_nope.transpose(0, 1), q_abs[..., :r].transpose(0, 1)  # [H, T, nope], [H, T, r]
        if torch.compiler.is_compiling():  # dynamo traces no `out=` into a strided view
            if self.w_kc_scale is not None:
                dst.copy_(bmm_fp8(x, self.w_kc, self.w_kc_scale))
            else:
                q_abs[..., :r] = torch.bmm(x, self.w_kc).transpose(0, 1)
        elif self.w_kc_scale is not None:
            bmm_fp8(x, self.w_kc, self.w_kc_scale, out=dst)
        else:
            self._bmm(x, self.w_kc, dst)
        return self._attend_absorbed(
            q_abs, latent.unsqueeze(1), fb, fused=True, stored=store is not None
        )

    def _absorb_in_preamble(self, q_nope: torch.Tensor) -> bool:
        """Whether W_UK runs inside the preamble's launch: a decode step's few tokens, bf16 (or
        fp16) absorbed weights on the kernel path, a power-of-two nope dim."""
        nope = self.qk_nope_head_dim
        if q_nope.shape[0] > ABSORB_MAX_TOKENS or self.w_kc_scale is not None or nope & (nope - 1):
            return False
        return small_gemm_wanted(q_nope.transpose(0, 1), self.w_kc, self.kernel)

    def _bmm(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """out = x [H, T, K] @ w [H, K, N] per head (the absorbed weights, eager CUDA path):
        a decode step's few rows on the small-M kernel, else cuBLAS."""
        if small_gemm_wanted(x, w, self.kernel):
            small_matmul(x, w, out=out)
        else:
            torch.bmm(x, w, out=out)

    def _q_latent_native(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, H, nope] @ W_UK per head -> [T, H, r] (the layer's torch path)."""
        if self.w_kc_scale is None:
            return torch.einsum("thn,hnr->thr", q_nope, self.w_kc)
        return _bmm_fp8_any(q_nope.transpose(0, 1), self.w_kc, self.w_kc_scale).transpose(0, 1)

    def _attend_absorbed(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        fb: ForwardBatch,
        fused: bool,
        stored: bool = False,
    ) -> torch.Tensor:
        """q [T, H, r + rope] over the latent rows; W_UV applied to the output -> [T, H, v]
        (`fused`: written by the GEMM into a contiguous [T, H, v], so o_proj reads it as is, and
        at decode by the attention backend; `stored`: the rows are in the pool already)."""
        w_vc_t, scale = self.w_vc.transpose(1, 2), self.w_vc_scale
        if fused and fb.is_decode and scale is None:
            # The backend applies W_UV (the kernels merge the splits and project in one launch)
            return self.attn_mqa(q, latent, None, fb, stored=stored, value_proj=w_vc_t)
        out_latent = self.attn_mqa(q, latent, None, fb, stored=stored)  # [T, H, r]
        x = out_latent.transpose(0, 1)
        if not fused:
            if scale is None:
                return torch.einsum("thr,hvr->thv", out_latent, self.w_vc)
            return _bmm_fp8_any(x, w_vc_t, scale).transpose(0, 1)
        if torch.compiler.is_compiling():  # as above
            y = torch.bmm(x, w_vc_t) if scale is None else bmm_fp8(x, w_vc_t, scale)
            return y.transpose(0, 1).contiguous()
        out = out_latent.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        if scale is None:
            self._bmm(x, w_vc_t, out.transpose(0, 1))
        else:
            bmm_fp8(x, w_vc_t, scale, out=out.transpose(0, 1))
        return out

    def _forward_decompressed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        fb.attn_backend.store_kv(self.layer_id, fb, latent, None)
        if any(fb.prefix_lens_cpu):
            ctx, _ = fb.attn_backend.gather_context(self.layer_id, fb)  # [S, 1, r + rope]
        else:  # no cached prefix: the new rows themselves (no read-back, no FP8 dequantizing)
            ctx = latent.reshape(latent.shape[0], 1, -1)
        s, h = ctx.shape[0], self.num_heads
        c_ctx, kpe_ctx = ctx.squeeze(1).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c_ctx).view(s, h, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        # The RoPE dims apart (k_pe one row for every head): nothing concatenated.
        rope = (q_pe, kpe_ctx.unsqueeze(1))
        return fb.attn_backend.forward_extend_ragged(q_nope, k_nope, v, self.attn_mha, fb, rope)


def _bmm_fp8_any(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 absorbed GEMM of the layer's torch path: the kernel all the same on CUDA (where
    torch_compile_layers="native" traces the torch path), since the torch code would upcast the
    whole weight every call and read more bytes than the bf16 GEMM it replaces."""
    if x.is_cuda:
        return bmm_fp8(x, w, scale)
    return bmm_fp8_native(x, w, scale)


class DeepseekMoE(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelState) -> None:
        super().__init__()
        hf = config.hf_config
        num_experts = _num_routed_experts(hf)
        inter = hf.moe_intermediate_size
        is_v3 = config.architecture == "DeepseekV3ForCausalLM"
        self.parallel = parallel
        self.gate = TopkRouter(hf, config.hidden_size, num_experts, is_v3)
        self.experts = Experts(num_experts, config.hidden_size, inter, parallel)
        n_shared = getattr(hf, "n_shared_experts", None) or 0
        self.shared_experts: LlamaMLP | None = (
            LlamaMLP(config.hidden_size, inter * n_shared, parallel, reduce_results=False)
            if n_shared
            else None
        )

    def forward(self, x: torch.Tensor, gate_partials: torch.Tensor | None = None) -> torch.Tensor:
        """`gate_partials`: the router's gate logits, computed with the norm (`norm_gate`)."""
        folded = self._folded_shared_experts(x)
        if folded is not None:
            # One fused MoE call runs the shared experts too, as always-on experts.
            slots = shared_expert_slots(folded, self.experts.intermediate_size)
            weights, ids = self.gate(x, num_shared=slots, gate_partials=gate_partials)
            out = self.experts(x, weights, ids, shared_experts=folded)
        else:
            weights, ids = self.gate(x, gate_partials=gate_partials)
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            out = self.experts(x, weights, ids, shared)
        return self.parallel.all_reduce(out)  # each rank's output is a partial sum

    def norm_gate(
        self, norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`norm.forward_add(x, residual)` and the gate logits in one launch (a decode step's
        few tokens, eagerly, every piece on its kernel), else None."""
        if x.shape[0] > NORM_GATE_MAX_TOKENS or torch.compiler.is_compiling():
            return None
        if not (norm.uses_kernel(x) and self.gate.uses_kernel(x)) or x.dim() != 2:
            return None
        if not (x.dtype == residual.dtype == norm.weight.dtype):
            return None
        if x.stride(1) != 1 or residual.stride(1) != 1:
            return None
        return norm_gate_logits(x, residual, norm.weight, norm.eps, self.gate.weight)

    def _folded_shared_experts(self, x: torch.Tensor) -> SharedExperts | None:
        """The shared MLP's weights when the router and the experts both run as kernels and the
        MLP splits into whole experts of this rank's intermediate size, else None."""
        mlp = self.shared_experts
        if mlp is None or not (self.gate.uses_kernel(x) and self.experts.uses_kernel(x)):
            return None
        if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
            return None
        folded = SharedExperts(mlp.gate_up_proj.weight, mlp.down_proj.weight)
        if shared_expert_slots(folded, self.experts.intermediate_size) == 0:
            return None
        return folded


def _num_routed_experts(hf: Any) -> int:
    for name in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = getattr(hf, name, None)
        if value:
            return int(value)
    raise ValueError("DeepSeek config names no routed expert count (n_routed_experts)")


class DeepseekDecoderLayer(DecoderLayer):
    def __init__(
        self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, parallel: ParallelState
    ) -> None:
        super().__init__()
        hf = config.hf_config
        self.self_attn = MLAAttention(config, layer_id, rotary, parallel)
        is_moe = _is_moe(hf) and layer_id >= (getattr(hf, "first_k_dense_replace", 0) or 0)
        self.mlp: nn.Module = (
            DeepseekMoE(config, parallel)
            if is_moe
            else LlamaMLP(config.hidden_size, hf.intermediate_size, parallel)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def mlp_block(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """At decode, the norm and the MoE's gate logits in one launch (DeepseekMoE.norm_gate)."""
        fused = None
        if isinstance(self.mlp, DeepseekMoE):
            fused = self.mlp.norm_gate(self.post_attention_layernorm, x, residual)
        if fused is None:
            return super().mlp_block(x, residual)
        x, residual, partials = fused
        return self.mlp(x, gate_partials=partials), residual


def _is_moe(hf: Any) -> bool:
    try:
        return _num_routed_experts(hf) > 0
    except ValueError:
        return False


class DeepseekV2ForCausalLM(DecoderOnlyLM):
    def __init__(self, config: ModelConfig, parallel: ParallelState | None = None) -> None:
        parallel = parallel or ParallelState()
        hf = config.hf_config
        interleaved = config.architecture == "DeepseekV2ForCausalLM" or bool(
            getattr(hf, "rope_interleave", True)
        )
        rotary = RotaryEmbedding(hf, config.qk_rope_head_dim, interleaved=interleaved)
        model = DecoderModel(
            config, parallel, rotary, lambda i: DeepseekDecoderLayer(config, i, rotary, parallel)
        )
        super().__init__(config, model, parallel)

    def weight_targets(self) -> dict[str, WeightTarget]:
        targets = default_targets(self, skip=("experts.w13_weight", "experts.w2_weight"))
        for i, layer in enumerate(self.model.layers):
            if not isinstance(layer.mlp, DeepseekMoE):
                continue
            experts = layer.mlp.experts
            inter = experts.intermediate_size  # this rank's
            rows, cols = experts.shard_specs()  # of gate/up [I, H] and of down [H, I]
            for e in range(experts.num_experts):
                prefix = f"model.layers.{i}.mlp.experts.{e}."
                w13, w2 = experts.w13_weight.data, experts.w2_weight.data
                gate, up = (e, slice(0, inter)), (e, slice(inter, None))
                targets[prefix + "gate_proj.weight"] = WeightTarget(w13, gate, rows)
                targets[prefix + "up_proj.weight"] = WeightTarget(w13, up, rows)
                targets[prefix + "down_proj.weight"] = WeightTarget(w2, (e,), cols)
        return targets

    def post_load(self) -> None:
        super().post_load()
        for attn in self.mla_layers():
            attn.post_load()

    def set_absorbed_weight_dtype(self, name: str, device: torch.device) -> None:
        """Before loading: "fp8_e4m3" makes post_load quantize every layer's w_kc and w_vc."""
        if name == "auto":
            return
        check_fp8_absorbed_weights(device)
        for attn in self.mla_layers():
            attn.fp8_absorbed = True

    def set_absorb_extend(self, enabled: bool) -> None:
        for attn in self.mla_layers():
            attn.absorb_extend = enabled

    def mla_layers(self) -> list[MLAAttention]:
        return [cast(MLAAttention, layer.self_attn) for layer in self.model.layers]


DeepseekV3ForCausalLM = DeepseekV2ForCausalLM
