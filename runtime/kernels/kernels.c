/* CPU kernels for MLX's CPU backend, loaded with ctypes by runtime/models/cpu_kernels.py.
 *
 * MLX's CPU exp is scalar (about 45M floats/s on one core), so attention's softmax and
 * the MLP's activation dominate a long prefill. These kernels do the same maths with a
 * vectorised exp2 and several threads:
 *
 *   mlxgw_attention: blocked attention with an online softmax (causal or unmasked, GQA)
 *   mlxgw_attention_quantized: the same over keys and values held as MLX's 8- or 4-bit
 *       affine groups (a --kv-bits cache), dequantized a key block at a time
 *   mlxgw_gated_mul: silu(g) * u or gelu_tanh(g) * u, elementwise (the gated MLP)
 *   mlxgw_gelu_erf: the exact (erf) GELU, elementwise (BERT's MLP)
 *
 * Everything is written with the GCC/clang vector extension (8 floats per vector), so one
 * source compiles for any target; on x86 each hot function is built twice, for the
 * baseline ISA and for AVX2+FMA, and the second is chosen at run time when the CPU has it.
 * No Python headers: the library is a plain shared object with a C ABI.
 */

#include "common.h"
#include "kernels.h"

/* ---------------------------------------------------------------- attention ---- */

/* Each work item is QBLOCK rows of one KV head; it walks the keys KBLOCK at a time and
 * each block in tiles of ROWS rows x KSTEP keys (scores) and ROWS rows x DSTEP dims (values):
 * 12 vector accumulators, which fit AVX2's 16 registers. Block sizes from 64 to 512 keys
 * and 32 to 128 rows measured the same (about 70 GFLOP/s a core on Zen 3); override with
 * -D for experiments. */
#ifndef KBLOCK_SIZE
#define KBLOCK_SIZE 256
#endif
#ifndef QBLOCK_SIZE
#define QBLOCK_SIZE 64
#endif
enum { ROWS = 16, QBLOCK = QBLOCK_SIZE, KBLOCK = KBLOCK_SIZE, KSTEP = 6, DSTEP = 6, MAX_DIM = 512 };

typedef struct {
    float *qt;  /* (dim, QBLOCK): scaled queries, transposed so rows are vector lanes */
    float *ot;  /* (dim, QBLOCK): output accumulators, transposed */
    float *st;  /* (KBLOCK, ROWS): scores, then probabilities, of one row tile */
    float *m;   /* (QBLOCK) running max, in log2 units */
    float *l;   /* (QBLOCK) running sum */
    int32_t *pos; /* (QBLOCK) key position of each row */
    float *kbuf;  /* (KBLOCK, dim): a quantized cache's key block, dequantized */
    float *vbuf;  /* (KBLOCK, dim): its value block */
} Scratch;

typedef uint8_t v8u8 __attribute__((vector_size(8)));

/* `count` rows of quantized codes (row stride `ldq` bytes; scales and biases at row
 * strides `lds`, `ldb` floats) into `out` (count, dim) floats. */
INLINE void dequantize_rows(const uint8_t *codes, int64_t ldq, const float *scales,
                            int64_t lds, const float *biases, int64_t ldb, int bits,
                            int group, int dim, int count, float *out) {
    const v8i shifts = {0, 4, 8, 12, 16, 20, 24, 28};
    for (int j = 0; j < count; j++) {
        const uint8_t *c = codes + j * ldq;
        const float *sc = scales + j * lds, *bi = biases + j * ldb;
        float *o = out + (int64_t)j * dim;
        for (int g0 = 0, g = 0; g0 < dim; g0 += group, g++) {
            v8f s = vsplat(sc[g]), b = vsplat(bi[g]);
            for (int i = g0; i < g0 + group; i += 8) {
                v8f x;
                if (bits == 8) {
                    v8u8 u;
                    memcpy(&u, c + i, sizeof u);
                    x = __builtin_convertvector(u, v8f);
                } else {
                    uint32_t w;
                    memcpy(&w, c + i / 2, sizeof w);
                    x = __builtin_convertvector((vsplati((int32_t)w) >> shifts) & 15, v8f);
                }
                vstore(o + i, x * s + b);
            }
        }
    }
}

