// See primitives.h. The C kernels are runtime/kernels/quantized.c; the BLAS is whichever
// cblas_sgemm the process resolved (runtime/backend.py preloads an optimized one).

#include "primitives.h"

#include <algorithm>
#include <atomic>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "kernels.h"
#include "products.h"
#include "quantized.h"

extern "C" {
void cblas_sgemm(
    int order,
    int trans_a,
    int trans_b,
    int m,
    int n,
    int k,
    float alpha,
    const float* a,
    int lda,
    const float* b,
    int ldb,
    float beta,
    float* c,
    int ldc);
}

extern "C" void mlxgw_pool_run(void* (*worker)(void*), void* job, int threads);

namespace mlxgw {

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
// the floats of one dequantized tile of features handed to the BLAS
constexpr int64_t kTileFloats = int64_t(1) << 21;
// decode rows over a weight smaller than this run on one thread: handing half of a few
// microseconds' work to a second costs more than it saves. Above it the pool's threads are
// still spinning from the previous product (a layer's products come back to back), so a
// split pays: from 512 KB down to 64 KB (SmolLM2's and Qwen2.5-0.5B's q and o projections
// now split), one-stream decode went 8-12% faster (SmolLM2 85 -> 95 tok/s, Qwen 35 -> 38)
constexpr size_t kThreadBytes = size_t(1) << 16;

} // namespace

int scale_type(mx::Dtype dtype) {
  if (dtype == mx::float32) {
    return 0;
  }
  if (dtype == mx::float16) {
    return 1;
  }
  if (dtype == mx::bfloat16) {
    return 2;
  }
  throw std::invalid_argument(
      "[mlxgw.quantized_matmul] scales and biases must be float32, float16 or bfloat16");
}

void check_format(
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int64_t depth,
    int group_size,
    int bits) {
  if (bits < 2 || bits > 8 || bits == 7) {
    throw std::invalid_argument("[mlxgw.quantized_matmul] bits must be 2, 3, 4, 5, 6 or 8");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("[mlxgw.quantized_matmul] group_size must be 32, 64 or 128");
  }
  bool lanes = in_lanes(w) && w.shape(2) == 16 && bits >= 4 && bits <= 8 && bits != 7;
  int64_t cols = w.ndim() == 2 || lanes ? w.shape(0) : 0;
  int64_t groups = depth / group_size;
  mx::Shape scale_shape{int(cols), int(groups)};
  if (lanes) {
    scale_shape.push_back(16);
  }
  bool ok = w.dtype() == (lanes ? mx::int32 : mx::uint32) && depth % group_size == 0 &&
      cols > 0 && groups > 0 &&
      w.shape(1) == depth * bits / 32 && scales.shape() == scale_shape &&
      (!biases || (biases->shape() == scales.shape() && biases->dtype() == scales.dtype()));
  if (!ok) {
    std::ostringstream msg;
    msg << "[mlxgw.quantized_matmul] shapes do not match: depth " << depth << ", w "
        << w.shape() << " " << w.dtype() << ", scales " << scales.shape() << ", biases ";
    if (biases) {
      msg << biases->shape();
    } else {
      msg << "none";
    }
    msg << " for " << bits << " bits in groups of " << group_size
        << " (2-D, or 3-D in 16-feature lanes for 4, 5, 6 and 8 bits)";
    throw std::invalid_argument(msg.str());
  }
  scale_type(scales.dtype());
}

// rows n0..n1 of the weight as float32: AVX2 where it runs, else the portable code
int dequantize_rows(
    const uint32_t* w,
    const void* s,
    const void* b,
    float* dst,
    int64_t n0,
    int64_t n1,
    int64_t depth,
    int64_t cols,
    int bits,
    int gs,
    int stype,
    int threads,
    int generic) {
  int status =
      mlxgw_dequantize_avx2(w, s, b, dst, n0, n1, depth, cols, bits, gs, stype, threads, generic);
  if (status == 1) {
    status = mlxgw_dequantize(w, s, b, dst, n0, n1, depth, cols, bits, gs, stype, threads, generic);
  }
  return status;
}

void check_status(int status, const char* what) {
  if (status == 1) {
    throw std::invalid_argument(std::string("[mlxgw] the kernel refused its arguments: ") + what);
  }
  if (status != 0) {
    throw std::runtime_error(std::string("[mlxgw] out of memory in ") + what);
  }
}

int activation_kind(const std::string& name) {
  if (name.empty()) {
    return -1;
  }
  if (name == "silu") {
    return GATE_SILU;
  }
  if (name == "gelu_tanh") {
    return GATE_GELU_TANH;
  }
  throw std::invalid_argument(
      "[mlxgw.quantized_matmuls] activation must be '', 'silu' or 'gelu_tanh', not '" + name +
      "'");
}

// copy a strided array's elements (any ndim, `size` bytes each) into a packed buffer
void gather(const char* src, char* dst, const mx::Shape& shape, const mx::Strides& strides,
            size_t size) {
  int nd = int(shape.size());
  int64_t total = 1;
  for (auto n : shape) {
    total *= n;
  }
  std::vector<int64_t> index(nd, 0);
  for (int64_t i = 0; i < total; i++) {
    int64_t offset = 0;
    for (int d = 0; d < nd; d++) {
      offset += index[d] * strides[d];
    }
    std::memcpy(dst + i * size, src + offset * int64_t(size), size);
    for (int d = nd - 1; d >= 0; d--) {
      if (++index[d] < shape[d]) {
        break;
      }
      index[d] = 0;
    }
  }
}

