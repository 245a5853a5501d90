"""Benchmark prompts: ``random``, ``shared-prefix`` and ``jsonl``.

Prompts of the synthetic datasets are built from *whole-word* tokens of the
model's own vocabulary (byte-level BPE tokens ``Ġword``, lower-case letters
only, that re-encode to themselves).  The byte-level pre-tokenizer splits
text before every `` word``, so a prompt made of N such tokens re-tokenizes
to exactly N tokens: the same prompt can be sent as token ids or as text and
the server sees exactly ``prompt_len`` tokens either way.

Every prompt starts with a nonce (run id + request index), because peers
(llama.cpp's server) answer a repeated prompt from their prompt cache.  In
``shared-prefix`` the nonce sits at the start of each *group's* system
prompt, so the prefix is shared inside a group and never across runs.

Invariants: ``len(sample.token_ids) == sample.prompt_len`` for synthetic
samples, and ``tokenizer.encode(sample.text) == sample.token_ids``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from typing import Any, Sequence

import attrs
import numpy as np

_WORD = re.compile(r"Ġ[a-z]{2,}")


@attrs.frozen
class SampleRequest:
    """One prompt to send.  ``messages`` is set for chat-only samples."""

    text: str
    prompt_len: int
    output_len: int | None  # None: let the server decide (jsonl without a length)
    token_ids: tuple[int, ...] | None = None
    system: str | None = None  # shared-prefix: the group's system prompt (chat endpoint)
    user: str | None = None  # shared-prefix: the question (chat endpoint)
    messages: tuple[dict[str, Any], ...] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        if self.system is not None:
            return [{"role": "system", "content": self.system}, {"role": "user", "content": self.user or ""}]
        return [{"role": "user", "content": self.text}]


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of ``model`` (``None``/``smollm2``: the embedded GGUF; a
    ``.gguf`` file; a Hugging Face folder).  Uses the model helper's
    ``fdx.model.loader.load_tokenizer`` when present.  Never imports Paddle."""
    try:
        from fdx.model.loader import load_tokenizer as _load  # type: ignore[attr-defined]
    except ImportError:
        _load = None
    if _load is not None:
        return _load(model)
    from fdx.model.source import resolve

    src = resolve(model)
    if src.kind == "gguf":
        from fdx.model.gguf_file import GGUFFile
        from fdx.model.tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(GGUFFile(src.path).fields, src.path)
    from fdx.model.tokenizer import tokenizer_from_hf

    return tokenizer_from_hf(src.path)


