/* Attention of decode queries over their cache (flash-decoding): one query per sequence,
 * or a few causal ones (a speculative step's verify rows).
 *
 * mlxgw_attention (kernels.c) is built for prompt chunks: tiles of 16 query rows per KV
 * head. A decode step has one query, so a KV head has only its GQA group of rows (3 for
 * SmolLM2, 7 for Qwen2.5), and those tiles computed 16 rows to use 3; with 2-3 KV heads
 * it also had fewer work items than threads. Here each (sequence, KV head) splits its keys
 * into chunks, the chunks are the work items (every thread busy, the keys streamed once),
 * each keeps a running max, sum and output per row (online softmax, scores in log2 units),
 * and a last pass merges the chunks' partial results. The keys before `starts[b]` (a
 * batch row's left padding) are never read.
 *
 * A verify step feeds up to DEC_MAX_LENGTH tokens per sequence. Query l of L sees the keys
 * up to column keys - L + l, and is split into chunks exactly as a one-query step over
 * those keys would be (the same chunk size, the same order of the merge): its output is
 * the bits a plain decode step of the same batch computes, so drafted tokens are checked
 * against the logits decoding without them would have had.
 *
 * A sliding window (`window` > 0) moves each query's first key to its column - window + 1
 * (never before the row's own first key), and its span, which sets the chunks, to at
 * most `window`: a verify step's queries, each with its own first key, are split as the
 * one-query steps at their columns are.
 *
 * A chunk runs in AVX2+FMA where the CPU has it (tiled_chunk_dim), else in portable code
 * (decode_chunk_dim). Every item of a call takes the same one, so the invariants above hold
 * on each.
 */

#include <math.h>

#include "common.h"
#include "kernels.h"

enum {
    DEC_MAX_ROWS = 16,
    DEC_MAX_DIM = 256,
    DEC_MIN_CHUNK = 256,
    DEC_MAX_LENGTH = MLXGW_DECODE_MAX_LENGTH
};
/* keys ahead whose cache lines a chunk asks for: the hardware prefetchers alone left the
 * loop waiting on memory at long contexts (SmolLM2 after 4,000 tokens: 70.5 -> 81.3
 * decode tokens/s; Qwen2.5-0.5B, whose keys are a smaller share of a step: +1%) */
enum { DEC_PREFETCH_KEYS = 32 };

typedef struct {
    int32_t chunk;  /* keys per chunk */
    int chunks;     /* chunks per (b, KV head) */
    int64_t first;  /* the first work item of this query position */
} QueryPlan;

/* What one work item computes: rows of (b, query qi, KV head kvh) of `a` against keys
 * [j0, j1), into dst. */
typedef struct {
    const AttnArgs *a;
    int b, qi, kvh;
    int32_t j0, j1;
    float *dst;
} Chunk;

typedef int (*LocateFn)(const AttnArgs *, const QueryPlan *, int, float *, int64_t, Chunk *);
typedef void (*ChunkFn)(const Chunk *, int);

typedef struct {
    const AttnArgs *a;
    int group;                   /* rows per KV head */
    QueryPlan plan[DEC_MAX_LENGTH];
    float *part;                 /* per item and row: max, sum, then dim output floats */
    int64_t next, items;
    LocateFn locate; /* the item's keys, by the batch's layout */
    ChunkFn chunk;   /* the code that attends to them, by the instruction set */
} DecodeJob;

/* lane k = the sum of v[k]'s lanes: a tree of pairwise shuffles and adds, 7 vector adds
 * where eight separate sums take 56 dependent scalar ones */