/* scores St[i][0:16] = sum_d Qt[d][0:16] * K[i][d] for `n` keys (n <= KSTEP, a constant
 * after inlining, so the accumulators live in registers) */
INLINE void score_keys(int n, const float *qt, const float *kp, int64_t ldk, int dim,
                       float *st) {
    v8f acc[KSTEP][2];
    UNROLL for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = vsplat(0.0f);
    for (int d = 0; d < dim; d++) {
        v8f q0 = vload(qt + d * QBLOCK), q1 = vload(qt + d * QBLOCK + 8);
        UNROLL for (int i = 0; i < n; i++) {
            float kv = kp[i * ldk + d]; /* scalar * vector broadcasts it */
            acc[i][0] += kv * q0;
            acc[i][1] += kv * q1;
        }
    }
    UNROLL for (int i = 0; i < n; i++) {
        vstore(st + i * ROWS, acc[i][0]);
        vstore(st + i * ROWS + 8, acc[i][1]);
    }
}

/* Ot[d0+i][0:16] += sum_j V[j][d0+i] * St[j][0:16] for i < n (n <= DSTEP) */
INLINE void accumulate_values(int n, const float *st, const float *vp, int64_t ldv, int count,
                              float *ot) {
    v8f acc[DSTEP][2];
    UNROLL for (int i = 0; i < n; i++) {
        acc[i][0] = vload(ot + i * QBLOCK);
        acc[i][1] = vload(ot + i * QBLOCK + 8);
    }
    for (int j = 0; j < count; j++) {
        v8f p0 = vload(st + j * ROWS), p1 = vload(st + j * ROWS + 8);
        const float *row = vp + j * ldv;
        UNROLL for (int i = 0; i < n; i++) {
            float vv = row[i];
            acc[i][0] += vv * p0;
            acc[i][1] += vv * p1;
        }
    }
    UNROLL for (int i = 0; i < n; i++) {
        vstore(ot + i * QBLOCK, acc[i][0]);
        vstore(ot + i * QBLOCK + 8, acc[i][1]);
    }
}

INLINE void score_block(const float *qt, const float *kp, int64_t ldk, int dim, int count,
                        float *st) {
    int i = 0;
    for (; i + KSTEP <= count; i += KSTEP)
        score_keys(KSTEP, qt, kp + i * ldk, ldk, dim, st + i * ROWS);
    switch (count - i) {
    case 5: score_keys(5, qt, kp + i * ldk, ldk, dim, st + i * ROWS); break;
    case 4: score_keys(4, qt, kp + i * ldk, ldk, dim, st + i * ROWS); break;
    case 3: score_keys(3, qt, kp + i * ldk, ldk, dim, st + i * ROWS); break;
    case 2: score_keys(2, qt, kp + i * ldk, ldk, dim, st + i * ROWS); break;
    case 1: score_keys(1, qt, kp + i * ldk, ldk, dim, st + i * ROWS); break;
    default: break;
    }
}

INLINE void value_block(const float *st, const float *vp, int64_t ldv, int dim, int count,
                        float *ot) {
    int d = 0;
    for (; d + DSTEP <= dim; d += DSTEP)
        accumulate_values(DSTEP, st, vp + d, ldv, count, ot + d * QBLOCK);
    switch (dim - d) {
    case 5: accumulate_values(5, st, vp + d, ldv, count, ot + d * QBLOCK); break;
    case 4: accumulate_values(4, st, vp + d, ldv, count, ot + d * QBLOCK); break;
    case 3: accumulate_values(3, st, vp + d, ldv, count, ot + d * QBLOCK); break;
    case 2: accumulate_values(2, st, vp + d, ldv, count, ot + d * QBLOCK); break;
    case 1: accumulate_values(1, st, vp + d, ldv, count, ot + d * QBLOCK); break;
    default: break;
    }
}

/* Online softmax over `count` scores of one row tile (16 rows at m/l/ot), keys from
 * absolute position j0; keys after a row's own position are masked when `masked`. */
