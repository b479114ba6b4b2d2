/* What decode_attention.c shares with its AVX-512 chunk (decode_attention512.c). */

#ifndef MLXGW_DECODE_ATTENTION_H
#define MLXGW_DECODE_ATTENTION_H

#include <stdint.h>

#include "kernels.h"

enum {
    DEC_MAX_ROWS = 16, /* query heads per KV head */
    DEC_MAX_DIM = 256  /* head width */
};

/* 1 where the AVX-512 chunk may run: x86 with AVX-512 F and DQ, `dim` a multiple of 16,
 * not `generic`, and MLX_GATEWAY_CPU_ISA not "avx2" */
__attribute__((visibility("hidden"))) int mlxgw_decode512_usable(int generic, int dim);
/* One chunk: the `group` query rows of (b, query qi, KV head kvh) against keys [j0, j1);
 * writes per row its max, its sum of weights and its dim output floats to part */
__attribute__((visibility("hidden"))) void mlxgw_decode512_chunk(const AttnArgs *a, int group,
                                                                 int b, int qi, int kvh,
                                                                 int32_t j0, int32_t j1,
                                                                 float *part);

#endif