INLINE v8f hsum8x8(const v8f *v) {
    v8f t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    /* u[0] holds keys 0-3 (lanes 0-3: first halves, 4-7: second halves), u[1] keys 4-7 */
    return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* The block of keys from j (before j1): its key and value rows, the keys past the chunk's
 * end pointing at its last key again (masked by the caller: weight 0); the caches' lines
 * some blocks ahead asked for. How many keys it has. */
INLINE int block_keys(const AttnArgs *a, const float *kp, const float *vp, int32_t j,
                      int32_t j1, const float **key, const float **value) {
    const int n = j1 - j < 8 ? j1 - j : 8;
    const float *kb = kp + j * a->k_strides[2], *vb = vp + j * a->v_strides[2];
    if (j + DEC_PREFETCH_KEYS + 8 <= j1)
        for (int k = 0; k < 8; k++)
            for (int d = 0; d < a->dim; d += 16) {
                __builtin_prefetch(kb + (DEC_PREFETCH_KEYS + k) * a->k_strides[2] + d);
                __builtin_prefetch(vb + (DEC_PREFETCH_KEYS + k) * a->v_strides[2] + d);
            }
    for (int k = 0; k < 8; k++) {
        key[k] = kb + (k < n ? k : n - 1) * a->k_strides[2];
        value[k] = vb + (k < n ? k : n - 1) * a->v_strides[2];
    }
    return n;
}

/* One chunk: rows of (b, query qi, KV head) against keys [j0, j1); writes max, sum, output. */
INLINE void decode_chunk_dim(const AttnArgs *a, int group, int b, int qi, int kvh, int32_t j0,
                             int32_t j1, float *part, const int dv) {
    const int dim = a->dim;
    const float qscale = a->scale * 1.4426950408889634f;
    const float *kp = a->k + b * a->k_strides[0] + kvh * a->k_strides[1];
    const float *vp = a->v + b * a->v_strides[0] + kvh * a->v_strides[1];
    v8f q[DEC_MAX_ROWS][DEC_MAX_DIM / 8], o[DEC_MAX_ROWS][DEC_MAX_DIM / 8];
    float m[DEC_MAX_ROWS], l[DEC_MAX_ROWS];
    for (int r = 0; r < group; r++) {
        const float *qp = a->q + b * a->q_strides[0] +
                          (int64_t)(kvh * group + r) * a->q_strides[1] + qi * a->q_strides[2];
        for (int d = 0; d < dv; d++) {
            q[r][d] = vload(qp + 8 * d) * vsplat(qscale);
            o[r][d] = vsplat(0.0f);
        }
        m[r] = -__builtin_inff();
        l[r] = 0.0f;
    }
    for (int32_t j = j0; j < j1; j += 8) {
        const float *key[8], *value[8];
        const int n = block_keys(a, kp, vp, j, j1, key, value);
        for (int r = 0; r < group; r++) {
            /* eight keys' dot products side by side (eight independent chains), then
             * summed across lanes all at once */
            v8f acc[8];
            for (int k = 0; k < 8; k++) acc[k] = q[r][0] * vload(key[k]);
            for (int d = 1; d < dv; d++)
                for (int k = 0; k < 8; k++) acc[k] += q[r][d] * vload(key[k] + 8 * d);
            float s[8];
            vstore(s, hsum8x8(acc));
            for (int k = n; k < 8; k++) s[k] = -__builtin_inff();
            float top = m[r];
            for (int k = 0; k < n; k++) top = s[k] > top ? s[k] : top;
            const v8f p = vexp2(vload(s) - vsplat(top));
            const v8f alpha = vexp2(vsplat(m[r] - top)); /* every lane; 0 on the first block */
            m[r] = top;
            l[r] = l[r] * alpha[0] + hsum(p);
            /* each output vector's sum over the block's keys in a register (the key loop
             * inside: a chain through memory per key would set the pace). The weights as
             * vectors by constant shuffles: a splat of a lane costs 8 inserts in GCC's
             * vector extension. Keys past n have weight 0 and read the last key's values. */
            const v8f pb[8] = {
                __builtin_shufflevector(p, p, 0, 0, 0, 0, 0, 0, 0, 0),
                __builtin_shufflevector(p, p, 1, 1, 1, 1, 1, 1, 1, 1),
                __builtin_shufflevector(p, p, 2, 2, 2, 2, 2, 2, 2, 2),
                __builtin_shufflevector(p, p, 3, 3, 3, 3, 3, 3, 3, 3),
                __builtin_shufflevector(p, p, 4, 4, 4, 4, 4, 4, 4, 4),
                __builtin_shufflevector(p, p, 5, 5, 5, 5, 5, 5, 5, 5),
                __builtin_shufflevector(p, p, 6, 6, 6, 6, 6, 6, 6, 6),
                __builtin_shufflevector(p, p, 7, 7, 7, 7, 7, 7, 7, 7),
            };
            for (int d = 0; d < dv; d++) {
                v8f acc = o[r][d] * alpha;
                for (int k = 0; k < 8; k++) acc += pb[k] * vload(value[k] + 8 * d);
                o[r][d] = acc;
            }
        }
    }
    for (int r = 0; r < group; r++) {
        float *out = part + (int64_t)r * (dim + 2);
        out[0] = m[r];
        out[1] = l[r];
        for (int d = 0; d < dv; d++) vstore(out + 2 + 8 * d, o[r][d]);
    }
}

/* the largest of v's lanes */
INLINE float hmax(v8f v) {
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    return v[0];
}

/* Rows r0..r0+rt-1, slices s0..s0+st-1 (8 floats each) of the output: scaled by each
 * row's alpha, plus the block's 8 weighted values. Value k's slice is loaded once for the
 * tile and each row's weight broadcast from memory (a vector times a scalar: one load
 * on AVX2, where GCC builds vsplat from 8 inserts), so the tile's rt x st sums stay in
 * registers as independent chains. */
INLINE void values_tile(float (*o)[DEC_MAX_DIM], const float (*w)[8], const float *alpha,
                        const float *const *value, int r0, int s0, const int rt, const int st) {
    v8f acc[4][2];
    for (int i = 0; i < rt; i++)
        for (int s = 0; s < st; s++)
            acc[i][s] = vload(o[r0 + i] + 8 * (s0 + s)) * alpha[r0 + i];
    for (int k = 0; k < 8; k++)
        for (int s = 0; s < st; s++) {
            const v8f v = vload(value[k] + 8 * (s0 + s));
            for (int i = 0; i < rt; i++) acc[i][s] += v * w[r0 + i][k];
        }
    for (int i = 0; i < rt; i++)
        for (int s = 0; s < st; s++) vstore(o[r0 + i] + 8 * (s0 + s), acc[i][s]);
}

/* every row, in tiles of 4 rows, by values_tile */
INLINE void values_rows(float (*o)[DEC_MAX_DIM], const float (*w)[8], const float *alpha,
                        const float *const *value, int group, int s0, const int st) {
    int r = 0;
    for (; r + 4 <= group; r += 4) values_tile(o, w, alpha, value, r, s0, 4, st);
    switch (group - r) {
    case 3: values_tile(o, w, alpha, value, r, s0, 3, st); break;
    case 2: values_tile(o, w, alpha, value, r, s0, 2, st); break;
    case 1: values_tile(o, w, alpha, value, r, s0, 1, st); break;
    default: break;
    }
}

/* decode_chunk_dim for AVX2: blocks of 8 keys as there, in an order that suits 16
 * registers of 8 floats. Per row, the block's 8 dot products side by side (8 independent
 * chains), summed across lanes all at once (hsum8x8); its maximum by one reduction and its
 * weights by one vector 2^x (decode_chunk_dim: a scalar loop and a sum per block); the sum
 * of weights kept in 8 lanes across the chunk, summed once at its end. Then the values
 * for all rows, in tiles (values_rows), each value loaded once per tile where
 * decode_chunk_dim loads it again for every row and scales the row's whole output every
 * block in a pass of its own. 8 streams of Qwen2.5-0.5B after 520 tokens, 24 layers'
 * caches: 8.2 -> 5.6 ms a step; one stream after 8000: 16.6 -> 12.3 ms. An AVX-512
 * version (16-key blocks) was 7-10% faster than this on an Intel Xeon, 2-3% of a whole
 * 8-stream step (where reading the caches bounds the attention), and a CPU that splits
 * 512-bit vectors in two (AMD Zen 4) runs the same number of 256-bit halves either way:
 * not worth a third code path. The portable code stays decode_chunk_dim: compiled for
 * 4-float SSE registers, GCC spills these tiles to the stack (2x slower). */
INLINE void tiled_chunk_dim(const AttnArgs *a, int group, int b, int qi, int kvh, int32_t j0,
                            int32_t j1, float *part, const int dv) {
    const int dim = a->dim;
    const float qscale = a->scale * 1.4426950408889634f;
    const float *kp = a->k + b * a->k_strides[0] + kvh * a->k_strides[1];
    const float *vp = a->v + b * a->v_strides[0] + kvh * a->v_strides[1];
    v8f q[DEC_MAX_ROWS][DEC_MAX_DIM / 8], lsum[DEC_MAX_ROWS];
    float o[DEC_MAX_ROWS][DEC_MAX_DIM] __attribute__((aligned(32)));
    float w[DEC_MAX_ROWS][8] __attribute__((aligned(32)));
    float m[DEC_MAX_ROWS], alpha[DEC_MAX_ROWS];
    for (int r = 0; r < group; r++) {
        const float *qp = a->q + b * a->q_strides[0] +
                          (int64_t)(kvh * group + r) * a->q_strides[1] + qi * a->q_strides[2];
        for (int d = 0; d < dv; d++) {
            q[r][d] = vload(qp + 8 * d) * qscale;
            vstore(o[r] + 8 * d, vsplat(0.0f));
        }
        m[r] = -__builtin_inff();
        lsum[r] = vsplat(0.0f);
    }
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int32_t j = j0; j < j1; j += 8) {
        const float *key[8], *value[8];
        const int n = block_keys(a, kp, vp, j, j1, key, value);
        const v8i valid = lane < vsplati(n);
        for (int r = 0; r < group; r++) {
            v8f acc[8];
            for (int k = 0; k < 8; k++) acc[k] = q[r][0] * vload(key[k]);
            for (int d = 1; d < dv; d++)
                for (int k = 0; k < 8; k++) acc[k] += q[r][d] * vload(key[k] + 8 * d);
            const v8f s = vselect(valid, hsum8x8(acc), vsplat(-__builtin_inff()));
            const float block_top = hmax(s);
            const float top = block_top > m[r] ? block_top : m[r];
            const v8f p = vexp2(s - top);
            /* 1 exactly where the maximum stays (2^0 is 1), 0 on the first block */
            alpha[r] = top == m[r] ? 1.0f : vexp2((v8f){m[r] - top})[0];
            m[r] = top;
            lsum[r] = lsum[r] * alpha[r] + p;
            vstore(w[r], p);
        }
        int s = 0;
        for (; s + 2 <= dv; s += 2) values_rows(o, w, alpha, value, group, s, 2);
        if (s < dv) values_rows(o, w, alpha, value, group, s, 1);
    }
    for (int r = 0; r < group; r++) {
        float *out = part + (int64_t)r * (dim + 2);
        out[0] = m[r];
        out[1] = hsum(lsum[r]);
        memcpy(out + 2, o[r], (size_t)dim * sizeof(float));
    }
}

