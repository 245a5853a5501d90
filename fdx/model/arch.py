"""Architecture description shared by the loaders and the forward pass."""

from __future__ import annotations

import attrs

SUPPORTED_ARCHS = ("llama", "qwen2")


@attrs.frozen
class ModelArgs:
    """Geometry of a decoder-only Llama-family transformer.

    Weights handed to the model use Hugging Face conventions: linear weights
    are ``[out, in]`` and q/k rows are in HF order (NEOX "rotate_half" RoPE).
    """

    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = False
    attention_bias: bool = False

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def describe(self) -> str:
        return (
            f"{self.arch} L{self.num_layers} d{self.hidden_size} ff{self.intermediate_size} "
            f"h{self.num_heads}/kv{self.num_kv_heads}x{self.head_dim} V{self.vocab_size}"
        )
