// MLX primitives around runtime/kernels' C code: a step that uses them stays one lazy
// graph (mx.async_eval pipelining; no evaluation per layer as a ctypes call needs).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mlxgw {

namespace mx = mlx::core;

// x (..., K) float32 @ W.T for W as mx.quantize(W, group_size, bits) packed it (w, scales,
// biases; scales and biases float32, float16 or bfloat16; no biases: each group's bias is
// -2^(bits - 1) times its scale, GGUF's symmetric formats): (..., N) float32, computed on
// the CPU. Up to `small_rows` rows read each packed weight once for all rows: with
// `x_bits` 16 or 8, the weights meet x rounded to int16 or int8 per block of 32
// (mlxgw_qdot, on AVX2), with 0 floats (mlxgw_quantized_matmul); more rows dequantize a
// tile of features at a time into the BLAS.
mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    int threads,
    bool generic,
    int small_rows,
    int x_bits);

// W itself, as float32 (N, K): what the products above compute with (tests, references).
mx::array dequantize(
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    int threads,
    bool generic);

// Several products of one x (a layer's q, k and v; a gated MLP's gate and up) as one
// primitive: one pass over the threads, x rounded once. `bias` (per weight; an empty
// optional for none) is added to every row. With `activation` "silu" or "gelu_tanh" and
// two weights, the one output is act(x @ W0.T + bias0) * (x @ W1.T + bias1).
std::vector<mx::array> quantized_matmuls(
    const mx::array& x,
    const std::vector<mx::array>& w,
    const std::vector<mx::array>& scales,
    const std::vector<std::optional<mx::array>>& biases,
    const std::vector<std::optional<mx::array>>& bias,
    const std::vector<int>& group_size,
    const std::vector<int>& bits,
    const std::string& activation,
    int threads,
    bool generic,
    int small_rows,
    int x_bits);

// Attention of (B, Hq, L, D) queries over (B, Hkv, K, D) keys and values (any strides;
// the queries are the last L of the K positions), float32, as runtime/kernels/kernels.c's
// mlxgw_attention: causal or not, `starts` (B) int32 each row's first key (left padding).
// Out: (B, L, Hq, D).
mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& starts,
    float scale,
    bool causal,
    int threads,
    bool generic,
    int window);

// Rows of a running batch, each in buffers of its own (runtime/cache/rows.py): `news[p]`
// (B, H, L, X_p) goes into every row b's buffer `rows[p][b]` (1, H, C_b, X_p), at columns
// [ends[b] - L, ends[b]), in place. Out: those buffers in the same order (the same memory,
// now holding the new columns): one graph node for every row and part of a layer.
std::vector<std::vector<mx::array>> append_rows(
    const std::vector<mx::array>& news,
    const std::vector<std::vector<mx::array>>& rows,
    const std::vector<int>& ends);

// `attention` over rows held in buffers of their own: (B, Hq, L, D) queries, row b's keys
// and values the first lengths[b] columns of keys[b] and values[b] (1, Hkv, C_b, D); the
// queries are each row's last L positions. The same bits as `attention` over the rows
// left-padded in one buffer with `starts` at their padding. Out: (B, L, Hq, D) float32.
mx::array attention_rows(
    const mx::array& q,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const std::vector<int>& lengths,
    float scale,
    bool causal,
    int threads,
    bool generic);

// `attention_rows` over rows of a quantized KV cache (runtime/cache/quantized.py): row b
// is keys[b] and values[b], each (codes uint32 (1, Hkv, C_b, D * bits / 32), scales and
// biases (1, Hkv, C_b, D / group_size)), as mlxgw_attention_quantized reads them, a row at
// a time (the kernel computes each row on its own: the bits of the rows left-padded).
mx::array quantized_attention_rows(
    const mx::array& q,
    const std::vector<std::vector<mx::array>>& keys,
    const std::vector<std::vector<mx::array>>& values,
    const std::vector<int>& lengths,
    int bits,
    int group_size,
    float scale,
    bool causal,
    int threads,
    bool generic);

// RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * (w + unit_offset), float32.
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, bool unit_offset);

// Rotary embedding of (B, H, L, D) x as mx.fast.rope's non-traditional pairing: the first
// `dims` of D rotate by (offset + l) * scale * inv_freq (dims / 2 of them), `offsets`
// one int32 or one per batch row; everything is scaled by mscale. Float32 (B, H, L, D).
mx::array rope(
    const mx::array& x,
    const mx::array& inv_freq,
    const mx::array& offsets,
    int dims,
    float scale,
    float mscale);

