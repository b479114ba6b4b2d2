/* Products with 4-, 5-, 6- and 8-bit weights kept in 16-feature lanes (AVX-512 VNNI; the
 * same layout and arithmetic on AVX2: qlanes2.c).
 *
 * qdot512.c puts the 32 weights of one block of one feature in a vector's lanes: every
 * row of x then pays, per block and feature, a `vpdpwssd`, a conversion to float and a
 * float multiply-add, and every feature ends with a horizontal sum. Here a vector holds
 * 16 features: lane j is feature j, with two consecutive weights as a pair of int16. A
 * `vpdpwssd` against a broadcast pair of x adds two products into each of 16 features at
 * once, so a block of 32 weights of 16 features costs a row 16 of them and one
 * conversion and multiply-add for all 16; the outputs come out as a vector of 16
 * features and need no horizontal sum. Measured on one thread, 4864 x 896 at 4 bits:
 * 3.0x qdot512.c's speed at one row, 3.7x at 8 (8 bits: 1.9x and 3.0x); decode rows
 * (streams, a speculative step's verify rows) are bound by exactly this.
 *
 * The layout (runtime/kernels/lanes.py writes it at load; `mlxgw_lanes_standard` reads it
 * back for the kernels that take the standard one): features in strips of 16, a strip's
 * blocks of 32 weights in order, each block 64 * bits bytes:
 *   8 bits: 16 chunks of 32 bytes; chunk c's byte 2j + t is weight 2c + t of feature j.
 *   4 to 6 bits: 8 chunks of 32 bytes of low halves; chunk c's byte 2j + t holds weight
 *   4c + t in its low nibble and 4c + 2 + t in its high one, so the widened bytes masked
 *   and shifted are the pairs (4c, 4c + 1) and (4c + 2, 4c + 3). Then, per further bit,
 *   a plane of 16 32-bit masks: mask 2c + h, bit 2j + t is that bit of weight 4c + 2h +
 *   t of feature j (one masked OR per vector puts it in place).
 * Scales and biases: per strip, per group, the 16 features' values in a row. The bytes
 * of mx.quantize's layout, permuted: nothing is re-rounded.
 *
 * Arithmetic: x rounded to int16 per block of 32 as in qdot.c (natural order); each
 * block's 32 products summed exactly in int32 (below 2^31: 32 x 255 x 32767), converted
 * to float, scaled by the weight's and x's scales and added in block order; each group's
 * bias term (bias x the exact float sum of x over the group) added before its blocks. A
 * row's arithmetic does not depend on the other rows of the call, nor on how many there
 * are (int32 sums are exact in any order): the batch stays invariant.
 *
 * Prompt-sized products dequantize a tile of features for the BLAS; from lanes the tile
 * comes out transposed, [K, features] (`mlxgw_lanes_dequantize_t`): a vector of 16
 * features per weight index is what the layout holds. */

#include "common.h"
#include "qdot.h"
#include "quantized.h"

/* -- the layout (portable) ------------------------------------------------------------- */

/* weight k (0..31) of feature j (0..15) of a strip block */
static inline unsigned lanes_value(const uint8_t *in, int bits, int j, int k) {
    if (bits == 8) return in[(k / 2) * 32 + 2 * j + k % 2];
    const int c = k / 4, h = (k / 2) % 2, t = k % 2;
    unsigned q = (in[c * 32 + 2 * j + t] >> (4 * h)) & 15u;
    for (int p = 0; p < bits - 4; p++) {
        uint32_t mask;
        memcpy(&mask, in + NIBBLE_BYTES + p * PLANE_BYTES + (2 * c + h) * 4, 4);
        q |= ((mask >> (2 * j + t)) & 1u) << (4 + p);
    }
    return q;
}

