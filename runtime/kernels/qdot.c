/* Decode-sized quantized products with int8 activations (x86 AVX2), as llama.cpp does.
 *
 *   mlxgw_qdot_i8: out[m, n] = sum_k x[m, k] * (s[n, g] * q[n, k] + b[n, g]) for MLX's
 *   affine layout of 2 to 6 and 8 bits (quantized.c describes it), with each row of x
 *   rounded to int8 per block of 32 values (scale max|x| / 127).
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
#include "qdot.h"
#include "quantized.h"

#include <pthread.h>

#if HAVE_X86_DISPATCH
#include <immintrin.h>

#define TARGET_QDOT __attribute__((target("avx2,fma,f16c")))
/* the row and width loops must be inlined with their constants: left as calls, the
 * accumulators live on the stack */
#define INLINE_QDOT TARGET_QDOT __attribute__((always_inline)) static inline

enum { QDOT_ROWS = 4, QDOT_CHUNK = 16 };
/* how far ahead of a feature row's block its bytes are prefetched: the hardware's
 * prefetchers stop at every 4 KB page, and a decode step's products stream weights far
 * larger than the caches (Gemma 3 270M's 8-bit head, 178 MB: one stream 30 -> 37 tok/s on
 * the AVX2 path; 1-8 KB ahead all measured alike) */
enum { QDOT_AHEAD = 2048 };

/* prefetch for block `blk` of a feature row: a block is 4 * bits bytes, at most half a
 * line, so at 2, 4 and 8 bits once a line (every 16 bytes' worth of blocks), at the other
 * widths, whose blocks do not divide a line, every block */
INLINE_QDOT void prefetch_block(const uint8_t *row, int bits, int64_t blk) {
    if ((bits & (bits - 1)) != 0 || (blk * bits) % 16 == 0)
        _mm_prefetch((const char *)row + blk * 4 * bits + QDOT_AHEAD, _MM_HINT_T0);
}

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

/* Any other width b (2, 3, 5, 6): each value's 16-bit window of the bit stream gathered
 * into a 16-bit lane (vpshufb), shifted into place by a multiply-high (w * 2^(16 - o) >> 16
 * = w >> o; a value at a byte boundary takes the window one byte earlier, o = 8), masked,
 * and packed to bytes. The bytes come out as values 0-7, 16-23, 8-15, 24-31 (the 128-bit
 * lanes of the pack): x is laid out in that order (`weight_order`). */
typedef struct {
    __m256i shuffle[2]; /* values 0-15 from source A, 16-31 from source B */
    __m256i multiply[2];
    int b_offset; /* byte where source B starts in the block (A starts at 0) */
} Unpack;

static Unpack unpackers[9];
static pthread_once_t unpackers_once = PTHREAD_ONCE_INIT;

static void build_unpackers(void) {
    static const int widths[] = {2, 3, 5, 6};
    for (int wi = 0; wi < 4; wi++) {
        const int b = widths[wi];
        Unpack *u = &unpackers[b];
        u->b_offset = b >= 4 ? 4 * b - 16 : 0; /* 2 and 3 bits: the block is copied whole */
        uint8_t shuffle[2][32];
        uint16_t multiply[2][16];
        for (int i = 0; i < 32; i++) {
            const int src = i / 16, lane = (i % 16) / 8, slot = i % 8;
            const int start = src ? u->b_offset : 0;
            int bit = b * i, byte = bit / 8, shift = bit % 8;
            if (shift == 0) {
                byte -= 1;
                shift = 8;
            }
            int lo = byte - start, hi = byte + 1 - start;
            shuffle[src][lane * 16 + slot * 2] = lo < 0 ? 0x80 : (uint8_t)lo;
            shuffle[src][lane * 16 + slot * 2 + 1] = (uint8_t)hi;
            multiply[src][lane * 8 + slot] = (uint16_t)(1u << (16 - shift));
        }
        for (int k = 0; k < 2; k++) {
            memcpy(&u->shuffle[k], shuffle[k], 32);
            memcpy(&u->multiply[k], multiply[k], 32);
        }
    }
}