// One-pass row kernels (runtime/kernels/rows.c) as primitives.
class RmsNorm : public mx::Primitive {
 public:
  RmsNorm(mx::Stream stream, float eps, bool unit_offset)
      : mx::Primitive(stream), eps_(eps), unit_offset_(unit_offset) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
  bool unit_offset_;
};

class Rope : public mx::Primitive {
 public:
  Rope(mx::Stream stream, int dims, float scale, float mscale)
      : mx::Primitive(stream), dims_(dims), scale_(scale), mscale_(mscale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  float scale_, mscale_;
};

struct Product {
  int group_size, bits;
  bool has_bias;
  bool has_biases; // false: symmetric groups (MLXGW_SYMMETRIC), no biases input
  bool operator==(const Product& o) const {
    return group_size == o.group_size && bits == o.bits && has_bias == o.has_bias &&
        has_biases == o.has_biases;
  }
  size_t inputs() const {
    return 2 + (has_biases ? 1 : 0) + (has_bias ? 1 : 0);
  }
};

// inputs: x, then (w, scales[, biases][, bias]) per product; outputs: one per product, or
// one for a gated pair
class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(
      mx::Stream stream,
      std::vector<Product> products,
      int activation,
      int threads,
      bool generic,
      int small_rows,
      int x_bits)
      : mx::Primitive(stream),
        products_(std::move(products)),
        activation_(activation),
        threads_(threads),
        generic_(generic),
        small_rows_(small_rows),
        x_bits_(x_bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwQuantizedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  std::vector<Product> products_;
  int activation_; // -1 none, else kernels.h's GATE_*
  int threads_;
  bool generic_;
  int small_rows_;
  int x_bits_;
};

class Attention : public mx::Primitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal, int threads, bool generic, int window)
      : mx::Primitive(stream),
        scale_(scale),
        causal_(causal),
        threads_(threads),
        generic_(generic),
        window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  float scale_;
  bool causal_;
  int threads_;
  bool generic_;
  int window_;
};

// inputs: the P new arrays, then every part's rows (part-major); outputs: the rows
class AppendRows : public mx::Primitive {
 public:
  AppendRows(mx::Stream stream, int parts, std::vector<int> ends)
      : mx::Primitive(stream), parts_(parts), ends_(std::move(ends)) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwAppendRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int parts_;
  std::vector<int> ends_;
};

// inputs: q, then the rows' keys, then their values
class AttentionRows : public mx::Primitive {
 public:
  AttentionRows(
      mx::Stream stream,
      std::vector<int> lengths,
      float scale,
      bool causal,
      int threads,
      bool generic)
      : mx::Primitive(stream),
        lengths_(std::move(lengths)),
        scale_(scale),
        causal_(causal),
        threads_(threads),
        generic_(generic) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwAttentionRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  std::vector<int> lengths_;
  float scale_;
  bool causal_;
  int threads_;
  bool generic_;
};

// inputs: q, then per row its keys' codes, scales, biases and its values'
class QuantizedAttentionRows : public mx::Primitive {
 public:
  QuantizedAttentionRows(
      mx::Stream stream,
      std::vector<int> lengths,
      int bits,
      int group_size,
      float scale,
      bool causal,
      int threads,
      bool generic)
      : mx::Primitive(stream),
        lengths_(std::move(lengths)),
        bits_(bits),
        group_size_(group_size),
        scale_(scale),
        causal_(causal),
        threads_(threads),
        generic_(generic) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwQuantizedAttentionRows";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  std::vector<int> lengths_;
  int bits_, group_size_;
  float scale_;
  bool causal_;
  int threads_;
  bool generic_;
};

// The exact (erf) GELU, elementwise, on the kernels' threads (kernels.c): float32.
mx::array gelu_erf(const mx::array& x, int threads, bool generic);

class GeluErf : public mx::Primitive {
 public:
  GeluErf(mx::Stream stream, int threads, bool generic)
      : mx::Primitive(stream), threads_(threads), generic_(generic) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwGeluErf";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int threads_;
  bool generic_;
};

class Dequantize : public mx::Primitive {
 public:
  // inputs: w, scales[, biases] (none: symmetric groups)
  Dequantize(mx::Stream stream, int group_size, int bits, int threads, bool generic)
      : mx::Primitive(stream),
        group_size_(group_size),
        bits_(bits),
        threads_(threads),
        generic_(generic) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwDequantize";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  int group_size_, bits_, threads_;
  bool generic_;
};

} // namespace mlxgw
