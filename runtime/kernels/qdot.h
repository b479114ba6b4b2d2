/* What qdot.c (AVX2) and qdot512.c (AVX-512) share: one product's arguments with x
 * already rounded to integers per block of 32, and the AVX-512 entry points. */

#ifndef MLXGW_QDOT_H
#define MLXGW_QDOT_H

#include <stdint.h>
#include <stdlib.h>

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
    int32_t lanes; /* w, scales and biases in 16-feature lanes, x natural: the kernel that
                    * multiplies them (a LANES_* other than LANES_NONE); 0 otherwise */
    int64_t next;
} QDot;

/* whether MLX_GATEWAY_CPU_ISA names `isa`: tests and benchmarks run a smaller CPU's
 * kernels with "avx2" (AVX2, FMA, F16C), "avxvnni" (those and AVX-VNNI), "generic" (the
 * portable code) */
static inline int mlxgw_isa_is(const char *isa) {
    const char *set = getenv("MLX_GATEWAY_CPU_ISA");
    if (set == NULL) return 0;
    while (*set && *isa && (*set | 32) == (*isa | 32)) set++, isa++;
    return *set == 0 && *isa == 0;
}

/* 1 where features n0..n1 of an int16-x product (`wide`) may run on AVX-512 (qdot512.c):
 * the CPU has AVX-512 F/BW/DQ/VL/VNNI/VBMI and MLX_GATEWAY_CPU_ISA names none of the
 * smaller sets */
__attribute__((visibility("hidden"))) int mlxgw_qdot512_usable(void);
/* out[m, n] for every row m and n0 <= n < n1, as qdot.c's int16 path computes it (the
 * same integer products, summed in 16 float lanes instead of 8) */
__attribute__((visibility("hidden"))) void mlxgw_qdot512_features(const QDot *a, int64_t n0,
                                                                  int64_t n1);

/* The lanes kernels, chosen once per call (the environment is read each time: tests set
 * MLX_GATEWAY_CPU_ISA as they go) */
enum { LANES_NONE = 0, LANES_512 = 1, LANES_AVX2 = 2, LANES_VNNI = 3 };
__attribute__((visibility("hidden"))) int mlxgw_qlanes_kind(void);

/* 1 where a lanes kernel may run: qlanes.c's (AVX-512 VNNI, where qdot512.c runs) or
 * qlanes2.c's (AVX2, FMA and F16C; not when MLX_GATEWAY_CPU_ISA says "generic") */
__attribute__((visibility("hidden"))) int mlxgw_qlanes_usable(void);
/* out[m, n] for every row m and n0 <= n < n1 (multiples of 16) of an int16-x product whose
 * weight is in lanes, 4 or 8 bits */
__attribute__((visibility("hidden"))) void mlxgw_qlanes_features(const QDot *a, int64_t n0,
                                                                 int64_t n1);

/* -- the lanes layout's blocks (qlanes.c describes them) -------------------------------- */

/* bytes of one block of 32 weights of 16 features: 8 chunks of low halves (4 bits each)
 * and, at 5 and 6 bits, a plane of 16 32-bit masks per further bit; 8 bits: 16 chunks */
static inline int64_t strip_block_bytes(int bits) { return 64 * (int64_t)bits; }
enum { NIBBLE_BYTES = 256, PLANE_BYTES = 64 };

/* dst[k * ld + n - n0] = weight (n, k) for the features n0 .. n1 (whole strips): the
 * transposed tile a prompt-sized product dequantizes for the BLAS */
typedef struct {
    const uint8_t *w;
    const void *scales, *biases;
    float *dst;
    int64_t n0, n1, depth, groups, ld, next;
    int32_t bits, group_size, stype, sym;
} LanesDequant;

/* qlanes2.c, the AVX2 lanes kernel: mlxgw_qlanes_features and the strip workers of
 * mlxgw_lanes_dequantize_t where qlanes.c's AVX-512 ones do not run */
__attribute__((visibility("hidden"))) int mlxgw_qlanes2_usable(void);
/* 1 where qlanes2.c adds with AVX-VNNI's vpdpwssd (the CPU has it, the ISA is not "avx2") */
__attribute__((visibility("hidden"))) int mlxgw_qlanes2_vnni(void);
__attribute__((visibility("hidden"))) void mlxgw_qlanes2_features(const QDot *a, int64_t n0,
                                                                  int64_t n1);
__attribute__((visibility("hidden"))) void *mlxgw_qlanes2_dequant(void *lanes_dequant);

#endif