/* the values of block `blk` as two vectors of 16-bit lanes: values 0-15, then 16-31 */
INLINE_QDOT void weights_any16(int bits, const uint8_t *row, int64_t blk,
                                             __m256i *wa, __m256i *wb) {
    const Unpack *u = &unpackers[bits];
    const uint8_t *p = row + blk * 4 * bits;
    __m128i a, b;
    if (bits >= 4) {
        a = _mm_loadu_si128((const __m128i *)p);
        b = _mm_loadu_si128((const __m128i *)(p + u->b_offset));
    } else { /* a block of 8 or 12 bytes: never read past it */
        uint8_t tmp[16] = {0};
        memcpy(tmp, p, (size_t)(4 * bits));
        a = b = _mm_loadu_si128((const __m128i *)tmp);
    }
    const __m256i mask = _mm256_set1_epi16((short)((1 << bits) - 1));
    *wa = _mm256_shuffle_epi8(_mm256_set_m128i(a, a), u->shuffle[0]);
    *wb = _mm256_shuffle_epi8(_mm256_set_m128i(b, b), u->shuffle[1]);
    *wa = _mm256_and_si256(_mm256_mulhi_epu16(*wa, u->multiply[0]), mask);
    *wb = _mm256_and_si256(_mm256_mulhi_epu16(*wb, u->multiply[1]), mask);
}

TARGET_QDOT static inline __m256i weights_any(int bits, const uint8_t *row, int64_t blk) {
    __m256i wa, wb;
    weights_any16(bits, row, blk, &wa, &wb);
    return _mm256_packus_epi16(wa, wb);
}

/* For int16 x: the block's 32 values as two vectors of 16-bit lanes, in the order
 * `wide_order` lays x out (4 bits: the even values, then the odd ones; else natural). */
INLINE_QDOT void weights16(int bits, const uint8_t *row, int64_t blk,
                                         __m256i *lo, __m256i *hi) {
    if (bits == 8) {
        const uint8_t *p = row + blk * 32;
        *lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
        *hi = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
    } else if (bits == 4) {
        __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(row + blk * 16)));
        *lo = _mm256_and_si256(v, _mm256_set1_epi16(15));
        *hi = _mm256_srli_epi16(v, 4);
    } else {
        weights_any16(bits, row, blk, lo, hi);
    }
}

/* where value k of a block of 32 sits in the unpacked weights of `bits` */
static inline int weight_order(int bits, int k) {
    if (bits == 4) return (k & 1) * 16 + k / 2; /* byte j: values 2j (low), 2j + 1 (high) */
    if (bits == 8) return k;
    return k < 8 ? k : k < 16 ? k + 8 : k < 24 ? k - 8 : k;
}

