"""Shared test set-up.

Triton kernels run on CPU through the interpreter when no GPU is present. The variable must be
set before `triton` is first imported, so it is set here, at the top of the root conftest.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


DEFAULT_MODEL = "models/smollm2-135m-instruct"


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests run: the GPU where there is one, else the CPU (Triton's interpreter).
    Here rather than in tests/kernels, so that a pytest call naming files of both folders in
    any order finds it."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def default_model() -> str:
    """The real default model, converted once (`make test` does it first; this lets pytest run
    on its own too)."""
    from engine.tools.prepare_default_model import main as prepare

    prepare(["--out", DEFAULT_MODEL])
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def default_tokenizer() -> str:
    """A directory with the default model's tokenizer files (the weights are not needed: the GPU
    machine gets only the tokenizer files carried over)."""
    from pathlib import Path

    if not (Path(DEFAULT_MODEL) / "tokenizer.json").is_file():
        from engine.tools.prepare_default_model import main as prepare

        prepare(["--out", DEFAULT_MODEL])
    return DEFAULT_MODEL


@pytest.fixture(scope="session")
def tiny_mla(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: str):
    """Factory of small random DeepSeek checkpoints (with the default model's tokenizer), cached
    per set of options."""
    from pathlib import Path

    from engine.tools.make_random_checkpoint import make_checkpoint

    made: dict[tuple, str] = {}

    def make(arch: str = "v2", **kwargs: object) -> str:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"ds{arch}")
            make_checkpoint(out, arch=arch, tokenizer_dir=Path(default_tokenizer), **kwargs)  # type: ignore[arg-type]
            made[key] = str(out)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: str) -> str:
    """A small random Llama checkpoint (4 query heads, 2 KV heads) with the default tokenizer."""
    from pathlib import Path

    from engine.tools.make_random_checkpoint import make_llama_checkpoint

    out = tmp_path_factory.mktemp("llama")
    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512
    )
    make_llama_checkpoint(
        out,
        tokenizer_dir=Path(default_tokenizer),
        weight_scale=0.08,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        **shape,
    )
    return str(out)
