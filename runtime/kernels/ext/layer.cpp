// A llama-style decoder layer's decode step as one MLX primitive.
//
// Built of separate primitives, a layer's decode step is about two dozen graph nodes
// (norms, the q/k/v products, their reshapes and transposes, two rotations, the rows'
// writes, attention, the output product, the residual adds, the MLP): on a CPU each
// costs a few microseconds of MLX's scheduling on the stream thread and of Python
// building it, several milliseconds a step on a small model, while the kernels read the
// weights in about 14 ms (Qwen2.5-Coder-0.5B). Here the same C kernels run in the same
// order on the same values, in one task: the same bits, one node.

#include "layer.h"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"

#include "kernels.h"
#include "products.h"
#include "quantized.h"

namespace mlxgw {

namespace {

enum { kQ = 0, kK, kV, kO, kGate, kUp, kDown, kProducts };

// One row's buffer pair as the task writes and reads it.
struct RowBuffers {
  float* k;
  float* v;
  int64_t capacity;
};

struct LayerTask {
  LayerSpec spec;
  const float *x, *norm1, *norm2, *q_norm, *k_norm, *freq;
  const int32_t* offsets;
  std::vector<ProductArgs> products;
  std::vector<size_t> weight_bytes;
  std::vector<RowBuffers> rows;
  std::vector<int> lengths;
  float* h;
  int64_t batch, length, dims, hidden;
  int threads, generic, small, x_bits;

  void run();

