// A llama-style decoder layer's decode step as one MLX primitive (layer.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "mlx/primitives.h"
#include "primitives.h"

namespace mlxgw {

namespace mx = mlx::core;

// The shapes and constants of one layer (everything but its arrays).
struct LayerSpec {
  int heads, kv_heads, head_dim;
  float eps; // the two RMSNorms'
  bool unit_offset; // gemma's (1 + w) norms
  float qk_eps; // < 0: no q/k norms
  int rope_dims;
  float rope_scale, mscale, scale;
  int activation; // kernels.h's GATE_*
  bool operator==(const LayerSpec& o) const {
    return heads == o.heads && kv_heads == o.kv_heads && head_dim == o.head_dim &&
        eps == o.eps && unit_offset == o.unit_offset && qk_eps == o.qk_eps &&
        rope_dims == o.rope_dims && rope_scale == o.rope_scale && mscale == o.mscale &&
        scale == o.scale && activation == o.activation;
  }
};

// h = x + o(attention(rope(q(n1(x))), rows + rope(k), rows + v)); h + down(act(gate(n2(h))) *
// up(n2(h))) for x (B, L, D) float32 over a running batch's rows (runtime/cache/rows.py):
// what the layer's separate primitives compute, bit for bit, as one node. `norms`: the
// input and post-attention norms' weights, then the q and k norms' when spec.qk_eps >= 0.
// Products in the order q, k, v, o, gate, up, down. `offsets` (B,) int32: each row's
// position; `keys` and `values`: each row's buffers (1, Hkv, C_b, head_dim) float32,
// `lengths` each row's tokens once these are written. Returns [h, keys' (B), values' (B)]:
// the row buffers written in place where they can be (as `append_rows`).
std::vector<mx::array> decoder_layer(
    const mx::array& x,
    const std::vector<mx::array>& norms,
    const std::vector<mx::array>& w,
    const std::vector<mx::array>& scales,
    const std::vector<std::optional<mx::array>>& biases,
    const std::vector<std::optional<mx::array>>& bias,
    const std::vector<int>& group_size,
    const std::vector<int>& bits,
    const mx::array& inv_freq,
    const mx::array& offsets,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const std::vector<int>& lengths,
    int heads,
    int kv_heads,
    int head_dim,
    float eps,
    bool unit_offset,
    float qk_eps,
    int rope_dims,
    float rope_scale,
    float mscale,
    float scale,
    const std::string& activation,
    int threads,
    bool generic,
    int small_rows,
    int x_bits);

class DecoderLayer : public mx::Primitive {
 public:
  DecoderLayer(
      mx::Stream stream,
      LayerSpec spec,
      std::vector<Product> products,
      std::vector<int> lengths,
      int threads,
      bool generic,
      int small_rows,
      int x_bits)
      : mx::Primitive(stream),
        spec_(spec),
        products_(std::move(products)),
        lengths_(std::move(lengths)),
        threads_(threads),
        generic_(generic),
        small_rows_(small_rows),
        x_bits_(x_bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs)
      override;
  const char* name() const override {
    return "MlxgwDecoderLayer";
  }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  LayerSpec spec_;
  std::vector<Product> products_;
  std::vector<int> lengths_;
  int threads_;
  bool generic_;
  int small_rows_;
  int x_bits_;
};

} // namespace mlxgw