// `arr` with a row-contiguous buffer: itself, or a copy made in the stream's order (MLX's
// own copy routine is not exported from libmlx) that the encoder keeps alive
mx::array row_contiguous(const mx::array& arr, mx::Stream stream) {
  if (arr.flags().row_contiguous) {
    return arr;
  }
  mx::array copy(arr.shape(), arr.dtype(), nullptr, {});
  copy.set_data(mx::allocator::malloc(copy.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  encoder.set_input_array(arr);
  encoder.set_output_array(copy);
  encoder.dispatch([src = arr.data<char>(),
                    dst = copy.data<char>(),
                    shape = arr.shape(),
                    strides = arr.strides(),
                    size = arr.itemsize()]() { gather(src, dst, shape, strides, size); });
  encoder.add_temporary(copy);
  return copy;
}

// `arr` with unit stride along its last axis (what the attention kernel reads)
mx::array unit_last_stride(const mx::array& arr, mx::Stream stream) {
  if (arr.ndim() == 0 || arr.strides().back() == 1 || arr.shape(-1) == 1) {
    return arr;
  }
  return row_contiguous(arr, stream);
}

namespace {

// features n0..n1 of a product's weight as float32 for the BLAS, in `buffer`: as rows
// [n1 - n0, depth] (false), or transposed, [depth, n1 - n0] (true: a weight in lanes,
// whose layout holds 16 features per weight index)
bool dequantize_tile(
    const ProductArgs& p,
    float* buffer,
    int64_t n0,
    int64_t n1,
    int64_t depth,
    int threads,
    int generic) {
  if (p.stype & MLXGW_LANES) {
    int status = mlxgw_lanes_dequantize_t(
        p.w, p.scales, p.biases, buffer, n0, n1, depth, p.bits, p.group_size, p.stype, threads,
        generic);
    if (status == 0) {
      return true;
    }
    if (status != 1) {
      check_status(status, "dequantize");
    }
  }
  check_status(
      dequantize_rows(
          p.w, p.scales, p.biases, buffer, n0, n1, depth, p.cols, p.bits, p.group_size,
          p.stype, threads, generic),
      "dequantize");
  return false;
}

// out[rows, n1 - n0] (row stride ldc) = x @ the tile, transposed or not
void tile_product(
    const float* x,
    int64_t rows,
    int64_t depth,
    const float* tile,
    bool transposed,
    int64_t width,
    float* out,
    int64_t ldc) {
  cblas_sgemm(
      kRowMajor, kNoTrans, transposed ? kNoTrans : kTrans, int(rows), int(width), int(depth),
      1.0f, x, int(depth), tile, int(transposed ? width : depth), 0.0f, out, int(ldc));
}

// one product over a prompt's rows: a tile of features at a time, dequantized, through
// the BLAS; or the float kernel over a few rows
void product(
    const float* x,
    int64_t rows,
    int64_t depth,
    const ProductArgs& p,
    int threads,
    int generic,
    bool few) {
  if (few) {
    check_status(
        mlxgw_quantized_matmul(
            x, p.w, p.scales, p.biases, p.out, rows, depth, p.cols, p.bits, p.group_size,
            p.stype, threads, generic),
        "quantized_matmul");
  } else {
    int64_t tile = std::max<int64_t>(64, kTileFloats / depth / 64 * 64);
    tile = std::min(tile, p.cols);
    // one tile buffer per thread, kept: a prompt chunk multiplies every weight through it,
    // and a fresh 8 MB buffer per product is mapped and faulted in each time
    thread_local std::vector<float> buffer;
    if (buffer.size() < size_t(tile * depth)) {
      buffer.resize(size_t(tile * depth));
    }
    for (int64_t n0 = 0; n0 < p.cols; n0 += tile) {
      int64_t n1 = std::min(p.cols, n0 + tile);
      bool transposed = dequantize_tile(p, buffer.data(), n0, n1, depth, threads, generic);
      tile_product(x, rows, depth, buffer.data(), transposed, n1 - n0, p.out + n0, p.cols);
    }
  }
  if (p.bias != nullptr) {
    for (int64_t m = 0; m < rows; m++) {
      for (int64_t n = 0; n < p.cols; n++) {
        p.out[m * p.cols + n] += p.bias[n];
      }
    }
  }
}

// act(gate) * up over rows [m0, m1) of a band of columns: `g` (row stride `ldg`) in place
struct GatedBand {
  float* g;
  const float* u;
  int64_t rows, w, ldg;
  int act, generic;
  std::atomic<int64_t> next;
};

void* gated_band_rows(void* arg) {
  auto* j = static_cast<GatedBand*>(arg);
  for (;;) {
    int64_t m0 = j->next.fetch_add(64);
    if (m0 >= j->rows) {
      return nullptr;
    }
    for (int64_t m = m0; m < std::min(j->rows, m0 + 64); m++) {
      float* g = j->g + m * j->ldg;
      mlxgw_gated_mul(g, j->u + m * j->w, g, j->w, j->act, 1, j->generic);
    }
  }
}

// a gated pair over a prompt's rows, one dequantized tile of columns at a time (the
// tile `product` uses, so each BLAS call is the one it makes: bit-identical): the gate's
// columns straight into `gated`, the up product's into a tile-wide scratch of the thread,
// then act(gate) * up in place. The scratch is rows x tile, not 2 x rows x cols
// (Qwen2.5-0.5B, 2048 rows: 19 MB, not 80 MB kept by the thread).
void gated_products(
    const float* x,
    int64_t rows,
    int64_t depth,
    const ProductArgs& gate,
    const ProductArgs& upp,
    float* gated,
    int act,
    int threads,
    int generic) {
  int64_t cols = gate.cols;
  int64_t tile = std::min(cols, std::max<int64_t>(64, kTileFloats / depth / 64 * 64));
  thread_local std::vector<float> buffer;
  thread_local std::vector<float> up;
  if (buffer.size() < size_t(tile * depth)) {
    buffer.resize(size_t(tile * depth));
  }
  if (up.size() < size_t(rows * tile)) {
    up.resize(size_t(rows * tile));
  }
  for (int64_t n0 = 0; n0 < cols; n0 += tile) {
    int64_t n1 = std::min(cols, n0 + tile), w = n1 - n0;
    for (const ProductArgs* p : {&gate, &upp}) {
      bool transposed = dequantize_tile(*p, buffer.data(), n0, n1, depth, threads, generic);
      bool is_gate = p == &gate;
      tile_product(
          x, rows, depth, buffer.data(), transposed, w, is_gate ? gated + n0 : up.data(),
          is_gate ? cols : w);
    }
    GatedBand job{gated + n0, up.data(), rows, w, cols, act, generic, {0}};
    mlxgw_pool_run(gated_band_rows, &job, threads);
  }
}

mx::Shape product_shape(const mx::array& x, const mx::array& w) {
  mx::Shape shape = x.shape();
  shape.back() = int(out_features(w));
  return shape;
}

} // namespace

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
    int x_bits) {
  size_t count = w.size();
  if (count < 1 || count > 8 || scales.size() != count || biases.size() != count ||
      bias.size() != count || group_size.size() != count || bits.size() != count) {
    throw std::invalid_argument(
        "[mlxgw.quantized_matmuls] 1 to 8 weights, each with scales, biases, an optional "
        "bias, a group size and a width");
  }
  if (x.ndim() < 1) {
    throw std::invalid_argument("[mlxgw.quantized_matmuls] x must have at least one axis");
  }
  int act = activation_kind(activation);
  if (act >= 0 && (count != 2 || out_features(w[0]) != out_features(w[1]))) {
    throw std::invalid_argument(
        "[mlxgw.quantized_matmuls] a gated activation takes two weights of one shape");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{mx::astype(x, mx::float32, stream)};
  std::vector<Product> products;
  std::vector<mx::Shape> shapes;
  for (size_t i = 0; i < count; i++) {
    check_format(w[i], scales[i], biases[i], x.shape(-1), group_size[i], bits[i]);
    inputs.insert(inputs.end(), {w[i], scales[i]});
    if (biases[i]) {
      inputs.push_back(*biases[i]);
    }
    if (bias[i].has_value()) {
      if (bias[i]->ndim() != 1 || bias[i]->shape(0) != out_features(w[i])) {
        throw std::invalid_argument("[mlxgw.quantized_matmuls] a bias must be (out_features,)");
      }
      inputs.push_back(mx::astype(*bias[i], mx::float32, stream));
    }
    products.push_back({group_size[i], bits[i], bias[i].has_value(), biases[i].has_value()});
    shapes.push_back(product_shape(x, w[i]));
  }
  if (act >= 0) {
    shapes.resize(1);
  }
  auto primitive = std::make_shared<QuantizedMatmul>(
      stream, std::move(products), act, std::max(1, threads), generic, small_rows, x_bits);
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return mx::array::make_arrays(std::move(shapes), dtypes, primitive, inputs);
}

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
    int x_bits) {
  return quantized_matmuls(
      x, {w}, {scales}, {biases}, {std::nullopt}, {group_size}, {bits}, "", threads, generic,
      small_rows, x_bits)[0];
}

mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    const std::optional<mx::array>& starts,
    float scale,
    bool causal,
    int threads,
    bool generic,
    int window) {
  bool ok = q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4 && k.shape() == v.shape() &&
      q.shape(0) == k.shape(0) && q.shape(3) == k.shape(3) && k.shape(1) > 0 &&
      q.shape(1) % k.shape(1) == 0 && q.shape(2) <= k.shape(2) && q.shape(3) <= 512;
  if (!ok) {
    std::ostringstream msg;
    msg << "[mlxgw.attention] q (B, Hq, L, D), k and v (B, Hkv, K, D) with Hq a multiple of "
           "Hkv, L <= K and D <= 512; got q "
        << q.shape() << ", k " << k.shape() << ", v " << v.shape();
    throw std::invalid_argument(msg.str());
  }
  if (window < 0 || (window > 0 && (!causal || q.shape(2) > MLXGW_DECODE_MAX_LENGTH))) {
    throw std::invalid_argument(
        "[mlxgw.attention] a sliding window needs causal queries, at most 16 of them");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{
      mx::astype(q, mx::float32, stream),
      mx::astype(k, mx::float32, stream),
      mx::astype(v, mx::float32, stream)};
  if (starts.has_value()) {
    if (starts->ndim() != 1 || starts->shape(0) != q.shape(0)) {
      throw std::invalid_argument("[mlxgw.attention] starts must be (B,)");
    }
    inputs.push_back(mx::astype(*starts, mx::int32, stream));
  }
  return mx::array(
      mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)},
      mx::float32,
      std::make_shared<Attention>(stream, scale, causal, std::max(1, threads), generic, window),
      std::move(inputs));
}

