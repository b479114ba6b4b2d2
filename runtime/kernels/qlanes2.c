/* The 16-feature lanes kernel on AVX2 (FMA, F16C): qlanes.c's layout and arithmetic in
 * 256-bit vectors, for the CPUs without AVX-512 (Zen 2 and 3, Intel's desktop and laptop
 * parts).
 *
 * A vector holds 8 features as int16 pairs, so a strip is two halves. Per block and row,
 * `vpmaddwd` against a broadcast pair of x adds two products into each of 8 features (AVX2
 * has no multiply-add into an accumulator, so a `vpaddd` follows); what the features share
 * is paid once per block for up to 8 rows: a block's values are unpacked once (at 5 and 6
 * bits the planes' bits spread to bytes by a shuffle and a compare, 32 at a time), and each
 * int32 sum is converted and scaled once for 8 features, with no horizontal sum.
 * The per-feature AVX2 kernel (qdot.c) pays an unpack per feature row and a conversion per
 * feature and block, and a 4-row pass reads the weights once per 4 rows: at 8 decode rows
 * it reached 2.0-2.8x its one-row speed; here a pass takes 8 rows.
 *
 * The results are bit for bit qlanes.c's: the same int32 sums (exact in any order),
 * converted, scaled (the weight's scale times x's) and added in block order by the same
 * float operations, each group's bias term first. */

#include "common.h"
#include "qdot.h"
#include "quantized.h"

#if HAVE_X86_DISPATCH
#include <immintrin.h>

#define TARGET_L2 __attribute__((target("avx2,fma,f16c")))
#define INLINE_L2 TARGET_L2 __attribute__((always_inline)) static inline

enum { L2_ROWS = 8 }; /* rows of x per pass over a block: 8 int32 sums, 2 weight vectors */
/* how far ahead the block's cache lines are asked for (as qlanes.c; the hardware's
 * prefetchers stop at every 4 KB page) */
enum { L2_AHEAD = 8192 };

int mlxgw_qlanes2_usable(void) {
    static int has = -1;
    if (has < 0)
        has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
              __builtin_cpu_supports("f16c");
    return has && !mlxgw_isa_is("generic");
}

/* AVX-VNNI (Intel since Alder Lake, AMD since Zen 5): vpdpwssd on 256-bit vectors, one
 * instruction for AVX2's vpmaddwd and vpaddd; MLX_GATEWAY_CPU_ISA=avx2 leaves it out */
#if defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11
#define HAVE_AVX_VNNI 1
#else
#define HAVE_AVX_VNNI 0
#endif

int mlxgw_qlanes2_vnni(void) {
#if HAVE_AVX_VNNI
    static int has = -1;
    if (has < 0) has = __builtin_cpu_supports("avxvnni");
    return has && mlxgw_qlanes2_usable() && !mlxgw_isa_is("avx2");
#else
    return 0;
#endif
}

/* the scales (or biases) of features 8h .. 8h + 7 of group g of strip s */
INLINE_L2 __m256 group8(int stype, const void *p, int64_t s, int64_t groups, int64_t g, int h) {
    const int64_t at = (s * groups + g) * 16 + 8 * h;
    if (stype == 0) return _mm256_loadu_ps((const float *)p + at);
    const __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + at));
    if (stype == 1) return _mm256_cvtph_ps(v);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* a 32-bit mask as 32 bytes: byte k all ones where bit k is set */
INLINE_L2 __m256i mask_bytes(uint32_t m) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2,
                                            2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i t = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(t, select), select);
}

/* 8 int16 pairs from 16 bytes: features 8h .. 8h + 7 of a chunk */
INLINE_L2 __m256i widen(const uint8_t *bytes) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)bytes));
}

/* Chunk c of a 4-, 5- or 6-bit strip block as int16 pairs: p[h] the weights (4c, 4c + 1)
 * of features 8h .. 8h + 7, p[2 + h] the weights (4c + 2, 4c + 3). At 5 and 6 bits the
 * chunk's two halves are taken as bytes first (byte 2j + t of the chunk holds weight 4c + t
 * of feature j in its low nibble, 4c + 2 + t in its high one; mask bit 2j + t of a plane is
 * that byte's further bit), so each plane's bits spread to bytes once for 16 features. */
INLINE_L2 void chunk_pairs(int bits, const uint8_t *wb, int c, __m256i p[4]) {
    if (bits == 4) {
        for (int h = 0; h < 2; h++) {
            const __m256i v = widen(wb + 32 * c + 16 * h);
            p[h] = _mm256_and_si256(v, _mm256_set1_epi16(15));
            p[2 + h] = _mm256_srli_epi16(v, 4);
        }
        return;
    }
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 32 * c));
    __m256i lo = _mm256_and_si256(v, low);
    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    for (int q = 0; q < bits - 4; q++) {
        uint32_t m[2];
        memcpy(m, wb + NIBBLE_BYTES + q * PLANE_BYTES + 8 * c, sizeof m);
        const __m256i bit = _mm256_set1_epi8((char)(16 << q));
        lo = _mm256_or_si256(lo, _mm256_and_si256(mask_bytes(m[0]), bit));
        hi = _mm256_or_si256(hi, _mm256_and_si256(mask_bytes(m[1]), bit));
    }
    p[0] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo));
    p[1] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1));
    p[2] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi));
    p[3] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1));
}