INLINE void softmax_block(float *st, int count, int32_t j0, const int32_t *pos, int masked,
                          float *m, float *l, float *ot, int dim) {
    v8f mx0 = vsplat(-__builtin_inff()), mx1 = mx0;
    v8i pos0 = vsplati(0), pos1 = vsplati(0);
    memcpy(&pos0, pos, sizeof pos0);
    memcpy(&pos1, pos + 8, sizeof pos1);
    const v8f ninf = vsplat(-__builtin_inff());
    for (int j = 0; j < count; j++) {
        v8f s0 = vload(st + j * ROWS), s1 = vload(st + j * ROWS + 8);
        if (masked) {
            v8i key = vsplati(j0 + j);
            s0 = vselect(key <= pos0, s0, ninf);
            s1 = vselect(key <= pos1, s1, ninf);
            vstore(st + j * ROWS, s0);
            vstore(st + j * ROWS + 8, s1);
        }
        mx0 = vmax(mx0, s0);
        mx1 = vmax(mx1, s1);
    }
    v8f old0 = vload(m), old1 = vload(m + 8);
    v8f new0 = vmax(old0, mx0), new1 = vmax(old1, mx1);
    v8f alpha0 = vexp2(old0 - new0), alpha1 = vexp2(old1 - new1);
    v8f sum0 = vsplat(0.0f), sum1 = vsplat(0.0f);
    for (int j = 0; j < count; j++) {
        v8f p0 = vexp2(vload(st + j * ROWS) - new0), p1 = vexp2(vload(st + j * ROWS + 8) - new1);
        vstore(st + j * ROWS, p0);
        vstore(st + j * ROWS + 8, p1);
        sum0 += p0;
        sum1 += p1;
    }
    vstore(m, new0);
    vstore(m + 8, new1);
    vstore(l, vload(l) * alpha0 + sum0);
    vstore(l + 8, vload(l + 8) * alpha1 + sum1);
    for (int d = 0; d < dim; d++) {
        vstore(ot + d * QBLOCK, vload(ot + d * QBLOCK) * alpha0);
        vstore(ot + d * QBLOCK + 8, vload(ot + d * QBLOCK + 8) * alpha1);
    }
}

INLINE int64_t at3(const int64_t *strides, int b, int h, int64_t row) {
    return b * strides[0] + h * strides[1] + row * strides[2];
}

/* Keys [j0, j0 + count) of (batch b, KV head h) into s->kbuf, their values into s->vbuf. */
INLINE void dequantize_key_block(const QAttnArgs *qa, int b, int h, int32_t j0, int count,
                                 Scratch *s) {
    const int dim = qa->base.dim;
    dequantize_rows(qa->kq + at3(qa->kq_strides, b, h, j0), qa->kq_strides[2],
                    qa->ks + at3(qa->ks_strides, b, h, j0), qa->ks_strides[2],
                    qa->kb + at3(qa->kb_strides, b, h, j0), qa->kb_strides[2], qa->bits,
                    qa->group, dim, count, s->kbuf);
    dequantize_rows(qa->vq + at3(qa->vq_strides, b, h, j0), qa->vq_strides[2],
                    qa->vs + at3(qa->vs_strides, b, h, j0), qa->vs_strides[2],
                    qa->vb + at3(qa->vb_strides, b, h, j0), qa->vb_strides[2], qa->bits,
                    qa->group, dim, count, s->vbuf);
}

/* Row `r` of a KV head's rows: the rows of one KV head are its (query, query head) pairs,
 * query-major, so the heads sharing the KV head (GQA) share its work item and the rows'
 * key positions never decrease. */
INLINE int64_t row_offset(const int64_t *strides, int b, int kvh, int group, int64_t r) {
    int64_t query = r / group, head = (int64_t)kvh * group + r % group;
    return b * strides[0] + head * strides[1] + query * strides[2];
}

/* One work item: QBLOCK rows of one (batch, KV head) against the keys they see; `qa`
 * (NULL: float keys and values) a quantized cache's, dequantized a key block at a time. */
