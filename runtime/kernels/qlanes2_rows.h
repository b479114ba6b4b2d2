/* qlanes2.c's row kernel, included once per instruction set: L2_TARGET the function
 * attribute, L2_NAME(n) the names it defines, L2_MADD(d, v, x) d + the int16 pair
 * products of v and x summed in int32 lanes (AVX2: vpmaddwd then vpaddd; AVX-VNNI: one
 * vpdpwssd). Everything else comes from qlanes2.c. */

/* rows m0 .. m0 + mr of strip s (FEW_ROWS: qlanes2.c) */
L2_TARGET __attribute__((always_inline)) static inline void
L2_NAME(strip_rows)(const QDot *a, int bits, int mr, int64_t s, int64_t m0) {
    const int64_t depth = a->depth, blocks = depth / QB, groups = a->groups;
    const int per_group = a->group_size / QB;
    const uint8_t *w = (const uint8_t *)a->w + s * blocks * strip_block_bytes(bits);
    const int32_t *xp = (const int32_t *)a->xq + m0 * (depth / 2); /* x as int16 pairs */
    const int64_t xstride = depth / 2;
    __m256 acc[L2_ROWS][2];
    __m256i pairs[8][4];
    for (int r = 0; r < mr; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t blk = 0;
    for (int64_t g = 0; g < groups; g++) {
        __m256 sw[2], bw[2];
        for (int h = 0; h < 2; h++) {
            sw[h] = group8(a->stype, a->scales, s, groups, g, h);
            bw[h] = a->sym ? _mm256_mul_ps(sw[h], _mm256_set1_ps(-(float)(1 << (bits - 1))))
                           : group8(a->stype, a->biases, s, groups, g, h);
        }
        for (int r = 0; r < mr; r++) {
            const __m256 xsum = _mm256_set1_ps(a->xsum[(m0 + r) * groups + g]);
            for (int h = 0; h < 2; h++) acc[r][h] = _mm256_fmadd_ps(bw[h], xsum, acc[r][h]);
        }
        for (int i = 0; i < per_group; i++, blk++) {
            const uint8_t *wb = w + blk * strip_block_bytes(bits);
            const int32_t *xb = xp + blk * (QB / 2);
            for (int l = 0; l < bits; l++) /* a block is `bits` cache lines */
                _mm_prefetch((const char *)wb + L2_AHEAD + 64 * l, _MM_HINT_T0);
            __m256i d[L2_ROWS][2];
#define L2_ROW_MADD(r, h, v, xi) d[r][h] = L2_MADD(d[r][h], v, _mm256_set1_epi32(xi))
/* half h's sums converted, scaled and added: done before the next half's start, so that
 * only one half's sums are live */
#define L2_FINISH(h)                                                                         \
    for (int r = 0; r < mr; r++)                                                             \
        acc[r][h] = _mm256_fmadd_ps(                                                         \
            _mm256_cvtepi32_ps(d[r][h]),                                                     \
            _mm256_mul_ps(sw[h], _mm256_set1_ps(a->xs[(m0 + r) * blocks + blk])), acc[r][h])
            if (mr <= FEW_ROWS) {
                for (int r = 0; r < mr; r++) d[r][0] = d[r][1] = _mm256_setzero_si256();
                if (bits != 8) {
                    for (int c = 0; c < 8; c++) {
                        __m256i p[4];
                        chunk_pairs(bits, wb, c, p);
                        for (int r = 0; r < mr; r++)
                            for (int h = 0; h < 2; h++) {
                                L2_ROW_MADD(r, h, p[h], xb[r * xstride + 2 * c]);
                                L2_ROW_MADD(r, h, p[2 + h], xb[r * xstride + 2 * c + 1]);
                            }
                    }
                } else {
                    for (int c = 0; c < 16; c++)
                        for (int h = 0; h < 2; h++) {
                            const __m256i v = widen(wb + 32 * c + 16 * h);
                            for (int r = 0; r < mr; r++) L2_ROW_MADD(r, h, v, xb[r * xstride + c]);
                        }
                }
                L2_FINISH(0);
                L2_FINISH(1);
            } else {
                if (bits != 8)
                    for (int c = 0; c < 8; c++) chunk_pairs(bits, wb, c, pairs[c]);
                for (int h = 0; h < 2; h++) {
                    for (int r = 0; r < mr; r++) d[r][h] = _mm256_setzero_si256();
                    if (bits != 8) {
                        for (int c = 0; c < 8; c++)
                            for (int r = 0; r < mr; r++) {
                                L2_ROW_MADD(r, h, pairs[c][h], xb[r * xstride + 2 * c]);
                                L2_ROW_MADD(r, h, pairs[c][2 + h], xb[r * xstride + 2 * c + 1]);
                            }
                    } else {
                        for (int c = 0; c < 16; c++) {
                            const __m256i v = widen(wb + 32 * c + 16 * h);
                            for (int r = 0; r < mr; r++) L2_ROW_MADD(r, h, v, xb[r * xstride + c]);
                        }
                    }
                    L2_FINISH(h);
                }
            }
#undef L2_FINISH
#undef L2_ROW_MADD
        }
    }
    for (int r = 0; r < mr; r++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(a->out + (m0 + r) * a->cols + s * 16 + 8 * h, acc[r][h]);
}

L2_TARGET __attribute__((always_inline)) static inline void
L2_NAME(strips)(const QDot *a, int bits, int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; s++) {
        int64_t m = 0;
        for (; m + L2_ROWS <= a->rows; m += L2_ROWS)
            L2_NAME(strip_rows)(a, bits, L2_ROWS, s, m);
        switch (a->rows - m) {
        case 7: L2_NAME(strip_rows)(a, bits, 7, s, m); break;
        case 6: L2_NAME(strip_rows)(a, bits, 6, s, m); break;
        case 5: L2_NAME(strip_rows)(a, bits, 5, s, m); break;
        case 4: L2_NAME(strip_rows)(a, bits, 4, s, m); break;
        case 3: L2_NAME(strip_rows)(a, bits, 3, s, m); break;
        case 2: L2_NAME(strip_rows)(a, bits, 2, s, m); break;
        case 1: L2_NAME(strip_rows)(a, bits, 1, s, m); break;
        default: break;
        }
    }
}

L2_TARGET static void L2_NAME(strips4)(const QDot *a, int64_t s0, int64_t s1) {
    L2_NAME(strips)(a, 4, s0, s1);
}
L2_TARGET static void L2_NAME(strips5)(const QDot *a, int64_t s0, int64_t s1) {
    L2_NAME(strips)(a, 5, s0, s1);
}
L2_TARGET static void L2_NAME(strips6)(const QDot *a, int64_t s0, int64_t s1) {
    L2_NAME(strips)(a, 6, s0, s1);
}
L2_TARGET static void L2_NAME(strips8)(const QDot *a, int64_t s0, int64_t s1) {
    L2_NAME(strips)(a, 8, s0, s1);
}