mx::array dequantize(
    const mx::array& w,
    const mx::array& scales,
    const std::optional<mx::array>& biases,
    int group_size,
    int bits,
    int threads,
    bool generic) {
  if (w.ndim() != 2 && w.ndim() != 3) {
    throw std::invalid_argument("[mlxgw.dequantize] w must be 2-D (or 3-D in lanes)");
  }
  int64_t depth = w.shape(1) * 32 / bits;
  check_format(w, scales, biases, depth, group_size, bits);
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      mx::Shape{int(out_features(w)), int(depth)},
      mx::float32,
      std::make_shared<Dequantize>(stream, group_size, bits, std::max(1, threads), generic),
      biases ? std::vector<mx::array>{w, scales, *biases} : std::vector<mx::array>{w, scales});
}

void QuantizedMatmul::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& encoder = mx::cpu::get_command_encoder(s);
  auto x = row_contiguous(inputs[0], s);
  encoder.set_input_array(x);
  int64_t depth = x.shape(-1);
  int64_t rows = depth ? x.size() / depth : 0;
  std::vector<ProductArgs> args;
  size_t at = 1;
  size_t weight_bytes = 0;
  for (size_t i = 0; i < products_.size(); i++) {
    auto w = row_contiguous(inputs[at], s);
    auto scales = row_contiguous(inputs[at + 1], s);
    at += 2;
    const void* biases = nullptr;
    int stype = product_stype(w, scales, products_[i].has_biases);
    if (products_[i].has_biases) {
      auto b = row_contiguous(inputs[at++], s);
      encoder.set_input_array(b);
      biases = b.data<void>();
    }
    const float* bias = nullptr;
    if (products_[i].has_bias) {
      auto b = row_contiguous(inputs[at++], s);
      encoder.set_input_array(b);
      bias = b.data<float>();
    }
    for (auto* a : {&w, &scales}) {
      encoder.set_input_array(*a);
    }
    weight_bytes += w.nbytes();
    args.push_back(
        {w.data<uint32_t>(), scales.data<void>(), biases, bias, nullptr, out_features(w),
         products_[i].bits, products_[i].group_size, stype});
  }
  for (auto& out : outputs) {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    encoder.set_output_array(out);
  }
  // a gated pair's products go to a scratch buffer of the thread that runs the task
  // (kept, as the prefill tile is), and act(gate) * up to the output
  if (activation_ < 0) {
    for (size_t i = 0; i < args.size(); i++) {
      args[i].out = outputs[i].data<float>();
    }
  }
  encoder.dispatch([xp = x.data<float>(),
                    args = std::move(args),
                    gated = activation_ >= 0 ? outputs[0].data<float>() : nullptr,
                    act = activation_,
                    rows,
                    depth,
                    threads = product_threads(weight_bytes, threads_),
                    generic = int(generic_),
                    small = small_rows_,
                    x_bits = x_bits_]() mutable {
    run_products(xp, rows, depth, args, gated, act, threads, generic, small, x_bits);
  });
}

