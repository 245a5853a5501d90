"""The model's tokenizer: a Hugging Face ``tokenizers`` object plus the chat
template, behind fdx's :class:`~fdx.core.interfaces.Tokenizer` protocol.

Built either from a GGUF vocabulary (byte-level BPE: vocab + merges, control
tokens as specials) or from a Hugging Face folder (``tokenizer.json`` +
``tokenizer_config.json``).  Invariants: ``decode(encode(s)) == s`` for any
text the byte-level BPE covers; the chat template is rendered with Jinja2 in a
sandbox and never adds a BOS the template did not write.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Sequence

from fdx.core.errors import ModelLoadError


class ModelTokenizer:
    """Implements :class:`fdx.core.interfaces.Tokenizer`."""

    def __init__(
        self,
        tok: Any,
        *,
        chat_template: str | None,
        eos_token_ids: frozenset[int],
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool = False,
        bos_token_id: int | None = None,
        vocab_size: int | None = None,
        source: str = "",
    ) -> None:
        self._tok = tok
        self.chat_template = chat_template
        self.eos_token_ids = frozenset(eos_token_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos_token = add_bos_token
        self.bos_token_id = bos_token_id
        self.vocab_size = int(vocab_size if vocab_size is not None else tok.get_vocab_size(with_added_tokens=True))
        self.source = source
        self._template: Any = None

    # -- Tokenizer protocol ---------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # the batch encoder releases the GIL (single ``encode`` holds it), so a
        # long prompt tokenized in a worker thread never stalls the event loop
        if len(text) > 4096:
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return list(ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The Hugging Face ``tokenizer.json`` of this tokenizer (what llguidance
        reads, and what a model folder carries)."""
        return str(self._tok.to_str())

    def id_to_token(self, token_id: int) -> str:
        t = self._tok.id_to_token(int(token_id))
        return "" if t is None else t

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_vars: Any) -> str:
        """The chat template rendered; ``template_vars`` are extra template
        variables (``chat_template_kwargs``, ``tools``), below the fixed ones."""
        if not self.chat_template:
            raise ModelLoadError(f"{self.source}: the model has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render({
            **template_vars,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        })

    # -- extras ---------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Chat template rendered then encoded (special tokens are parsed
        from the text; no extra BOS is added)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


# --------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------


def tokenizer_from_gguf(fields: dict[str, Any], path: str) -> ModelTokenizer:
    """Byte-level BPE from GGUF metadata (``tokenizer.ggml.*``)."""
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(f"{path}: unsupported tokenizer model {model!r} (only byte-level BPE 'gpt2')")
    try:
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges: list[str] = fields["tokenizer.ggml.merges"]
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing tokenizer metadata {exc.args[0]!r}") from None
    types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(tokens[i], special=True, normalized=False) for i, ty in enumerate(types) if ty in (3, 4)]
    if specials:
        tok.add_special_tokens(specials)
    eos_ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        v = fields.get(key)
        if v is not None:
            eos_ids.add(int(v))
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    eos_id = fields.get("tokenizer.ggml.eos_token_id")
    return ModelTokenizer(
        tok,
        chat_template=fields.get("tokenizer.chat_template"),
        eos_token_ids=frozenset(eos_ids),
        bos_token=tokens[bos_id] if bos_id is not None and bos_id < len(tokens) else None,
        eos_token=tokens[eos_id] if eos_id is not None and eos_id < len(tokens) else None,
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        bos_token_id=int(bos_id) if bos_id is not None else None,
        vocab_size=len(tokens),
        source=path,
    )


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


def tokenizer_from_hf(folder: str, vocab_size: int | None = None) -> ModelTokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` (+ ``generation_config.json``)."""
    from tokenizers import Tokenizer

    tj = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(tj):
        raise ModelLoadError(f"{tj}: file not found (the model folder needs a tokenizer.json)")
    try:
        tok = Tokenizer.from_file(tj)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise ModelLoadError(f"{tj}: cannot parse tokenizer ({exc})") from None
    cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
    gen = _read_json(os.path.join(folder, "generation_config.json"))
    chat_template = cfg.get("chat_template")
    if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default") or next(iter(named.values()), None)
    if chat_template is None:
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                chat_template = f.read()
        else:
            chat_template = _read_json(os.path.join(folder, "chat_template.json")).get("chat_template")
    bos = _token_str(cfg.get("bos_token"))
    eos = _token_str(cfg.get("eos_token"))
    eos_ids: set[int] = set()
    g = gen.get("eos_token_id")
    if isinstance(g, int):
        eos_ids.add(g)
    elif isinstance(g, list):
        eos_ids.update(int(x) for x in g)
    if eos is not None and tok.token_to_id(eos) is not None:
        eos_ids.add(int(tok.token_to_id(eos)))
    bos_id = tok.token_to_id(bos) if bos else None
    return ModelTokenizer(
        tok,
        chat_template=chat_template,
        eos_token_ids=frozenset(eos_ids),
        bos_token=bos,
        eos_token=eos,
        add_bos_token=bool(cfg.get("add_bos_token", False)),
        bos_token_id=bos_id,
        vocab_size=vocab_size,
        source=folder,
    )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: invalid JSON ({exc})") from None
    return out if isinstance(out, dict) else {}