INLINE void attend_item(const AttnArgs *a, const QAttnArgs *qa, Scratch *s, int64_t item) {
    const int group = a->q_heads / a->kv_heads;
    const int64_t total_rows = (int64_t)a->length * group;
    const int64_t nqb = (total_rows + QBLOCK - 1) / QBLOCK;
    /* costliest items first: with a causal mask the last rows see the most keys */
    const int64_t qb = nqb - 1 - item % nqb;
    const int64_t bk = item / nqb;
    const int b = (int)(bk / a->kv_heads), kvh = (int)(bk % a->kv_heads);
    const int dim = a->dim;
    const int64_t r0 = qb * QBLOCK;
    const int rows = total_rows - r0 < QBLOCK ? (int)(total_rows - r0) : QBLOCK;
    const int tiles = (rows + ROWS - 1) / ROWS;
    const float qscale = a->scale * 1.4426950408889634f; /* scores in log2 units */
    const float *kp = qa != NULL ? NULL : a->k + b * a->k_strides[0] + kvh * a->k_strides[1];
    const float *vp = qa != NULL ? NULL : a->v + b * a->v_strides[0] + kvh * a->v_strides[1];

    for (int r = 0; r < tiles * ROWS; r++) {
        int real = r < rows ? r : rows - 1; /* padding rows copy the last row's position */
        int32_t query = (int32_t)((r0 + real) / group);
        s->pos[r] = a->causal ? a->keys - a->length + query : a->keys - 1;
        s->m[r] = -__builtin_inff();
        s->l[r] = 0.0f;
        const float *qp = a->q + row_offset(a->q_strides, b, kvh, group, r0 + real);
        for (int d = 0; d < dim; d++) {
            s->qt[d * QBLOCK + r] = r < rows ? qp[d] * qscale : 0.0f;
            s->ot[d * QBLOCK + r] = 0.0f;
        }
    }
    const int32_t key_end = s->pos[tiles * ROWS - 1] + 1;
    const int32_t key_start = a->starts != NULL ? a->starts[b] : 0;
    int64_t ldk = a->k_strides[2], ldv = a->v_strides[2];
    if (qa != NULL) ldk = ldv = dim;
    for (int32_t j0 = key_start; j0 < key_end; j0 += KBLOCK) {
        const int32_t block_end = j0 + KBLOCK < key_end ? j0 + KBLOCK : key_end;
        const float *kb, *vb;
        if (qa != NULL) {
            dequantize_key_block(qa, b, kvh, j0, block_end - j0, s);
            kb = s->kbuf;
            vb = s->vbuf;
        } else {
            kb = kp + j0 * a->k_strides[2];
            vb = vp + j0 * a->v_strides[2];
        }
        for (int t = 0; t < tiles; t++) {
            const int32_t *pos = s->pos + t * ROWS;
            int32_t tile_end = pos[ROWS - 1] + 1 < block_end ? pos[ROWS - 1] + 1 : block_end;
            int count = tile_end - j0;
            if (count <= 0) continue;
            int masked = tile_end - 1 > pos[0];
            score_block(s->qt + t * ROWS, kb, ldk, dim, count, s->st);
            softmax_block(s->st, count, j0, pos, masked, s->m + t * ROWS, s->l + t * ROWS,
                          s->ot + t * ROWS, dim);
            value_block(s->st, vb, ldv, dim, count, s->ot + t * ROWS);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *op = a->out + row_offset(a->o_strides, b, kvh, group, r0 + r);
        float inv = 1.0f / s->l[r];
        for (int d = 0; d < dim; d++) op[d] = s->ot[d * QBLOCK + r] * inv;
    }
}

static void attend_item_generic(const AttnArgs *a, Scratch *s, int64_t item) {
    attend_item(a, NULL, s, item);
}

/* `a` is the `base` of a QAttnArgs */
static void attend_qitem_generic(const AttnArgs *a, Scratch *s, int64_t item) {
    attend_item(a, (const QAttnArgs *)a, s, item);
}

#if HAVE_X86_DISPATCH
TARGET_AVX2 static void attend_item_avx2(const AttnArgs *a, Scratch *s, int64_t item) {
    attend_item(a, NULL, s, item);
}

TARGET_AVX2 static void attend_qitem_avx2(const AttnArgs *a, Scratch *s, int64_t item) {
    attend_item(a, (const QAttnArgs *)a, s, item);
}
#endif

/* ------------------------------------------------------------ gated activations ---- */

/* out = act(g) * u. Both activations are x * sigmoid(z): silu with z = x, and tanh-gelu,
 * 0.5 x (1 + tanh(y)) with y = sqrt(2/pi) (x + 0.044715 x^3), is x * sigmoid(2y), which
 * avoids tanh's cancellation near 0. sigmoid(z) = 1 / (1 + 2^(-z log2 e)). */
INLINE v8f gated(int kind, v8f x, v8f u) {
    const v8f one = vsplat(1.0f), nlog2e = vsplat(-1.4426950408889634f);
    v8f z = x;
    if (kind == GATE_GELU_TANH)
        z = vsplat(1.5957691216057308f) * (x + vsplat(0.044715f) * x * x * x);
    return x * u / (one + vexp2(z * nlog2e));
}

INLINE void gated_range(int kind, const float *g, const float *u, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vstore(out + i, gated(kind, vload(g + i), vload(u + i)));
    if (i < n) {
        float gx[8] = {0}, ux[8] = {0}, ox[8];
        memcpy(gx, g + i, (size_t)(n - i) * sizeof(float));
        memcpy(ux, u + i, (size_t)(n - i) * sizeof(float));
        vstore(ox, gated(kind, vload(gx), vload(ux)));
        memcpy(out + i, ox, (size_t)(n - i) * sizeof(float));
    }
}

static void gated_generic(int kind, const float *g, const float *u, float *out, int64_t n) {
    if (kind == GATE_SILU)
        gated_range(GATE_SILU, g, u, out, n);
    else
        gated_range(GATE_GELU_TANH, g, u, out, n);
}

#if HAVE_X86_DISPATCH
TARGET_AVX2 static void gated_avx2(int kind, const float *g, const float *u, float *out,
                                   int64_t n) {
    if (kind == GATE_SILU)
        gated_range(GATE_SILU, g, u, out, n);
    else
        gated_range(GATE_GELU_TANH, g, u, out, n);
}
#endif

/* ------------------------------------------------------------ erf gelu ---- */

/* x (1 + erf(x / sqrt 2)) / 2 with erf as Eigen's rational approximation (odd numerator,
 * even denominator in z^2, z clamped to [-4, 4] where float32 erf is +-1): within 5e-7 of
 * erf, the same terms as runtime/models/bert.py's MLX form. MLX's own erf is a scalar loop,
 * and its fused form of this one runs on one thread. */
INLINE v8f gelu_erf(v8f x) {
    v8f z = vmin(vmax(x * vsplat(0.7071067811865476f), vsplat(-4.0f)), vsplat(4.0f));
    v8f z2 = z * z;
    v8f p = vsplat(-2.72614225801306e-10f);
    p = p * z2 + vsplat(2.77068142495902e-08f);
    p = p * z2 + vsplat(-2.10102402082508e-06f);
    p = p * z2 + vsplat(-5.69250639462346e-05f);
    p = p * z2 + vsplat(-7.34990630326855e-04f);
    p = p * z2 + vsplat(-2.95459980854025e-03f);
    p = p * z2 + vsplat(-1.60960333262415e-02f);
    v8f q = vsplat(-1.45660718464996e-05f);
    q = q * z2 + vsplat(-2.13374055278905e-04f);
    q = q * z2 + vsplat(-1.68282697438203e-03f);
    q = q * z2 + vsplat(-7.37332916720468e-03f);
    q = q * z2 + vsplat(-1.42647390514189e-02f);
    return vsplat(0.5f) * x * (vsplat(1.0f) + z * p / q);
}

/* GatedFn's shape, for gated_worker: `kind` and `u` unused */
INLINE void gelu_erf_range(const float *x, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) vstore(out + i, gelu_erf(vload(x + i)));
    if (i < n) {
        float xs[8] = {0}, os[8];
        memcpy(xs, x + i, (size_t)(n - i) * sizeof(float));
        vstore(os, gelu_erf(vload(xs)));
        memcpy(out + i, os, (size_t)(n - i) * sizeof(float));
    }
}