/* decode_chunk_dim (or, `tiled`, tiled_chunk_dim) with the head width a constant where it
 * is a common one (64, 128): its loops then unroll and a row's vectors stay in registers */
INLINE void decode_chunk(const AttnArgs *a, int group, int b, int qi, int kvh, int32_t j0,
                         int32_t j1, float *part, const int tiled) {
    const int dv = a->dim == 64 ? 8 : a->dim == 128 ? 16 : a->dim / 8;
    if (tiled)
        tiled_chunk_dim(a, group, b, qi, kvh, j0, j1, part, dv);
    else
        decode_chunk_dim(a, group, b, qi, kvh, j0, j1, part, dv);
}

/* The query position of work item `item` (the plans are in order of their first item). */
INLINE int item_query(const AttnArgs *a, const QueryPlan *plan, int64_t item) {
    int l = 0;
    while (l + 1 < a->length && plan[l + 1].first <= item) l++;
    return l;
}

/* Work item `item` as (query position l, row b, KV head kvh, chunk ci). */
typedef struct {
    int l, b, kvh, ci;
} Place;

static Place place(const AttnArgs *a, const QueryPlan *plan, int64_t item) {
    const int l = item_query(a, plan, item);
    const int64_t local = item - plan[l].first;
    const int64_t bk = local / plan[l].chunks;
    return (Place){l, (int)(bk / a->kv_heads), (int)(bk % a->kv_heads),
                   (int)(local % plan[l].chunks)};
}

