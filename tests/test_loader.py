"""Checkpoints that do not fit the model fail to load with an error that names the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from engine import EngineConfig
from engine.config import ConfigError, ModelConfig
from engine.executor.loader import CheckpointError
from engine.executor.model_runner import ModelRunner


@pytest.fixture
def checkpoint(tiny_mla, tmp_path: Path) -> Path:
    src = Path(tiny_mla("v2", moe=True, q_lora_rank=None))
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _edit(path: Path, fn) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _load(path: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(path), max_total_tokens=32, max_running_requests=1))


def test_missing_tensor_is_named(checkpoint: Path) -> None:
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _edit(checkpoint, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
        _load(checkpoint)


def test_wrong_shape_is_named(checkpoint: Path) -> None:
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    _edit(checkpoint, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(CheckpointError, match=f"{name}.*shape"):
        _load(checkpoint)


def test_unexpected_tensor_is_named(checkpoint: Path) -> None:
    _edit(checkpoint, lambda t: t.__setitem__("model.extra.weight", t["model.norm.weight"].clone()))
    with pytest.raises(CheckpointError, match="unexpected tensor.*model.extra.weight"):
        _load(checkpoint)


def test_unsupported_architecture_is_named(checkpoint: Path) -> None:
    config_file = checkpoint / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["MambaForCausalLM"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unsupported architecture 'MambaForCausalLM'"):
        ModelConfig.from_pretrained(checkpoint)


def test_sharded_checkpoint_loads(checkpoint: Path) -> None:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half]}
    shards["model-00002-of-00002.safetensors"] = names[half:]
    (checkpoint / "model.safetensors").unlink()
    weight_map = {}
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(checkpoint / shard))
        weight_map.update({n: shard for n in shard_names})
    index = {"metadata": {}, "weight_map": weight_map}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    runner = _load(checkpoint)
    w = runner.model.get_parameter("model.norm.weight")
    assert w.detach().equal(tensors["model.norm.weight"])


def test_unknown_engine_config_key_is_named() -> None:
    with pytest.raises(ConfigError, match="unknown engine config key.*max_batch"):
        EngineConfig.from_dict({"max_batch": 3})


def test_v2_lite_preset_has_the_real_shape(tmp_path: Path) -> None:
    """`make_random_checkpoint --preset v2-lite` (GPU benchmarks): the config our loader reads."""
    from engine.tools.make_random_checkpoint import PRESETS, make_config

    config = make_config(**PRESETS["v2-lite"])
    config.architectures = ["DeepseekV2ForCausalLM"]  # what saving the model would record
    config.save_pretrained(str(tmp_path))
    mc = ModelConfig.from_pretrained(tmp_path)
    assert mc.is_mla and mc.num_hidden_layers == 27 and mc.num_attention_heads == 16
    assert (mc.kv_lora_rank, mc.qk_rope_head_dim, mc.head_dim) == (512, 64, 192)
    hf = mc.hf_config
    assert (hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == (64, 6, 1408)
    assert hf.q_lora_rank is None and hf.rope_parameters["rope_type"] == "yarn"


def _set_config(path: Path, **changes: object) -> Path:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(changes)
    config_file.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method='fp8'"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_what_the_engine_would_compute_differently_is_refused(
    checkpoint: Path, changes: dict[str, object], needle: str
) -> None:
    """Options transformers would honour and the engine would not (it would run, silently
    wrong) are refused by name."""
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_pretrained(_set_config(checkpoint, **changes))


def test_sliding_window_and_longrope_are_refused(tiny_llama: str, tmp_path: Path) -> None:
    path = Path(shutil.copytree(tiny_llama, tmp_path / "qwen2"))
    _set_config(path, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    _set_config(path, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    with pytest.raises(ConfigError, match="sliding-window attention"):
        ModelConfig.from_pretrained(path)
    # longrope: frequencies that change past original_max_position_embeddings
    path = Path(shutil.copytree(tiny_llama, tmp_path / "longrope"))
    half = ModelConfig.from_pretrained(path).head_dim // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half}
    rope.update(long_factor=[2.0] * half, original_max_position_embeddings=16)
    _set_config(path, rope_scaling=None, rope_parameters=rope)
    with pytest.raises(ConfigError, match="longrope"):
        ModelConfig.from_pretrained(path)


def test_fp8_weights_are_refused(checkpoint: Path) -> None:
    """An FP8-quantized tensor is not cast without its scales."""
    import torch

    name = "model.layers.0.self_attn.kv_b_proj.weight"
    _edit(checkpoint, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    with pytest.raises(CheckpointError, match=f"{name}.*FP8"):
        _load(checkpoint)


def test_tied_embedding_stored_twice_must_agree(checkpoint: Path) -> None:
    """config.json ties the embeddings and the checkpoint stores the LM head too: the same
    values load; different ones are refused (one would silently replace the other)."""
    _set_config(checkpoint, tie_word_embeddings=True)
    embed = "model.embed_tokens.weight"
    _edit(
        checkpoint,
        lambda t: (
            t.pop("lm_head.weight", None),
            t.__setitem__("lm_head.weight", t[embed].clone()),
        ),
    )
    _load(checkpoint)
    _edit(checkpoint, lambda t: t.__setitem__("lm_head.weight", t[embed] * 2))
    with pytest.raises(CheckpointError, match="twice with different values"):
        _load(checkpoint)


def test_corrupt_files_are_named(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        _load(checkpoint)
    (checkpoint / "config.json").write_text("{ not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_pretrained(checkpoint)