static void gelu_erf_generic(int kind, const float *x, const float *u, float *out, int64_t n) {
    (void)kind;
    (void)u;
    gelu_erf_range(x, out, n);
}

#if HAVE_X86_DISPATCH
TARGET_AVX2 static void gelu_erf_avx2(int kind, const float *x, const float *u, float *out,
                                      int64_t n) {
    (void)kind;
    (void)u;
    gelu_erf_range(x, out, n);
}
#endif

/* ------------------------------------------------------------ small gemm ---- */

/* out[m, n] = sum_k x[m, k] * w[n, k] for a few rows m (a batched decode step, a short
 * prefill chunk): the weights are read from memory once for all of x's rows. BLAS libraries
 * pack w for every call at these shapes and run at half the speed of reading it.
 *
 * The register block is 4 rows of w by 2 rows of x: per 8 floats of depth, 6 loads feed 8
 * fused multiply-adds (8 accumulators, 4 + 2 inputs: 14 of the 16 AVX registers). Blocks
 * with more x rows than w rows (2x4, 3x4) measured slower: the w rows are the stream that
 * comes from memory, x's rows stay in cache, and the loads of x then bound the loop. */
INLINE float dot(const float *a, const float *b, int64_t depth) {
    int64_t vec = depth & ~(int64_t)7;
    v8f acc = {0};
    for (int64_t k = 0; k < vec; k += 8) acc += vload(a + k) * vload(b + k);
    float t = hsum(acc);
    for (int64_t k = vec; k < depth; k++) t += a[k] * b[k];
    return t;
}

