// runtime.kernels._mlx_ext: the primitives of primitives.h for Python (the bridge is
// runtime/kernels/primitives.py).

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>

#include "mlx/version.h"
#include "layer.h"
#include "primitives.h"
#include "quantized.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_mlx_ext, m) {
  m.doc() = "mlx-gateway's CPU kernels as MLX primitives";
  // the MLX this was compiled against: the bridge refuses to use it with another
  m.attr("mlx_version") = std::string(mlx::core::version());
  m.attr("mlx_header_version") = std::to_string(MLX_VERSION_MAJOR) + "." +
      std::to_string(MLX_VERSION_MINOR) + "." + std::to_string(MLX_VERSION_PATCH);
  m.def(
      "lanes_usable",
      []() { return mlxgw_lanes_usable() != 0; },
      "whether this CPU runs a 16-feature lanes kernel (AVX-512 VNNI or AVX2) and the "
      "environment does not ask for the portable code: a 4- to 8-bit weight is worth "
      "keeping in lanes (runtime/kernels/lanes.py)");
  m.def(
      "lanes_from_standard",
      [](nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu> src,
         nb::ndarray<uint8_t, nb::c_contig, nb::device::cpu> dst,
         int64_t n,
         int64_t in_features,
         int bits,
         int threads) {
        const size_t bytes = size_t(n) * size_t(in_features) * size_t(bits) / 8;
        if (src.nbytes() != bytes || dst.nbytes() != bytes) {
          throw std::invalid_argument(
              "[mlxgw.lanes_from_standard] src and dst must hold n * in_features * bits / 8 "
              "bytes");
        }
        int status;
        {
          nb::gil_scoped_release released;
          status = mlxgw_lanes_from_standard(src.data(), dst.data(), n, in_features, bits, threads);
        }
        return status == 0;
      },
      "src"_a,
      "dst"_a,
      "n"_a,
      "in_features"_a,
      "bits"_a,
      "threads"_a,
      "a standard weight's bytes (uint8 [n, in_features * bits / 8]) permuted into lanes in "
      "dst (runtime/kernels/lanes.py); False for a width or shape lanes do not take");
  m.def(
      "quantized_matmul",
      &mlxgw::quantized_matmul,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a.none(),
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "threads"_a,
      "generic"_a,
      "small_rows"_a,
      "x_bits"_a,
      "x @ dequantize(w).T on the CPU, as float32");
  m.def(
      "quantized_matmuls",
      &mlxgw::quantized_matmuls,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "bias"_a,
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "activation"_a,
      "threads"_a,
      "generic"_a,
      "small_rows"_a,
      "x_bits"_a,
      "several products of one x in one primitive (optionally gated: act(p0) * p1)");
  m.def(
      "attention",
      &mlxgw::attention,
      "q"_a,
      "k"_a,
      "v"_a,
      "starts"_a.none(),
      nb::kw_only(),
      "scale"_a,
      "causal"_a,
      "threads"_a,
      "generic"_a,
      "window"_a = 0,
      "attention of (B, Hq, L, D) queries over (B, Hkv, K, D) keys and values: (B, L, Hq, D); "
      "window > 0: a sliding window (causal, at most 16 queries)");
  m.def(
      "append_rows",
      &mlxgw::append_rows,
      "news"_a,
      "rows"_a,
      "ends"_a,
      "write news[p] (B, H, L, X) into rows[p][b] (1, H, C, X) at [ends[b] - L, ends[b]), in "
      "place: the rows written");
  m.def(
      "attention_rows",
      &mlxgw::attention_rows,
      "q"_a,
      "keys"_a,
      "values"_a,
      "lengths"_a,
      nb::kw_only(),
      "scale"_a,
      "causal"_a,
      "threads"_a,
      "generic"_a,
      "attention of (B, Hq, L, D) queries over rows of their own: (B, L, Hq, D)");
  m.def(
      "quantized_attention_rows",
      &mlxgw::quantized_attention_rows,
      "q"_a,
      "keys"_a,
      "values"_a,
      "lengths"_a,
      nb::kw_only(),
      "bits"_a,
      "group_size"_a,
      "scale"_a,
      "causal"_a,
      "threads"_a,
      "generic"_a,
      "attention of (B, Hq, L, D) queries over quantized rows of their own: (B, L, Hq, D)");
  m.def(
      "gelu_erf",
      &mlxgw::gelu_erf,
      "x"_a,
      nb::kw_only(),
      "threads"_a,
      "generic"_a,
      "the exact (erf) GELU, elementwise, float32, on the kernels' threads");
  m.def(
      "rms_norm",
      &mlxgw::rms_norm,
      "x"_a,
      "w"_a,
      nb::kw_only(),
      "eps"_a,
      "unit_offset"_a,
      "RMSNorm over the last axis, float32, in one pass");
  m.def(
      "rope",
      &mlxgw::rope,
      "x"_a,
      "inv_freq"_a,
      "offsets"_a,
      nb::kw_only(),
      "dims"_a,
      "scale"_a,
      "mscale"_a,
      "rotary embedding of (B, H, L, D), mx.fast.rope's non-traditional pairing, float32");
  m.def(
      "dequantize",
      &mlxgw::dequantize,
      "w"_a,
      "scales"_a,
      "biases"_a.none(),
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "threads"_a,
      "generic"_a,
      "the float32 weight of an affine-quantized triplet, on the CPU");
  m.def(
      "decoder_layer",
      &mlxgw::decoder_layer,
      "x"_a,
      "norms"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      "bias"_a,
      "group_size"_a,
      "bits"_a,
      "inv_freq"_a,
      "offsets"_a,
      "keys"_a,
      "values"_a,
      "lengths"_a,
      nb::kw_only(),
      "heads"_a,
      "kv_heads"_a,
      "head_dim"_a,
      "eps"_a,
      "unit_offset"_a,
      "qk_eps"_a,
      "rope_dims"_a,
      "rope_scale"_a,
      "mscale"_a,
      "scale"_a,
      "activation"_a,
      "threads"_a,
      "generic"_a,
      "small_rows"_a,
      "x_bits"_a,
      "a llama-style layer's step over a running batch's rows as one primitive: "
      "[h, keys' (B), values' (B)]");
}
