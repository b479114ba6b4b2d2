"""ModernBERT encoders (transformers' ModernBertModel and
ModernBertForSequenceClassification): the encoder under newer embedding models and
rerankers, with an 8k context.

What sets it apart from BERT (runtime/models/bert.py):

- pre-norm layers (the first layer's attention reads the embeddings unnormalized), a final
  norm, and no biases by default (`norm_bias`, `attention_bias`, `mlp_bias`);
- rotary positions instead of a position table, with one theta for the global layers and
  another for the local ones;
- every `global_attn_every_n_layers`-th layer (counting from 0) attends over the whole
  input, the others over a band: a query sees the keys at most `local_attention // 2`
  positions away (transformers' bidirectional sliding-window mask, both ends inclusive);
- a gated MLP (GeGLU: one projection split into the activated input and its gate);
- no token types: a pair's second segment is told apart by its separator only, so the
  type ids a tokenizer hands over are accepted and ignored, as transformers' own
  tokenizer for it leaves them out;
- the classification head pools first ([CLS], `classifier_pooling` "cls") or averages
  the row's tokens ("mean"), then dense -> activation -> norm -> classifier.

Batches are left-padded (runtime/models/encoder.py): a row's positions count from its
first token, and in column terms the band is the same for every row, so a piece no wider
than the band runs the local layers as global ones (the CPU attention primitive), and a
wider one runs MLX's attention under the band and the padding as one mask.

Weights keep transformers' names, except that the layer list is `blocks` (`layers` is the
encoder protocol's method) and a checkpoint's "model." prefix is dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.nn.layers.activations import gelu, gelu_approx, relu, silu
from mlx.nn.layers.base import Module
from mlx.nn.layers.embedding import Embedding
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import LayerNorm

from runtime import kernels as cpu_kernels
from runtime.models.bert import classification_labels
from runtime.models.encoder import bidirectional_attention, first_token, key_mask


def _exact_gelu(x: mx.array) -> mx.array:
    """The erf GELU (transformers' "gelu"), on the CPU kernels' threads where they run."""
    out = cpu_kernels.gelu_erf(x)
    return gelu(x) if out is None else out


_ACTIVATIONS: Mapping[str, Callable[[mx.array], mx.array]] = {
    "gelu": _exact_gelu,
    "gelu_new": gelu_approx,
    "gelu_pytorch_tanh": gelu_approx,
    "relu": relu,
    "silu": silu,
}
_POOLINGS = ("cls", "mean")


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_activation: str
    global_layers: tuple[bool, ...]  # per layer: attends over the whole input
    window: int  # a local layer's query sees keys at most this far away
    global_theta: float
    local_theta: float
    pad_token_id: int
    num_labels: int  # 0: no classification head (an embedding model)
    classifier_pooling: str = "cls"
    classifier_activation: str = "gelu"
    classifier_bias: bool = False

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def type_vocab_size(self) -> int:
        """Two: a pair's type ids are taken (and ignored, the model has no type table),
        so a cross-encoder's (query, document) pairs pass the runner's check."""
        return 2

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelArgs:
        layers = int(config["num_hidden_layers"])
        hidden_act = str(config.get("hidden_activation", "gelu"))
        head_act = str(config.get("classifier_activation", "gelu"))
        for act in (hidden_act, head_act):
            if act not in _ACTIVATIONS:
                known = ", ".join(_ACTIVATIONS)
                raise ValueError(f"unsupported ModernBERT activation {act!r}; supported: {known}")
        pooling = str(config.get("classifier_pooling", "cls"))
        if pooling not in _POOLINGS:
            raise ValueError(f"unsupported classifier_pooling {pooling!r}; supported: cls, mean")
        global_theta, local_theta = _thetas(config)
        return cls(
            model_type=str(config.get("model_type", "modernbert")),
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=layers,
            num_heads=int(config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
            norm_eps=float(config.get("norm_eps", 1e-5)),
            norm_bias=bool(config.get("norm_bias", False)),
            attention_bias=bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
            hidden_activation=hidden_act,
            global_layers=_global_layers(config, layers),
            window=int(config.get("local_attention", 128)) // 2,
            global_theta=global_theta,
            local_theta=local_theta,
            pad_token_id=int(config.get("pad_token_id") or 0),
            num_labels=classification_labels(config),
            classifier_pooling=pooling,
            classifier_activation=head_act,
            classifier_bias=bool(config.get("classifier_bias", False)),
        )


def _global_layers(config: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers attend globally: config.json's `layer_types` (transformers 5 writes
    it), else every `global_attn_every_n_layers`-th from the first (the older key)."""
    types = config.get("layer_types")
    if types:
        if len(types) != layers:
            raise ValueError(f"layer_types names {len(types)} layers; the model has {layers}")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"unsupported ModernBERT layer types {sorted(unknown)}")
        return tuple(t == "full_attention" for t in types)
    every = int(config.get("global_attn_every_n_layers", 3))
    return tuple(i % every == 0 for i in range(layers))


