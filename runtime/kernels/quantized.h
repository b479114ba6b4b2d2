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
/* `stype` with this bit set: the weight, scales and biases are in 16-feature lanes
 * (qlanes.c: 4, 5, 6 and 8 bits, features a multiple of 16); every entry point takes it */
enum { MLXGW_LANES = 8 };

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

/* rows n0..n1 of a weight in lanes, in the standard layout: rows base..end (n0 and n1
 * rounded out to whole strips of 16) of w, scales and biases in one allocation (`block`,
 * freed by the caller); 0, or 2 when out of memory */
typedef struct {
    void *block;
    const uint32_t *w;
    const void *scales, *biases;
    int64_t base, end;
} MlxgwStandard;
/* 1 where int16 products of weights in lanes take their own kernel here (AVX-512 VNNI or
 * AVX2, MLX_GATEWAY_CPU_ISA not "generic"); elsewhere they read a standard copy, made per
 * call */
int mlxgw_lanes_usable(void);
/* dst[k * (n1 - n0) + n - n0] (the tile transposed: [K, n1 - n0]) = weight (n, k) as
 * float32, for a weight in lanes, n0 and n1 multiples of 16; 1 where it does not run
 * (no AVX-512 VNNI, generic): the caller dequantizes rows (`mlxgw_dequantize`) */
int mlxgw_lanes_dequantize_t(const uint32_t *w, const void *scales, const void *biases,
                             float *dst, int64_t n0, int64_t n1, int64_t in_features,
                             int32_t bits, int32_t group_size, int32_t stype, int32_t threads,
                             int32_t generic);
int mlxgw_lanes_standard(const uint32_t *w, const void *scales, const void *biases,
                         int32_t stype, int64_t n0, int64_t n1, int64_t in_features,
                         int32_t bits, int32_t group_size, MlxgwStandard *out);
/* a standard weight's bytes ([n, in_features * bits / 8]) in lanes ([n / 16, blocks,
 * 64 * bits]) on `threads` threads: runtime/kernels/lanes.py `to_lanes` at load; 1 for a
 * width (4, 5, 6, 8) or shape (n a multiple of 16, in_features of 32) it does not take */
int mlxgw_lanes_from_standard(const uint8_t *src, uint8_t *dst, int64_t n,
                              int64_t in_features, int32_t bits, int32_t threads);

#ifdef __cplusplus
}
#endif

#endif