int product_threads(size_t weight_bytes, int threads) {
  return weight_bytes < kThreadBytes ? 1 : threads;
}

void run_products(
    const float* xp,
    int64_t rows,
    int64_t depth,
    std::vector<ProductArgs>& args,
    float* gated,
    int act,
    int threads,
    int generic,
    int small,
    int x_bits) {
  {
    if (rows == 0) {
      return;
    }
    if (gated != nullptr && rows > small && args[0].bias == nullptr &&
        args[1].bias == nullptr) {
      gated_products(xp, rows, depth, args[0], args[1], gated, act, threads, generic);
      return;
    }
    if (gated != nullptr) {
      thread_local std::vector<float> scratch;
      size_t need = size_t(2 * rows * args[0].cols);
      if (scratch.size() < need) {
        scratch.resize(need);
      }
      args[0].out = scratch.data();
      args[1].out = scratch.data() + rows * args[0].cols;
    }
    bool done = false;
    if (rows <= small && x_bits != 0) {
      std::vector<MlxgwQProj> projs;
      for (auto& p : args) {
        projs.push_back({p.w, p.scales, p.biases, p.bias, p.out, p.cols, p.bits, p.group_size,
                         p.stype});
      }
      int status = mlxgw_qdot_many(
          xp, rows, depth, projs.data(), int32_t(projs.size()), x_bits, threads, generic);
      if (status != 1) {
        check_status(status, "qdot");
        done = true;
      }
    }
    if (!done) {
      for (auto& p : args) {
        product(xp, rows, depth, p, threads, generic, rows <= small);
      }
    }
    if (gated != nullptr) {
      int64_t n = rows * args[0].cols;
      check_status(
          mlxgw_gated_mul(args[0].out, args[1].out, gated, n, act, threads, generic),
          "gated_mul");
    }
  }
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.quantized_matmul] runs on the CPU only");
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedMatmul&>(other);
  return products_ == o.products_ && activation_ == o.activation_ && threads_ == o.threads_ &&
      generic_ == o.generic_ && small_rows_ == o.small_rows_ && x_bits_ == o.x_bits_;
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  size_t at = 1;
  for (auto& p : products_) {
    shapes.push_back(product_shape(inputs[0], inputs[at]));
    at += p.inputs();
  }
  if (activation_ >= 0) {
    shapes.resize(1);
  }
  return shapes;
}