def _thetas(config: Mapping[str, Any]) -> tuple[float, float]:
    """(global, local) rope thetas: transformers 5's `rope_parameters` per layer type, else
    the older `global_rope_theta` / `local_rope_theta` (a null local theta: the global
    one, as the original model code reads it). Only plain RoPE is supported."""
    if config.get("rope_scaling"):
        raise ValueError("ModernBERT with rope_scaling is not supported")
    params = config.get("rope_parameters")
    global_theta = float(config.get("global_rope_theta") or 160_000.0)
    local = config.get("local_rope_theta", 10_000.0)
    local_theta = global_theta if local is None else float(local)
    if isinstance(params, Mapping) and params:
        found: dict[str, float] = {}
        for kind, default in (("full_attention", global_theta), ("sliding_attention", local_theta)):
            entry = params.get(kind) or {}
            rope_type = entry.get("rope_type", "default")
            if rope_type != "default":
                raise ValueError(f"ModernBERT rope_type {rope_type!r} is not supported")
            found[kind] = float(entry.get("rope_theta") or default)
        global_theta, local_theta = found["full_attention"], found["sliding_attention"]
    return global_theta, local_theta


def _rotate_half(x: mx.array) -> mx.array:
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


@dataclass(frozen=True)
class Rotary:
    """A batch's cos and sin tables for one theta, (B, 1, L, head_dim) in float32."""

    cos: mx.array
    sin: mx.array

    @classmethod
    def of(cls, positions: mx.array, head_dim: int, theta: float) -> Rotary:
        exponents = mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim
        inverse = 1.0 / (mx.array(theta, dtype=mx.float32) ** exponents)
        freqs = positions.astype(mx.float32)[:, :, None] * inverse[None, None, :]
        angles = mx.concatenate([freqs, freqs], axis=-1)[:, None]
        return cls(mx.cos(angles), mx.sin(angles))

    def apply(self, x: mx.array) -> mx.array:
        x32 = x.astype(mx.float32)
        return (x32 * self.cos + _rotate_half(x32) * self.sin).astype(x.dtype)


def banded_attention(
    q: mx.array, k: mx.array, v: mx.array, *, scale: float, padding: Sequence[int], window: int
) -> mx.array:
    """`bidirectional_attention` where a query sees only the keys at most `window`
    columns away. A piece no wider than the band needs no band (the primitive's path).
    The padded queries see every key, so their (unread) rows stay finite: a row of
    all-hidden keys would give NaNs that a later layer's zero weights cannot cancel."""
    length = q.shape[2]
    if length - 1 <= window:
        return bidirectional_attention(q, k, v, scale=scale, padding=padding)
    cols = mx.arange(length, dtype=mx.int32)
    band = mx.abs(cols[:, None] - cols[None, :]) <= window
    real = key_mask(padding, length)
    allowed = (band[None] & real[:, None, :]) | ~real[:, :, None]
    zero, hidden = mx.array(0.0, dtype=q.dtype), mx.array(-mx.inf, dtype=q.dtype)
    mask = mx.where(allowed[:, None], zero, hidden)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


class Embeddings(Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.tok_embeddings = Embedding(args.vocab_size, args.hidden_size)
        self.norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)

    def __call__(self, tokens: mx.array) -> mx.array:
        return self.norm(self.tok_embeddings(tokens))


