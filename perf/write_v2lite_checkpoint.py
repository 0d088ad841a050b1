"""Write a random DeepSeek-V2-Lite-shaped checkpoint straight into safetensors shards.

Every tensor is drawn on the device in the checkpoint's dtype (bf16) with `normal_` and saved
under the checkpoint's own names (`model.layers.N.mlp.experts.E.gate_proj.weight`, ...), shard by
shard, with a `model.safetensors.index.json`: no fp32 model through transformers, so the full
27-layer shape (15.7B parameters, 31 GB) takes well under a minute on a GPU. The config comes
from `engine.tools.make_random_checkpoint` (the `v2-lite` preset, vocabulary 102400); the
tokenizer files are copied from the default model's directory (ids beyond its vocabulary decode
to nothing, which is fine for prompts of random ids).

    python3 perf/write_v2lite_checkpoint.py --out /tmp/bench-v2lite [--layers 8] [--tiny]

An existing directory written with the same config is reused as it is.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.tools.make_random_checkpoint import PRESETS, make_config  # noqa: E402

TOKENIZER_DIR = REPO / "models" / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
INDEX = "model.safetensors.index.json"
V2_LITE_VOCAB = 102400
# A few-second CPU shape with the same structure (dense first layer, routed + shared experts,
# YaRN, q_lora_rank None). Its vocabulary is larger than the tokenizer's on purpose: ids beyond
# the tokenizer then appear in prompts and outputs, as they do with the full shape.
TINY: dict[str, Any] = dict(
    layers=2,
    hidden_size=128,
    heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    intermediate_size=256,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=2560,
    yarn=True,
)
TINY_VOCAB = 51200


def checkpoint_config(layers: int | None = None, tiny: bool = False) -> Any:
    """The transformers DeepseekV2Config of the checkpoint (V2-Lite's shape, or the tiny one)."""
    shape = dict(TINY if tiny else PRESETS["v2-lite"])
    if layers is not None:
        shape["layers"] = layers
    config = make_config(arch="v2", vocab_size=TINY_VOCAB if tiny else V2_LITE_VOCAB, **shape)
    config.architectures = ["DeepseekV2ForCausalLM"]
    config.bos_token_id, config.eos_token_id = (1, 2) if tiny else (100000, 100001)
    config.pad_token_id = None
    config.dtype = "bfloat16"
    return config


def tensor_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a DeepSeek-V2 checkpoint, in the checkpoint's order."""
    c = config
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c.vocab_size, h))]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.append((p + "input_layernorm.weight", (h,)))
        if c.q_lora_rank is None:
            out.append((p + "self_attn.q_proj.weight", (heads * qk, h)))
        else:
            out.append((p + "self_attn.q_a_proj.weight", (c.q_lora_rank, h)))
            out.append((p + "self_attn.q_a_layernorm.weight", (c.q_lora_rank,)))
            out.append((p + "self_attn.q_b_proj.weight", (heads * qk, c.q_lora_rank)))
        kv_b_rows = heads * (c.qk_nope_head_dim + c.v_head_dim)
        out += [
            (p + "self_attn.kv_a_proj_with_mqa.weight", (c.kv_lora_rank + c.qk_rope_head_dim, h)),
            (p + "self_attn.kv_a_layernorm.weight", (c.kv_lora_rank,)),
            (p + "self_attn.kv_b_proj.weight", (kv_b_rows, c.kv_lora_rank)),
            (p + "self_attn.o_proj.weight", (h, heads * c.v_head_dim)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if i < c.first_k_dense_replace:
            out += _mlp(p + "mlp.", h, c.intermediate_size)
            continue
        out.append((p + "mlp.gate.weight", (c.n_routed_experts, h)))
        for e in range(c.n_routed_experts):
            out += _mlp(f"{p}mlp.experts.{e}.", h, c.moe_intermediate_size)
        if c.n_shared_experts:
            inter = c.moe_intermediate_size * c.n_shared_experts
            out += _mlp(p + "mlp.shared_experts.", h, inter)
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (c.vocab_size, h))]
    return out


def _mlp(prefix: str, hidden: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (prefix + "gate_proj.weight", (inter, hidden)),
        (prefix + "up_proj.weight", (inter, hidden)),
        (prefix + "down_proj.weight", (hidden, inter)),
    ]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan_shards(
    shapes: list[tuple[str, tuple[int, ...]]], shard_bytes: int, itemsize: int = 2
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of at most `shard_bytes` (one tensor may exceed)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in shapes:
        nbytes = _numel(shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_checkpoint(
    out: Path,
    layers: int | None = None,
    tiny: bool = False,
    device: str = "auto",
    seed: int = 0,
    std: float = 0.02,
    shard_bytes: int = 4 << 30,
    tokenizer_dir: Path = TOKENIZER_DIR,
) -> dict[str, Any]:
    """Write (or reuse) the checkpoint in `out`; returns what was done, with timings.

    Matrices are N(0, std) (0.02: larger stds grow the residual stream layer after layer at this
    width), norm weights are ones. The index file is written last, so a directory with an index
    and the same config.json is complete.
    """
    config = checkpoint_config(layers, tiny)
    config_text = config.to_json_string()
    shapes = tensor_shapes(config)
    params = sum(_numel(s) for _, s in shapes)
    info: dict[str, Any] = dict(
        path=str(out), layers=config.num_hidden_layers, tiny=tiny, params=params, bytes=params * 2
    )
    cfg_file = out / "config.json"
    if (out / INDEX).is_file() and cfg_file.is_file() and cfg_file.read_text() == config_text:
        index = json.loads((out / INDEX).read_text())
        if all((out / f).is_file() for f in set(index["weight_map"].values())):
            return dict(info, reused=True, write_s=0.0)
    missing = [f for f in TOKENIZER_FILES[:2] if not (tokenizer_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{', '.join(missing)} not in {tokenizer_dir}: carry the tokenizer files of the "
            "default model (models/smollm2-135m-instruct/tokenizer.json, tokenizer_config.json, "
            "chat_template.jinja)"
        )
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.safetensors"), out / INDEX]:
        old.unlink(missing_ok=True)

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    gen = torch.Generator(dev).manual_seed(seed)
    t0 = time.perf_counter()
    shards = plan_shards(shapes, shard_bytes)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=params * 2, desc="writing checkpoint", unit="B", unit_scale=True)
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in shard:
            if len(shape) == 1:  # norm weights
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(shape, dtype=torch.bfloat16, device=dev)
                t.normal_(0.0, std, generator=gen)
                t = t.cpu()
            tensors[name] = t
            weight_map[name] = file
            bar.update(t.numel() * 2)
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    bar.close()
    cfg_file.write_text(config_text)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    index_doc = {"metadata": {"total_size": params * 2}, "weight_map": weight_map}
    (out / INDEX).write_text(json.dumps(index_doc, indent=2))
    return dict(info, reused=False, write_s=time.perf_counter() - t0, shards=len(shards))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-v2lite"))
    ap.add_argument("--layers", type=int, default=None, help="cut the depth (default: 27)")
    ap.add_argument("--tiny", action="store_true", help="a small shape for CPU tests")
    ap.add_argument("--device", default="auto", help="where the weights are drawn")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    info = write_checkpoint(a.out, a.layers, a.tiny, a.device, a.seed)
    print(json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