void Attention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& encoder = mx::cpu::get_command_encoder(s);
  auto q = unit_last_stride(inputs[0], s);
  auto k = unit_last_stride(inputs[1], s);
  auto v = unit_last_stride(inputs[2], s);
  for (auto* a : {&q, &k, &v}) {
    encoder.set_input_array(*a);
  }
  const int32_t* starts = nullptr;
  if (inputs.size() > 3) {
    auto st = row_contiguous(inputs[3], s);
    encoder.set_input_array(st);
    starts = st.data<int32_t>();
  }
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  AttnArgs a{};
  a.q = q.data<float>();
  a.k = k.data<float>();
  a.v = v.data<float>();
  a.out = out.data<float>();
  for (int i = 0; i < 3; i++) {
    a.q_strides[i] = q.strides()[i];
    a.k_strides[i] = k.strides()[i];
    a.v_strides[i] = v.strides()[i];
  }
  // out is (B, L, Hq, D): strides for (b, head, row)
  int64_t heads = q.shape(1), length = q.shape(2), dim = q.shape(3);
  a.o_strides[0] = length * heads * dim;
  a.o_strides[1] = dim;
  a.o_strides[2] = heads * dim;
  a.batch = q.shape(0);
  a.q_heads = int32_t(heads);
  a.kv_heads = k.shape(1);
  a.length = int32_t(length);
  a.keys = k.shape(2);
  a.dim = int32_t(dim);
  a.scale = scale_;
  a.causal = causal_;
  a.threads = threads_;
  a.generic = generic_;
  a.starts = starts;
  a.window = window_;
  encoder.dispatch([a]() {
    int status = mlxgw_attention_decode(&a);
    if (status == 1) {
      status = mlxgw_attention(&a);
    }
    check_status(status, "attention");
  });
}

void Attention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.attention] runs on the CPU only");
}

bool Attention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Attention&>(other);
  return scale_ == o.scale_ && causal_ == o.causal_ && threads_ == o.threads_ &&
      generic_ == o.generic_ && window_ == o.window_;
}

std::vector<mx::Shape> Attention::output_shapes(const std::vector<mx::array>& inputs) {
  auto& q = inputs[0];
  return {mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}};
}

void Dequantize::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto w = row_contiguous(inputs[0], stream());
  auto scales = row_contiguous(inputs[1], stream());
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(w);
  encoder.set_input_array(scales);
  const void* bp = nullptr;
  int stype = product_stype(w, scales, inputs.size() > 2);
  if (inputs.size() > 2) {
    auto biases = row_contiguous(inputs[2], stream());
    encoder.set_input_array(biases);
    bp = biases.data<void>();
  }
  encoder.set_output_array(out);
  encoder.dispatch([wp = w.data<uint32_t>(),
                    sp = scales.data<void>(),
                    bp,
                    op = out.data<float>(),
                    cols = int64_t(out.shape(0)),
                    depth = int64_t(out.shape(1)),
                    stype,
                    bits = bits_,
                    gs = group_size_,
                    threads = threads_,
                    generic = int(generic_)]() {
    check_status(
        dequantize_rows(wp, sp, bp, op, 0, cols, depth, cols, bits, gs, stype, threads, generic),
        "dequantize");
  });
}

void Dequantize::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.dequantize] runs on the CPU only");
}

bool Dequantize::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Dequantize&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && threads_ == o.threads_ &&
      generic_ == o.generic_;
}

std::vector<mx::Shape> Dequantize::output_shapes(const std::vector<mx::array>& inputs) {
  return {mx::Shape{int(out_features(inputs[0])), int(inputs[0].shape(1) * 32 / bits_)}};
}

mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, bool unit_offset) {
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1)) {
    std::ostringstream msg;
    msg << "[mlxgw.rms_norm] w must be (D,) for x (..., D); got x " << x.shape() << ", w "
        << w.shape();
    throw std::invalid_argument(msg.str());
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<RmsNorm>(stream, eps, unit_offset),
      {mx::astype(x, mx::float32, stream), mx::astype(w, mx::float32, stream)});
}

mx::array rope(
    const mx::array& x,
    const mx::array& inv_freq,
    const mx::array& offsets,
    int dims,
    float scale,
    float mscale) {
  bool ok = x.ndim() == 4 && dims > 0 && dims % 2 == 0 && dims <= x.shape(3) && dims <= 1024 &&
      inv_freq.ndim() == 1 && inv_freq.shape(0) == dims / 2 && offsets.ndim() == 1 &&
      (offsets.shape(0) == 1 || offsets.shape(0) == x.shape(0));
  if (!ok) {
    std::ostringstream msg;
    msg << "[mlxgw.rope] x (B, H, L, D), an even dims <= min(D, 1024), inv_freq (dims / 2,), "
           "offsets (1,) or (B,); got x "
        << x.shape() << ", dims " << dims << ", inv_freq " << inv_freq.shape() << ", offsets "
        << offsets.shape();
    throw std::invalid_argument(msg.str());
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<Rope>(stream, dims, scale, mscale),
      {mx::astype(x, mx::float32, stream),
       mx::astype(inv_freq, mx::float32, stream),
       mx::astype(offsets, mx::int32, stream)});
}

void RmsNorm::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& encoder = mx::cpu::get_command_encoder(s);
  auto x = row_contiguous(inputs[0], s);
  auto w = row_contiguous(inputs[1], s);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_output_array(out);
  int64_t dim = x.shape(-1);
  encoder.dispatch([xp = x.data<float>(),
                    wp = w.data<float>(),
                    op = out.data<float>(),
                    rows = dim ? int64_t(x.size()) / dim : 0,
                    dim,
                    eps = eps_,
                    unit = int(unit_offset_)]() { mlxgw_rms_norm(xp, wp, op, rows, dim, eps, unit); });
}

mx::array gelu_erf(const mx::array& x, int threads, bool generic) {
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      x.shape(),
      mx::float32,
      std::make_shared<GeluErf>(stream, threads, generic),
      {mx::astype(x, mx::float32, stream)});
}