class WordVocab:
    """Token ids of whole lower-case words (`` word``) that round-trip alone."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        ids = []
        n = int(getattr(tokenizer, "vocab_size", 0))
        for i in range(n):
            piece = tokenizer.id_to_token(i)
            if piece and _WORD.fullmatch(piece):
                ids.append(i)
        # keep those that re-encode to themselves (checked in one batch of text)
        if ids:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            if tokenizer.encode(text) != ids:
                ids = [i for i in ids if tokenizer.encode(tokenizer.decode([i])) == [i]]
        if len(ids) < 100:
            raise ValueError(
                f"the tokenizer has only {len(ids)} whole-word tokens (byte-level BPE 'Ġword' expected); "
                "use --dataset jsonl"
            )
        self.ids = np.asarray(ids, dtype=np.int64)

    def words(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.choice(self.ids, size=n)] if n > 0 else []


def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float) -> np.ndarray:
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo = max(1, int(round(mean * (1.0 - ratio))))
    hi = max(lo, int(round(mean * (1.0 + ratio))))
    return rng.integers(lo, hi + 1, size=n)


def _prompt(tok: Any, vocab: WordVocab, rng: np.random.Generator, head: str, length: int) -> tuple[str, list[int]]:
    """``head`` (nonce text) then whole words, ``length`` tokens in all."""
    head_ids = tok.encode(head)
    if len(head_ids) >= length:  # tiny prompts: random words alone (unique enough)
        ids = vocab.words(rng, length)
        return tok.decode(ids), ids
    ids = head_ids + vocab.words(rng, length - len(head_ids))
    text = tok.decode(ids)
    return text, ids


def random_dataset(
    tokenizer: Any,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    nonce: str | None = None,
    vocab: WordVocab | None = None,
    output_range_ratio: float | None = None,
) -> list[SampleRequest]:
    """``num_prompts`` prompts of ``input_len * [1-r, 1+r]`` tokens, asking
    for ``output_len * [1-r', 1+r']`` tokens (``r'`` defaults to ``r``)."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = np.random.default_rng(seed)
    vocab = vocab or WordVocab(tokenizer)
    nonce = nonce or secrets.token_hex(4)
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_ratio = range_ratio if output_range_ratio is None else output_range_ratio
    out_lens = _lengths(rng, num_prompts, output_len, out_ratio)
    out = []
    for i in range(num_prompts):
        text, ids = _prompt(tokenizer, vocab, rng, f"Run {nonce} request {i}:", int(in_lens[i]))
        out.append(SampleRequest(text=text, prompt_len=len(ids), output_len=int(out_lens[i]), token_ids=tuple(ids)))
    return out


def shared_prefix_dataset(
    tokenizer: Any,
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
    nonce: str | None = None,
    vocab: WordVocab | None = None,
) -> list[SampleRequest]:
    """``num_groups`` long system prompts; requests go round-robin over the
    groups and each adds its own ``suffix_len``-token question."""
    if num_groups < 1 or prefix_len < 1 or suffix_len < 1 or output_len < 1:
        raise ValueError("--shared-prefix-groups/-len/-suffix-len and the output length must be >= 1")
    rng = np.random.default_rng(seed)
    vocab = vocab or WordVocab(tokenizer)
    nonce = nonce or secrets.token_hex(4)
    prefixes = [_prompt(tokenizer, vocab, rng, f"Run {nonce} group {g}. System:", prefix_len) for g in range(num_groups)]
    out = []
    for i in range(num_prompts):
        ptext, pids = prefixes[i % num_groups]
        qids = vocab.words(rng, suffix_len)
        qtext = tokenizer.decode(qids)
        ids = pids + qids
        out.append(
            SampleRequest(
                text=ptext + qtext,
                prompt_len=len(ids),
                output_len=output_len,
                token_ids=tuple(ids),
                system=ptext,
                user=qtext.lstrip(),
            )
        )
    return out


def jsonl_dataset(
    path: str,
    num_prompts: int,
    tokenizer: Any | None = None,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """One prompt per line: a JSON string, or an object with ``prompt`` (str)
    or ``messages`` (chat), and optionally ``max_tokens``/``output_len``.
    Fewer lines than ``num_prompts`` are cycled."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: file not found")
    rows: list[SampleRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from None
            rows.append(_jsonl_row(obj, tokenizer, output_len, f"{path}:{lineno}"))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [rows[i % len(rows)] for i in range(num_prompts)]


def _jsonl_row(obj: Any, tokenizer: Any | None, output_len: int | None, where: str) -> SampleRequest:
    messages = None
    if isinstance(obj, str):
        text = obj
        out_len = output_len
    elif isinstance(obj, dict):
        out_len = obj.get("output_len", obj.get("max_tokens", output_len))
        if out_len is not None and (not isinstance(out_len, int) or out_len < 1):
            raise ValueError(f"{where}: output_len/max_tokens must be a positive integer")
        if isinstance(obj.get("prompt"), str):
            text = obj["prompt"]
        elif isinstance(obj.get("messages"), list):
            messages = tuple(obj["messages"])
            text = "\n".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        else:
            raise ValueError(f"{where}: expected a 'prompt' string or a 'messages' list")
    else:
        raise ValueError(f"{where}: expected a JSON string or object")
    n = 0
    if tokenizer is not None:
        if messages is not None and getattr(tokenizer, "chat_template", None):
            try:
                n = len(tokenizer.encode_chat(list(messages)))
            except Exception:  # noqa: BLE001 - a template error only loses the estimate
                n = len(tokenizer.encode(text))
        else:
            n = len(tokenizer.encode(text))
    return SampleRequest(text=text, prompt_len=n, output_len=out_len, messages=messages)


def check_exact(tokenizer: Any, samples: Sequence[SampleRequest]) -> None:
    """Assert the synthetic invariant (used by tests)."""
    for s in samples:
        if s.token_ids is not None:
            assert tokenizer.encode(s.text) == list(s.token_ids), s.text[:80]
            assert len(s.token_ids) == s.prompt_len