/* out[m..m+1, n..n+3] */
INLINE void gemm_4x2(const float *x, const float *w, float *out, int64_t cols, int64_t depth,
                     int64_t m, int64_t n) {
    const float *x0 = x + m * depth, *x1 = x0 + depth;
    const float *w0 = w + n * depth, *w1 = w0 + depth, *w2 = w1 + depth, *w3 = w2 + depth;
    int64_t vec = depth & ~(int64_t)7;
    v8f a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
    for (int64_t k = 0; k < vec; k += 8) {
        v8f s = vload(x0 + k), t = vload(x1 + k), p;
        p = vload(w0 + k);
        a00 += p * s;
        a01 += p * t;
        p = vload(w1 + k);
        a10 += p * s;
        a11 += p * t;
        p = vload(w2 + k);
        a20 += p * s;
        a21 += p * t;
        p = vload(w3 + k);
        a30 += p * s;
        a31 += p * t;
    }
    float r0[4] = {hsum(a00), hsum(a10), hsum(a20), hsum(a30)};
    float r1[4] = {hsum(a01), hsum(a11), hsum(a21), hsum(a31)};
    const float *wj[4] = {w0, w1, w2, w3};
    for (int j = 0; j < 4; j++) {
        for (int64_t k = vec; k < depth; k++) {
            r0[j] += wj[j][k] * x0[k];
            r1[j] += wj[j][k] * x1[k];
        }
        out[m * cols + n + j] = r0[j];
        out[(m + 1) * cols + n + j] = r1[j];
    }
}

/* out[m, n..n+3]: the odd row left over */
INLINE void gemm_4x1(const float *x, const float *w, float *out, int64_t cols, int64_t depth,
                     int64_t m, int64_t n) {
    const float *x0 = x + m * depth;
    const float *w0 = w + n * depth, *w1 = w0 + depth, *w2 = w1 + depth, *w3 = w2 + depth;
    int64_t vec = depth & ~(int64_t)7;
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (int64_t k = 0; k < vec; k += 8) {
        v8f s = vload(x0 + k);
        a0 += vload(w0 + k) * s;
        a1 += vload(w1 + k) * s;
        a2 += vload(w2 + k) * s;
        a3 += vload(w3 + k) * s;
    }
    float r[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
    const float *wj[4] = {w0, w1, w2, w3};
    for (int j = 0; j < 4; j++) {
        for (int64_t k = vec; k < depth; k++) r[j] += wj[j][k] * x0[k];
        out[m * cols + n + j] = r[j];
    }
}

INLINE void gemm_rows(const float *x, const float *w, float *out, int64_t rows, int64_t cols,
                      int64_t depth, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
        int64_t m = 0;
        for (; m + 2 <= rows; m += 2) gemm_4x2(x, w, out, cols, depth, m, n);
        if (m < rows) gemm_4x1(x, w, out, cols, depth, m, n);
    }
    for (; n < n1; n++)
        for (int64_t m = 0; m < rows; m++)
            out[m * cols + n] = dot(x + m * depth, w + n * depth, depth);
}

static void gemm_generic(const float *x, const float *w, float *out, int64_t rows, int64_t cols,
                         int64_t depth, int64_t n0, int64_t n1) {
    gemm_rows(x, w, out, rows, cols, depth, n0, n1);
}

#if HAVE_X86_DISPATCH
TARGET_AVX2 static void gemm_avx2(const float *x, const float *w, float *out, int64_t rows,
                                  int64_t cols, int64_t depth, int64_t n0, int64_t n1) {
    gemm_rows(x, w, out, rows, cols, depth, n0, n1);
}
#endif