class Attention(Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dims = args.hidden_size
        self.heads = args.num_heads
        self.scale = (dims // args.num_heads) ** -0.5
        self.Wqkv = Linear(dims, 3 * dims, bias=args.attention_bias)
        self.Wo = Linear(dims, dims, bias=args.attention_bias)

    def __call__(
        self, x: mx.array, rotary: Rotary, padding: Sequence[int], window: int | None
    ) -> mx.array:
        batch, length, dims = x.shape
        qkv = self.Wqkv(x).reshape(batch, length, 3, self.heads, -1).transpose(2, 0, 3, 1, 4)
        q, k, v = rotary.apply(qkv[0]), rotary.apply(qkv[1]), qkv[2]
        if window is None:
            out = bidirectional_attention(q, k, v, scale=self.scale, padding=padding)
        else:
            out = banded_attention(q, k, v, scale=self.scale, padding=padding, window=window)
        return self.Wo(out.transpose(0, 2, 1, 3).reshape(batch, length, dims))


class MLP(Module):
    """GeGLU: Wi's first half activated, times its second half, through Wo."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.Wi = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.Wo = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)
        self._act = _ACTIVATIONS[args.hidden_activation]

    def __call__(self, x: mx.array) -> mx.array:
        up, gate = mx.split(self.Wi(x), 2, axis=-1)
        return self.Wo(self._act(up) * gate)


class Layer(Module):
    """Pre-norm attention and MLP; the first layer has no attention norm (the embeddings
    were just normalized)."""

    def __init__(self, args: ModelArgs, index: int) -> None:
        super().__init__()
        self.attn_norm = (
            LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias) if index else None
        )
        self.attn = Attention(args)
        self.mlp_norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.mlp = MLP(args)
        self.window = None if args.global_layers[index] else args.window

    def __call__(self, x: mx.array, rotary: Rotary, padding: Sequence[int]) -> mx.array:
        normed = x if self.attn_norm is None else self.attn_norm(x)
        x = x + self.attn(normed, rotary, padding, self.window)
        return x + self.mlp(self.mlp_norm(x))


class Head(Module):
    """The sequence classifier's prediction head: dense -> activation -> norm."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dims = args.hidden_size
        self.dense = Linear(dims, dims, bias=args.classifier_bias)
        self.norm = LayerNorm(dims, eps=args.norm_eps, bias=args.norm_bias)
        self._act = _ACTIVATIONS[args.classifier_activation]

    def __call__(self, pooled: mx.array) -> mx.array:
        return self.norm(self._act(self.dense(pooled)))


class Model(Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embeddings = Embeddings(args)
        self.blocks = [Layer(args, i) for i in range(args.num_layers)]
        self.final_norm = LayerNorm(args.hidden_size, eps=args.norm_eps, bias=args.norm_bias)
        self.head: Head | None = None
        self.classifier: Linear | None = None
        if args.num_labels:
            self.head = Head(args)
            self.classifier = Linear(args.hidden_size, args.num_labels)

    def forward(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> mx.array:
        *_, last = self.layers(tokens, padding, token_types)
        return last

    def layers(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> Iterator[mx.array]:
        """The last layer's states come out through the final norm (what transformers
        calls last_hidden_state). `token_types` is ignored (see the module docstring)."""
        args = self.args
        starts = mx.array(list(padding), dtype=mx.int32)[:, None]
        positions = mx.maximum(mx.arange(tokens.shape[1], dtype=mx.int32)[None, :] - starts, 0)
        head_dim = args.hidden_size // args.num_heads
        tables = {
            True: Rotary.of(positions, head_dim, args.global_theta),
            False: Rotary.of(positions, head_dim, args.local_theta),
        }
        x = self.embeddings(tokens)
        for index, block in enumerate(self.blocks):
            x = block(x, tables[args.global_layers[index]], padding)
            yield self.final_norm(x) if index == len(self.blocks) - 1 else x

    def __call__(
        self, tokens: mx.array, padding: Sequence[int], token_types: mx.array | None = None
    ) -> mx.array:
        return self.forward(tokens, padding, token_types)

    def classify(self, hidden: mx.array, padding: Sequence[int]) -> mx.array:
        if self.head is None or self.classifier is None:
            raise ValueError("this ModernBERT checkpoint has no classification head")
        if self.args.classifier_pooling == "cls":
            pooled = first_token(hidden, padding)
        else:
            real = key_mask(padding, hidden.shape[1])[:, :, None]
            counts = mx.array([hidden.shape[1] - p for p in padding], dtype=hidden.dtype)
            pooled = mx.sum(mx.where(real, hidden, 0.0), axis=1) / counts[:, None]
        return self.classifier(self.head(pooled))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            key = _our_name(name, self.args)
            if key is not None:
                out[key] = value
        return out


def _our_name(name: str, args: ModelArgs) -> str | None:
    """Our parameter name for a checkpoint's tensor; None for what we do not use (a
    masked-LM checkpoint's prediction head and decoder, an embedding model's head)."""
    name = name.removeprefix("model.")
    if name.startswith("decoder."):
        return None
    if name.startswith(("head.", "classifier.")):
        return name if args.num_labels else None
    if name.startswith("layers."):
        return "blocks." + name.removeprefix("layers.")
    return name
