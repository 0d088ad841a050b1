"""Write a small random DeepSeek-V2 or V3 checkpoint (config.json, model.safetensors, tokenizer)
with transformers' own classes, for tests and demos.

    python -m engine.tools.make_random_checkpoint --out models/tiny-dsv2 --arch v2 --layers 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

DEFAULT_TOKENIZER = Path("models/smollm2-135m-instruct")


# Real models' shapes (random weights): `--preset v2-lite --layers 8` is DeepSeek-V2-Lite with 8
# of its 27 layers, for GPU benchmarks (the vocabulary is the tokenizer's, not V2-Lite's 102400).
PRESETS: dict[str, dict[str, Any]] = {
    "v2-lite": dict(
        layers=27,
        hidden_size=2048,
        heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        first_k_dense_replace=1,
        max_position_embeddings=163840,
        yarn=True,
    ),
}


def make_config(
    arch: str = "v2",
    layers: int = 3,
    hidden_size: int = 128,
    heads: int = 4,
    kv_lora_rank: int = 32,
    q_lora_rank: int | None = None,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 16,  # GPU tensor-core dots need K >= 16
    v_head_dim: int = 16,
    intermediate_size: int | None = None,  # None: 2 x hidden
    moe_intermediate_size: int | None = None,  # None: hidden / 2
    moe: bool = True,
    n_routed_experts: int = 8,
    num_experts_per_tok: int = 2,
    n_shared_experts: int = 1,
    first_k_dense_replace: int = 1,
    vocab_size: int = 49152,
    max_position_embeddings: int = 2048,
    yarn: bool = False,
) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or hidden_size * 2,
        moe_intermediate_size=moe_intermediate_size or hidden_size // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        n_routed_experts=n_routed_experts if moe else None,
        num_experts_per_tok=num_experts_per_tok,
        n_shared_experts=n_shared_experts,
        first_k_dense_replace=first_k_dense_replace if moe else layers,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    if yarn:
        # V2-Lite's proportions: a 40x stretch of the original context.
        original = max(max_position_embeddings // 40, 64)
        kwargs["max_position_embeddings"] = original * 40
        kwargs["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": original,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        }
    if arch == "v3":
        groups = 4 if n_routed_experts % 4 == 0 else 1
        kwargs.update(n_group=groups, topk_group=min(2, groups), norm_topk_prob=True)
        kwargs["routed_scaling_factor"] = 2.5
        return DeepseekV3Config(**kwargs)
    return DeepseekV2Config(**kwargs)


def make_llama_checkpoint(
    out: Path,
    seed: int = 0,
    tokenizer_dir: Path | None = DEFAULT_TOKENIZER,
    weight_scale: float | None = None,
    **overrides: Any,
) -> Path:
    """A random Llama with SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads) unless
    overridden; for benchmarks where the real weights cannot travel, and for tests.
    `weight_scale`: std of the matrices (None: transformers' own initialisation)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    shape: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    shape.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    if weight_scale is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, weight_scale)
    model.save_pretrained(str(out))
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


def make_checkpoint(
    out: Path,
    arch: str = "v2",
    seed: int = 0,
    weight_scale: float = 0.08,
    tokenizer_dir: Path | None = DEFAULT_TOKENIZER,
    save_dtype: torch.dtype = torch.float32,
    **config_kwargs: Any,
) -> Path:
    """Random weights with std `weight_scale` (large enough that logits are far from uniform),
    saved in `save_dtype`."""
    from transformers import AutoTokenizer, DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    config = make_config(arch=arch, **config_kwargs)
    config.initializer_range = weight_scale
    torch.manual_seed(seed)
    cls = DeepseekV3ForCausalLM if arch == "v3" else DeepseekV2ForCausalLM
    model = cls(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                continue
            if p.dim() >= 2:
                p.normal_(0.0, weight_scale)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)  # exercise the V3 bias in routing
    model.to(save_dtype).save_pretrained(str(out))
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arch", choices=("v2", "v3", "llama"), default="v2")
    p.add_argument(
        "--preset", choices=sorted(PRESETS), help="a real model's shape (other sizes ignored)"
    )
    p.add_argument("--layers", type=int, default=None, help="default 3, or the preset's")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-lora-rank", type=int, default=32)
    p.add_argument("--q-lora-rank", type=int, default=None, help="omit for None (V2-Lite)")
    p.add_argument("--no-moe", action="store_true")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--yarn", action="store_true", help="YaRN RoPE scaling as in V2-Lite")
    p.add_argument("--weight-scale", type=float, default=0.08)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    a = p.parse_args(argv)
    if a.arch == "llama":
        make_llama_checkpoint(a.out, seed=a.seed, tokenizer_dir=a.tokenizer)
        print(f"wrote {a.out}")
        return 0
    if a.preset:
        shape = dict(PRESETS[a.preset])
        if a.layers is not None:
            shape["layers"] = a.layers
        make_checkpoint(
            a.out,
            arch=a.arch,
            seed=a.seed,
            weight_scale=0.02,  # std 0.08 would grow the residual stream ~4x a layer at this size
            tokenizer_dir=a.tokenizer,
            save_dtype=torch.bfloat16,
            **shape,
        )
        print(f"wrote {a.out}")
        return 0
    make_checkpoint(
        a.out,
        arch=a.arch,
        seed=a.seed,
        weight_scale=a.weight_scale,
        tokenizer_dir=a.tokenizer,
        layers=a.layers or 3,
        hidden_size=a.hidden_size,
        heads=a.heads,
        kv_lora_rank=a.kv_lora_rank,
        q_lora_rank=a.q_lora_rank,
        moe=not a.no_moe,
        n_routed_experts=a.experts,
        num_experts_per_tok=a.top_k,
        yarn=a.yarn,
    )
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