/* strips s0..s1 of a lanes weight into standard rows, row 16 * s0 at dst */
static void standard_weights(const uint8_t *src, uint8_t *dst, int64_t s0, int64_t s1,
                             int64_t in_features, int bits) {
    const int64_t blocks = in_features / QB, row_bytes = in_features * bits / 8;
    const int64_t block_bytes = strip_block_bytes(bits), chunks = bits == 4 ? 8 : 16;
    for (int64_t s = s0; s < s1; s++)
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *in = src + (s * blocks + b) * block_bytes;
            for (int64_t j = 0; j < 16; j++) {
                uint8_t *out = dst + ((s - s0) * 16 + j) * row_bytes + b * QB * bits / 8;
                if (bits == 5 || bits == 6) { /* value k at bits k * bits of the stream */
                    uint64_t acc = 0;
                    int held = 0, at = 0;
                    for (int k = 0; k < QB; k++) {
                        acc |= (uint64_t)lanes_value(in, bits, (int)j, k) << held;
                        held += bits;
                        while (held >= 8) {
                            out[at++] = (uint8_t)acc;
                            acc >>= 8;
                            held -= 8;
                        }
                    }
                    continue;
                }
                for (int64_t c = 0; c < chunks; c++) {
                    const uint8_t l0 = in[c * 32 + 2 * j], l1 = in[c * 32 + 2 * j + 1];
                    if (bits == 8) { /* weights 2c, 2c + 1 */
                        out[2 * c] = l0;
                        out[2 * c + 1] = l1;
                    } else { /* l0: weights 4c and 4c + 2, l1: 4c + 1 and 4c + 3 */
                        out[2 * c] = (uint8_t)((l0 & 15) | (l1 & 15) << 4);
                        out[2 * c + 1] = (uint8_t)(l0 >> 4 | (l1 & 0xf0));
                    }
                }
            }
        }
}

typedef struct {
    const uint8_t *src; /* standard rows, [N, in_features * bits / 8] */
    uint8_t *dst;       /* lanes, [N / 16, blocks, 64 * bits] */
    int64_t strips, in_features, next;
    int bits;
} ToLanes;

/* One strip block from its 16 rows' standard bytes (`rows[j]`: feature j's block): the
 * inverse of standard_weights, a 16 x 16 transpose of byte pairs at 4 and 8 bits (4 bits:
 * each pair's nibbles swapped into the lanes order), values unpacked at 5 and 6 bits. */
static void lanes_block(const uint8_t *const rows[16], uint8_t *out, int bits) {
    if (bits == 8 || bits == 4) { /* standard pair c of feature j -> chunk c, bytes 2j, 2j + 1 */
        const int chunks = bits == 8 ? 16 : 8;
        for (int j = 0; j < 16; j++)
            for (int c = 0; c < chunks; c++) {
                const uint8_t a = rows[j][2 * c], b = rows[j][2 * c + 1];
                uint8_t *o = out + c * 32 + 2 * j;
                if (bits == 8) {
                    o[0] = a, o[1] = b;
                } else { /* a: weights 4c | 4c + 1, b: 4c + 2 | 4c + 3 */
                    o[0] = (uint8_t)((a & 15) | (b & 15) << 4);
                    o[1] = (uint8_t)(a >> 4 | (b & 0xf0));
                }
            }
        return;
    }
    uint32_t masks[2][16] = {{0}}; /* per further bit, mask 2c + h */
    for (int j = 0; j < 16; j++) {
        uint8_t v[QB], in[32] = {0};
        memcpy(in, rows[j], (size_t)(4 * bits)); /* value k at bits k * bits */
        for (int k = 0; k < QB; k++) {
            const int bit = k * bits, at = bit / 8, shift = bit % 8;
            v[k] = (uint8_t)(((unsigned)in[at] | (unsigned)in[at + 1] << 8) >> shift) &
                   (uint8_t)((1u << bits) - 1);
        }
        for (int c = 0; c < 8; c++)
            for (int t = 0; t < 2; t++)
                out[c * 32 + 2 * j + t] = (uint8_t)((v[4 * c + t] & 15) | (v[4 * c + 2 + t] & 15) << 4);
        for (int p = 0; p < bits - 4; p++)
            for (int m = 0; m < 16; m++) /* weights 2m + t at bits 2j + t */
                masks[p][m] |= (uint32_t)((v[2 * m] >> (4 + p)) & 1) << (2 * j) |
                               (uint32_t)((v[2 * m + 1] >> (4 + p)) & 1) << (2 * j + 1);
    }
    for (int p = 0; p < bits - 4; p++)
        memcpy(out + NIBBLE_BYTES + p * PLANE_BYTES, masks[p], PLANE_BYTES);
}