 private:
  void products_of(const float* in, int64_t depth, std::initializer_list<int> which, float* gated);
};

void LayerTask::products_of(
    const float* in,
    int64_t depth,
    std::initializer_list<int> which,
    float* gated) {
  std::vector<ProductArgs> args;
  size_t bytes = 0;
  for (int i : which) {
    args.push_back(products[size_t(i)]);
    bytes += weight_bytes[size_t(i)];
  }
  run_products(
      in, batch * length, depth, args, gated, gated ? spec.activation : -1,
      product_threads(bytes, threads), generic, small, x_bits);
}

void LayerTask::run() {
  const int64_t r = batch * length, hq = spec.heads, hkv = spec.kv_heads, hd = spec.head_dim;
  const int64_t qd = hq * hd, kd = hkv * hd, inner = products[kGate].cols;
  thread_local std::vector<float> scratch;
  const size_t need = size_t(r * (2 * hidden + 2 * qd + 3 * kd + qd + inner + hidden));
  if (scratch.size() < need) {
    scratch.resize(need);
  }
  float* xn = scratch.data();
  float* q = xn + r * hidden;
  float* k = q + r * qd;
  float* v = k + r * kd;
  float* qr = v + r * kd;
  float* kr = qr + r * qd;
  float* att = kr + r * kd;
  float* mid = att + r * qd;
  float* tmp = mid + r * inner;

  mlxgw_rms_norm(x, norm1, xn, r, hidden, spec.eps, spec.unit_offset);
  products[kQ].out = q;
  products[kK].out = k;
  products[kV].out = v;
  products_of(xn, hidden, {kQ, kK, kV}, nullptr);
  if (spec.qk_eps >= 0) {
    mlxgw_rms_norm(q, q_norm, q, r * hq, hd, spec.qk_eps, spec.unit_offset);
    mlxgw_rms_norm(k, k_norm, k, r * hkv, hd, spec.qk_eps, spec.unit_offset);
  }
  // (B, L, H, hd) read as (B, H, L, hd); rotated into packed (B, H, L, hd)
  const int per_row = batch > 1;
  const int64_t q_strides[3] = {length * qd, hd, qd}, k_strides[3] = {length * kd, hd, kd};
  check_status(
      mlxgw_rope(q, q_strides, qr, batch, hq, length, hd, spec.rope_dims, freq, offsets,
                 per_row, spec.rope_scale, spec.mscale),
      "rope");
  check_status(
      mlxgw_rope(k, k_strides, kr, batch, hkv, length, hd, spec.rope_dims, freq, offsets,
                 per_row, spec.rope_scale, spec.mscale),
      "rope");
  AttnArgs base{};
  base.q = qr;
  base.out = att;
  base.q_strides[0] = hq * length * hd;
  base.q_strides[1] = length * hd;
  base.q_strides[2] = hd;
  base.o_strides[0] = length * qd; // out is (B, L, Hq, hd)
  base.o_strides[1] = hd;
  base.o_strides[2] = qd;
  base.batch = int32_t(batch);
  base.q_heads = int32_t(hq);
  base.kv_heads = int32_t(hkv);
  base.length = int32_t(length);
  base.dim = int32_t(hd);
  base.scale = spec.scale;
  base.causal = 1;
  base.threads = threads;
  base.generic = generic;
  std::vector<AttnArgs> per(size_t(batch), base);
  for (int64_t b = 0; b < batch; b++) {
    const RowBuffers& row = rows[size_t(b)];
    const int end = lengths[size_t(b)];
    write_row({reinterpret_cast<const char*>(kr + b * hkv * length * hd),
               reinterpret_cast<char*>(row.k), length * hd, hd, hkv, length, hd, row.capacity,
               end, int64_t(sizeof(float))});
    write_row({reinterpret_cast<const char*>(v + b * length * kd),
               reinterpret_cast<char*>(row.v), hd, kd, hkv, length, hd, row.capacity, end,
               int64_t(sizeof(float))});
    AttnArgs& a = per[size_t(b)];
    a.q = qr + b * base.q_strides[0];
    a.out = att + b * base.o_strides[0];
    a.k = row.k;
    a.v = row.v;
    const int64_t strides[3] = {hkv * row.capacity * hd, row.capacity * hd, hd};
    std::copy(strides, strides + 3, a.k_strides);
    std::copy(strides, strides + 3, a.v_strides);
    a.batch = 1;
    a.keys = end;
    base.keys = std::max(base.keys, end);
  }
  attend_rows(base, per);

  products[kO].out = tmp;
  products_of(att, qd, {kO}, nullptr);
  for (int64_t i = 0; i < r * hidden; i++) {
    h[i] = x[i] + tmp[i];
  }
  mlxgw_rms_norm(h, norm2, xn, r, hidden, spec.eps, spec.unit_offset);
  products_of(xn, hidden, {kGate, kUp}, mid);
  products[kDown].out = tmp;
  products_of(mid, inner, {kDown}, nullptr);
  for (int64_t i = 0; i < r * hidden; i++) {
    h[i] = h[i] + tmp[i];
  }
}

void check_layer(
    const mx::array& x,
    const LayerSpec& spec,
    const std::vector<mx::array>& w,
    const mx::array& inv_freq,
    const mx::array& offsets,
    const std::vector<mx::array>& keys,
    const std::vector<mx::array>& values,
    const std::vector<int>& lengths) {
  const size_t batch = lengths.size();
  const int hd = spec.head_dim;
  bool ok = x.ndim() == 3 && x.dtype() == mx::float32 && size_t(x.shape(0)) == batch &&
      batch > 0 && w.size() == kProducts && spec.heads > 0 && spec.kv_heads > 0 &&
      spec.heads % spec.kv_heads == 0 && hd > 0 && hd <= 512 && spec.rope_dims > 0 &&
      spec.rope_dims % 2 == 0 && spec.rope_dims <= hd && inv_freq.ndim() == 1 &&
      inv_freq.shape(0) == spec.rope_dims / 2 && offsets.ndim() == 1 &&
      size_t(offsets.shape(0)) == batch && keys.size() == batch && values.size() == batch;
  for (size_t i = 0; ok && i < w.size(); i++) {
    ok = w[i].ndim() == 2 || in_lanes(w[i]);
  }
  if (ok) {
    const int64_t d = x.shape(2), qd = int64_t(spec.heads) * hd, kd = int64_t(spec.kv_heads) * hd;
    const int64_t ff = out_features(w[kGate]);
    const int64_t out[kProducts] = {qd, kd, kd, d, ff, ff, d};
    for (int i = 0; ok && i < kProducts; i++) {
      ok = out_features(w[size_t(i)]) == out[i];
    }
  }
  for (size_t b = 0; ok && b < batch; b++) {
    const auto& k = keys[b];
    ok = k.ndim() == 4 && k.shape(0) == 1 && k.shape(1) == spec.kv_heads && k.shape(3) == hd &&
        k.dtype() == mx::float32 && values[b].shape() == k.shape() &&
        values[b].dtype() == mx::float32 && lengths[b] >= x.shape(1) && lengths[b] <= k.shape(2);
  }
  if (!ok) {
    std::ostringstream msg;
    msg << "[mlxgw.decoder_layer] x (B, L, D) float32; q, k, v, o, gate, up, down weights of "
           "heads x head_dim, kv_heads x head_dim, D and the MLP's width; inv_freq "
           "(rope_dims / 2,), offsets (B,), per row float32 keys and values (1, kv_heads, C, "
           "head_dim) with L <= length <= C; got x "
        << x.shape() << " and " << keys.size() << " rows";
    throw std::invalid_argument(msg.str());
  }
}

} // namespace

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
    int x_bits) {
  LayerSpec spec{heads, kv_heads, head_dim, eps, unit_offset, qk_eps, rope_dims, rope_scale,
                 mscale, scale, activation_kind(activation)};
  if (spec.activation < 0 || scales.size() != kProducts || biases.size() != kProducts ||
      bias.size() != kProducts || group_size.size() != kProducts || bits.size() != kProducts ||
      norms.size() != (qk_eps >= 0 ? 4u : 2u)) {
    throw std::invalid_argument(
        "[mlxgw.decoder_layer] seven products (q, k, v, o, gate, up, down) with their scales, "
        "biases, bias, group size and width; two norms, four with q/k norms; a gated "
        "activation");
  }
  check_layer(x, spec, w, inv_freq, offsets, keys, values, lengths);
  auto stream = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{x};
  for (const auto& n : norms) {
    inputs.push_back(mx::astype(n, mx::float32, stream));
  }
  std::vector<Product> products;
  const int64_t depth[kProducts] = {
      x.shape(2), x.shape(2), x.shape(2), int64_t(heads) * head_dim, x.shape(2), x.shape(2),
      out_features(w[kGate])};
  for (size_t i = 0; i < kProducts; i++) {
    check_format(w[i], scales[i], biases[i], depth[i], group_size[i], bits[i]);
    inputs.insert(inputs.end(), {w[i], scales[i]});
    if (biases[i]) {
      inputs.push_back(*biases[i]);
    }
    if (bias[i]) {
      if (bias[i]->ndim() != 1 || bias[i]->shape(0) != out_features(w[i])) {
        throw std::invalid_argument("[mlxgw.decoder_layer] a bias must be (out_features,)");
      }
      inputs.push_back(mx::astype(*bias[i], mx::float32, stream));
    }
    products.push_back({group_size[i], bits[i], bias[i].has_value(), biases[i].has_value()});
  }
  inputs.push_back(mx::astype(inv_freq, mx::float32, stream));
  inputs.push_back(mx::astype(offsets, mx::int32, stream));
  std::vector<mx::Shape> shapes{x.shape()};
  for (const auto* side : {&keys, &values}) {
    for (const auto& a : *side) {
      inputs.push_back(a);
      shapes.push_back(a.shape());
    }
  }
  std::vector<mx::Dtype> dtypes(shapes.size(), mx::float32);
  return mx::array::make_arrays(
      std::move(shapes),
      dtypes,
      std::make_shared<DecoderLayer>(
          stream, spec, std::move(products), lengths, std::max(1, threads), generic,
          small_rows, x_bits),
      inputs);
}

