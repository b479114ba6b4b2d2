/* qdot.c's int16-activation products on AVX-512 (F, BW, DQ, VL, VNNI, VBMI), chosen at run
 * time where the CPU has them (AMD Zen 4/5, Intel Ice Lake and later).
 *
 * The arithmetic is qdot.c's: x rounded to int16 per block of 32 values (in the order
 * `wide_order` lays them out), weights widened to int16, exact int32 dot products per
 * block, then one float multiply-add per block with the weight's and x's scales, plus the
 * bias term from x's exact group sums. What changes is the width: one block of 32 weights
 * is one 512-bit vector of int16 lanes, and `vpdpwssd` multiplies and adds it against x in
 * one instruction, where AVX2 needs two `vpmaddwd`s and an add. Widths other than 4 and 8
 * bits unpack with one byte permute (`vpermb`: each value's 16-bit window of the bit stream
 * into its lane) and one variable shift per lane (`vpsrlvw`), where AVX2 needs a shuffle
 * per half, a multiply-high and a mask each. A block then costs about half the
 * instructions per row of x, which is what decode rows (one per stream, and a speculative
 * step's verify rows) are bound by on a CPU whose memory keeps up.
 *
 * The integer products are exact and equal qdot.c's; the float sums run in 16 lanes
 * instead of 8, so results differ from the AVX2 path's by float rounding only, within the
 * same error bound. Every row count takes the same per-row arithmetic, so a row's result
 * does not depend on how many rows share the call (the batch stays invariant). */

#include "common.h"
#include "qdot.h"

#if HAVE_X86_DISPATCH
#include <immintrin.h>
#include <pthread.h>

#define TARGET_512                                                                           \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")))
#define INLINE_512 TARGET_512 __attribute__((always_inline)) static inline

enum { ROWS_512 = 8 }; /* rows of x per pass over a feature's weights */

/* For widths 2 to 6: lane i of the permute takes bytes (b i / 8, b i / 8 + 1) of
 * the block, the bytes holding value i; the shift moves it to bit 0. */
typedef struct {
    __m512i index, shift;
} Unpack512;

static Unpack512 unpack512[9];
static pthread_once_t unpack512_once = PTHREAD_ONCE_INIT;

static void build_unpack512(void) {
    static const int widths[] = {2, 3, 4, 5, 6};
    for (int wi = 0; wi < 5; wi++) {
        const int b = widths[wi];
        uint8_t index[64];
        uint16_t shift[32];
        for (int i = 0; i < 32; i++) {
            /* 4 bits in wide_order: lane i < 16 holds value 2i, lane 16 + j value 2j + 1 */
            const int value = b == 4 ? (i < 16 ? 2 * i : 2 * (i - 16) + 1) : i;
            const int bit = b * value;
            index[2 * i] = (uint8_t)(bit / 8);
            index[2 * i + 1] = (uint8_t)(bit / 8 + 1); /* past the block: a zeroed byte */
            shift[i] = (uint16_t)(bit % 8);
        }
        memcpy(&unpack512[b].index, index, 64);
        memcpy(&unpack512[b].shift, shift, 64);
    }
}

int mlxgw_qdot512_usable(void) {
    static int has = -1;
    if (has < 0)
        has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512dq") &&
              __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
              __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("f16c");
    if (!has) return 0;
    return !mlxgw_isa_is("avx2") && !mlxgw_isa_is("avxvnni"); /* tests compare the paths */
}

/* block `blk` of a feature row as 32 int16 lanes, in wide_order (qdot.c): 4 bits the even
 * values then the odd ones, the other widths in order */
INLINE_512 __m512i weights512(int bits, const uint8_t *row, int64_t blk, int last) {
    if (bits == 8) return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + blk * 32)));
    /* a block is 4 * bits bytes; 32 are loaded (the bytes past the block only ever reach
     * bits that the mask below clears). The weights' last feature row takes a masked load
     * instead, which never reads past the buffer: masked loads are slow on weights
     * streamed from memory (2.4x slower a 5-bit product, measured), so only there. */
    const uint8_t *p = row + blk * 4 * bits;
    const __m256i packed = last ? _mm256_maskz_loadu_epi8((__mmask32)((1u << (4 * bits)) - 1u), p)
                                : _mm256_loadu_si256((const __m256i *)p);
    const __m512i win =
        _mm512_permutexvar_epi8(unpack512[bits].index, _mm512_zextsi256_si512(packed));
    return _mm512_and_si512(_mm512_srlv_epi16(win, unpack512[bits].shift),
                            _mm512_set1_epi16((short)((1 << bits) - 1)));
}