/* whole strips, taken in turn by the threads */
static void *to_lanes_worker(void *arg) {
    ToLanes *a = arg;
    const int bits = a->bits;
    const int64_t blocks = a->in_features / QB, row_bytes = a->in_features * bits / 8;
    const int64_t block_bytes = strip_block_bytes(bits), in_bytes = QB * bits / 8;
    for (;;) {
        const int64_t s = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED);
        if (s >= a->strips) return NULL;
        const uint8_t *rows[16];
        for (int j = 0; j < 16; j++) rows[j] = a->src + (s * 16 + j) * row_bytes;
        uint8_t *out = a->dst + s * blocks * block_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            lanes_block(rows, out + b * block_bytes, bits);
            for (int j = 0; j < 16; j++) rows[j] += in_bytes;
        }
    }
}

/* A standard weight's bytes in lanes (runtime/kernels/lanes.py `to_lanes`): 0, or 1 for a
 * width or shape the layout does not take. */
EXPORT int mlxgw_lanes_from_standard(const uint8_t *src, uint8_t *dst, int64_t n,
                                     int64_t in_features, int32_t bits, int32_t threads) {
    if (bits < 4 || bits == 7 || bits > 8 || n < 16 || n % 16 || in_features < QB ||
        in_features % QB)
        return 1;
    ToLanes a = {src, dst, n / 16, in_features, 0, bits};
    if (threads < 1) threads = 1;
    if (threads > n / 16) threads = (int32_t)(n / 16);
    run_threads(to_lanes_worker, &a, threads);
    return 0;
}

/* strips s0..s1 of lanes scales or biases ([N / 16, groups, 16] of `size` bytes) as
 * standard rows ([N, groups]), row 16 * s0 at dst */
static void standard_groups(const uint8_t *src, uint8_t *dst, int64_t s0, int64_t s1,
                            int64_t groups, int size) {
    for (int64_t s = s0; s < s1; s++)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t j = 0; j < 16; j++)
                memcpy(dst + (((s - s0) * 16 + j) * groups + g) * size,
                       src + ((s * groups + g) * 16 + j) * size, (size_t)size);
}

EXPORT int mlxgw_lanes_standard(const uint32_t *w, const void *scales, const void *biases,
                                int32_t stype, int64_t n0, int64_t n1, int64_t in_features,
                                int32_t bits, int32_t group_size, MlxgwStandard *out) {
    const int32_t st = stype & ~(MLXGW_SYMMETRIC | MLXGW_LANES);
    const int size = st == 0 ? 4 : 2;
    const int64_t s0 = n0 / 16, s1 = (n1 + 15) / 16, rows = 16 * (s1 - s0);
    const int64_t groups = in_features / group_size;
    const size_t wbytes = (size_t)(rows * in_features * bits / 8);
    const size_t gbytes = (size_t)(rows * groups * size);
    uint8_t *block = malloc(wbytes + 2 * gbytes + 64);
    if (!block) return 2;
    uint8_t *sp = block + (wbytes + 63) / 64 * 64, *bp = sp + gbytes;
    standard_weights((const uint8_t *)w, block, s0, s1, in_features, bits);
    standard_groups(scales, sp, s0, s1, groups, size);
    if (biases != NULL) standard_groups(biases, bp, s0, s1, groups, size);
    *out = (MlxgwStandard){block, (const uint32_t *)block, sp, biases ? bp : NULL, 16 * s0,
                           16 * s1};
    return 0;
}

/* -- the kernel (AVX-512) -------------------------------------------------------------- */

#if HAVE_X86_DISPATCH
#include <immintrin.h>

#define TARGET_LANES                                                                         \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INLINE_LANES TARGET_LANES __attribute__((always_inline)) static inline

enum { LANES_ROWS = 8 }; /* rows of x per pass over a strip */
/* How far ahead of the block it multiplies the kernel asks for the weights' cache lines.
 * The hardware prefetchers alone left it waiting on memory: one thread, weights streamed
 * from DRAM (a 151936 x 896 8-bit head; 65536 x 896 at 4 bits), 8 KB ahead took the head
 * from 4.7 to 3.8 ms at one row and 15.0 to 8.7 ms at 8, the 4-bit one from 1.31 to 0.74
 * and 3.98 to 2.94 ms (1, 2, 4 and 16 KB measured too: 8 KB or about as good). The strips
 * a thread takes are contiguous, so the lines ahead are its own next ones. */