void GeluErf::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& encoder = mx::cpu::get_command_encoder(s);
  auto x = row_contiguous(inputs[0], s);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_input_array(x);
  encoder.set_output_array(out);
  encoder.dispatch([xp = x.data<float>(),
                    op = out.data<float>(),
                    n = int64_t(x.size()),
                    threads = threads_,
                    generic = int(generic_)]() {
    check_status(mlxgw_gelu_erf(xp, op, n, threads, generic), "gelu_erf");
  });
}

void GeluErf::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.gelu_erf] runs on the CPU only");
}

bool GeluErf::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const GeluErf&>(other);
  return threads_ == o.threads_ && generic_ == o.generic_;
}

void RmsNorm::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.rms_norm] runs on the CPU only");
}

bool RmsNorm::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const RmsNorm&>(other);
  return eps_ == o.eps_ && unit_offset_ == o.unit_offset_;
}

void Rope::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& encoder = mx::cpu::get_command_encoder(s);
  auto x = unit_last_stride(inputs[0], s);
  auto freq = row_contiguous(inputs[1], s);
  auto offsets = row_contiguous(inputs[2], s);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  for (auto* a : {&x, &freq, &offsets}) {
    encoder.set_input_array(*a);
  }
  encoder.set_output_array(out);
  std::array<int64_t, 3> strides{x.strides()[0], x.strides()[1], x.strides()[2]};
  encoder.dispatch([xp = x.data<float>(),
                    strides,
                    op = out.data<float>(),
                    shape = x.shape(),
                    dims = dims_,
                    fp = freq.data<float>(),
                    offp = offsets.data<int32_t>(),
                    per_row = int(offsets.shape(0) > 1),
                    scale = scale_,
                    mscale = mscale_]() {
    check_status(
        mlxgw_rope(
            xp, strides.data(), op, shape[0], shape[1], shape[2], shape[3], dims, fp, offp,
            per_row, scale, mscale),
        "rope");
  });
}

void Rope::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.rope] runs on the CPU only");
}

bool Rope::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const Rope&>(other);
  return dims_ == o.dims_ && scale_ == o.scale_ && mscale_ == o.mscale_;
}

// -- rows of a running batch in buffers of their own (runtime/cache/rows.py) --

// Whether a row's buffer can take its new columns where it is: packed, from its start, in
// memory MLX allocated (anything else is copied first). Its other holders see only the
// columns before the row's length, which these writes never touch.
bool writable_in_place(const mx::array& a) {
  return a.flags().row_contiguous && a.offset() == 0 && a.data_shared_ptr()->is_owned();
}

void take_row(
    mx::cpu::CommandEncoder& encoder,
    const mx::array& row,
    mx::array& out,
    mx::Stream s) {
  if (writable_in_place(row)) {
    out.copy_shared_buffer(row);
  } else { // copied whole first: its other holders keep theirs
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto packed = row_contiguous(row, s);
    encoder.set_input_array(packed);
    encoder.dispatch([src = packed.data<char>(), dst = out.data<char>(), n = out.nbytes()]() {
      std::memcpy(dst, src, n);
    });
  }
  encoder.set_input_array(row);
  encoder.set_output_array(out);
}

void write_row(const RowWrite& w) {
  const int64_t bytes = w.width * w.itemsize;
  for (int64_t h = 0; h < w.heads; h++) {
    for (int64_t l = 0; l < w.length; l++) {
      const char* from = w.src + (h * w.src_h + l * w.src_l) * w.itemsize;
      char* to = w.dst + ((h * w.capacity) + w.end - w.length + l) * bytes;
      std::memcpy(to, from, size_t(bytes));
    }
  }
}


std::vector<std::vector<mx::array>> append_rows(
    const std::vector<mx::array>& news,
    const std::vector<std::vector<mx::array>>& rows,
    const std::vector<int>& ends) {
  const size_t parts = news.size(), batch = ends.size();
  bool ok = parts > 0 && rows.size() == parts;
  std::vector<mx::array> inputs;
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t p = 0; ok && p < parts; p++) {
    const auto& n = news[p];
    ok = n.ndim() == 4 && size_t(n.shape(0)) == batch && rows[p].size() == batch;
    inputs.push_back(n);
  }
  for (size_t p = 0; ok && p < parts; p++) {
    const auto& n = news[p];
    for (size_t b = 0; ok && b < batch; b++) {
      const auto& r = rows[p][b];
      ok = r.ndim() == 4 && r.shape(0) == 1 && r.shape(1) == n.shape(1) &&
          r.shape(3) == n.shape(3) && r.dtype() == n.dtype() && ends[b] >= n.shape(2) &&
          ends[b] <= r.shape(2);
      inputs.push_back(r);
      shapes.push_back(r.shape());
      dtypes.push_back(r.dtype());
    }
  }
  if (!ok) {
    throw std::invalid_argument(
        "[mlxgw.append_rows] news[p] (B, H, L, X), rows[p][b] (1, H, C, X) of its dtype, "
        "L <= ends[b] <= C, one end per row");
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  auto outs = mx::array::make_arrays(
      std::move(shapes), dtypes, std::make_shared<AppendRows>(stream, int(parts), ends), inputs);
  std::vector<std::vector<mx::array>> out(parts);
  for (size_t p = 0; p < parts; p++) {
    out[p].assign(outs.begin() + p * batch, outs.begin() + (p + 1) * batch);
  }
  return out;
}