void DecoderLayer::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto s = stream();
  auto& encoder = mx::cpu::get_command_encoder(s);
  size_t at = 0;
  auto take = [&](bool packed) {
    auto a = packed ? row_contiguous(inputs[at++], s) : inputs[at++];
    encoder.set_input_array(a);
    return a;
  };
  LayerTask task{};
  task.spec = spec_;
  auto x = take(true);
  task.x = x.data<float>();
  task.batch = x.shape(0);
  task.length = x.shape(1);
  task.hidden = x.shape(2);
  std::vector<mx::array> held{x};
  for (int i = 0; i < (spec_.qk_eps >= 0 ? 4 : 2); i++) {
    held.push_back(take(true));
  }
  task.norm1 = held[1].data<float>();
  task.norm2 = held[2].data<float>();
  task.q_norm = spec_.qk_eps >= 0 ? held[3].data<float>() : nullptr;
  task.k_norm = spec_.qk_eps >= 0 ? held[4].data<float>() : nullptr;
  for (const auto& p : products_) {
    auto w = take(true);
    auto sc = take(true);
    const void* bp = nullptr;
    int stype = product_stype(w, sc, p.has_biases);
    if (p.has_biases) {
      bp = take(true).data<void>();
    }
    const float* bias = p.has_bias ? take(true).data<float>() : nullptr;
    task.products.push_back({w.data<uint32_t>(), sc.data<void>(), bp, bias, nullptr, out_features(w),
                             p.bits, p.group_size, stype});
    task.weight_bytes.push_back(w.nbytes());
  }
  task.freq = take(true).data<float>();
  task.offsets = take(true).data<int32_t>();
  const size_t batch = lengths_.size();
  for (size_t b = 0; b < batch; b++) {
    task.rows.push_back({nullptr, nullptr, inputs[at + b].shape(2)});
  }
  for (size_t side = 0; side < 2; side++) {
    for (size_t b = 0; b < batch; b++) {
      const auto& row = inputs[at + side * batch + b];
      auto& out = outputs[1 + side * batch + b];
      take_row(encoder, row, out, s);
      (side == 0 ? task.rows[b].k : task.rows[b].v) = out.data<float>();
    }
  }
  auto& h = outputs[0];
  h.set_data(mx::allocator::malloc(h.nbytes()));
  encoder.set_output_array(h);
  task.h = h.data<float>();
  task.lengths = lengths_;
  task.threads = threads_;
  task.generic = int(generic_);
  task.small = small_rows_;
  task.x_bits = x_bits_;
  encoder.dispatch([task = std::move(task)]() mutable { task.run(); });
}

void DecoderLayer::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[mlxgw.decoder_layer] runs on the CPU only");
}

bool DecoderLayer::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const DecoderLayer&>(other);
  return spec_ == o.spec_ && products_ == o.products_ && lengths_ == o.lengths_ &&
      threads_ == o.threads_ && generic_ == o.generic_ && small_rows_ == o.small_rows_ &&
      x_bits_ == o.x_bits_;
}

std::vector<mx::Shape> DecoderLayer::output_shapes(const std::vector<mx::array>& inputs) {
  std::vector<mx::Shape> shapes{inputs[0].shape()};
  const size_t rows = 2 * lengths_.size();
  for (size_t i = inputs.size() - rows; i < inputs.size(); i++) {
    shapes.push_back(inputs[i].shape());
  }
  return shapes;
}

} // namespace mlxgw