/* ---------------------------------------------------------------- threads ---- */

typedef void (*ItemFn)(const AttnArgs *, Scratch *, int64_t);
typedef void (*GatedFn)(int, const float *, const float *, float *, int64_t);
typedef void (*GemmFn)(const float *, const float *, float *, int64_t, int64_t, int64_t, int64_t,
                       int64_t);

typedef struct {
    int64_t next; /* next work item, taken with an atomic add */
    int64_t total;
    int failed;   /* a worker could not allocate its scratch */
    const AttnArgs *attn;
    int quantized; /* attn is a QAttnArgs's base: the workers need key-block scratch */
    ItemFn item_fn;
    const float *g, *u;
    float *out;
    int64_t chunk;
    int kind;
    GatedFn gated_fn;
    const float *x, *w; /* small gemm: out (rows x cols) = x (rows x depth) @ w^T */
    int64_t rows, cols, depth;
    GemmFn gemm_fn;
} Job;

static void *attn_worker(void *arg) {
    Job *job = arg;
    const AttnArgs *a = job->attn;
    Scratch s;
    size_t plane = (size_t)a->dim * QBLOCK * sizeof(float);
    s.qt = malloc(plane);
    s.ot = malloc(plane);
    s.st = malloc((size_t)KBLOCK * ROWS * sizeof(float));
    s.m = malloc(QBLOCK * sizeof(float));
    s.l = malloc(QBLOCK * sizeof(float));
    s.pos = malloc(QBLOCK * sizeof(int32_t));
    s.kbuf = job->quantized ? malloc((size_t)KBLOCK * a->dim * sizeof(float)) : NULL;
    s.vbuf = job->quantized ? malloc((size_t)KBLOCK * a->dim * sizeof(float)) : NULL;
    if (!s.qt || !s.ot || !s.st || !s.m || !s.l || !s.pos ||
        (job->quantized && (!s.kbuf || !s.vbuf))) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    } else {
        for (;;) {
            int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
            if (item >= job->total) break;
            job->item_fn(a, &s, item);
        }
    }
    free(s.qt);
    free(s.ot);
    free(s.st);
    free(s.m);
    free(s.l);
    free(s.pos);
    free(s.kbuf);
    free(s.vbuf);
    return NULL;
}

static void *gated_worker(void *arg) {
    Job *job = arg;
    for (;;) {
        int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        int64_t start = item * job->chunk;
        if (start >= job->total) break;
        int64_t n = job->total - start < job->chunk ? job->total - start : job->chunk;
        job->gated_fn(job->kind, job->g + start, job->u + start, job->out + start, n);
    }
    return NULL;
}

static void *gemm_worker(void *arg) {
    Job *job = arg;
    for (;;) {
        int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        int64_t start = item * job->chunk;
        if (start >= job->cols) break;
        int64_t end = start + job->chunk < job->cols ? start + job->chunk : job->cols;
        job->gemm_fn(job->x, job->w, job->out, job->rows, job->cols, job->depth, start, end);
    }
    return NULL;
}

/* Returns 0 on success, 1 for arguments it does not handle, 2 when out of memory. */
static int starts_valid(const AttnArgs *a) {
    if (a->starts == NULL) return 1;
    for (int32_t b = 0; b < a->batch; b++)
        if (a->starts[b] < 0 || a->starts[b] > a->keys - a->length) return 0;
    return 1;
}

EXPORT int mlxgw_attention(const AttnArgs *a) {
    if (a->batch < 1 || a->q_heads < 1 || a->kv_heads < 1 || a->q_heads % a->kv_heads != 0 ||
        a->length < 1 || a->keys < a->length || a->dim < 1 || a->dim > MAX_DIM ||
        !starts_valid(a) || a->window > 0)
        return 1;
    Job job = {0};
    job.attn = a;
    int64_t rows = (int64_t)a->length * (a->q_heads / a->kv_heads);
    job.total = (int64_t)a->batch * a->kv_heads * ((rows + QBLOCK - 1) / QBLOCK);
    job.item_fn = attend_item_generic;
#if HAVE_X86_DISPATCH
    if (use_avx2(a->generic)) job.item_fn = attend_item_avx2;
#endif
    run_threads(attn_worker, &job, a->threads < 1 ? 1 : a->threads);
    return job.failed ? 2 : 0;
}

