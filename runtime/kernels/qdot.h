/* What qdot.c (AVX2) and qdot512.c (AVX-512) share: one product's arguments with x
 * already rounded to integers per block of 32, and the AVX-512 entry points. */

#ifndef MLXGW_QDOT_H
#define MLXGW_QDOT_H

#include <stdint.h>

enum { QB = 32 };

typedef struct {
    const void *xq;    /* [rows, K]: int8 or int16 x, each 32-block in weight order */
    const float *xs;   /* [rows, K / 32]: block scales */
    const float *xsum; /* [rows, K / gs]: exact sums of x per weight group */
    const uint32_t *w;
    const void *scales, *biases;
    float *out;
    int64_t rows, depth, cols, groups;
    int32_t bits, group_size, stype, wide; /* wide: x as int16 */
    int32_t sym; /* no biases: a group's bias is -2^(bits - 1) times its scale */
    int32_t lanes; /* w, scales and biases in 16-feature lanes (qlanes.c), x natural */
    int64_t next;
} QDot;

/* 1 where features n0..n1 of an int16-x product (`wide`) may run on AVX-512 (qdot512.c):
 * the CPU has AVX-512 F/BW/DQ/VL/VNNI/VBMI and MLX_GATEWAY_CPU_ISA does not say "avx2" */
__attribute__((visibility("hidden"))) int mlxgw_qdot512_usable(void);
/* out[m, n] for every row m and n0 <= n < n1, as qdot.c's int16 path computes it (the
 * same integer products, summed in 16 float lanes instead of 8) */
__attribute__((visibility("hidden"))) void mlxgw_qdot512_features(const QDot *a, int64_t n0,
                                                                  int64_t n1);

/* 1 where the lanes kernel may run (the AVX-512 VNNI of qdot512.c) */
__attribute__((visibility("hidden"))) int mlxgw_qlanes_usable(void);
/* out[m, n] for every row m and n0 <= n < n1 (multiples of 16) of an int16-x product whose
 * weight is in lanes, 4 or 8 bits */
__attribute__((visibility("hidden"))) void mlxgw_qlanes_features(const QDot *a, int64_t n0,
                                                                 int64_t n1);

#endif
