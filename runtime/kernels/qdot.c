/* Decode-sized quantized products with int8 activations (x86 AVX2), as llama.cpp does.
 *
 *   mlxgw_qdot_i8: out[m, n] = sum_k x[m, k] * (s[n, g] * q[n, k] + b[n, g]) for MLX's
 *   4- and 8-bit affine layout (quantized.c describes it), with each row of x rounded to
 *   int8 per block of 32 values (scale max|x| / 127).
 *
 * Per block of 32 weights the float kernel (quantized.c) unpacks, converts, scales and
 * stores 32 floats before it multiplies them; here the 32 packed weights meet 32 int8
 * activations in one byte multiply-add (vpmaddubsw, then vpmaddwd to 32-bit lanes), and
 * one float multiply-add per block applies both scales. The bias term needs no weights:
 * sum_k x * b = b * sum_k x over a group, with the exact float sums of x.
 *
 * Error: rounding x to int8 changes each product by at most |s q| * max|x_block| / 254,
 * so |out - exact| <= sum over blocks of max|x_block| / 254 * sum_k |s q| in that block
 * (`qdot_bound` in the tests states the same); llama.cpp's Q8_0/Q8_K activations carry
 * the same error. 8-bit weights are centred (q - 128, as int8) so that the byte products
 * cannot saturate (vpmaddubsw adds two products into int16: 128 * 127 * 2 < 32768).
 * Returns 1 (not handled) on CPUs without AVX2+FMA+F16C and for other widths: the caller
 * runs the float kernel then.
 */

#include "common.h"

#if HAVE_X86_DISPATCH
#include <immintrin.h>

#define TARGET_QDOT __attribute__((target("avx2,fma,f16c")))

enum { QB = 32, QDOT_ROWS = 4, QDOT_CHUNK = 16 };

typedef struct {
    const int8_t *xq;  /* [rows, K]: int8 x, each 32-block in weight order (4 bits: evens, odds) */
    const float *xs;   /* [rows, K / 32]: block scales */
    const float *xsum; /* [rows, K / gs]: exact sums of x per weight group */
    const uint32_t *w;
    const void *scales, *biases;
    float *out;
    int64_t rows, depth, cols, groups;
    int32_t bits, group_size, stype;
    int64_t next;
} QDot;

TARGET_QDOT static inline float scale_at(int stype, const void *p, int64_t i) {
    if (stype == 0) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    if (stype == 1) return _cvtsh_ss(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* 32 weights of block `blk` of one feature row, as bytes in the order x was laid out */
TARGET_QDOT static inline __m256i weights4(const uint8_t *row, int64_t blk) {
    __m128i b = _mm_loadu_si128((const __m128i *)(row + blk * 16));
    __m128i m = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    return _mm256_set_m128i(hi, lo);
}

TARGET_QDOT static inline __m256i weights8(const uint8_t *row, int64_t blk) {
    __m256i b = _mm256_loadu_si256((const __m256i *)(row + blk * 32));
    return _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80)); /* q - 128 as int8 */
}

/* 8 int32 lanes of sum w * x over the block */
TARGET_QDOT static inline __m256i dot4(__m256i w, const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), _mm256_set1_epi16(1));
}