/* Up to FEW_ROWS rows take each chunk's pairs in registers and both halves at once
 * (sharing x's broadcasts); more rows unpack a block into `pairs` once and take a half at
 * a time (8 rows' sums and two weight vectors in 16 registers). */
enum { FEW_ROWS = 2 };

#define L2_TARGET TARGET_L2
#define L2_NAME(n) n##_avx2
#define L2_MADD(d, v, x) _mm256_add_epi32(d, _mm256_madd_epi16(v, x))
#include "qlanes2_rows.h"
#undef L2_TARGET
#undef L2_NAME
#undef L2_MADD

#if HAVE_AVX_VNNI
#define L2_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define L2_NAME(n) n##_vnni
#define L2_MADD(d, v, x) _mm256_dpwssd_avx_epi32(d, v, x)
#include "qlanes2_rows.h"
#undef L2_TARGET
#undef L2_NAME
#undef L2_MADD
#endif

void mlxgw_qlanes2_features(const QDot *a, int64_t n0, int64_t n1) {
    const int64_t s0 = n0 / 16, s1 = n1 / 16;
#if HAVE_AVX_VNNI
    if (a->lanes == LANES_VNNI) {
        switch (a->bits) {
        case 4: strips4_vnni(a, s0, s1); break;
        case 5: strips5_vnni(a, s0, s1); break;
        case 6: strips6_vnni(a, s0, s1); break;
        default: strips8_vnni(a, s0, s1); break;
        }
        return;
    }
#endif
    switch (a->bits) {
    case 4: strips4_avx2(a, s0, s1); break;
    case 5: strips5_avx2(a, s0, s1); break;
    case 6: strips6_avx2(a, s0, s1); break;
    default: strips8_avx2(a, s0, s1); break;
    }
}

/* -- prompt-sized products: a strip's weights as floats, transposed (qlanes.c) --------- */

/* a vector of 8 int16 pairs (weights k0 and k0 + 1 of features 8h .. 8h + 7) as floats,
 * scaled, into rows k0 and k0 + 1 of the tile */
INLINE_L2 void store_pairs(__m256i v, float *out, int64_t ld, int k0, int h, __m256 sw, __m256 bw) {
    const __m256 e = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)));
    const __m256 o = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 16));
    _mm256_storeu_ps(out + k0 * ld + 8 * h, _mm256_fmadd_ps(e, sw, bw));
    _mm256_storeu_ps(out + (k0 + 1) * ld + 8 * h, _mm256_fmadd_ps(o, sw, bw));
}

INLINE_L2 void dequant_strip(const LanesDequant *a, int bits, int64_t s) {
    const int64_t blocks = a->depth / QB;
    const int per_group = a->group_size / QB;
    float *col = a->dst + s * 16 - a->n0;
    for (int64_t g = 0, blk = 0; g < a->groups; g++) {
        __m256 sw[2], bw[2];
        for (int h = 0; h < 2; h++) {
            sw[h] = group8(a->stype, a->scales, s, a->groups, g, h);
            bw[h] = a->sym ? _mm256_mul_ps(sw[h], _mm256_set1_ps(-(float)(1 << (bits - 1))))
                           : group8(a->stype, a->biases, s, a->groups, g, h);
        }
        for (int i = 0; i < per_group; i++, blk++) {
            const uint8_t *wb = a->w + (s * blocks + blk) * strip_block_bytes(bits);
            float *out = col + blk * QB * a->ld;
            if (bits == 8) {
                for (int c = 0; c < 16; c++)
                    for (int h = 0; h < 2; h++)
                        store_pairs(widen(wb + 32 * c + 16 * h), out, a->ld, 2 * c, h, sw[h], bw[h]);
                continue;
            }
            for (int c = 0; c < 8; c++) {
                __m256i p[4];
                chunk_pairs(bits, wb, c, p);
                for (int h = 0; h < 2; h++) {
                    store_pairs(p[h], out, a->ld, 4 * c, h, sw[h], bw[h]);
                    store_pairs(p[2 + h], out, a->ld, 4 * c + 2, h, sw[h], bw[h]);
                }
            }
        }
    }
}

#define DEQUANT_STRIPS(bits)                                                                 \
    TARGET_L2 static void dequant_strips_##bits(LanesDequant *a) {                           \
        for (;;) {                                                                           \
            const int64_t s = a->n0 / 16 + __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED); \
            if (s >= a->n1 / 16) return;                                                     \
            dequant_strip(a, bits, s);                                                       \
        }                                                                                    \
    }
DEQUANT_STRIPS(4)
DEQUANT_STRIPS(5)
DEQUANT_STRIPS(6)
DEQUANT_STRIPS(8)

void *mlxgw_qlanes2_dequant(void *arg) {
    LanesDequant *a = arg;
    switch (a->bits) {
    case 4: dequant_strips_4(a); break;
    case 5: dequant_strips_5(a); break;
    case 6: dequant_strips_6(a); break;
    default: dequant_strips_8(a); break;
    }
    return NULL;
}

#else

int mlxgw_qlanes2_usable(void) { return 0; }

int mlxgw_qlanes2_vnni(void) { return 0; }

void mlxgw_qlanes2_features(const QDot *a, int64_t n0, int64_t n1) {
    (void)a, (void)n0, (void)n1;
}

void *mlxgw_qlanes2_dequant(void *arg) {
    (void)arg;
    return NULL;
}

#endif