/* An empty partial result where a chunk has no keys left: 0 after the item's rows wrote
 * it, else 1. */
static int nonempty(Chunk *c, int group) {
    if (c->j0 < c->j1) return 1;
    for (int r = 0; r < group; r++) {
        c->dst[(int64_t)r * (c->a->dim + 2)] = -__builtin_inff();
        c->dst[(int64_t)r * (c->a->dim + 2) + 1] = 0.0f;
    }
    return 0;
}

/* Work item `item` = (query position, b, KV head, chunk): its keys, clipped to the row's
 * [start, the query's own column]. */
static int locate_item(const AttnArgs *a, const QueryPlan *plan, int group, float *part,
                       int64_t item, Chunk *c) {
    const Place at = place(a, plan, item);
    const int l = at.l, b = at.b, kvh = at.kvh;
    const int64_t span = plan[l].chunk;
    int32_t start = a->starts != NULL ? a->starts[b] : 0;
    const int32_t seen = a->keys - a->length + l + 1;
    if (a->window > 0 && seen - a->window > start) start = seen - a->window;
    const int32_t j0 = start + at.ci * (int32_t)span;
    *c = (Chunk){a, b, l, kvh, j0, j0 + span < seen ? (int32_t)(j0 + span) : seen,
                 part + item * (int64_t)group * (a->dim + 2)};
    return nonempty(c, group);
}

