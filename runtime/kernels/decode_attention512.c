/* decode_attention.c's chunk of keys on AVX-512 (F, DQ), chosen at run time where the CPU
 * has it (AMD Zen 4/5, Intel Skylake-SP and later) and the head width is a multiple of 16.
 *
 * The AVX2 chunk reloads every key for each row of the GQA group, sums eight dot products
 * across lanes with a tree of 8-lane shuffles, then finds the block's maximum and the sum
 * of its weights one scalar at a time, and scales the row's output once per block with
 * every value loaded again: about 600 cycles per row and 16 keys, where the multiply-adds
 * alone need about 64. A decode step of 8 streams spent a fifth of its time there
 * (Qwen2.5-0.5B after 512 tokens: 9.3 ms of 24 layers, which fit in cache, so the time is
 * instructions, not memory). Here a block is 16 keys:
 *
 * - scores: per row, 16 dot products side by side (16 independent chains, the row's
 *   query slice in a register, each key slice a memory operand), summed across lanes all
 *   at once (hsum16: 15 adds and 30 in-lane shuffles, lane k = key k);
 * - softmax: the block's maximum by one reduction, the weights by one vector 2^x, and the
 *   weights' sum kept in 16 lanes across the chunk (scaled with the output, summed across
 *   lanes once at the chunk's end);
 * - values: each value slice loaded once for a tile of rows (up to 4 rows by 2 slices, 8
 *   independent chains), its weight broadcast from memory per row.
 *
 * The arithmetic is the AVX2 chunk's (scores in log2 units, online softmax per chunk, the
 * same merge of chunks in decode_attention.c) in a different order of float sums, so
 * results differ from it by rounding only. Every query of a verify step and every row of a
 * batch takes this same code, so the decode kernel's invariants (a verify row has the bits
 * of a plain step; a row's bits do not depend on the others) hold on this path as well. */

#include "common.h"
#include "kernels.h"

#if HAVE_X86_DISPATCH
#include <immintrin.h>
#include <math.h>
#include <strings.h>

#include "decode_attention.h"

#define TARGET_512 __attribute__((target("avx512f,avx512dq,avx2,fma")))
#define INLINE_512 TARGET_512 __attribute__((always_inline)) static inline

enum { BLOCK = 16, MAX_ROWS = DEC_MAX_ROWS, MAX_SLICES = DEC_MAX_DIM / 16, PREFETCH = 32 };

int mlxgw_decode512_usable(int generic, int dim) {
    static int has = -1;
    if (has < 0)
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
              __builtin_cpu_supports("fma");
    if (generic || !has || dim % 16 != 0) return 0;
    const char *isa = getenv("MLX_GATEWAY_CPU_ISA"); /* tests compare the AVX2 path */
    return !(isa != NULL && strcasecmp(isa, "avx2") == 0);
}

/* lane k = the sum of a[k]'s 16 lanes: pairs of vectors interleaved and added within
 * 128-bit lanes (twice), then the 128-bit lanes of pairs shuffled and added (twice) */
INLINE_512 __m512 hsum16(const __m512 *a) {
    __m512 t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) /* lanes of 128 bits: a0+a2, b0+b2, a1+a3, b1+b3 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* lane L of u[i]: keys 4i..4i+3 summed over lane L */
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++) /* keys 8i..8i+3 (lanes 0+1, 2+3), 8i+4..8i+7 (the same) */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* common.h's vexp2 in 16 lanes: the same polynomial, exactly 0 below -126 (and for -inf
 * and NaN) */
INLINE_512 __m512 exp2_512(__m512 x) {
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(127.0f));
    const __m512 t = _mm512_add_ps(x, magic);
    const __m512 f = _mm512_sub_ps(x, _mm512_sub_ps(t, magic));
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(magic)),
                         _mm512_set1_epi32(127)),
        23);
    return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(bits));
}

/* rows r0..r0+rt-1, slices s0..s0+st-1 of the output: scaled by each row's alpha, plus the
 * block's 16 weighted values (value k's slice loaded once for the tile) */
INLINE_512 void values_tile(float (*o)[DEC_MAX_DIM], const float (*w)[BLOCK], const float *alpha,
                            const float *const *value, int r0, int s0, const int rt,
                            const int st) {
    __m512 acc[4][2];
    for (int i = 0; i < rt; i++)
        for (int s = 0; s < st; s++)
            acc[i][s] = _mm512_mul_ps(_mm512_load_ps(o[r0 + i] + 16 * (s0 + s)),
                                      _mm512_set1_ps(alpha[r0 + i]));
    for (int k = 0; k < BLOCK; k++)
        for (int s = 0; s < st; s++) {
            const __m512 v = _mm512_loadu_ps(value[k] + 16 * (s0 + s));
            for (int i = 0; i < rt; i++)
                acc[i][s] = _mm512_fmadd_ps(_mm512_set1_ps(w[r0 + i][k]), v, acc[i][s]);
        }
    for (int i = 0; i < rt; i++)
        for (int s = 0; s < st; s++) _mm512_store_ps(o[r0 + i] + 16 * (s0 + s), acc[i][s]);
}