TARGET_QDOT static inline __m256i dot8(__m256i w, const int8_t *x) {
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

TARGET_QDOT static inline float hsum8(__m256i v32) {
    __m256 v = _mm256_cvtepi32_ps(v32);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* rows m0 .. m0 + mr of one feature n; mr <= QDOT_ROWS, bits 4 or 8 (constants inlined) */
TARGET_QDOT static inline void feature_rows(const QDot *a, int bits, int mr, int64_t n,
                                            int64_t m0) {
    const int64_t depth = a->depth, blocks = depth / QB, groups = a->groups;
    const int per_group = a->group_size / QB;
    const uint8_t *row = (const uint8_t *)a->w + n * depth * bits / 8;
    const float half = bits == 8 ? 128.0f : 0.0f; /* 8-bit weights are centred */
    __m256 acc[QDOT_ROWS];
    float bias[QDOT_ROWS];
    for (int r = 0; r < mr; r++) {
        acc[r] = _mm256_setzero_ps();
        bias[r] = 0.0f;
    }
    int64_t blk = 0;
    for (int64_t g = 0; g < groups; g++) {
        const float s = scale_at(a->stype, a->scales, n * groups + g);
        const float b = scale_at(a->stype, a->biases, n * groups + g) + half * s;
        for (int r = 0; r < mr; r++) bias[r] += b * a->xsum[(m0 + r) * groups + g];
        for (int i = 0; i < per_group; i++, blk++) {
            __m256i w = bits == 4 ? weights4(row, blk) : weights8(row, blk);
            for (int r = 0; r < mr; r++) {
                const int64_t m = m0 + r;
                __m256i d = bits == 4 ? dot4(w, a->xq + m * depth + blk * QB)
                                      : dot8(w, a->xq + m * depth + blk * QB);
                __m256 f = _mm256_set1_ps(s * a->xs[m * blocks + blk]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), f, acc[r]);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        a->out[(m0 + r) * a->cols + n] = _mm_cvtss_f32(v) + bias[r];
    }
}

TARGET_QDOT static void features_bits(const QDot *a, int bits, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        int64_t m = 0;
        for (; m + QDOT_ROWS <= a->rows; m += QDOT_ROWS) feature_rows(a, bits, QDOT_ROWS, n, m);
        switch (a->rows - m) {
        case 3: feature_rows(a, bits, 3, n, m); break;
        case 2: feature_rows(a, bits, 2, n, m); break;
        case 1: feature_rows(a, bits, 1, n, m); break;
        default: break;
        }
    }
}

TARGET_QDOT static void *qdot_worker(void *arg) {
    QDot *a = arg;
    for (;;) {
        int64_t start = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED) * QDOT_CHUNK;
        if (start >= a->cols) break;
        int64_t end = start + QDOT_CHUNK < a->cols ? start + QDOT_CHUNK : a->cols;
        if (a->bits == 4)
            features_bits(a, 4, start, end);
        else
            features_bits(a, 8, start, end);
    }
    return NULL;
}

/* x rows to int8 blocks (in the weights' value order), block scales, group sums */
TARGET_QDOT static void quantize_rows(const float *x, int64_t rows, int64_t depth, int bits,
                                      int gs, int8_t *xq, float *xs, float *xsum) {
    const int64_t blocks = depth / QB, groups = depth / gs;
    for (int64_t m = 0; m < rows; m++) {
        for (int64_t g = 0; g < groups; g++) {
            float t = 0.0f;
            for (int k = 0; k < gs; k++) t += x[m * depth + g * gs + k];
            xsum[m * groups + g] = t;
        }
        for (int64_t blk = 0; blk < blocks; blk++) {
            const float *src = x + m * depth + blk * QB;
            float amax = 0.0f;
            for (int k = 0; k < QB; k++) {
                float v = src[k] < 0 ? -src[k] : src[k];
                amax = v > amax ? v : amax;
            }
            float scale = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
            xs[m * blocks + blk] = scale;
            int8_t *dst = xq + m * depth + blk * QB;
            for (int k = 0; k < QB; k++) {
                /* 4 bits: byte j holds values 2j (low nibble) and 2j + 1 (high) */
                int pos = bits == 4 ? (k & 1) * 16 + k / 2 : k;
                dst[pos] = (int8_t)__builtin_lrintf(src[k] * inv);
            }
        }
    }
}

static int qdot_supported(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}
#endif

/* Arguments as mlxgw_quantized_matmul's (quantized.c); bits 4 or 8. Returns 0 on success,
 * 1 when not handled here (widths, no AVX2/F16C, generic), 2 when out of memory. */
EXPORT int mlxgw_qdot_i8(const float *x, const uint32_t *w, const void *scales,
                         const void *biases, float *out, int64_t rows, int64_t in_features,
                         int64_t out_features, int32_t bits, int32_t group_size, int32_t stype,
                         int32_t threads, int32_t generic) {
#if HAVE_X86_DISPATCH
    if (generic || !qdot_supported() || (bits != 4 && bits != 8) ||
        (group_size != 32 && group_size != 64 && group_size != 128) || stype < 0 ||
        stype > 2 || rows < 1 || out_features < 1 || in_features < group_size ||
        in_features % group_size != 0)
        return 1;
    const int64_t blocks = in_features / QB, groups = in_features / group_size;
    int8_t *xq = malloc((size_t)(rows * in_features));
    float *xs = malloc((size_t)(rows * blocks) * sizeof(float));
    float *xsum = malloc((size_t)(rows * groups) * sizeof(float));
    if (!xq || !xs || !xsum) {
        free(xq);
        free(xs);
        free(xsum);
        return 2;
    }
    quantize_rows(x, rows, in_features, bits, group_size, xq, xs, xsum);
    QDot a = {xq, xs, xsum, w, scales, biases, out, rows, in_features, out_features, groups,
              bits, group_size, stype, 0};
    int64_t items = (out_features + QDOT_CHUNK - 1) / QDOT_CHUNK;
    if (threads < 1) threads = 1;
    if (threads > items) threads = (int32_t)items;
    run_threads(qdot_worker, &a, threads);
    free(xq);
    free(xs);
    free(xsum);
    return 0;
#else
    (void)x, (void)w, (void)scales, (void)biases, (void)out, (void)rows, (void)in_features;
    (void)out_features, (void)bits, (void)group_size, (void)stype, (void)threads, (void)generic;
    return 1;
#endif
}