/* mlxgw_attention over a quantized cache (QAttnArgs); the same return codes. */
EXPORT int mlxgw_attention_quantized(const QAttnArgs *qa) {
    const AttnArgs *a = &qa->base;
    if (a->batch < 1 || a->q_heads < 1 || a->kv_heads < 1 || a->q_heads % a->kv_heads != 0 ||
        a->length < 1 || a->keys < a->length || a->dim < 1 || a->dim > MAX_DIM ||
        (qa->bits != 8 && qa->bits != 4) || qa->group < 8 || qa->group % 8 != 0 ||
        a->dim % qa->group != 0)
        return 1;
    if (!starts_valid(a)) return 1;
    Job job = {0};
    job.attn = a;
    job.quantized = 1;
    int64_t rows = (int64_t)a->length * (a->q_heads / a->kv_heads);
    job.total = (int64_t)a->batch * a->kv_heads * ((rows + QBLOCK - 1) / QBLOCK);
    job.item_fn = attend_qitem_generic;
#if HAVE_X86_DISPATCH
    if (use_avx2(a->generic)) job.item_fn = attend_qitem_avx2;
#endif
    run_threads(attn_worker, &job, a->threads < 1 ? 1 : a->threads);
    return job.failed ? 2 : 0;
}

/* out = act(g) * u over n floats; kind: 0 silu, 1 tanh-approximated gelu; generic as in
 * AttnArgs. */
EXPORT int mlxgw_gated_mul(const float *g, const float *u, float *out, int64_t n, int32_t kind,
                           int32_t threads, int32_t generic) {
    if (kind != GATE_SILU && kind != GATE_GELU_TANH) return 1;
    (void)generic; /* read only where there is a choice of code */
    Job job = {0};
    job.g = g;
    job.u = u;
    job.out = out;
    job.total = n;
    job.chunk = 1 << 16;
    job.kind = kind;
    job.gated_fn = gated_generic;
#if HAVE_X86_DISPATCH
    if (use_avx2(generic)) job.gated_fn = gated_avx2;
#endif
    if (threads < 1 || n < 2 * job.chunk) threads = 1; /* small inputs: not worth a thread */
    run_threads(gated_worker, &job, threads);
    return 0;
}

/* out = gelu(x) over n floats, gelu the exact (erf) one; generic as in AttnArgs. */
EXPORT int mlxgw_gelu_erf(const float *x, float *out, int64_t n, int32_t threads,
                          int32_t generic) {
    if (n < 0) return 1;
    (void)generic;
    Job job = {0};
    job.g = x;
    job.u = x; /* unused by the gelu functions */
    job.out = out;
    job.total = n;
    job.chunk = 1 << 14;
    job.gated_fn = gelu_erf_generic;
#if HAVE_X86_DISPATCH
    if (use_avx2(generic)) job.gated_fn = gelu_erf_avx2;
#endif
    if (threads < 1 || n < 2 * job.chunk) threads = 1; /* small inputs: not worth a thread */
    run_threads(gated_worker, &job, threads);
    return 0;
}

/* out (rows x cols) = x (rows x depth) @ w^T, w being (cols x depth), all row-major float32:
 * a linear layer over a few rows. */
EXPORT int mlxgw_small_gemm(const float *x, const float *w, float *out, int64_t rows,
                            int64_t cols, int64_t depth, int32_t threads, int32_t generic) {
    if (rows < 1 || cols < 1 || depth < 1) return 1;
    (void)generic;
    Job job = {0};
    job.x = x;
    job.w = w;
    job.out = out;
    job.rows = rows;
    job.cols = cols;
    job.depth = depth;
    job.chunk = span_items(cols, threads, 64); /* rows of w per work item */
    job.gemm_fn = gemm_generic;
#if HAVE_X86_DISPATCH
    if (use_avx2(generic)) job.gemm_fn = gemm_avx2;
#endif
    if (threads < 1) threads = 1;
    run_threads(gemm_worker, &job, threads);
    return 0;
}

/* Which code the kernels run: "avx2-fma" or "generic". */
EXPORT const char *mlxgw_isa(int32_t generic) { return use_avx2(generic) ? "avx2-fma" : "generic"; }