enum { PREFETCH_BYTES = 8192 };

/* the 16 features' scales (or biases) of group g of strip s */
INLINE_LANES __m512 group16(int stype, const void *p, int64_t s, int64_t groups, int64_t g) {
    const int64_t at = (s * groups + g) * 16;
    if (stype == 0) return _mm512_loadu_ps((const float *)p + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + at));
    if (stype == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* chunk c of a 4-, 5- or 6-bit strip block as two vectors of 16 int16 pairs: weights
 * (4c, 4c + 1) and (4c + 2, 4c + 3) of each feature; bits 4 and 5 from the planes */
INLINE_LANES void pairs(int bits, const uint8_t *wb, int c, __m512i *lo, __m512i *hi) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wb + 32 * c)));
    *lo = _mm512_and_si512(v, _mm512_set1_epi16(15));
    *hi = _mm512_srli_epi16(v, 4);
    for (int p = 0; p < bits - 4; p++) {
        const uint32_t *plane = (const uint32_t *)(wb + NIBBLE_BYTES + p * PLANE_BYTES);
        const __m512i bit = _mm512_set1_epi16((short)(16 << p));
        *lo = _mm512_or_si512(*lo, _mm512_maskz_mov_epi16((__mmask32)plane[2 * c], bit));
        *hi = _mm512_or_si512(*hi, _mm512_maskz_mov_epi16((__mmask32)plane[2 * c + 1], bit));
    }
}

/* rows m0 .. m0 + mr of strip s; na int32 accumulators per row (latency: a row's 16
 * multiply-adds a block would otherwise wait on each other) */
INLINE_LANES void strip_rows(const QDot *a, int bits, int mr, int na, int64_t s, int64_t m0) {
    const int64_t depth = a->depth, blocks = depth / QB, groups = a->groups;
    const int per_group = a->group_size / QB;
    const uint8_t *w = (const uint8_t *)a->w + s * blocks * strip_block_bytes(bits);
    const int32_t *xp = (const int32_t *)a->xq + m0 * (depth / 2); /* x as int16 pairs */
    const int64_t xstride = depth / 2;
    __m512 acc[LANES_ROWS];
    for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
    int64_t blk = 0;
    for (int64_t g = 0; g < groups; g++) {
        const __m512 sw = group16(a->stype, a->scales, s, groups, g);
        const __m512 bw = a->sym ? _mm512_mul_ps(sw, _mm512_set1_ps(-(float)(1 << (bits - 1))))
                                 : group16(a->stype, a->biases, s, groups, g);
        for (int r = 0; r < mr; r++)
            acc[r] = _mm512_fmadd_ps(bw, _mm512_set1_ps(a->xsum[(m0 + r) * groups + g]), acc[r]);
        for (int i = 0; i < per_group; i++, blk++) {
            const uint8_t *wb = w + blk * strip_block_bytes(bits);
            const int32_t *xb = xp + blk * (QB / 2);
            for (int l = 0; l < bits; l++) /* a block is `bits` cache lines */
                _mm_prefetch((const char *)wb + PREFETCH_BYTES + 64 * l, _MM_HINT_T0);
            __m512i d[LANES_ROWS][4];
            for (int r = 0; r < mr; r++)
                for (int k = 0; k < na; k++) d[r][k] = _mm512_setzero_si512();
            if (bits != 8) {
                for (int c = 0; c < 8; c++) {
                    __m512i lo, hi;
                    pairs(bits, wb, c, &lo, &hi);
                    const int k0 = (2 * c) % na, k1 = (2 * c + 1) % na;
                    for (int r = 0; r < mr; r++) {
                        const int32_t *x = xb + r * xstride + 2 * c;
                        d[r][k0] = _mm512_dpwssd_epi32(d[r][k0], lo, _mm512_set1_epi32(x[0]));
                        d[r][k1] = _mm512_dpwssd_epi32(d[r][k1], hi, _mm512_set1_epi32(x[1]));
                    }
                }
            } else {
                for (int c = 0; c < 16; c++) {
                    const __m512i v =
                        _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(wb + 32 * c)));
                    const int k0 = c % na;
                    for (int r = 0; r < mr; r++)
                        d[r][k0] = _mm512_dpwssd_epi32(d[r][k0], v,
                                                       _mm512_set1_epi32(xb[r * xstride + c]));
                }
            }
            for (int r = 0; r < mr; r++) {
                __m512i t = d[r][0];
                for (int k = 1; k < na; k++) t = _mm512_add_epi32(t, d[r][k]);
                const __m512 f =
                    _mm512_mul_ps(sw, _mm512_set1_ps(a->xs[(m0 + r) * blocks + blk]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), f, acc[r]);
            }
        }
    }
    for (int r = 0; r < mr; r++) _mm512_storeu_ps(a->out + (m0 + r) * a->cols + s * 16, acc[r]);
}

