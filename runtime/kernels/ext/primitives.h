// MLX primitives around runtime/kernels' C code: a step that uses them stays one lazy
// graph (mx.async_eval pipelining; no evaluation per layer as a ctypes call needs).
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace mlxgw {

namespace mx = mlx::core;

// x (..., K) float32 @ W.T for W as mx.quantize(W, group_size, bits) packed it (w, scales,
// biases; scales and biases float32, float16 or bfloat16): (..., N) float32, computed on
// the CPU. Up to `small_rows` rows read each packed weight once for all rows: with
// `x_bits` 16 or 8, the weights meet x rounded to int16 or int8 per block of 32
// (mlxgw_qdot, on AVX2), with 0 floats (mlxgw_quantized_matmul); more rows dequantize a
// tile of features at a time into the BLAS.
mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
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
    const mx::array& biases,
    int group_size,
    int bits,
    int threads,
    bool generic);

class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(
      mx::Stream stream,
      int group_size,
      int bits,
      int threads,
      bool generic,
      int small_rows,
      int x_bits)
      : mx::Primitive(stream),
        group_size_(group_size),
        bits_(bits),
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
  int group_size_, bits_, threads_;
  bool generic_;
  int small_rows_;
  int x_bits_;
};

class Dequantize : public mx::Primitive {
 public:
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
