/* The quantized kernels' C interface (quantized.c, qdot.c), for their callers: the MLX
 * extension (ext/primitives.cpp) and the portable-code check (tests/runtime/kernels). */

#ifndef MLXGW_QUANTIZED_H
#define MLXGW_QUANTIZED_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* `stype` (the scales' element type: 0 float32, 1 float16, 2 bfloat16) with this bit set:
 * the weight has no biases array (`biases` is not read), each group's bias is
 * -2^(bits - 1) times its scale (GGUF's Q4_0, Q5_0 and Q8_0 kept without biases) */
enum { MLXGW_SYMMETRIC = 4 };

/* out[rows, N] = x[rows, K] @ dequantize(w, scales, biases).T, float kernel (quantized.c) */
int mlxgw_quantized_matmul(const float *x, const uint32_t *w, const void *scales,
                           const void *biases, float *out, int64_t rows, int64_t in_features,
                           int64_t out_features, int32_t bits, int32_t group_size, int32_t stype,
                           int32_t threads, int32_t generic);
/* the same with x rounded to x_bits (8 or 16) integers per block of 32 (qdot.c, AVX2) */
int mlxgw_qdot(const float *x, const uint32_t *w, const void *scales, const void *biases,
               float *out, int64_t rows, int64_t in_features, int64_t out_features, int32_t bits,
               int32_t group_size, int32_t stype, int32_t x_bits, int32_t threads,
               int32_t generic);
/* One product of mlxgw_qdot_many: out[rows, cols] = x @ dequantize(w, scales, biases).T
 * (+ bias[cols] on every row, when bias is not NULL). */
typedef struct {
    const uint32_t *w;
    const void *scales, *biases;
    const float *bias;
    float *out;
    int64_t cols;
    int32_t bits, group_size, stype;
} MlxgwQProj;
/* mlxgw_qdot for `count` (at most 8) weights of one x, in one job on the threads: x is
 * rounded once per layout the widths need */
int mlxgw_qdot_many(const float *x, int64_t rows, int64_t in_features, const MlxgwQProj *projs,
                    int32_t count, int32_t x_bits, int32_t threads, int32_t generic);
/* dst = rows n0..n1 of the weight as float32: portable (quantized.c) and AVX2 (qdot.c) */
int mlxgw_dequantize(const uint32_t *w, const void *scales, const void *biases, float *dst,
                     int64_t n0, int64_t n1, int64_t in_features, int64_t out_features,
                     int32_t bits, int32_t group_size, int32_t stype, int32_t threads,
                     int32_t generic);
int mlxgw_dequantize_avx2(const uint32_t *w, const void *scales, const void *biases,
                          float *dst, int64_t n0, int64_t n1, int64_t in_features,
                          int64_t out_features, int32_t bits, int32_t group_size, int32_t stype,
                          int32_t threads, int32_t generic);

#ifdef __cplusplus
}
#endif

#endif