void AppendRows::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& encoder = mx::cpu::get_command_encoder(s);
  const size_t parts = size_t(parts_), batch = ends_.size();
  std::vector<mx::array> news;
  for (size_t p = 0; p < parts; p++) {
    news.push_back(unit_last_stride(inputs[p], s));
    encoder.set_input_array(news.back());
  }
  std::vector<RowWrite> writes;
  for (size_t p = 0; p < parts; p++) {
    const auto& n = news[p];
    for (size_t b = 0; b < batch; b++) {
      const auto& row = inputs[parts + p * batch + b];
      auto& out = outputs[p * batch + b];
      take_row(encoder, row, out, s);
      writes.push_back(
          {n.data<char>() + b * n.strides()[0] * n.itemsize(), out.data<char>(), n.strides()[1],
           n.strides()[2], n.shape(1), n.shape(2), n.shape(3), out.shape(2), ends_[b],
           int64_t(n.itemsize())});
    }
  }
  encoder.dispatch([writes = std::move(writes)]() {
    for (const auto& w : writes) {
      write_row(w);
    }
  });
}

void AppendRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.append_rows] runs on the CPU only");
}

bool AppendRows::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const AppendRows&>(other);
  return parts_ == o.parts_ && ends_ == o.ends_;
}

std::vector<mx::Shape> AppendRows::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes;
  for (size_t i = size_t(parts_); i < inputs.size(); i++) {
    shapes.push_back(inputs[i].shape());
  }
  return shapes;
}

mx::array attention_rows(
    const mx::array& q,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const std::vector<int>& lengths,
    float scale,
    bool causal,
    int threads,
    bool generic) {
  const size_t batch = lengths.size();
  bool ok = q.ndim() == 4 && size_t(q.shape(0)) == batch && keys.size() == batch &&
      values.size() == batch && batch > 0 && q.shape(3) <= 512;
  for (size_t b = 0; ok && b < batch; b++) {
    const auto& k = keys[b];
    ok = k.ndim() == 4 && k.shape(0) == 1 && k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0 &&
        k.shape(1) == keys[0].shape(1) && k.shape(3) == q.shape(3) &&
        values[b].shape() == k.shape() && lengths[b] >= q.shape(2) && lengths[b] <= k.shape(2);
  }
  if (!ok) {
    std::ostringstream msg;
    msg << "[mlxgw.attention_rows] q (B, Hq, L, D), per row keys and values (1, Hkv, C, D) "
           "with Hq a multiple of Hkv, L <= length <= C and D <= 512; got q "
        << q.shape() << " and " << keys.size() << " rows";
    throw std::invalid_argument(msg.str());
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, stream)};
  for (const auto* side : {&keys, &values}) {
    for (const auto& a : *side) {
      inputs.push_back(mx::astype(a, mx::float32, stream));
    }
  }
  return mx::array(
      mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)},
      mx::float32,
      std::make_shared<AttentionRows>(
          stream, lengths, scale, causal, std::max(1, threads), generic),
      std::move(inputs));
}

void AttentionRows::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& encoder = mx::cpu::get_command_encoder(s);
  const int64_t batch = int64_t(lengths_.size());
  auto q = unit_last_stride(inputs[0], s);
  encoder.set_input_array(q);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  int64_t heads = q.shape(1), length = q.shape(2), dim = q.shape(3);
  AttnArgs base{};
  base.q = q.data<float>();
  base.out = out.data<float>();
  for (int i = 0; i < 3; i++) {
    base.q_strides[i] = q.strides()[i];
  }
  base.o_strides[0] = length * heads * dim; // out is (B, L, Hq, D)
  base.o_strides[1] = dim;
  base.o_strides[2] = heads * dim;
  base.batch = int32_t(batch);
  base.q_heads = int32_t(heads);
  base.kv_heads = inputs[1].shape(1);
  base.length = int32_t(length);
  base.dim = int32_t(dim);
  base.scale = scale_;
  base.causal = causal_;
  base.threads = threads_;
  base.generic = generic_;
  std::vector<AttnArgs> rows(size_t(batch), base);
  for (int64_t b = 0; b < batch; b++) {
    auto k = unit_last_stride(inputs[1 + b], s);
    auto v = unit_last_stride(inputs[1 + batch + b], s);
    encoder.set_input_array(k);
    encoder.set_input_array(v);
    AttnArgs& r = rows[size_t(b)];
    r.q = base.q + b * base.q_strides[0];
    r.out = base.out + b * base.o_strides[0];
    r.k = k.data<float>();
    r.v = v.data<float>();
    for (int i = 0; i < 3; i++) {
      r.k_strides[i] = k.strides()[i];
      r.v_strides[i] = v.strides()[i];
    }
    r.batch = 1;
    r.keys = lengths_[size_t(b)];
    base.keys = std::max(base.keys, r.keys);
  }
  encoder.dispatch([base, rows = std::move(rows)]() { attend_rows(base, rows); });
}

void attend_rows(const AttnArgs& base, const std::vector<AttnArgs>& rows) {
  AttnRows ra{base, rows.data()};
  int status = mlxgw_attention_decode_rows(&ra);
  if (status == 1) { // the prompt kernel computes each row on its own: the same bits
    status = 0;
    for (size_t b = 0; status == 0 && b < rows.size(); b++) {
      status = mlxgw_attention(&rows[b]);
    }
  }
  check_status(status, "attention_rows");
}

void AttentionRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.attention_rows] runs on the CPU only");
}

bool AttentionRows::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const AttentionRows&>(other);
  return lengths_ == o.lengths_ && scale_ == o.scale_ && causal_ == o.causal_ &&
      threads_ == o.threads_ && generic_ == o.generic_;
}

