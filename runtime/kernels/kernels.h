/* The C interface of kernels.c (attention, gated activations, small GEMM), for its callers:
 * the ctypes bridge (bridge.py mirrors these structs) and the MLX extension (ext/). */

#ifndef MLXGW_KERNELS_H
#define MLXGW_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    const float *q; /* (B, Hq, L, D), any strides but unit stride along D */
    const float *k; /* (B, Hkv, K, D) */
    const float *v; /* (B, Hkv, K, D) */
    float *out;     /* (B, Hq, L, D) as strides: e.g. a (B, L, Hq, D) buffer */
    int64_t q_strides[3], k_strides[3], v_strides[3], o_strides[3]; /* b, head, row */
    int32_t batch, q_heads, kv_heads, length, keys, dim;
    float scale;
    int32_t causal;  /* 1: query i is key position keys - length + i and sees keys <= it */
    int32_t threads;
    int32_t generic; /* 1: the portable code even where AVX2 is available (tests) */
    /* (B) or NULL: each batch row's first key; the keys before it (a batch row's left
     * padding) are never read */
    const int32_t *starts;
    /* > 0: a sliding window, the query at key position p sees keys p - window + 1 .. p
     * (decode_attention.c; mlxgw_attention refuses it) */
    int32_t window;
} AttnArgs;

/* Attention over a quantized KV cache: `base` as for mlxgw_attention (its k and v unused),
 * keys and values as `mx.quantize` gave them along head_dim: codes (the uint32 words read
 * as bytes, element i of a row in byte i * bits / 8, low bits first) and one float32
 * scale and bias per `group` elements (value = scale * code + bias). Strides count
 * bytes for the codes and floats for the scales and biases. */
typedef struct {
    AttnArgs base;
    const uint8_t *kq, *vq;         /* (B, Hkv, K, D * bits / 8) */
    const float *ks, *kb, *vs, *vb; /* (B, Hkv, K, D / group) */
    int64_t kq_strides[3], vq_strides[3], ks_strides[3], kb_strides[3], vs_strides[3],
        vb_strides[3];
    int32_t bits;          /* 8 or 4 */
    int32_t group;         /* a multiple of 8 dividing dim */
} QAttnArgs;

enum { GATE_SILU = 0, GATE_GELU_TANH = 1 };
/* the most queries per sequence mlxgw_attention_decode takes (a speculative step's
 * verify rows) */
enum { MLXGW_DECODE_MAX_LENGTH = 16 };

/* 0 on success, 1 for arguments a kernel does not handle, 2 when out of memory */
int mlxgw_attention(const AttnArgs *a);
int mlxgw_attention_quantized(const QAttnArgs *qa);
/* decode_attention.c: mlxgw_attention for one query per sequence (length 1), or up to 16
 * causal ones (verify rows), the keys of each sequence and KV head split into chunks across
 * the threads; 1 where it does not apply (longer or non-causal query blocks, over 16 query heads per KV head, a head width not a multiple of
 * 8 or over 256). */
int mlxgw_attention_decode(const AttnArgs *a);
/* decode_attention.c: mlxgw_attention_decode over rows held in buffers of their own (a
 * running batch, runtime/cache/rows.py): `base` gives the shared sizes (its k, v, keys and
 * starts unused), `rows[b]` row b as a one-row AttnArgs (q, k, v, out at row b; `keys` its
 * own length). The same bits as mlxgw_attention_decode over those rows left-padded in one
 * buffer; 1 where that refuses. */
typedef struct {
    AttnArgs base;
    const AttnArgs *rows; /* (batch) */
} AttnRows;
int mlxgw_attention_decode_rows(const AttnRows *ra);
/* out = act(g) * u over n floats (kind: GATE_SILU or GATE_GELU_TANH) */
int mlxgw_gated_mul(const float *g, const float *u, float *out, int64_t n, int32_t kind,
                    int32_t threads, int32_t generic);
/* out = gelu(x) over n floats, the exact (erf) gelu */
int mlxgw_gelu_erf(const float *x, float *out, int64_t n, int32_t threads, int32_t generic);
int mlxgw_small_gemm(const float *x, const float *w, float *out, int64_t rows, int64_t cols,
                     int64_t depth, int32_t threads, int32_t generic);
const char *mlxgw_isa(int32_t generic);

/* rows.c. RMSNorm of `rows` rows of `dim`: x / sqrt(mean(x^2) + eps) * (w + unit_offset). */
void mlxgw_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t dim,
                    float eps, int32_t unit_offset);
/* Rotary embedding of (B, H, L, D) x (strides for b, h, l; unit stride along D) into a
 * packed (B, H, L, D) out: the first `dims` of D rotate in mx.fast.rope's non-traditional
 * pairing (i with i + dims / 2) by (offset + l) * scale * inv_freq[i], the rest pass
 * through; everything is scaled by mscale (yarn). `offsets`: one, or one per batch row
 * (per_row). 1 for dims it does not take (odd, over D, over 1024). */
int mlxgw_rope(const float *x, const int64_t *strides, float *out, int64_t batch, int64_t heads,
               int64_t length, int64_t dim, int64_t dims, const float *inv_freq,
               const int32_t *offsets, int32_t per_row, float scale, float mscale);

#ifdef __cplusplus
}
#endif

#endif
