#!/usr/bin/env python3
"""Beam-search goldens for tests/test_beam_search.py, from transformers.

Runs transformers' ``generate(num_beams=W, do_sample=False)`` in float32 on
the embedded SmolLM2 GGUF (transformers' GGUF loader dequantizes it to
float32: the same weights ``fdx serve --dtype float32`` computes with) and
writes, for each prompt and width, the ``W`` best sequences (generated token
ids, eos included when a beam finished on it) and their scores
(``sum_logprobs / generated_len ** length_penalty``), best first, to
``tests/data/beam_goldens.json``.

The prompts are tokenized by fdx's own tokenizer (transformers' GGUF
tokenizer splits digits differently, see /work/shared/notes/model.md), in
a child process of the fdx Python, and transformers gets the ids: no bos is
added (``add_bos_token = False``), eos is 2 (``<|im_end|>``), pad is 2.

Usage (torch + transformers + gguf in one Python, fdx in another)::

    FDX_PYTHON=/work/main/.venv/bin/python /work/golden-venv/bin/python scripts/make_beam_goldens.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "beam_goldens.json"

#: (name, kind, text): ``chat`` prompts go through the chat template
PROMPTS = [
    ("capital", "chat", "What is the capital of France?"),
    ("language", "text", "The best way to learn a new language is"),
    ("fib", "text", "def fibonacci(n):"),
]
#: (width, max_new_tokens, length_penalty, early_stopping) for every prompt
CASES = [(2, 20, 1.0, False), (4, 20, 1.0, False)]
#: extra cases per prompt: length_penalty and early_stopping semantics (``capital`` ends beams on eos)
EXTRA = {
    "language": [(4, 20, 0.5, True), (4, 20, 2.0, "never")],
    "capital": [(4, 20, 1.0, True), (4, 24, 0.0, "never"), (2, 20, 2.0, False)],
}


def tokenize() -> None:
    """Child mode (the fdx Python): prompts on stdin -> ids + GGUF path on stdout."""
    sys.path.insert(0, str(ROOT))
    from fdx.model.loader import load_tokenizer
    from fdx.model.source import embedded_gguf_path

    tok = load_tokenizer(None)
    out = []
    for name, kind, text in json.load(sys.stdin):
        if kind == "chat":
            ids = tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            ids = tok.encode(text)
        out.append({"name": name, "kind": kind, "text": text, "prompt_token_ids": list(map(int, ids))})
    json.dump({"gguf": embedded_gguf_path(), "prompts": out, "eos_token_ids": sorted(tok.eos_token_ids)},
              sys.stdout)


def main() -> int:
    fdx_python = os.environ.get("FDX_PYTHON", "/work/main/.venv/bin/python")
    child = subprocess.run([fdx_python, __file__, "--tokenize"], input=json.dumps(PROMPTS), text=True,
                           capture_output=True, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    info = json.loads(child.stdout)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    gguf = info["gguf"]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32)
    model.eval()
    eos = info["eos_token_ids"]
    assert eos == [2], eos
    goldens = []
    for p in info["prompts"]:
        cases = CASES + EXTRA.get(p["name"], [])
        for width, max_new, lp, es in cases:
            ids = torch.tensor([p["prompt_token_ids"]], dtype=torch.long)
            # a fresh config: no model defaults (repetition penalty, min length, ...) beyond these
            gc = GenerationConfig(num_beams=width, num_return_sequences=width, do_sample=False,
                                  max_new_tokens=max_new, length_penalty=lp, early_stopping=es,
                                  eos_token_id=eos[0], pad_token_id=eos[0], bos_token_id=1,
                                  output_scores=True, return_dict_in_generate=True)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
            n_prompt = ids.shape[1]
            beams = []
            for j in range(width):
                n_gen = int((out.beam_indices[j] >= 0).sum())  # the real length (pad == eos)
                toks = out.sequences[j, n_prompt : n_prompt + n_gen].tolist()
                beams.append({"token_ids": toks, "score": float(out.sequences_scores[j])})
            goldens.append({**p, "width": width, "max_tokens": max_new, "length_penalty": lp,
                            "early_stopping": es, "beams": beams})
            print(p["name"], width, lp, es, [(len(b["token_ids"]), round(b["score"], 4)) for b in beams], flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    import transformers

    OUT.write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                               "dtype": "float32", "goldens": goldens}, indent=1) + "\n")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--tokenize"]:
        tokenize()
        sys.exit(0)
    sys.exit(main())