/* The same for rows of their own (AttnRows): row b is its own one-row AttnArgs. */
static int locate_rows_item(const AttnArgs *a, const QueryPlan *plan, int group, float *part,
                            int64_t item, Chunk *c) {
    const AttnRows *ra = (const AttnRows *)a;
    const Place at = place(a, plan, item);
    const int l = at.l, b = at.b, kvh = at.kvh;
    const int64_t span = plan[l].chunk;
    const AttnArgs *row = &ra->rows[b];
    const int32_t seen = row->keys - a->length + l + 1;
    const int32_t start = a->window > 0 && seen > a->window ? seen - a->window : 0;
    const int32_t j0 = start + at.ci * (int32_t)span;
    *c = (Chunk){row, 0, l, kvh, j0, j0 + span < seen ? (int32_t)(j0 + span) : seen,
                 part + item * (int64_t)group * (a->dim + 2)};
    return nonempty(c, group);
}

/* the chunk code for each instruction set, the item located by either layout's function */
static void chunk_generic(const Chunk *c, int group) {
    decode_chunk(c->a, group, c->b, c->qi, c->kvh, c->j0, c->j1, c->dst, 0);
}

#if HAVE_X86_DISPATCH
TARGET_AVX2 static void chunk_avx2(const Chunk *c, int group) {
    decode_chunk(c->a, group, c->b, c->qi, c->kvh, c->j0, c->j1, c->dst, 1);
}
#endif

static void *decode_worker(void *arg) {
    DecodeJob *job = arg;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (item >= job->items) break;
        Chunk c;
        if (job->locate(job->a, job->plan, job->group, job->part, item, &c))
            job->chunk(&c, job->group);
    }
    return NULL;
}

/* The chunks' partial results of (query position l, b, KV head) merged into its rows of
 * out. */
static void merge(const DecodeJob *job, int l, int64_t bk) {
    const AttnArgs *a = job->a;
    const QueryPlan *p = &job->plan[l];
    const int group = job->group, dim = a->dim;
    const int b = (int)(bk / a->kv_heads), kvh = (int)(bk % a->kv_heads);
    const int64_t stride = (int64_t)group * (dim + 2);
    const float *parts = job->part + (p->first + bk * p->chunks) * stride;
    for (int r = 0; r < group; r++) {
        float top = -__builtin_inff();
        for (int c = 0; c < p->chunks; c++) {
            const float mc = parts[c * stride + (int64_t)r * (dim + 2)];
            top = mc > top ? mc : top;
        }
        float *out = a->out + b * a->o_strides[0] +
                     (int64_t)(kvh * group + r) * a->o_strides[1] + l * a->o_strides[2];
        for (int d = 0; d < dim; d++) out[d] = 0.0f;
        float total = 0.0f;
        for (int c = 0; c < p->chunks; c++) {
            const float *q = parts + c * stride + (int64_t)r * (dim + 2);
            if (q[1] == 0.0f) continue;
            const float w = exp2f(q[0] - top);
            total += q[1] * w;
            for (int d = 0; d < dim; d++) out[d] += q[2 + d] * w;
        }
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int d = 0; d < dim; d++) out[d] *= inv;
    }
}

