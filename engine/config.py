"""Frozen configuration: what the checkpoint is (ModelConfig) and how to serve it (EngineConfig)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
)
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, read from the checkpoint's config.json.

    `hf_config` keeps the transformers config object; it is the source for anything rarely needed
    (RoPE scaling parameters are turned into frequencies by transformers' own RoPE functions).
    """

    path: str
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # MLA (DeepSeek-V2/V3); zero for other models.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    hf_config: Any = field(default=None, repr=False, compare=False)

    @property
    def is_mla(self) -> bool:
        return self.architecture in MLA_ARCHITECTURES

    @property
    def kv_cache_dim(self) -> int:
        """Values stored per token per layer for MLA: the latent plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        from transformers import AutoConfig

        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"no config.json in model directory {str(path)!r}")
        try:
            raw = json.loads(config_file.read_text())
        except ValueError as e:
            raise ConfigError(f"cannot read {str(config_file)!r}: {e}") from e
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r} in {config_file}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hf = AutoConfig.from_pretrained(str(path))
        _refuse_unsupported(hf, raw, config_file)
        eos = _eos_token_ids(path, raw)
        heads = hf.num_attention_heads
        common: dict[str, Any] = dict(
            path=str(path),
            architecture=arch,
            hidden_size=hf.hidden_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=heads,
            vocab_size=hf.vocab_size,
            max_position_embeddings=hf.max_position_embeddings,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            eos_token_ids=eos,
            hf_config=hf,
        )
        if arch in MLA_ARCHITECTURES:
            return cls(
                num_key_value_heads=heads,
                head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim,
                kv_lora_rank=hf.kv_lora_rank,
                q_lora_rank=hf.q_lora_rank,
                qk_nope_head_dim=hf.qk_nope_head_dim,
                qk_rope_head_dim=hf.qk_rope_head_dim,
                v_head_dim=hf.v_head_dim,
                **common,
            )
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        return cls(
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            **common,
        )


def _refuse_unsupported(hf: Any, raw: dict[str, Any], config_file: Path) -> None:
    """Raise ConfigError for what the engine would otherwise compute differently from the
    checkpoint's model: quantized weights, activations other than SiLU, sliding-window
    attention, and RoPE types whose frequencies change with the sequence length (longrope)."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ConfigError(
            f"quantized checkpoints are not supported (quantization_config.quant_method="
            f"{method!r} in {config_file}): use a bf16, fp16 or fp32 checkpoint"
        )
    act = getattr(hf, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ConfigError(f"hidden_act={act!r} in {config_file}: only silu is supported")
    sliding = "sliding_attention" in (getattr(hf, "layer_types", None) or [])
    if sliding or getattr(hf, "use_sliding_window", False):
        raise ConfigError(
            f"sliding-window attention (use_sliding_window / sliding_window in {config_file}) "
            "is not supported"
        )
    rope_type = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type == "longrope":
        raise ConfigError(f"rope_type 'longrope' in {config_file} is not supported")


def _eos_token_ids(path: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json (preferred, as transformers does) or config.json."""
    ids: list[int] = []
    gen_file = path / "generation_config.json"
    sources = [json.loads(gen_file.read_text())] if gen_file.is_file() else []
    sources.append(raw)
    for src in sources:
        value = src.get("eos_token_id")
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else list(value)
        break
    return tuple(int(i) for i in ids)


KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
ABSORBED_WEIGHT_DTYPES = ("auto", "fp8_e4m3")
MLA_DECODE_KERNELS = ("auto", "triton", "gluon")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("fcfs", "lpm")
ATTENTION_BACKENDS = ("auto", "torch_native", "triton")
TORCH_COMPILE_LAYERS = ("native", "kernels")
TORCH_COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
TORCH_COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs. Every field can be set from model.json or `LLM(model, **overrides)`."""

    model: str = "models/smollm2-135m-instruct"
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # "auto": cuda when available, else cpu
    kv_cache_dtype: str = "auto"  # "auto" (model dtype) or "fp8_e4m3"
    # MLA's absorbed W_UK / W_UV (w_kc, w_vc) at decode: "auto" (model dtype) or "fp8_e4m3"
    # (quantized at load time, per-output-channel fp32 scales; engine/layers/fp8_bmm.py).
    absorbed_weight_dtype: str = "auto"
    # MLA decode: "gluon", the warp-specialized Gluon kernels (Hopper GPUs, DeepSeek's latent
    # and RoPE sizes, page size 1 or a multiple of 64): over an FP8 cache
    # engine/kernels/mla_decode_gluon.py (1.19-1.27x the Triton kernel at batch >= 16 past 1K
    # of context on an H200, perf/RESULTS.md run AK), over a 16-bit cache at 64+ query heads a
    # GPU engine/kernels/mla_decode_gluon_wide.py (about 2x at 128 heads, run AM), below that
    # the first one without its converter (1.00-2.21x FlashMLA bf16 on an H100, run AO); "triton"
    # (the kernel every GPU runs); or "auto": a Gluon kernel where one serves, else Triton.
    mla_decode_kernel: str = "auto"
    page_size: int = 1
    mem_fraction: float = 0.85  # of free device memory for weights + KV (CUDA only)
    max_total_tokens: int | None = None  # KV slots; None: measured (CUDA) or 16384 (CPU)
    max_running_requests: int = 256
    max_context_len: int | None = None  # None (and the most): the model's max_position_embeddings
    chunked_prefill_size: int = 2048
    schedule_policy: str = "lpm"
    attention_backend: str = "auto"  # "auto", "torch_native" or "triton"
    enable_cuda_graph: bool = True
    cuda_graph_max_bs: int = 256
    # torch.compile of the decode forward for batches of up to torch_compile_max_bs requests
    # (engine/executor/compile.py): inside the CUDA graphs on CUDA, called directly elsewhere.
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    # What the compiled forward runs for the norms, activation, RoPE, MLA preamble and router:
    # "native" their torch code, fused by inductor; "kernels" the hand-written Triton kernels as
    # opaque custom ops. Attention, the KV store and the fused MoE are custom ops either way.
    torch_compile_layers: str = "native"
    torch_compile_backend: str = "inductor"  # "aot_eager" / "eager": no code generation (tests)
    torch_compile_mode: str = "default"
    # Inductor's cache (compiled kernels and graphs), so that a restart compiles nothing; None:
    # $TORCHINDUCTOR_CACHE_DIR if set, else ~/.cache/mla-engine/inductor.
    torch_compile_cache_dir: str | None = None
    tp_size: int = 1
    seed: int = 0
    disable_radix_cache: bool = False
    max_tokens_cap: int | None = None  # a request asking for more max_tokens is refused
    # Token ids in and out only (vLLM's skip_tokenizer_init): no tokenizer is loaded, prompts
    # must be token ids, outputs carry no text, stop strings are refused.
    skip_tokenizer_init: bool = False
    debug_checks: bool = False  # run the KV-slot integrity check whenever the engine is idle
    # A log line (INFO) per prefill batch and per this many decode steps (SGLang's
    # decode_log_interval): engine/batch_log.py. 0: none.
    decode_log_interval: int = 40
    # The overlap schedule: step n+1 is queued on the device before step n's tokens are
    # processed, so scheduling, detokenizing and streaming run while the device computes. None:
    # on with CUDA (any tp_size). True runs it on a CPU as well (nothing is hidden there).
    enable_overlap: bool | None = None
    # Serving only (the Triton model): run the engine in a child process (`python3 -m
    # engine.engine_process`) instead of inside the Python-backend stub, whose embedded
    # libpython ran Python 1.6-1.7x slower (engine/engine_process.py). LLM and AsyncEngine
    # ignore it.
    engine_process: bool = True
    # CUDA graphs with tp_size > 1: every rank captures the same sizes at start-up and replays in
    # step with rank 0, the NCCL collectives inside the graphs. Off until it has run on two GPUs.
    cuda_graph_with_tp: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        if self.absorbed_weight_dtype not in ABSORBED_WEIGHT_DTYPES:
            raise ConfigError(
                f"absorbed_weight_dtype must be one of {ABSORBED_WEIGHT_DTYPES}, "
                f"got {self.absorbed_weight_dtype!r}"
            )
        if self.mla_decode_kernel not in MLA_DECODE_KERNELS:
            raise ConfigError(
                f"mla_decode_kernel must be one of {MLA_DECODE_KERNELS}, "
                f"got {self.mla_decode_kernel!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, "
                f"got {self.attention_backend!r}"
            )
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ConfigError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        for name in (
            "page_size",
            "max_running_requests",
            "chunked_prefill_size",
            "tp_size",
            "torch_compile_max_bs",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.page_size & (self.page_size - 1):
            raise ConfigError(f"page_size must be a power of two, got {self.page_size}")
        if self.decode_log_interval < 0:
            raise ConfigError(f"decode_log_interval must be >= 0, got {self.decode_log_interval}")
        if self.max_context_len is not None and self.max_context_len < 2:
            raise ConfigError(f"max_context_len must be >= 2, got {self.max_context_len}")
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ConfigError(f"max_tokens_cap must be >= 1, got {self.max_tokens_cap}")
        if self.max_total_tokens is not None and self.max_total_tokens < max(2, self.page_size):
            raise ConfigError(
                f"max_total_tokens must be >= 2 and hold one page (page_size {self.page_size}), "
                f"got {self.max_total_tokens}"
            )
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ConfigError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        for name, choices in (
            ("torch_compile_layers", TORCH_COMPILE_LAYERS),
            ("torch_compile_backend", TORCH_COMPILE_BACKENDS),
            ("torch_compile_mode", TORCH_COMPILE_MODES),
        ):
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.torch_compile_mode != "default" and self.torch_compile_backend != "inductor":
            raise ConfigError(
                f"torch_compile_mode={self.torch_compile_mode!r} needs "
                f"torch_compile_backend='inductor', got {self.torch_compile_backend!r}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        """Build from a dict (model.json), rejecting unknown keys by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown engine config key(s): {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**values)

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# --- engine settings of a served model: model.json + LLM_<FIELD> environment overrides ----------

ENV_PREFIX = "LLM_"


def load_engine_config(
    model_json: Path, repo_root: Path, environ: Mapping[str, str] | None = None
) -> EngineConfig:
    """The served model's EngineConfig: `engine_config_dict` checked by `EngineConfig.from_dict`,
    each JSON value against its field's type first."""
    values = engine_config_dict(model_json, repo_root, environ)
    types = {f.name: str(f.type) for f in fields(EngineConfig)}
    for name, value in values.items():
        if name in types and not _of_type(value, types[name]):
            raise ConfigError(f"{name}={value!r}: expected a value of type {types[name]}")
    return EngineConfig.from_dict(values)


def engine_config_dict(
    model_json: Path, repo_root: Path, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """EngineConfig values from model.json, overridden by `LLM_<FIELD>` environment variables.

    `LLM_MAX_TOTAL_TOKENS=4096` sets `max_total_tokens`; values are parsed by the field's type
    (`none` or an empty string clears an optional field). A relative `model` path is resolved
    against `repo_root` (the folder holding the model repository). Unknown keys in model.json are
    left in for `EngineConfig.from_dict` to reject by name.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = json.loads(model_json.read_text()) if model_json.is_file() else {}
    if not isinstance(values, dict):
        raise ConfigError(f"{model_json} must hold a JSON object of EngineConfig fields")
    for f in fields(EngineConfig):
        raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            values[f.name] = _parse_env_value(f.name, str(f.type), raw)
    model = values.get("model", EngineConfig.model)
    if model and not Path(model).is_absolute():
        values["model"] = str((repo_root / model).resolve())
    return values


def _of_type(value: Any, type_name: str) -> bool:
    """Whether a JSON value fits a field typed `bool`, `int`, `float` or `str`, each maybe
    `| None` (a string "auto" for a bool would otherwise read as true)."""
    if value is None:
        return "None" in type_name
    base = type_name.split("|")[0].strip()
    if base == "bool":
        return isinstance(value, bool)
    if base == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return base != "str" or isinstance(value, str)


def _parse_env_value(name: str, type_name: str, raw: str) -> Any:
    text = raw.strip()
    if "None" in type_name and text.lower() in ("", "none", "null"):
        return None
    try:
        if type_name.startswith("bool"):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if type_name.startswith("int"):
            return int(text)
        if type_name.startswith("float"):
            return float(text)
    except ValueError:
        var = ENV_PREFIX + name.upper()
        raise ConfigError(f"{var}={raw!r}: expected a value of type {type_name}") from None
    return raw