std::vector<mx::Shape> AttentionRows::output_shapes(const std::vector<mx::array>& inputs) {
  auto& q = inputs[0];
  return {mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}};
}

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
    bool generic) {
  const size_t batch = lengths.size();
  const int dim = q.ndim() == 4 ? q.shape(3) : 0;
  bool ok = q.ndim() == 4 && size_t(q.shape(0)) == batch && keys.size() == batch &&
      values.size() == batch && batch > 0 && (bits == 8 || bits == 4) && group_size > 0 &&
      group_size % 8 == 0 && dim % group_size == 0 && dim <= 512;
  for (size_t b = 0; ok && b < batch; b++) {
    for (const auto* side : {&keys[b], &values[b]}) {
      ok = ok && side->size() == 3;
      for (size_t i = 0; ok && i < 3; i++) {
        const auto& a = (*side)[i];
        const int width = i == 0 ? dim * bits / 32 : dim / group_size;
        ok = a.ndim() == 4 && a.shape(0) == 1 && a.shape(1) > 0 &&
            q.shape(1) % a.shape(1) == 0 && a.shape(1) == keys[0][0].shape(1) &&
            a.shape(2) == (*side)[0].shape(2) && a.shape(3) == width &&
            (i == 0 ? a.dtype() == mx::uint32 : true) && lengths[b] >= q.shape(2) &&
            lengths[b] <= a.shape(2);
      }
    }
  }
  if (!ok) {
    std::ostringstream msg;
    msg << "[mlxgw.quantized_attention_rows] q (B, Hq, L, D), per row keys and values "
           "(codes, scales, biases) of 8 or 4 bits in groups dividing D; got q "
        << q.shape() << " and " << keys.size() << " rows";
    throw std::invalid_argument(msg.str());
  }
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{mx::astype(q, mx::float32, stream)};
  for (size_t b = 0; b < batch; b++) {
    for (const auto* side : {&keys[b], &values[b]}) {
      inputs.push_back((*side)[0]);
      inputs.push_back(mx::astype((*side)[1], mx::float32, stream));
      inputs.push_back(mx::astype((*side)[2], mx::float32, stream));
    }
  }
  return mx::array(
      mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)},
      mx::float32,
      std::make_shared<QuantizedAttentionRows>(
          stream, lengths, bits, group_size, scale, causal, std::max(1, threads), generic),
      std::move(inputs));
}

void QuantizedAttentionRows::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& encoder = mx::cpu::get_command_encoder(s);
  const int64_t batch = int64_t(lengths_.size());
  auto q = unit_last_stride(inputs[0], s);
  encoder.set_input_array(q);
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  encoder.set_output_array(out);
  const int64_t heads = q.shape(1), length = q.shape(2), dim = q.shape(3);
  std::vector<QAttnArgs> rows(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; b++) {
    std::array<mx::array, 6> parts{
        row_contiguous(inputs[1 + 6 * b], s), row_contiguous(inputs[2 + 6 * b], s),
        row_contiguous(inputs[3 + 6 * b], s), row_contiguous(inputs[4 + 6 * b], s),
        row_contiguous(inputs[5 + 6 * b], s), row_contiguous(inputs[6 + 6 * b], s)};
    for (auto& a : parts) {
      encoder.set_input_array(a);
    }
    QAttnArgs& r = rows[size_t(b)];
    r = QAttnArgs{};
    AttnArgs& a = r.base;
    a.q = q.data<float>() + b * q.strides()[0];
    a.out = out.data<float>() + b * length * heads * dim; // out is (B, L, Hq, D)
    for (int i = 0; i < 3; i++) {
      a.q_strides[i] = q.strides()[i];
    }
    a.o_strides[0] = length * heads * dim;
    a.o_strides[1] = dim;
    a.o_strides[2] = heads * dim;
    a.batch = 1;
    a.q_heads = int32_t(heads);
    a.kv_heads = parts[0].shape(1);
    a.length = int32_t(length);
    a.keys = lengths_[size_t(b)];
    a.dim = int32_t(dim);
    a.scale = scale_;
    a.causal = causal_;
    a.threads = threads_;
    a.generic = generic_;
    r.kq = parts[0].data<uint8_t>();
    r.ks = parts[1].data<float>();
    r.kb = parts[2].data<float>();
    r.vq = parts[3].data<uint8_t>();
    r.vs = parts[4].data<float>();
    r.vb = parts[5].data<float>();
    for (int i = 0; i < 3; i++) { // codes in bytes, groups in floats
      r.kq_strides[i] = parts[0].strides()[i] * 4;
      r.ks_strides[i] = parts[1].strides()[i];
      r.kb_strides[i] = parts[2].strides()[i];
      r.vq_strides[i] = parts[3].strides()[i] * 4;
      r.vs_strides[i] = parts[4].strides()[i];
      r.vb_strides[i] = parts[5].strides()[i];
    }
    r.bits = bits_;
    r.group = group_size_;
  }
  encoder.dispatch([rows = std::move(rows)]() {
    for (const auto& r : rows) {
      check_status(mlxgw_attention_quantized(&r), "quantized_attention_rows");
    }
  });
}

void QuantizedAttentionRows::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.quantized_attention_rows] runs on the CPU only");
}

bool QuantizedAttentionRows::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedAttentionRows&>(other);
  return lengths_ == o.lengths_ && bits_ == o.bits_ && group_size_ == o.group_size_ &&
      scale_ == o.scale_ && causal_ == o.causal_ && threads_ == o.threads_ &&
      generic_ == o.generic_;
}

std::vector<mx::Shape> QuantizedAttentionRows::output_shapes(
    const std::vector<mx::array>& inputs) {
  auto& q = inputs[0];
  return {mx::Shape{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}};
}

} // namespace mlxgw