INLINE_LANES void strips(const QDot *a, int bits, int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; s++) {
        int64_t m = 0;
        for (; m + LANES_ROWS <= a->rows; m += LANES_ROWS) strip_rows(a, bits, LANES_ROWS, 1, s, m);
        switch (a->rows - m) {
        case 7: strip_rows(a, bits, 7, 1, s, m); break;
        case 6: strip_rows(a, bits, 6, 1, s, m); break;
        case 5: strip_rows(a, bits, 5, 1, s, m); break;
        case 4: strip_rows(a, bits, 4, bits == 8 ? 1 : 2, s, m); break; /* 8 bits: measured */
        case 3: strip_rows(a, bits, 3, bits == 8 ? 1 : 2, s, m); break;
        case 2: strip_rows(a, bits, 2, 4, s, m); break;
        case 1: strip_rows(a, bits, 1, 4, s, m); break;
        default: break;
        }
    }
}

INLINE_LANES void dequant_strip(const LanesDequant *a, int bits, int64_t s) {
    const int64_t blocks = a->depth / QB;
    const int per_group = a->group_size / QB;
    float *col = a->dst + s * 16 - a->n0;
    for (int64_t g = 0, blk = 0; g < a->groups; g++) {
        const __m512 sw = group16(a->stype, a->scales, s, a->groups, g);
        const __m512 bw = a->sym ? _mm512_mul_ps(sw, _mm512_set1_ps(-(float)(1 << (bits - 1))))
                                 : group16(a->stype, a->biases, s, a->groups, g);
        for (int i = 0; i < per_group; i++, blk++) {
            const uint8_t *wb = a->w + (s * blocks + blk) * strip_block_bytes(bits);
            float *out = col + blk * QB * a->ld;
            const __m512i low = _mm512_set1_epi32(0xffff);
            /* a vector of 16 int16 pairs: weights k0 and k0 + 1 of the 16 features */
#define LANES_STORE(v, k0)                                                                   \
    do {                                                                                     \
        const __m512 e = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));                       \
        const __m512 o = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 16));                       \
        _mm512_storeu_ps(out + (k0) * a->ld, _mm512_fmadd_ps(e, sw, bw));                    \
        _mm512_storeu_ps(out + ((k0) + 1) * a->ld, _mm512_fmadd_ps(o, sw, bw));              \
    } while (0)
            if (bits == 8) {
                for (int c = 0; c < 16; c++) {
                    const __m512i v = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(wb + 32 * c)));
                    LANES_STORE(v, 2 * c);
                }
            } else {
                for (int c = 0; c < 8; c++) {
                    __m512i lo, hi;
                    pairs(bits, wb, c, &lo, &hi);
                    LANES_STORE(lo, 4 * c);
                    LANES_STORE(hi, 4 * c + 2);
                }
            }
#undef LANES_STORE
        }
    }
}

#define DEQUANT_LANES(bits)                                                                  \
    TARGET_LANES static void *dequant_lanes_##bits(void *arg) {                              \
        LanesDequant *a = arg;                                                               \
        for (;;) {                                                                           \
            const int64_t s = a->n0 / 16 + __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED); \
            if (s >= a->n1 / 16) return NULL;                                                \
            dequant_strip(a, bits, s);                                                       \
        }                                                                                    \
    }