/* Plans each query position's chunks as a one-query step over its keys would split them
 * (`keys`: the longest row's, from its first key; enough chunks for every thread to have
 * several, none shorter than DEC_MIN_CHUNK, each a whole number of 8-key blocks), runs
 * the items on the threads (in AVX2 where the CPU has it) and merges them. */
static int run_decode(const AttnArgs *a, int32_t keys, int threads, LocateFn locate) {
    const int64_t heads = (int64_t)a->batch * a->kv_heads;
    DecodeJob job = {0};
    job.a = a;
    job.group = a->q_heads / a->kv_heads;
    for (int l = 0; l < a->length; l++) {
        int32_t span = keys - a->length + l + 1;
        if (a->window > 0 && span > a->window) span = a->window;
        int64_t chunks = (4 * (int64_t)threads + heads - 1) / heads;
        const int64_t most = (span + DEC_MIN_CHUNK - 1) / DEC_MIN_CHUNK;
        chunks = chunks < most ? chunks : most;
        chunks = chunks < 1 ? 1 : chunks;
        int32_t chunk = (int32_t)((span + chunks - 1) / chunks);
        job.plan[l].chunk = (chunk + 7) / 8 * 8;
        job.plan[l].chunks = (int)chunks;
        job.plan[l].first = job.items;
        job.items += heads * chunks;
    }
    job.part = malloc((size_t)job.items * job.group * (a->dim + 2) * sizeof(float));
    if (job.part == NULL) return 2;
    job.locate = locate;
    job.chunk = chunk_generic;
#if HAVE_X86_DISPATCH
    if (use_avx2(a->generic)) job.chunk = chunk_avx2;
#endif
    run_threads(decode_worker, &job, threads < job.items ? threads : (int)job.items);
    for (int l = 0; l < a->length; l++)
        for (int64_t bk = 0; bk < heads; bk++) merge(&job, l, bk);
    free(job.part);
    return 0;
}

EXPORT int mlxgw_attention_decode(const AttnArgs *a) {
    if (a->length < 1 || a->length > DEC_MAX_LENGTH || (a->length > 1 && !a->causal) ||
        a->batch < 1 || a->kv_heads < 1 || a->q_heads % a->kv_heads != 0 ||
        a->q_heads / a->kv_heads > DEC_MAX_ROWS || a->dim < 8 || a->dim % 8 != 0 ||
        a->dim > DEC_MAX_DIM || a->keys < a->length)
        return 1;
    int32_t first_key = a->keys; /* the earliest first key of any row */
    for (int32_t b = 0; b < a->batch; b++) {
        const int32_t start = a->starts != NULL ? a->starts[b] : 0;
        if (start < 0 || start > a->keys - a->length) return 1;
        first_key = start < first_key ? start : first_key;
    }
    const int threads = a->threads < 1 ? 1 : a->threads;
    return run_decode(a, a->keys - first_key, threads, locate_item);
}

/* ------------------------------------------------------------ rows of their own ---- */

/* A running batch whose rows keep their keys and values in buffers of their own
 * (runtime/cache/rows.py): row b is `rows[b]`, a one-row AttnArgs (its q, k, v and out
 * at row b, `keys` its own length). The chunks are planned as mlxgw_attention_decode
 * plans the same rows left-padded in one buffer (from the longest row's keys, each row's
 * chunks from its own first key), so every row gets the same bits it would get there. */
EXPORT int mlxgw_attention_decode_rows(const AttnRows *ra) {
    const AttnArgs *a = &ra->base;
    if (a->length < 1 || a->length > DEC_MAX_LENGTH || (a->length > 1 && !a->causal) ||
        a->batch < 1 || a->kv_heads < 1 || a->q_heads % a->kv_heads != 0 ||
        a->q_heads / a->kv_heads > DEC_MAX_ROWS || a->dim < 8 || a->dim % 8 != 0 ||
        a->dim > DEC_MAX_DIM || ra->rows == NULL)
        return 1;
    int32_t longest = 0;
    for (int32_t b = 0; b < a->batch; b++) {
        const AttnArgs *row = &ra->rows[b];
        if (row->keys < a->length || row->dim != a->dim || row->kv_heads != a->kv_heads)
            return 1;
        longest = row->keys > longest ? row->keys : longest;
    }
    const int threads = a->threads < 1 ? 1 : a->threads;
    return run_decode(a, longest, threads, locate_rows_item);
}