INLINE_512 float scale1(int stype, const void *p, int64_t i) {
    if (stype == 0) return ((const float *)p)[i];
    const uint16_t h = ((const uint16_t *)p)[i];
    if (stype == 1) return _cvtsh_ss(h);
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE_512 __m256 scales8(int stype, const void *p, int64_t i) {
    if (stype == 0) return _mm256_loadu_ps((const float *)p + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (stype == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* acc += (block's int32 products) * f, one block of one row */
INLINE_512 __m512 block_fma(__m512i w, const int16_t *x, float f, __m512 acc) {
    const __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(x));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(f), acc);
}

/* acc[0] += the block's products * f, then the accumulators rotate: consecutive blocks
 * add into different ones, so that a row's multiply-adds do not all wait on each other.
 * Every row count uses the same number of them (the same order of sums): a row's result
 * must not depend on the rows beside it. */
INLINE_512 void rotate_fma(__m512 *acc, int na, __m512i w, const int16_t *x, float f) {
    const __m512 t = block_fma(w, x, f, acc[0]);
    for (int k = 0; k + 1 < na; k++) acc[k] = acc[k + 1];
    acc[na - 1] = t;
}

/* rows m0 .. m0 + mr of feature n (mr <= ROWS_512; bits and mr constants inlined) */
INLINE_512 void rows512(const QDot *a, int bits, int mr, int64_t n, int64_t m0) {
    const int64_t depth = a->depth, blocks = depth / QB, groups = a->groups;
    const int per_group = a->group_size / QB;
    const uint8_t *row = (const uint8_t *)a->w + n * depth * bits / 8;
    const int last = n == a->cols - 1; /* a 32-byte load could pass the buffer's end */
    const int16_t *xq = (const int16_t *)a->xq + m0 * depth;
    enum { MAX_ACC = 2 };
    const int na = MAX_ACC; /* accumulators per row */
    __m512 acc[ROWS_512][MAX_ACC];
    __m256 bacc[ROWS_512];
    float bias[ROWS_512];
    for (int r = 0; r < mr; r++) {
        for (int k = 0; k < MAX_ACC; k++) acc[r][k] = _mm512_setzero_ps();
        bacc[r] = _mm256_setzero_ps();
        bias[r] = 0.0f;
    }
    int64_t blk = 0;
    if (per_group == 1) { /* eight groups' scales, biases and bias terms at a time */
        for (; blk + 8 <= blocks; blk += 8) {
            const __m256 sv = scales8(a->stype, a->scales, n * groups + blk);
            const __m256 off = _mm256_set1_ps(-(float)(1 << (bits - 1)));
            const __m256 bv = a->sym ? _mm256_mul_ps(sv, off)
                                     : scales8(a->stype, a->biases, n * groups + blk);
            float fs[ROWS_512][8];
            for (int r = 0; r < mr; r++) {
                const int64_t m = m0 + r;
                bacc[r] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(a->xsum + m * groups + blk), bacc[r]);
                _mm256_storeu_ps(fs[r], _mm256_mul_ps(sv, _mm256_loadu_ps(a->xs + m * blocks + blk)));
            }
            for (int j = 0; j < 8; j++) {
                const __m512i w = weights512(bits, row, blk + j, last);
                for (int r = 0; r < mr; r++)
                    rotate_fma(acc[r], na, w, xq + r * depth + (blk + j) * QB, fs[r][j]);
            }
        }
    }
    for (int64_t g = blk / per_group; g < groups; g++) {
        const float s = scale1(a->stype, a->scales, n * groups + g);
        const float b = a->sym ? -(float)(1 << (bits - 1)) * s
                               : scale1(a->stype, a->biases, n * groups + g);
        for (int r = 0; r < mr; r++) bias[r] += b * a->xsum[(m0 + r) * groups + g];
        for (int i = 0; i < per_group; i++, blk++) {
            const __m512i w = weights512(bits, row, blk, last);
            for (int r = 0; r < mr; r++)
                rotate_fma(acc[r], na, w, xq + r * depth + blk * QB,
                           s * a->xs[(m0 + r) * blocks + blk]);
        }
    }
    for (int r = 0; r < mr; r++) {
        const __m512 t = _mm512_add_ps(acc[r][0], acc[r][1]);
        __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
        h = _mm256_add_ps(h, bacc[r]);
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        a->out[(m0 + r) * a->cols + n] = _mm_cvtss_f32(v) + bias[r];
    }
}

INLINE_512 void features512(const QDot *a, int bits, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++) {
        int64_t m = 0;
        for (; m + ROWS_512 <= a->rows; m += ROWS_512) rows512(a, bits, ROWS_512, n, m);
        switch (a->rows - m) {
        case 7: rows512(a, bits, 7, n, m); break;
        case 6: rows512(a, bits, 6, n, m); break;
        case 5: rows512(a, bits, 5, n, m); break;
        case 4: rows512(a, bits, 4, n, m); break;
        case 3: rows512(a, bits, 3, n, m); break;
        case 2: rows512(a, bits, 2, n, m); break;
        case 1: rows512(a, bits, 1, n, m); break;
        default: break;
        }
    }
}

/* each width gets its own code */
#define FEATURES512(bits)                                                                    \
    TARGET_512 static void features512_##bits(const QDot *a, int64_t n0, int64_t n1) {       \
        features512(a, bits, n0, n1);                                                        \
    }
FEATURES512(2)
FEATURES512(3)
FEATURES512(4)
FEATURES512(5)
FEATURES512(6)
FEATURES512(8)

void mlxgw_qdot512_features(const QDot *a, int64_t n0, int64_t n1) {
    pthread_once(&unpack512_once, build_unpack512);
    switch (a->bits) {
    case 2: features512_2(a, n0, n1); break;
    case 3: features512_3(a, n0, n1); break;
    case 4: features512_4(a, n0, n1); break;
    case 5: features512_5(a, n0, n1); break;
    case 6: features512_6(a, n0, n1); break;
    default: features512_8(a, n0, n1); break;
    }
}

#else

int mlxgw_qdot512_usable(void) { return 0; }

void mlxgw_qdot512_features(const QDot *a, int64_t n0, int64_t n1) {
    (void)a, (void)n0, (void)n1;
}

#endif
