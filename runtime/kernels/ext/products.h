// The quantized products as the primitives run them (primitives.cpp), for the other
// primitives that run several in one task (layer.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"

#include "kernels.h"
#include "quantized.h"

namespace mlxgw {

namespace mx = mlx::core;

// MLXGW's code for a scales dtype (quantized.h), or invalid_argument
int scale_type(mx::Dtype dtype);
// A weight in 16-feature lanes (qlanes.c; runtime/kernels/lanes.py writes it): w int32
// [N / 16, K * bits / 32, 16], scales and biases [N / 16, K / group_size, 16]. The
// standard layout (mx.quantize's) is uint32 [N, K * bits / 32].
inline bool in_lanes(const mx::array& w) {
  return w.ndim() == 3 && w.dtype() == mx::int32;
}
// the weight's output features, in either layout
inline int64_t out_features(const mx::array& w) {
  return in_lanes(w) ? 16 * int64_t(w.shape(0)) : int64_t(w.shape(0));
}
// scale_type's code with the layout's and the symmetric groups' bits (quantized.h)
inline int product_stype(const mx::array& w, const mx::array& scales, bool has_biases) {
  return scale_type(scales.dtype()) | (in_lanes(w) ? MLXGW_LANES : 0) |
      (has_biases ? 0 : MLXGW_SYMMETRIC);
}
// invalid_argument for a weight whose arrays do not fit `depth`, `group_size`, `bits`
void check_format(
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int64_t depth,
    int group_size,
    int bits);
// kernels.h's GATE_* for an activation's name ("silu", "gelu_tanh"); -1 for ""
int activation_kind(const std::string& name);
// a kernel's status (0 ok, 1 refused, 2 out of memory) as an exception
void check_status(int status, const char* what);
// `arr` packed (itself, or a copy the stream's encoder keeps alive)
mx::array row_contiguous(const mx::array& arr, mx::Stream stream);
// `arr` with unit stride along its last axis
mx::array unit_last_stride(const mx::array& arr, mx::Stream stream);
// whether a row buffer can be written where it is (runtime/cache/rows.py)
bool writable_in_place(const mx::array& a);

struct ProductArgs {
  const uint32_t* w;
  const void* scales;
  const void* biases; // nullptr: symmetric groups (stype has MLXGW_SYMMETRIC)
  const float* bias;
  float* out;
  int64_t cols;
  int bits, group_size, stype;
};

// x [rows, depth] times each product's weight, transposed (+ its bias), into its `out`:
// up to `small` rows through the integer kernels (x_bits 16 or 8; 0: the float kernel),
// more through dequantized tiles and the BLAS. With `act` >= 0 (two products of one
// shape) act(product 0) * product 1 goes to `gated` instead, the products to a scratch
// buffer of the calling thread.
void run_products(
    const float* x,
    int64_t rows,
    int64_t depth,
    std::vector<ProductArgs>& args,
    float* gated,
    int act,
    int threads,
    int generic,
    int small,
    int x_bits);

// the threads for products of this many weight bytes (one below kThreadBytes)
int product_threads(size_t weight_bytes, int threads);

// rows of a running batch's caches (runtime/cache/rows.py) that a primitive writes
struct RowWrite {
  const char* src; // new (b, 0, 0) of its part
  char* dst; // the row's buffer
  int64_t src_h, src_l; // strides (elements) of the new array's heads and positions
  int64_t heads, length, width, capacity, end, itemsize;
};
void write_row(const RowWrite& w);
// causal attention over rows in buffers of their own (`base` the shared sizes, `rows[b]`
// row b as a one-row AttnArgs): the decode kernel, else the prompt kernel row by row
void attend_rows(const AttnArgs& base, const std::vector<AttnArgs>& rows);
// `out`, a row buffer's next state: `row`'s memory where it can be written in place, else a
// whole copy of it (queued on the encoder)
void take_row(
    mx::cpu::CommandEncoder& encoder,
    const mx::array& row,
    mx::array& out,
    mx::Stream s);

} // namespace mlxgw
