"""Write the bundled SmolLM2 GGUF as a float32 Hugging Face directory, for side-by-side runs.

vLLM loads HF directories; both engines then run identical weights. transformers refuses
to save a GGUF-loaded model, so a plain LlamaForCausalLM is built from its config and the
weights are loaded strictly (BENCHMARKING.md).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_OUT = os.path.expanduser("~/.cache/minivllm/smollm2-135m-instruct-fp32")


def prepare(out_dir: str = DEFAULT_OUT) -> str:
    if os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import torch
    import transformers

    from minivllm.model.loader import default_model_path

    folder, name = os.path.split(default_model_path())
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.save_pretrained(out_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tokenizer.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=DEFAULT_OUT)
    print(prepare(parser.parse_args().out))