/* the same for int16 x (`weights16`) */
static inline int wide_order(int bits, int k) {
    return bits == 4 ? (k & 1) * 16 + k / 2 : k;
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

/* rows m0 .. m0 + mr of one feature n; mr <= QDOT_ROWS (bits and mr constants inlined) */
INLINE_QDOT void feature_rows(const QDot *a, int bits, int mr, int64_t n, int64_t m0) {
    const int64_t depth = a->depth, blocks = depth / QB, groups = a->groups;
    const int per_group = a->group_size / QB;
    const uint8_t *row = (const uint8_t *)a->w + n * depth * bits / 8;
    /* 8-bit weights meet int8 x centred (q - 128) */
    const float half = bits == 8 ? 128.0f : 0.0f;
    __m256 acc[QDOT_ROWS];
    float bias[QDOT_ROWS];
    for (int r = 0; r < mr; r++) {
        acc[r] = _mm256_setzero_ps();
        bias[r] = 0.0f;
    }
    int64_t blk = 0;
    for (int64_t g = 0; g < groups; g++) {
        const float s = scale_at(a->stype, a->scales, n * groups + g);
        /* symmetric: -half * s + half * s */
        const float b = a->sym ? (bits == 8 ? 0.0f : -(float)(1 << (bits - 1)) * s)
                               : scale_at(a->stype, a->biases, n * groups + g) + half * s;
        for (int r = 0; r < mr; r++) bias[r] += b * a->xsum[(m0 + r) * groups + g];
        for (int i = 0; i < per_group; i++, blk++) {
            prefetch_block(row, bits, blk);
            __m256i w = bits == 4   ? weights4(row, blk)
                        : bits == 8 ? weights8(row, blk)
                                    : weights_any(bits, row, blk);
            for (int r = 0; r < mr; r++) {
                const int64_t m = m0 + r;
                const int64_t at = m * depth + blk * QB;
                __m256i d = bits == 8 ? dot8(w, (const int8_t *)a->xq + at)
                                      : dot4(w, (const int8_t *)a->xq + at);
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

/* 8 consecutive scales or biases as floats */
INLINE_QDOT __m256 scales8(int stype, const void *p, int64_t i) {
    if (stype == 0) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (stype == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* one block's 32 products for int16 x, as 8 int32 lanes */
INLINE_QDOT __m256i dot16(__m256i lo, __m256i hi, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 16))));
}

/* feature_rows for int16 x. The weights widen straight to 16-bit lanes (no byte packing);
 * with groups of 32, eight groups' scales, biases and bias terms are read and multiplied
 * as vectors; each row keeps two accumulators, so that consecutive blocks' multiply-adds
 * do not wait on each other. */
INLINE_QDOT void feature_rows_wide(const QDot *a, int bits, int mr, int64_t n, int64_t m0) {
    const int64_t depth = a->depth, blocks = depth / QB, groups = a->groups;
    const int per_group = a->group_size / QB;
    const uint8_t *row = (const uint8_t *)a->w + n * depth * bits / 8;
    const int16_t *xq = (const int16_t *)a->xq;
    __m256 acc[QDOT_ROWS], other[QDOT_ROWS], bacc[QDOT_ROWS];
    float bias[QDOT_ROWS];
    for (int r = 0; r < mr; r++) {
        acc[r] = other[r] = bacc[r] = _mm256_setzero_ps();
        bias[r] = 0.0f;
    }
    int64_t blk = 0;
    if (per_group == 1) {
        for (; blk + 8 <= blocks; blk += 8) {
            const __m256 sv = scales8(a->stype, a->scales, n * groups + blk);
            const __m256 off = _mm256_set1_ps(-(float)(1 << (bits - 1)));
            const __m256 bv = a->sym ? _mm256_mul_ps(sv, off)
                                     : scales8(a->stype, a->biases, n * groups + blk);
            float fs[QDOT_ROWS][8];
            for (int r = 0; r < mr; r++) {
                const int64_t m = m0 + r;
                bacc[r] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(a->xsum + m * groups + blk), bacc[r]);
                _mm256_storeu_ps(fs[r], _mm256_mul_ps(sv, _mm256_loadu_ps(a->xs + m * blocks + blk)));
            }
            for (int j = 0; j < 8; j++) {
                __m256i lo, hi;
                prefetch_block(row, bits, blk + j);
                weights16(bits, row, blk + j, &lo, &hi);
                for (int r = 0; r < mr; r++) {
                    __m256i d = dot16(lo, hi, xq + (m0 + r) * depth + (blk + j) * QB);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(&fs[r][j]),
                                             acc[r]);
                    const __m256 t = acc[r]; /* the next block adds into the other one */
                    acc[r] = other[r];
                    other[r] = t;
                }
            }
        }
    }
    for (int64_t g = blk / per_group; g < groups; g++) {
        const float s = scale_at(a->stype, a->scales, n * groups + g);
        const float b = a->sym ? -(float)(1 << (bits - 1)) * s
                               : scale_at(a->stype, a->biases, n * groups + g);
        for (int r = 0; r < mr; r++) bias[r] += b * a->xsum[(m0 + r) * groups + g];
        for (int i = 0; i < per_group; i++, blk++) {
            __m256i lo, hi;
            prefetch_block(row, bits, blk);
            weights16(bits, row, blk, &lo, &hi);
            for (int r = 0; r < mr; r++) {
                const int64_t m = m0 + r;
                __m256i d = dot16(lo, hi, xq + m * depth + blk * QB);
                __m256 f = _mm256_set1_ps(s * a->xs[m * blocks + blk]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), f, acc[r]);
                const __m256 t = acc[r];
                acc[r] = other[r];
                other[r] = t;
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        __m256 t = _mm256_add_ps(_mm256_add_ps(acc[r], other[r]), bacc[r]);
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        a->out[(m0 + r) * a->cols + n] = _mm_cvtss_f32(v) + bias[r];
    }
}

INLINE_QDOT void features_bits(const QDot *a, int bits, int wide, int64_t n0,
                                             int64_t n1) {
    if (wide) {
        for (int64_t n = n0; n < n1; n++) {
            int64_t m = 0;
            for (; m + QDOT_ROWS <= a->rows; m += QDOT_ROWS)
                feature_rows_wide(a, bits, QDOT_ROWS, n, m);
            switch (a->rows - m) {
            case 3: feature_rows_wide(a, bits, 3, n, m); break;
            case 2: feature_rows_wide(a, bits, 2, n, m); break;
            case 1: feature_rows_wide(a, bits, 1, n, m); break;
            default: break;
            }
        }
        return;
    }
    for (int64_t n = n0; n < n1; n++) {
        int64_t m = 0;
        for (; m + QDOT_ROWS <= a->rows; m += QDOT_ROWS)
            feature_rows(a, bits, QDOT_ROWS, n, m);
        switch (a->rows - m) {
        case 3: feature_rows(a, bits, 3, n, m); break;
        case 2: feature_rows(a, bits, 2, n, m); break;
        case 1: feature_rows(a, bits, 1, n, m); break;
        default: break;
        }
    }
}

/* each (width, activation size) pair gets its own code */
#define FEATURES(bits)                                                                       \
    TARGET_QDOT static void features_##bits(const QDot *a, int64_t n0, int64_t n1) {         \
        if (a->wide)                                                                         \
            features_bits(a, bits, 1, n0, n1);                                               \
        else                                                                                 \
            features_bits(a, bits, 0, n0, n1);                                               \
    }
FEATURES(2)
FEATURES(3)
FEATURES(4)
FEATURES(5)
FEATURES(6)
FEATURES(8)

TARGET_QDOT static void qdot_features(const QDot *a, int64_t start, int64_t end) {
    switch (a->bits) {
    case 2: features_2(a, start, end); break;
    case 3: features_3(a, start, end); break;
    case 4: features_4(a, start, end); break;
    case 5: features_5(a, start, end); break;
    case 6: features_6(a, start, end); break;
    default: features_8(a, start, end); break;
    }
}

/* Several products of one x, run as one job: the work items are chunks of every
 * projection's features, in turn. */
typedef struct {
    QDot *parts;
    const float *const *bias; /* per part: (cols) floats added to each row, or NULL */
    const int64_t *first;     /* per part: its first work item; first[count] = all items */
    const int64_t *chunk;     /* per part: features per work item */
    int32_t count;
    int32_t use512; /* int16 x on AVX-512 (qdot512.c) */
    int64_t next;
} QDotJob;

TARGET_QDOT static void *qdot_worker(void *arg) {
    QDotJob *job = arg;
    int32_t p = 0;
    for (;;) {
        int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (item >= job->first[job->count]) break;
        while (item >= job->first[p + 1]) p++;
        const QDot *a = &job->parts[p];
        const int64_t size = job->chunk[p];
        int64_t start = (item - job->first[p]) * size;
        int64_t end = start + size < a->cols ? start + size : a->cols;
        if (a->lanes)
            mlxgw_qlanes_features(a, start, end);
        else if (job->use512)
            mlxgw_qdot512_features(a, start, end);
        else
            qdot_features(a, start, end);
        const float *bias = job->bias[p];
        if (bias != NULL) {
            for (int64_t m = 0; m < a->rows; m++)
                for (int64_t n = start; n < end; n++) a->out[m * a->cols + n] += bias[n];
        }
    }
    return NULL;
}

/* x rows to int8 or int16 (wide) blocks in the weights' value order, block scales, group
 * sums */
TARGET_QDOT static void quantize_rows(const float *x, int64_t rows, int64_t depth, int bits,
                                      int gs, int wide, void *xq, float *xs, float *xsum) {
    const float top = wide ? 32767.0f : 127.0f;
    const int64_t blocks = depth / QB, groups = depth / gs;
    for (int64_t m = 0; m < rows; m++) {
        for (int64_t g = 0; g < groups; g++) {
            float t = 0.0f;
            for (int k = 0; k < gs; k++) t += x[m * depth + g * gs + k];
            xsum[m * groups + g] = t;
        }
        for (int64_t blk = 0; blk < blocks; blk++) {
            const float *src = x + m * depth + blk * QB;
            /* the largest magnitude (exact in any order), then each value times the
             * block's inverse scale rounded to nearest, ties to even: what lrintf gives
             * in the default rounding mode, eight at a time */
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 vmax = _mm256_setzero_ps();
            for (int k = 0; k < QB; k += 8)
                vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(src + k)), vmax); /* a NaN skipped, as a compare does */
            __m128 half = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
            half = _mm_max_ps(half, _mm_movehl_ps(half, half));
            half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
            const float amax = _mm_cvtss_f32(half);
            float scale = amax / top, inv = amax > 0 ? top / amax : 0.0f;
            xs[m * blocks + blk] = scale;
            const int64_t at = m * depth + blk * QB;
            int32_t rounded[QB];
            const __m256 vinv = _mm256_set1_ps(inv);
            for (int k = 0; k < QB; k += 8)
                _mm256_storeu_si256((__m256i *)(rounded + k),
                                    _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + k), vinv)));
            for (int k = 0; k < QB; k++) {
                if (wide)
                    ((int16_t *)xq)[at + wide_order(bits, k)] = (int16_t)rounded[k];
                else
                    ((int8_t *)xq)[at + weight_order(bits, k)] = (int8_t)rounded[k];
            }
        }
    }
}

