/* Per-row kernels a decoder layer calls several times a step: RMSNorm and rotary
 * embeddings. MLX runs its fused versions of both on Metal and CUDA only; on the CPU,
 * mx.fast.rms_norm and mx.fast.rope fall back to a graph of 6 and about 15 element-wise
 * ops, each with its own dispatch, which is most of a small model's decode step. Here each
 * is one pass (the MLX extension registers them as primitives). Float32 throughout, with
 * the fallbacks' arithmetic: the same float32 angles, so the same positions rotate alike. */

#include <math.h>

#include "common.h"
#include "kernels.h"

EXPORT void mlxgw_rms_norm(const float *x, const float *w, float *out, int64_t rows,
                           int64_t dim, float eps, int32_t unit_offset) {
    const float unit = unit_offset ? 1.0f : 0.0f;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float sum = 0.0f;
        for (int64_t i = 0; i < dim; i++) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) o[i] = xr[i] * inv * (w[i] + unit);
    }
}

EXPORT int mlxgw_rope(const float *x, const int64_t *strides, float *out, int64_t batch,
                      int64_t heads, int64_t length, int64_t dim, int64_t dims,
                      const float *inv_freq, const int32_t *offsets, int32_t per_row, float scale,
                      float mscale) {
    enum { MAX_HALF = 512 };
    const int64_t half = dims / 2;
    if (dims % 2 != 0 || dims > dim || half > MAX_HALF) return 1;
    float cs[MAX_HALF], sn[MAX_HALF];
    for (int64_t b = 0; b < batch; b++) {
        const int64_t offset = offsets[per_row ? b : 0];
        for (int64_t l = 0; l < length; l++) {
            const float pos = (float)(offset + l) * scale;
            for (int64_t i = 0; i < half; i++) {
                const float theta = pos * inv_freq[i];
                cs[i] = cosf(theta) * mscale;
                sn[i] = sinf(theta) * mscale;
            }
            for (int64_t h = 0; h < heads; h++) {
                const float *xr = x + b * strides[0] + h * strides[1] + l * strides[2];
                float *o = out + ((b * heads + h) * length + l) * dim;
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = xr[i], x2 = xr[i + half];
                    o[i] = x1 * cs[i] - x2 * sn[i];
                    o[i + half] = x2 * cs[i] + x1 * sn[i];
                }
                for (int64_t i = dims; i < dim; i++) o[i] = xr[i] * mscale;
            }
        }
    }
    return 0;
}