INLINE_512 void values_rows(float (*o)[DEC_MAX_DIM], const float (*w)[BLOCK], const float *alpha,
                            const float *const *value, int group, int s0, const int st) {
    int r = 0;
    for (; r + 4 <= group; r += 4) values_tile(o, w, alpha, value, r, s0, 4, st);
    switch (group - r) {
    case 3: values_tile(o, w, alpha, value, r, s0, 3, st); break;
    case 2: values_tile(o, w, alpha, value, r, s0, 2, st); break;
    case 1: values_tile(o, w, alpha, value, r, s0, 1, st); break;
    default: break;
    }
}

INLINE_512 void chunk512(const AttnArgs *a, int group, int b, int qi, int kvh, int32_t j0,
                         int32_t j1, float *part, const int slices) {
    const int dim = a->dim;
    const float qscale = a->scale * 1.4426950408889634f;
    const float *kp = a->k + b * a->k_strides[0] + kvh * a->k_strides[1];
    const float *vp = a->v + b * a->v_strides[0] + kvh * a->v_strides[1];
    __m512 q[MAX_ROWS][MAX_SLICES], lsum[MAX_ROWS];
    float o[MAX_ROWS][DEC_MAX_DIM] __attribute__((aligned(64)));
    float w[MAX_ROWS][BLOCK] __attribute__((aligned(64)));
    float m[MAX_ROWS], alpha[MAX_ROWS];
    for (int r = 0; r < group; r++) {
        const float *qp = a->q + b * a->q_strides[0] +
                          (int64_t)(kvh * group + r) * a->q_strides[1] + qi * a->q_strides[2];
        for (int s = 0; s < slices; s++) {
            q[r][s] = _mm512_mul_ps(_mm512_loadu_ps(qp + 16 * s), _mm512_set1_ps(qscale));
            _mm512_store_ps(o[r] + 16 * s, _mm512_setzero_ps());
        }
        m[r] = -__builtin_inff();
        lsum[r] = _mm512_setzero_ps();
    }
    for (int32_t j = j0; j < j1; j += BLOCK) {
        const int n = j1 - j < BLOCK ? j1 - j : BLOCK;
        const float *kb = kp + j * a->k_strides[2], *vb = vp + j * a->v_strides[2];
        if (j + PREFETCH + BLOCK <= j1)
            for (int k = 0; k < BLOCK; k++)
                for (int d = 0; d < dim; d += 16) {
                    _mm_prefetch((const char *)(kb + (PREFETCH + k) * a->k_strides[2] + d), _MM_HINT_T0);
                    _mm_prefetch((const char *)(vb + (PREFETCH + k) * a->v_strides[2] + d), _MM_HINT_T0);
                }
        /* keys past the chunk's end read the last key again and get weight 0 */
        const float *key[BLOCK], *value[BLOCK];
        for (int k = 0; k < BLOCK; k++) {
            key[k] = kb + (k < n ? k : n - 1) * a->k_strides[2];
            value[k] = vb + (k < n ? k : n - 1) * a->v_strides[2];
        }
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int r = 0; r < group; r++) {
            __m512 acc[BLOCK];
            for (int k = 0; k < BLOCK; k++) acc[k] = _mm512_mul_ps(q[r][0], _mm512_loadu_ps(key[k]));
            for (int s = 1; s < slices; s++)
                for (int k = 0; k < BLOCK; k++)
                    acc[k] = _mm512_fmadd_ps(q[r][s], _mm512_loadu_ps(key[k] + 16 * s), acc[k]);
            const __m512 score =
                _mm512_mask_mov_ps(_mm512_set1_ps(-__builtin_inff()), valid, hsum16(acc));
            const float block_top = _mm512_reduce_max_ps(score);
            const float top = block_top > m[r] ? block_top : m[r];
            const __m512 p = exp2_512(_mm512_sub_ps(score, _mm512_set1_ps(top)));
            /* 1 exactly where the maximum stays (2^0 is 1), 0 on the first block */
            alpha[r] = top == m[r] ? 1.0f : _mm512_cvtss_f32(exp2_512(_mm512_set1_ps(m[r] - top)));
            m[r] = top;
            lsum[r] = _mm512_fmadd_ps(lsum[r], _mm512_set1_ps(alpha[r]), p);
            _mm512_store_ps(w[r], p);
        }
        int s = 0;
        for (; s + 2 <= slices; s += 2) values_rows(o, w, alpha, value, group, s, 2);
        if (s < slices) values_rows(o, w, alpha, value, group, s, 1);
    }
    for (int r = 0; r < group; r++) {
        float *out = part + (int64_t)r * (dim + 2);
        out[0] = m[r];
        out[1] = _mm512_reduce_add_ps(lsum[r]);
        memcpy(out + 2, o[r], (size_t)dim * sizeof(float));
    }
}

/* chunk512 with the number of 16-float slices a constant where the head width is a common
 * one (64, 128, 256): its loops then unroll and a row's query stays in registers */
TARGET_512 void mlxgw_decode512_chunk(const AttnArgs *a, int group, int b, int qi, int kvh,
                                      int32_t j0, int32_t j1, float *part) {
    switch (a->dim) {
    case 64: chunk512(a, group, b, qi, kvh, j0, j1, part, 4); break;
    case 128: chunk512(a, group, b, qi, kvh, j0, j1, part, 8); break;
    case 256: chunk512(a, group, b, qi, kvh, j0, j1, part, 16); break;
    default: chunk512(a, group, b, qi, kvh, j0, j1, part, a->dim / 16); break;
    }
}

#endif
