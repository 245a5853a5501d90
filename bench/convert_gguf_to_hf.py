#!/usr/bin/env python3
"""Convert a GGUF (default: the embedded SmolLM2-135M Q4_1) into a Hugging Face
model folder that vLLM can load, with transformers' GGUF loader (dequantized to
float32; vLLM serves it in bf16).  Run it with a Python that has transformers,
torch, accelerate and gguf (bench/build_vllm_peer.sh uses the vLLM venv).

Usage:  convert_gguf_to_hf.py GGUF OUT_DIR
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    gguf, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype="float32")
    # the weights are dequantized already; save_pretrained refuses while a quantizer is attached
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out + ".partial"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    for root, _dirs, files in os.walk(tmp):  # save_pretrained writes some files 0600
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    os.replace(tmp, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
