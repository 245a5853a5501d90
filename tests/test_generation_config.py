"""``--generation-config`` / ``--override-generation-config``
(fdx/generation_config.py): where the sampling defaults come from, what is
refused, and that a request's own fields win (sampling_params)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fdx.config import make_config
from fdx.core.errors import ConfigError
from fdx.generation_config import load_generation_defaults, parse_override
from fdx.request_params import sampling_params
from fdx.server.protocol import ChatCompletionRequest


def test_embedded_model_gets_its_model_card_sampling() -> None:
    d = load_generation_defaults("auto", "smollm2")
    assert d.values() == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 512}
    assert "smollm2" in d.source and d.ignored == ()
    assert load_generation_defaults("vllm", "smollm2").values() == {}


def test_hf_folder_and_path(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
         "top_k": 20, "max_new_tokens": 64, "transformers_version": "4.45"}))
    d = load_generation_defaults("auto", str(tmp_path))
    assert d.values() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert d.ignored == ("bos_token_id", "do_sample", "eos_token_id", "transformers_version")
    # a PATH: the folder or the file itself, whatever the model
    for path in (tmp_path, tmp_path / "generation_config.json"):
        assert load_generation_defaults(str(path), "smollm2").values()["temperature"] == 0.6
    # an override on top
    d = load_generation_defaults("auto", str(tmp_path), parse_override('{"temperature": 0, "repetition_penalty": 1.1}'))
    assert d.values()["temperature"] == 0 and d.values()["repetition_penalty"] == 1.1
    assert "--override-generation-config" in d.source
    # a value out of range in the file is an error naming file and key
    (tmp_path / "generation_config.json").write_text('{"top_p": 1.5}')
    with pytest.raises(ConfigError, match="top_p"):
        load_generation_defaults("auto", str(tmp_path))


@pytest.mark.parametrize("raw,needle", [
    ('{"num_beams": 4}', "num_beams"),
    ('{"temperature": 0.5, "do_sample": true}', "do_sample"),
    ('{"temperature": -1}', "temperature"),
    ('{"top_k": true}', "top_k"),
    ('{"max_new_tokens": 0}', "max_new_tokens"),
    ('[1, 2]', "JSON object"),
    ('{"temperature": ', "not valid JSON"),
])
def test_override_errors_name_the_key(raw: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        make_config(override_generation_config=raw)
    assert "--override-generation-config" in str(e.value)


def test_generation_config_flag_values(tmp_path: Path) -> None:
    assert make_config(generation_config="vllm").generation_config == "vllm"
    with pytest.raises(ConfigError, match="--generation-config"):
        make_config(generation_config=str(tmp_path / "missing"))
    (tmp_path / "generation_config.json").write_text("{}")
    assert make_config(generation_config=str(tmp_path)).generation_config == str(tmp_path)


def test_request_fields_win_over_defaults() -> None:
    d = load_generation_defaults("vllm", None, parse_override(
        '{"temperature": 0.3, "top_p": 0.8, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2}'))
    msgs = [{"role": "user", "content": "hi"}]
    bare = sampling_params(ChatCompletionRequest(messages=msgs), max_tokens=8, num_logprobs=None,
                           max_logprobs=20, vocab_size=100, defaults=d)
    assert (bare.temperature, bare.top_p, bare.top_k, bare.min_p, bare.repetition_penalty) == (0.3, 0.8, 5, 0.1, 1.2)
    mine = sampling_params(ChatCompletionRequest(messages=msgs, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                                                 repetition_penalty=1.0),
                           max_tokens=8, num_logprobs=None, max_logprobs=20, vocab_size=100, defaults=d)
    assert (mine.temperature, mine.top_p, mine.top_k, mine.min_p, mine.repetition_penalty) == (0.0, 1.0, 0, 0.0, 1.0)
    none = sampling_params(ChatCompletionRequest(messages=msgs), max_tokens=8, num_logprobs=None, max_logprobs=20,
                           vocab_size=100)
    assert (none.temperature, none.top_p) == (1.0, 1.0)