static int qdot_supported(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

/* The layout x is rounded into for a width: which order, and whether 8-bit weights are
 * centred (int8 x); products of equal layouts and group sizes share one rounded x. */
static int x_layout(int bits, int wide) {
    if (wide) return bits == 4 ? 1 : 0;
    return bits == 4 ? 1 : bits == 8 ? 2 : 3;
}

static int qdot_refuses(const MlxgwQProj *p, int64_t depth) {
    const int32_t st = p->stype & ~(MLXGW_SYMMETRIC | MLXGW_LANES);
    if ((p->stype & MLXGW_LANES) && ((p->bits < 4 || p->bits == 7 || p->bits > 8) || p->cols % 16 != 0))
        return 1;
    return p->bits < 2 || p->bits > 8 || p->bits == 7 ||
           (p->group_size != 32 && p->group_size != 64 && p->group_size != 128) ||
           st < 0 || st > 2 || p->cols < 1 || depth < p->group_size ||
           depth % p->group_size != 0;
}
#endif

EXPORT int mlxgw_qdot_many(const float *x, int64_t rows, int64_t in_features,
                           const MlxgwQProj *projs, int32_t count, int32_t x_bits,
                           int32_t threads, int32_t generic) {
#if HAVE_X86_DISPATCH
    enum { MAX_PARTS = 8 };
    if (generic || !qdot_supported() || rows < 1 || count < 1 || count > MAX_PARTS ||
        (x_bits != 8 && x_bits != 16))
        return 1;
    for (int32_t p = 0; p < count; p++)
        if (qdot_refuses(&projs[p], in_features)) return 1;
    const int wide = x_bits == 16;
    const int64_t blocks = in_features / QB;
    pthread_once(&unpackers_once, build_unpackers);
    QDot parts[MAX_PARTS];
    const float *bias[MAX_PARTS];
    int64_t first[MAX_PARTS + 1], chunk[MAX_PARTS];
    void *owned[MAX_PARTS][4] = {{0}};
    MlxgwQProj std_projs[MAX_PARTS]; /* lanes weights the lanes kernel does not take here */
    /* LANES_512 exactly where the AVX-512 kernels run (qdot512.c for standard weights) */
    const int lanes_kind = wide ? mlxgw_qlanes_kind() : LANES_NONE;
    const int lanes_ok = lanes_kind != LANES_NONE;
    int status = 0;
    first[0] = 0;
    for (int32_t p = 0; p < count; p++) {
        const MlxgwQProj *pr = &projs[p];
        const int lanes = (pr->stype & MLXGW_LANES) != 0;
        if (lanes && !lanes_ok) { /* the AVX2 or int8 kernels: the standard layout */
            MlxgwStandard st;
            if (mlxgw_lanes_standard(pr->w, pr->scales, pr->biases, pr->stype, 0, pr->cols,
                                     in_features, pr->bits, pr->group_size, &st) != 0) {
                status = 2;
                count = p;
                break;
            }
            owned[p][3] = st.block;
            std_projs[p] = *pr;
            std_projs[p].w = st.w;
            std_projs[p].scales = st.scales;
            std_projs[p].biases = st.biases;
            std_projs[p].stype &= ~MLXGW_LANES;
            pr = &std_projs[p];
        }
        const int use_lanes = lanes && lanes_ok;
        const int order = use_lanes ? 8 : pr->bits; /* the lanes kernel reads x in order */
        const int64_t groups = in_features / pr->group_size;
        int32_t same = -1; /* an earlier part whose rounded x this one can read */
        for (int32_t e = 0; e < p && same < 0; e++)
            if (x_layout(parts[e].lanes ? 8 : parts[e].bits, wide) == x_layout(order, wide) &&
                parts[e].group_size == pr->group_size)
                same = e;
        void *xq;
        float *xs, *xsum;
        if (same >= 0) {
            xq = (void *)parts[same].xq;
            xs = (float *)parts[same].xs;
            xsum = (float *)parts[same].xsum;
        } else {
            xq = owned[p][0] = malloc((size_t)(rows * in_features) * (wide ? 2 : 1));
            xs = owned[p][1] = malloc((size_t)(rows * blocks) * sizeof(float));
            xsum = owned[p][2] = malloc((size_t)(rows * groups) * sizeof(float));
            if (!xq || !xs || !xsum) {
                status = 2;
                count = p + 1;
                break;
            }
            quantize_rows(x, rows, in_features, order, pr->group_size, wide, xq, xs, xsum);
        }
        parts[p] = (QDot){xq, xs, xsum, pr->w, pr->scales, pr->biases, pr->out, rows,
                          in_features, pr->cols, groups, pr->bits, pr->group_size,
                          pr->stype & ~(MLXGW_SYMMETRIC | MLXGW_LANES), wide,
                          (pr->stype & MLXGW_SYMMETRIC) != 0, use_lanes ? lanes_kind : 0, 0};
        bias[p] = pr->bias;
        chunk[p] = span_items(pr->cols, threads, QDOT_CHUNK);
        first[p + 1] = first[p] + (pr->cols + chunk[p] - 1) / chunk[p];
    }
    if (status == 0) {
        QDotJob job = {parts, bias, first, chunk, count, lanes_kind == LANES_512, 0};
        if (threads < 1) threads = 1;
        if (threads > first[count]) threads = (int32_t)first[count];
        run_threads(qdot_worker, &job, threads);
    }
    for (int32_t p = 0; p < MAX_PARTS; p++)
        for (int k = 0; k < 4; k++) free(owned[p][k]);
    return status;
#else
    (void)x, (void)rows, (void)in_features, (void)projs, (void)count, (void)x_bits;
    (void)threads, (void)generic;
    return 1;
#endif
}

/* Arguments as mlxgw_quantized_matmul's (quantized.c); bits 2-6 or 8; x_bits 8 or 16, the
 * integers x is rounded to. Returns 0 on success, 1 when not handled here (widths, no
 * AVX2/F16C, generic), 2 when out of memory. */
EXPORT int mlxgw_qdot(const float *x, const uint32_t *w, const void *scales, const void *biases,
                      float *out, int64_t rows, int64_t in_features, int64_t out_features,
                      int32_t bits, int32_t group_size, int32_t stype, int32_t x_bits,
                      int32_t threads, int32_t generic) {
    const MlxgwQProj proj = {w, scales, biases, NULL, out, out_features, bits, group_size, stype};
    return mlxgw_qdot_many(x, rows, in_features, &proj, 1, x_bits, threads, generic);
}

/* -- dequantization into float32 rows (prompt-sized products, quantized.c's contract) --- */

#if HAVE_X86_DISPATCH
/* 32 values of block `blk` in their natural order, as bytes */
TARGET_QDOT static inline __m256i natural_bytes(int bits, const uint8_t *row, int64_t blk) {
    if (bits == 8) return _mm256_loadu_si256((const __m256i *)(row + blk * 32));
    if (bits == 4) {
        __m256i w = weights4(row, blk); /* evens | odds */
        __m128i even = _mm256_castsi256_si128(w), odd = _mm256_extracti128_si256(w, 1);
        return _mm256_set_m128i(_mm_unpackhi_epi8(even, odd), _mm_unpacklo_epi8(even, odd));
    }
    /* values 0-7, 16-23, 8-15, 24-31: swap the middle 64-bit quarters */
    return _mm256_permute4x64_epi64(weights_any(bits, row, blk), 0xd8);
}

typedef struct {
    const uint32_t *w;
    const void *scales, *biases;
    float *dst;
    int64_t n0, n1, depth, groups, next, chunk;
    int32_t bits, group_size, stype, sym;
} Dequant;

TARGET_QDOT static void dequant_feature(const Dequant *a, int bits, int64_t n) {
    const int64_t depth = a->depth, groups = a->groups;
    const int per_group = a->group_size / QB;
    const uint8_t *row = (const uint8_t *)a->w + n * depth * bits / 8;
    float *out = a->dst + (n - a->n0) * depth;
    int64_t blk = 0;
    for (int64_t g = 0; g < groups; g++) {
        const float sf = scale_at(a->stype, a->scales, n * groups + g);
        const __m256 s = _mm256_set1_ps(sf);
        const __m256 b = _mm256_set1_ps(a->sym ? -(float)(1 << (bits - 1)) * sf
                                               : scale_at(a->stype, a->biases, n * groups + g));
        for (int i = 0; i < per_group; i++, blk++) {
            __m256i q = natural_bytes(bits, row, blk);
            __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int k = 0; k < 4; k++) {
                __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k]));
                _mm256_storeu_ps(out + blk * QB + k * 8, _mm256_fmadd_ps(f, s, b));
            }
        }
    }
}

