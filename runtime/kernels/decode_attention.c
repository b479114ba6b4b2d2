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
 */

#include <math.h>

#include "common.h"
#include "kernels.h"

enum { DEC_MAX_ROWS = 16, DEC_MAX_DIM = 256, DEC_MIN_CHUNK = 256, DEC_MAX_LENGTH = 16 };

typedef struct {
    int32_t chunk;  /* keys per chunk */
    int chunks;     /* chunks per (b, KV head) */
    int64_t first;  /* the first work item of this query position */
} QueryPlan;

typedef struct {
    const AttnArgs *a;
    int group;                   /* rows per KV head */
    QueryPlan plan[DEC_MAX_LENGTH];
    float *part;                 /* per item and row: max, sum, then dim output floats */
    int64_t next, items;
    void (*fn)(const AttnArgs *, const QueryPlan *, int, float *, int64_t);
} DecodeJob;

/* One chunk: rows of (b, query qi, KV head) against keys [j0, j1); writes max, sum, output. */
INLINE void decode_chunk(const AttnArgs *a, int group, int b, int qi, int kvh, int32_t j0,
                         int32_t j1, float *part) {
    const int dim = a->dim, dv = dim / 8;
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
        const int n = j1 - j < 8 ? j1 - j : 8;
        const float *kb = kp + j * a->k_strides[2], *vb = vp + j * a->v_strides[2];
        for (int r = 0; r < group; r++) {
            float s[8];
            for (int k = 0; k < 8; k++) {
                if (k >= n) {
                    s[k] = -__builtin_inff();
                    continue;
                }
                const float *key = kb + k * a->k_strides[2];
                v8f acc = q[r][0] * vload(key);
                for (int d = 1; d < dv; d++) acc += q[r][d] * vload(key + 8 * d);
                s[k] = hsum(acc);
            }
            float top = m[r];
            for (int k = 0; k < n; k++) top = s[k] > top ? s[k] : top;
            const v8f p = vexp2(vload(s) - vsplat(top));
            const float alpha = vexp2(vsplat(m[r] - top))[0]; /* 0 on the first block */
            m[r] = top;
            l[r] = l[r] * alpha + hsum(p);
            for (int d = 0; d < dv; d++) o[r][d] *= vsplat(alpha);
            for (int k = 0; k < n; k++) {
                const v8f pk = vsplat(p[k]);
                const float *value = vb + k * a->v_strides[2];
                for (int d = 0; d < dv; d++) o[r][d] += pk * vload(value + 8 * d);
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

/* The query position of work item `item` (the plans are in order of their first item). */
INLINE int item_query(const AttnArgs *a, const QueryPlan *plan, int64_t item) {
    int l = 0;
    while (l + 1 < a->length && plan[l + 1].first <= item) l++;
    return l;
}

/* Work item `item` = (query position, b, KV head, chunk): its keys, clipped to the row's
 * [start, the query's own column]. */
INLINE void decode_item(const AttnArgs *a, const QueryPlan *plan, int group, float *part,
                        int64_t item) {
    const int l = item_query(a, plan, item);
    const QueryPlan *p = &plan[l];
    const int64_t local = item - p->first;
    const int64_t bk = local / p->chunks;
    const int c = (int)(local % p->chunks);
    const int b = (int)(bk / a->kv_heads), kvh = (int)(bk % a->kv_heads);
    const int32_t start = a->starts != NULL ? a->starts[b] : 0;
    const int32_t seen = a->keys - a->length + l + 1;
    int32_t j0 = start + c * p->chunk, j1 = j0 + p->chunk;
    if (j1 > seen) j1 = seen;
    float *dst = part + item * (int64_t)group * (a->dim + 2);
    if (j0 >= j1) { /* nothing left for this chunk: an empty partial result */
        for (int r = 0; r < group; r++) {
            dst[(int64_t)r * (a->dim + 2)] = -__builtin_inff();
            dst[(int64_t)r * (a->dim + 2) + 1] = 0.0f;
        }
        return;
    }
    decode_chunk(a, group, b, l, kvh, j0, j1, dst);
}

static void decode_generic(const AttnArgs *a, const QueryPlan *plan, int group, float *part,
                           int64_t item) {
    decode_item(a, plan, group, part, item);
}

#if HAVE_X86_DISPATCH
TARGET_AVX2 static void decode_avx2(const AttnArgs *a, const QueryPlan *plan, int group,
                                    float *part, int64_t item) {
    decode_item(a, plan, group, part, item);
}
#endif

static void *decode_worker(void *arg) {
    DecodeJob *job = arg;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (item >= job->items) break;
        job->fn(job->a, job->plan, job->group, job->part, item);
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
    const int64_t heads = (int64_t)a->batch * a->kv_heads;
    DecodeJob job = {0};
    job.a = a;
    job.group = a->q_heads / a->kv_heads;
    for (int l = 0; l < a->length; l++) {
        /* as a one-query step over this query's keys would split them: enough chunks for
         * every thread to have several, none shorter than DEC_MIN_CHUNK */
        const int32_t longest = a->keys - a->length + l + 1 - first_key;
        int64_t chunks = (4 * (int64_t)threads + heads - 1) / heads;
        const int64_t most = (longest + DEC_MIN_CHUNK - 1) / DEC_MIN_CHUNK;
        chunks = chunks < most ? chunks : most;
        chunks = chunks < 1 ? 1 : chunks;
        int32_t chunk = (int32_t)((longest + chunks - 1) / chunks);
        job.plan[l].chunk = (chunk + 7) / 8 * 8;
        job.plan[l].chunks = (int)chunks;
        job.plan[l].first = job.items;
        job.items += heads * chunks;
    }
    job.part = malloc((size_t)job.items * job.group * (a->dim + 2) * sizeof(float));
    if (job.part == NULL) return 2;
    job.fn = decode_generic;
#if HAVE_X86_DISPATCH
    if (use_avx2(a->generic)) job.fn = decode_avx2;
#endif
    run_threads(decode_worker, &job, threads < job.items ? threads : (int)job.items);
    for (int l = 0; l < a->length; l++)
        for (int64_t bk = 0; bk < heads; bk++) merge(&job, l, bk);
    free(job.part);
    return 0;
}