DEQUANT_LANES(4)
DEQUANT_LANES(5)
DEQUANT_LANES(6)
DEQUANT_LANES(8)

EXPORT int mlxgw_lanes_dequantize_t(const uint32_t *w, const void *scales, const void *biases,
                                    float *dst, int64_t n0, int64_t n1, int64_t in_features,
                                    int32_t bits, int32_t group_size, int32_t stype,
                                    int32_t threads, int32_t generic) {
    const int32_t st = stype & ~(MLXGW_SYMMETRIC | MLXGW_LANES);
    const int kind = mlxgw_qlanes_kind();
    if (generic || kind == LANES_NONE || !(stype & MLXGW_LANES) || bits < 4 ||
        bits == 7 || bits > 8 || n0 % 16 || n1 % 16 || n0 >= n1 || group_size % QB ||
        in_features % group_size || st > 2)
        return 1;
    LanesDequant a = {(const uint8_t *)w, scales, biases, dst, n0, n1, in_features,
                      in_features / group_size, n1 - n0, 0, bits, group_size, st,
                      (stype & MLXGW_SYMMETRIC) != 0};
    void *(*fn)(void *) = kind != LANES_512 ? mlxgw_qlanes2_dequant
                        : bits == 4 ? dequant_lanes_4 : bits == 5 ? dequant_lanes_5
                        : bits == 6 ? dequant_lanes_6 : dequant_lanes_8;
    if (threads < 1) threads = 1;
    if (threads > (n1 - n0) / 16) threads = (int32_t)((n1 - n0) / 16);
    run_threads(fn, &a, threads);
    return 0;
}

TARGET_LANES static void strips4(const QDot *a, int64_t s0, int64_t s1) { strips(a, 4, s0, s1); }
TARGET_LANES static void strips5(const QDot *a, int64_t s0, int64_t s1) { strips(a, 5, s0, s1); }
TARGET_LANES static void strips6(const QDot *a, int64_t s0, int64_t s1) { strips(a, 6, s0, s1); }
TARGET_LANES static void strips8(const QDot *a, int64_t s0, int64_t s1) { strips(a, 8, s0, s1); }

int mlxgw_qlanes_kind(void) {
    if (mlxgw_qdot512_usable()) return LANES_512;
    if (!mlxgw_qlanes2_usable()) return LANES_NONE;
    return mlxgw_qlanes2_vnni() ? LANES_VNNI : LANES_AVX2;
}

int mlxgw_qlanes_usable(void) { return mlxgw_qlanes_kind() != LANES_NONE; }

EXPORT int mlxgw_lanes_usable(void) { return mlxgw_qlanes_usable(); }

void mlxgw_qlanes_features(const QDot *a, int64_t n0, int64_t n1) {
    if (a->lanes != LANES_512) {
        mlxgw_qlanes2_features(a, n0, n1);
        return;
    }
    switch (a->bits) {
    case 4: strips4(a, n0 / 16, n1 / 16); break;
    case 5: strips5(a, n0 / 16, n1 / 16); break;
    case 6: strips6(a, n0 / 16, n1 / 16); break;
    default: strips8(a, n0 / 16, n1 / 16); break;
    }
}

#else

int mlxgw_qlanes_kind(void) { return LANES_NONE; }

int mlxgw_qlanes_usable(void) { return 0; }

EXPORT int mlxgw_lanes_dequantize_t(const uint32_t *w, const void *scales, const void *biases,
                                    float *dst, int64_t n0, int64_t n1, int64_t in_features,
                                    int32_t bits, int32_t group_size, int32_t stype,
                                    int32_t threads, int32_t generic) {
    (void)w, (void)scales, (void)biases, (void)dst, (void)n0, (void)n1, (void)in_features;
    (void)bits, (void)group_size, (void)stype, (void)threads, (void)generic;
    return 1;
}

EXPORT int mlxgw_lanes_usable(void) { return 0; }

void mlxgw_qlanes_features(const QDot *a, int64_t n0, int64_t n1) {
    (void)a, (void)n0, (void)n1;
}

#endif