TARGET_QDOT static void *dequant_worker(void *arg) {
    Dequant *a = arg;
    for (;;) {
        int64_t start = a->n0 + __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED) * a->chunk;
        if (start >= a->n1) break;
        int64_t end = start + a->chunk < a->n1 ? start + a->chunk : a->n1;
        for (int64_t n = start; n < end; n++) {
            switch (a->bits) {
            case 2: dequant_feature(a, 2, n); break;
            case 3: dequant_feature(a, 3, n); break;
            case 4: dequant_feature(a, 4, n); break;
            case 5: dequant_feature(a, 5, n); break;
            case 6: dequant_feature(a, 6, n); break;
            default: dequant_feature(a, 8, n); break;
            }
        }
    }
    return NULL;
}
#endif

/* mlxgw_dequantize (quantized.c) with AVX2: same arguments and results; 1 where it does
 * not apply (no AVX2/F16C, generic), and the caller runs the portable one. */
EXPORT int mlxgw_dequantize_avx2(const uint32_t *w, const void *scales, const void *biases,
                                 float *dst, int64_t n0, int64_t n1, int64_t in_features,
                                 int64_t out_features, int32_t bits, int32_t group_size,
                                 int32_t stype, int32_t threads, int32_t generic) {
#if HAVE_X86_DISPATCH
    if ((stype & MLXGW_LANES) && !generic && qdot_supported()) {
        MlxgwStandard st;
        if (mlxgw_lanes_standard(w, scales, biases, stype, n0, n1, in_features, bits,
                                 group_size, &st) != 0)
            return 2;
        const int status = mlxgw_dequantize_avx2(
            st.w, st.scales, st.biases, dst, n0 - st.base, n1 - st.base, in_features,
            st.end - st.base, bits, group_size, stype & ~MLXGW_LANES, threads, generic);
        free(st.block);
        return status;
    }
    const int32_t sym = (stype & MLXGW_SYMMETRIC) != 0;
    stype &= ~MLXGW_SYMMETRIC;
    if (generic || !qdot_supported() || bits < 2 || bits > 8 || bits == 7 ||
        (group_size != 32 && group_size != 64 && group_size != 128) || stype < 0 ||
        stype > 2 || n0 < 0 || n1 > out_features || n0 >= n1 || in_features < group_size ||
        in_features % group_size != 0)
        return 1;
    pthread_once(&unpackers_once, build_unpackers);
    const int64_t chunk = span_items(n1 - n0, threads, QDOT_CHUNK);
    Dequant a = {w, scales, biases, dst, n0, n1, in_features, in_features / group_size, 0,
                 chunk, bits, group_size, stype, sym};
    int64_t items = (n1 - n0 + chunk - 1) / chunk;
    if (threads < 1) threads = 1;
    if (threads > items) threads = (int32_t)items;
    run_threads(dequant_worker, &a, threads);
    return 0;
#else
    (void)w, (void)scales, (void)biases, (void)dst, (void)n0, (void)n1, (void)in_features;
    (void)out_features, (void)bits, (void)group_size, (void)stype, (void)threads, (void)generic;
    return 1;
#endif
}
