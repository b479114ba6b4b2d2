// See primitives.h. The C kernels are runtime/kernels/quantized.c; the BLAS is whichever
// cblas_sgemm the process resolved (runtime/backend.py preloads an optimized one).

#include "primitives.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

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

namespace mlxgw {

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
// the floats of one dequantized tile of features handed to the BLAS
constexpr int64_t kTileFloats = int64_t(1) << 21;
// decode rows over a weight smaller than this run on one thread: waking a second costs
// more than the work (SmolLM2's 576 x 576 at 4 bits, 0.17 MB: 33 us alone, 88 us on two)
constexpr size_t kThreadBytes = size_t(1) << 19;

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
    const mx::array& biases,
    int64_t depth,
    int group_size,
    int bits) {
  if (bits < 2 || bits > 8 || bits == 7) {
    throw std::invalid_argument("[mlxgw.quantized_matmul] bits must be 2, 3, 4, 5, 6 or 8");
  }
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument("[mlxgw.quantized_matmul] group_size must be 32, 64 or 128");
  }
  int64_t cols = w.ndim() == 2 ? w.shape(0) : 0;
  int64_t groups = depth / group_size;
  bool ok = w.dtype() == mx::uint32 && depth % group_size == 0 && cols > 0 && groups > 0 &&
      w.shape(1) == depth * bits / 32 && scales.shape() == mx::Shape{int(cols), int(groups)} &&
      biases.shape() == scales.shape() && biases.dtype() == scales.dtype();
  if (!ok) {
    std::ostringstream msg;
    msg << "[mlxgw.quantized_matmul] shapes do not match: depth " << depth << ", w "
        << w.shape() << " " << w.dtype() << ", scales " << scales.shape() << ", biases "
        << biases.shape() << " for " << bits << " bits in groups of " << group_size;
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

} // namespace

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
    int x_bits) {
  if (x.ndim() < 1) {
    throw std::invalid_argument("[mlxgw.quantized_matmul] x must have at least one axis");
  }
  check_format(w, scales, biases, x.shape(-1), group_size, bits);
  auto stream = mx::default_stream(mx::Device::cpu);
  auto xf = mx::contiguous(mx::astype(x, mx::float32, stream), false, stream);
  mx::Shape shape = x.shape();
  shape.back() = w.shape(0);
  return mx::array(
      std::move(shape),
      mx::float32,
      std::make_shared<QuantizedMatmul>(
          stream, group_size, bits, std::max(1, threads), generic, small_rows, x_bits),
      {xf,
       mx::contiguous(w, false, stream),
       mx::contiguous(scales, false, stream),
       mx::contiguous(biases, false, stream)});
}

mx::array dequantize(
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int threads,
    bool generic) {
  if (w.ndim() != 2) {
    throw std::invalid_argument("[mlxgw.dequantize] w must be 2-D");
  }
  int64_t depth = w.shape(1) * 32 / bits;
  check_format(w, scales, biases, depth, group_size, bits);
  auto stream = mx::default_stream(mx::Device::cpu);
  return mx::array(
      mx::Shape{w.shape(0), int(depth)},
      mx::float32,
      std::make_shared<Dequantize>(stream, group_size, bits, std::max(1, threads), generic),
      {mx::contiguous(w, false, stream),
       mx::contiguous(scales, false, stream),
       mx::contiguous(biases, false, stream)});
}

void QuantizedMatmul::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& x = inputs[0];
  auto& w = inputs[1];
  auto& scales = inputs[2];
  auto& biases = inputs[3];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(x);
  encoder.set_input_array(w);
  encoder.set_input_array(scales);
  encoder.set_input_array(biases);
  encoder.set_output_array(out);
  int64_t depth = x.shape(-1);
  int64_t rows = depth ? x.size() / depth : 0;
  int64_t cols = w.shape(0);
  encoder.dispatch([xp = x.data<float>(),
                    wp = w.data<uint32_t>(),
                    sp = scales.data<void>(),
                    bp = biases.data<void>(),
                    op = out.data<float>(),
                    rows,
                    depth,
                    cols,
                    stype = scale_type(scales.dtype()),
                    bits = bits_,
                    gs = group_size_,
                    threads = w.nbytes() < kThreadBytes ? 1 : threads_,
                    generic = int(generic_),
                    small = small_rows_,
                    x_bits = x_bits_]() {
    if (rows == 0) {
      return;
    }
    if (rows <= small && x_bits != 0 &&
        mlxgw_qdot(
            xp, wp, sp, bp, op, rows, depth, cols, bits, gs, stype, x_bits, threads, generic) ==
            0) {
      return;
    }
    if (rows <= small) {
      check_status(
          mlxgw_quantized_matmul(
              xp, wp, sp, bp, op, rows, depth, cols, bits, gs, stype, threads, generic),
          "quantized_matmul");
      return;
    }
    // prompt-sized: a tile of features at a time, dequantized, through the BLAS
    int64_t tile = std::max<int64_t>(64, kTileFloats / depth / 64 * 64);
    tile = std::min(tile, cols);
    std::unique_ptr<float[]> buffer(new float[tile * depth]);
    for (int64_t n0 = 0; n0 < cols; n0 += tile) {
      int64_t n1 = std::min(cols, n0 + tile);
      check_status(
          dequantize_rows(
              wp, sp, bp, buffer.get(), n0, n1, depth, cols, bits, gs, stype, threads, generic),
          "dequantize");
      cblas_sgemm(
          kRowMajor,
          kNoTrans,
          kTrans,
          int(rows),
          int(n1 - n0),
          int(depth),
          1.0f,
          xp,
          int(depth),
          buffer.get(),
          int(depth),
          0.0f,
          op + n0,
          int(cols));
    }
  });
}

void QuantizedMatmul::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.quantized_matmul] runs on the CPU only");
}

bool QuantizedMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantizedMatmul&>(other);
  return group_size_ == o.group_size_ && bits_ == o.bits_ && threads_ == o.threads_ &&
      generic_ == o.generic_ && small_rows_ == o.small_rows_ && x_bits_ == o.x_bits_;
}

std::vector<mx::Shape> QuantizedMatmul::output_shapes(const std::vector<mx::array>& inputs) {
  mx::Shape shape = inputs[0].shape();
  shape.back() = inputs[1].shape(0);
  return {shape};
}

void Dequantize::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& w = inputs[0];
  auto& scales = inputs[1];
  auto& biases = inputs[2];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(w);
  encoder.set_input_array(scales);
  encoder.set_input_array(biases);
  encoder.set_output_array(out);
  encoder.dispatch([wp = w.data<uint32_t>(),
                    sp = scales.data<void>(),
                    bp = biases.data<void>(),
                    op = out.data<float>(),
                    cols = int64_t(out.shape(0)),
                    depth = int64_t(out.shape(1)),
                    stype = scale_type(scales.dtype()),
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
  return {mx::Shape{inputs[0].shape(0), int(inputs[0].shape(1) * 32 / bits_)}};
}

} // namespace mlxgw
