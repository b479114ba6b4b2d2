/* Quantized matrix products with few rows (decode steps) for MLX's affine quantization.
 *
 *   mlxgw_quantized_matmul: out[m, n] = sum_k x[m, k] * (s[n, g] * q[n, k] + b[n, g]),
 *   g = k / group_size, the layout mx.quantize writes: w uint32 [N, K * bits / 32], each
 *   row a little-endian bit stream (value i in bits i*bits .. i*bits+bits-1), scales and
 *   biases [N, K / gs] in float32, float16 or bfloat16 (SCALE_* below).
 *   mlxgw_dequantize: the float32 rows n0..n1 of the same weight (prompt-sized products
 *   dequantize a tile of features and hand it to the BLAS).
 *
 * MLX's own CPU quantized matmul dequantizes every weight on one thread with scalar code.
 * Here the output features are split across threads; each thread takes 4 features at a
 * time, unpacks a slice of their weights once into a small float buffer that stays in L1
 * (s * (q - 2^(bits-1)), the scale folded in), and runs every row of x against it, so each
 * weight word is read from memory and unpacked once per call whatever the row count. The
 * bias needs no per-weight work: sum_k x * b = b * sum_k x over a group, so it is one dot
 * product per output of the biases with the rows' group sums of x (computed once per call).
 * Centring q (q - 2^(bits-1), the bias adjusted by s * 2^(bits-1)) keeps the two terms from
 * cancelling, which would cost precision with 8-bit values.
 */

#include "common.h"
#include "quantized.h"

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint64_t v4q __attribute__((vector_size(32)));

#if defined(__clang__)
#define SHUFFLE8(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#define SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE8(v, ...) __builtin_shuffle(v, (v8u){__VA_ARGS__})
#define SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, (v8u){__VA_ARGS__})
#endif

/* QNB features x QROWS rows per register block: 8 accumulators, 2 x and 1 q input. QKC
 * values of each of the QNB features per unpacked slice: 8 KB of floats. QCHUNK features
 * per work item. */
enum { QNB = 4, QROWS = 2, QKC = 512, QCHUNK = 16 };

/* the element type of scales and biases */
enum { SCALE_F32 = 0, SCALE_F16 = 1, SCALE_BF16 = 2 };

typedef struct {
    const float *x;       /* [rows, K] */
    const uint32_t *w;    /* [N, K * bits / 32] */
    const void *scales;   /* [N, K / gs], stype */
    const void *biases;   /* [N, K / gs], stype */
    float *out;           /* [rows, N] */
    const float *xsum;    /* [rows, K / gs]: sum of x over each group */
    int64_t rows, depth, cols, groups;
    int32_t bits, group_size, stype;
    int32_t sym; /* no biases (MLXGW_SYMMETRIC): every bias is -half * scale */
} QArgs;

typedef struct {
    float *qf;   /* [QNB, QKC]: the unpacked, scaled slice */
    float *tot;  /* [rows, QNB, 8]: vector accumulators of s * sum x * (q - half) */
    float *sc;   /* [QNB, groups]: the block's scales as float32 */
    float *bias; /* [QNB, groups]: its biases as float32, adjusted for the centring */
} QScratch;

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 1023u, bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13; /* inf, nan */
    } else if (exp != 0) {
        bits = sign | (exp + 112) << 23 | man << 13;
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int shift = 0;
        while (!(man & 1024u)) {
            man <<= 1;
            shift++;
        }
        bits = sign | (uint32_t)(113 - shift) << 23 | (man & 1023u) << 13;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* dst[0:n] = src[0:n] as float32 */
static void scales_to_float(int stype, const void *src, int64_t n, float *dst) {
    if (stype == SCALE_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (stype == SCALE_F16) {
        const uint16_t *h = src;
        for (int64_t i = 0; i < n; i++) dst[i] = half_to_float(h[i]);
    } else {
        const uint16_t *h = src;
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(dst + i, &bits, sizeof(float));
        }
    }
}

INLINE const void *scale_row(int stype, const void *base, int64_t row, int64_t groups) {
    return (const char *)base + row * groups * (stype == SCALE_F32 ? 4 : 2);
}

/* 8 consecutive values from element e of one feature's packed row, centred. bits is a
 * constant after inlining. */
INLINE v8f unpack8(int bits, const uint32_t *wrow, uint64_t e) {
    v8u v;
    if (bits != 4 && bits != 8) {
        /* any other width: the 8 values fill `bits` bytes of the row's bit stream */
        uint64_t u = 0;
        memcpy(&u, (const uint8_t *)wrow + e / 8 * (uint64_t)bits, (size_t)bits);
        const uint64_t b = (uint64_t)bits, mask = (1u << bits) - 1u;
        v4q all = (v4q){u, u, u, u};
        v4q lo = (all >> (v4q){0, b, 2 * b, 3 * b}) & mask;
        v4q hi = (all >> (v4q){4 * b, 5 * b, 6 * b, 7 * b}) & mask;
        /* the low 32-bit half of each 64-bit lane (a narrowing conversion would be
         * scalar inserts) */
        v = SHUFFLE16((v8u)lo, (v8u)hi, 0, 2, 4, 6, 8, 10, 12, 14);
    } else if (bits == 4) {
        uint32_t a = wrow[e / 8];
        v = ((v8u){a, a, a, a, a, a, a, a} >> (v8u){0, 4, 8, 12, 16, 20, 24, 28}) & 15u;
    } else {
        /* both words in every 64-bit lane (a, b as 32-bit lanes on a little-endian CPU), one
         * byte shift per pair of lanes: the values come out as 0 4 1 5 2 6 3 7, and a lane
         * permutation puts them in order (GCC turns a byte-to-int vector conversion into
         * scalar inserts, several times slower) */
        uint64_t ab = (uint64_t)wrow[e / 4] | (uint64_t)wrow[e / 4 + 1] << 32;
        v = ((v8u)(v4q){ab, ab, ab, ab} >> (v8u){0, 0, 8, 8, 16, 16, 24, 24}) & 255u;
        v = SHUFFLE8(v, 0, 2, 4, 6, 1, 3, 5, 7);
    }
    return __builtin_convertvector((v8i)v, v8f) - vsplat((float)(1 << (bits - 1)));
}

/* dst[0:kc] = s * (q - half) for values k0 .. k0+kc of one feature (kc a multiple of gs) */
INLINE void unpack_slice(int bits, int gs, const uint32_t *wrow, const float *srow, int64_t k0,
                         int kc, float *dst) {
    for (int k = 0; k < kc; k += gs) {
        v8f s = vsplat(srow[(k0 + k) / gs]);
        for (int i = 0; i < gs; i += 8) vstore(dst + k + i, unpack8(bits, wrow, k0 + k + i) * s);
    }
}

/* tot[r][j] += x[r, k0:k0+kc] * qf[j] for r < mr rows and j < nb features (constants after
 * inlining, so the accumulators live in registers) */
INLINE void dot_block(int nb, int mr, const float *qf, const float *x, int64_t depth, int64_t k0,
                      int kc, float *tot) {
    v8f acc[QROWS][QNB];
    UNROLL for (int r = 0; r < mr; r++) UNROLL for (int j = 0; j < nb; j++) acc[r][j] =
        vload(tot + (r * QNB + j) * 8);
    const float *xr = x + k0;
    for (int k = 0; k < kc; k += 8) {
        v8f xv[QROWS];
        UNROLL for (int r = 0; r < mr; r++) xv[r] = vload(xr + r * depth + k);
        UNROLL for (int j = 0; j < nb; j++) {
            v8f q = vload(qf + j * QKC + k);
            UNROLL for (int r = 0; r < mr; r++) acc[r][j] += q * xv[r];
        }
    }
    UNROLL for (int r = 0; r < mr; r++) UNROLL for (int j = 0; j < nb; j++)
        vstore(tot + (r * QNB + j) * 8, acc[r][j]);
}

INLINE float dotf(const float *a, const float *b, int64_t n) {
    int64_t vec = n & ~(int64_t)7;
    v8f acc = vsplat(0.0f);
    for (int64_t i = 0; i < vec; i += 8) acc += vload(a + i) * vload(b + i);
    float t = hsum(acc);
    for (int64_t i = vec; i < n; i++) t += a[i] * b[i];
    return t;
}

/* out[:, n:n+nb] */
INLINE void features(int bits, int nb, const QArgs *a, QScratch *s, int64_t n) {
    const int gs = a->group_size;
    const int64_t depth = a->depth, groups = a->groups, words = depth * bits / 32;
    const float half = (float)(1 << (bits - 1));
    memset(s->tot, 0, (size_t)a->rows * QNB * 8 * sizeof(float));
    for (int j = 0; j < nb; j++) {
        float *sc = s->sc + j * groups, *bi = s->bias + j * groups;
        scales_to_float(a->stype, scale_row(a->stype, a->scales, n + j, groups), groups, sc);
        if (a->sym) { /* -half * s, centred: 0 */
            memset(bi, 0, (size_t)groups * sizeof(float));
            continue;
        }
        scales_to_float(a->stype, scale_row(a->stype, a->biases, n + j, groups), groups, bi);
        for (int64_t g = 0; g < groups; g++) bi[g] += half * sc[g];
    }
    for (int64_t k0 = 0; k0 < depth; k0 += QKC) {
        int kc = depth - k0 < QKC ? (int)(depth - k0) : QKC;
        UNROLL for (int j = 0; j < nb; j++)
            unpack_slice(bits, gs, a->w + (n + j) * words, s->sc + j * groups, k0, kc,
                         s->qf + j * QKC);
        int64_t m = 0;
        for (; m + QROWS <= a->rows; m += QROWS)
            dot_block(nb, QROWS, s->qf, a->x + m * depth, depth, k0, kc, s->tot + m * QNB * 8);
        if (m < a->rows) dot_block(nb, 1, s->qf, a->x + m * depth, depth, k0, kc,
                                   s->tot + m * QNB * 8);
    }
    for (int j = 0; j < nb; j++)
        for (int64_t m = 0; m < a->rows; m++)
            a->out[m * a->cols + n + j] = hsum(vload(s->tot + (m * QNB + j) * 8)) +
                                          dotf(s->bias + j * groups, a->xsum + m * groups, groups);
}

INLINE void feature_range(int bits, const QArgs *a, QScratch *s, int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + QNB <= n1; n += QNB) features(bits, QNB, a, s, n);
    switch (n1 - n) {
    case 3: features(bits, 3, a, s, n); break;
    case 2: features(bits, 2, a, s, n); break;
    case 1: features(bits, 1, a, s, n); break;
    default: break;
    }
}

/* bits is a constant in each call, so each width gets its own unpacking code */
#define BY_BITS(a, s, n0, n1)                                                                \
    switch ((a)->bits) {                                                                     \
    case 2: feature_range(2, a, s, n0, n1); break;                                           \
    case 3: feature_range(3, a, s, n0, n1); break;                                           \
    case 4: feature_range(4, a, s, n0, n1); break;                                           \
    case 5: feature_range(5, a, s, n0, n1); break;                                           \
    case 6: feature_range(6, a, s, n0, n1); break;                                           \
    default: feature_range(8, a, s, n0, n1); break;                                          \
    }

static void qmm_generic(const QArgs *a, QScratch *s, int64_t n0, int64_t n1) {
    BY_BITS(a, s, n0, n1)
}

#if HAVE_X86_DISPATCH
TARGET_AVX2 static void qmm_avx2(const QArgs *a, QScratch *s, int64_t n0, int64_t n1) {
    BY_BITS(a, s, n0, n1)
}
#endif

typedef struct {
    const QArgs *args;
    void (*fn)(const QArgs *, QScratch *, int64_t, int64_t);
    int64_t next;  /* next work item (`chunk` features), taken with an atomic add */
    int64_t chunk; /* span_items: a multiple of QCHUNK */
    int failed;    /* a worker could not allocate its scratch */
} QJob;

static void *qmm_worker(void *arg) {
    QJob *job = arg;
    const QArgs *a = job->args;
    QScratch s;
    s.qf = malloc((size_t)QNB * QKC * sizeof(float));
    s.tot = malloc((size_t)a->rows * QNB * 8 * sizeof(float));
    s.sc = malloc((size_t)QNB * a->groups * sizeof(float));
    s.bias = malloc((size_t)QNB * a->groups * sizeof(float));
    if (!s.qf || !s.tot || !s.sc || !s.bias) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    } else {
        for (;;) {
            int64_t start = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED) * job->chunk;
            if (start >= a->cols) break;
            int64_t end = start + job->chunk < a->cols ? start + job->chunk : a->cols;
            job->fn(a, &s, start, end);
        }
    }
    free(s.qf);
    free(s.tot);
    free(s.sc);
    free(s.bias);
    return NULL;
}

static int valid_format(int32_t bits, int32_t group_size, int32_t stype) {
    return bits >= 2 && bits <= 8 && bits != 7 &&
           (group_size == 32 || group_size == 64 || group_size == 128) &&
           stype >= SCALE_F32 && stype <= SCALE_BF16;
}

/* x [rows, K] float32, w/scales/biases as mx.quantize writes them for a [N, K] weight
 * (scales and biases of type stype), out [rows, N] float32; bits 2, 3, 4, 5, 6 or 8 (4 and
 * 8 have vector unpacking), group_size 32, 64 or 128, K a multiple of group_size;
 * generic: the portable code even where AVX2 is available (tests). Returns 0 on success,
 * 1 for arguments it does not handle, 2 when out of memory. */
EXPORT int mlxgw_quantized_matmul(const float *x, const uint32_t *w, const void *scales,
                                  const void *biases, float *out, int64_t rows,
                                  int64_t in_features, int64_t out_features, int32_t bits,
                                  int32_t group_size, int32_t stype, int32_t threads,
                                  int32_t generic) {
    if (stype & MLXGW_LANES) { /* this kernel reads the standard layout */
        MlxgwStandard st;
        if (out_features % 16 != 0 || in_features % group_size != 0 || group_size < 1)
            return 1;
        if (mlxgw_lanes_standard(w, scales, biases, stype, 0, out_features, in_features, bits,
                                 group_size, &st) != 0)
            return 2;
        const int status = mlxgw_quantized_matmul(
            x, st.w, st.scales, st.biases, out, rows, in_features, out_features, bits,
            group_size, stype & ~MLXGW_LANES, threads, generic);
        free(st.block);
        return status;
    }
    const int32_t sym = (stype & MLXGW_SYMMETRIC) != 0;
    stype &= ~MLXGW_SYMMETRIC;
    if (!valid_format(bits, group_size, stype) || rows < 1 || out_features < 1 ||
        in_features < group_size || in_features % group_size != 0)
        return 1;
    QArgs a = {x, w, scales, biases, out, NULL, rows, in_features, out_features,
               in_features / group_size, bits, group_size, stype, sym};
    float *xsum = malloc((size_t)rows * a.groups * sizeof(float));
    if (!xsum) return 2;
    for (int64_t i = 0; i < rows * a.groups; i++) {
        const float *xp = x + i * group_size; /* groups are consecutive along each row */
        v8f acc = vsplat(0.0f);
        for (int k = 0; k < group_size; k += 8) acc += vload(xp + k);
        xsum[i] = hsum(acc);
    }
    a.xsum = xsum;
    if (threads < 1) threads = 1;
    QJob job = {&a, qmm_generic, 0, span_items(out_features, threads, QCHUNK), 0};
#if HAVE_X86_DISPATCH
    if (use_avx2(generic)) job.fn = qmm_avx2;
#else
    (void)generic;
#endif
    int64_t items = (out_features + job.chunk - 1) / job.chunk;
    if (threads > items) threads = (int32_t)items;
    run_threads(qmm_worker, &job, threads);
    free(xsum);
    return job.failed ? 2 : 0;
}

/* -- dequantization (prompt-sized products) ---------------------------------------------- */

typedef struct {
    const QArgs *args; /* x, xsum, out and rows unused; out is dst */
    float *dst;        /* [n1 - n0, K] */
    int64_t n0, n1, next, chunk;
    void (*fn)(const QArgs *, float *, int64_t, int64_t, float *);
    int failed;
} DJob;

/* rows n .. n + count of the weight into dst, using sc as [groups] scratch */
INLINE void dequant_rows(int bits, const QArgs *a, float *dst, int64_t n, int64_t count,
                         float *sc) {
    const int gs = a->group_size;
    const int64_t depth = a->depth, groups = a->groups, words = depth * bits / 32;
    for (int64_t r = 0; r < count; r++) {
        float *bi = sc + groups;
        scales_to_float(a->stype, scale_row(a->stype, a->scales, n + r, groups), groups, sc);
        if (!a->sym)
            scales_to_float(a->stype, scale_row(a->stype, a->biases, n + r, groups), groups, bi);
        const uint32_t *wrow = a->w + (n + r) * words;
        const float half = (float)(1 << (bits - 1));
        float *out = dst + r * depth;
        for (int64_t g = 0; g < groups; g++) {
            v8f s = vsplat(sc[g]), b = vsplat(a->sym ? 0.0f : bi[g] + half * sc[g]);
            for (int i = 0; i < gs; i += 8) {
                int64_t k = g * gs + i;
                vstore(out + k, unpack8(bits, wrow, (uint64_t)k) * s + b);
            }
        }
    }
}

#define DEQUANT_BY_BITS(a, dst, n, count, sc)                                                \
    switch ((a)->bits) {                                                                     \
    case 2: dequant_rows(2, a, dst, n, count, sc); break;                                    \
    case 3: dequant_rows(3, a, dst, n, count, sc); break;                                    \
    case 4: dequant_rows(4, a, dst, n, count, sc); break;                                    \
    case 5: dequant_rows(5, a, dst, n, count, sc); break;                                    \
    case 6: dequant_rows(6, a, dst, n, count, sc); break;                                    \
    default: dequant_rows(8, a, dst, n, count, sc); break;                                   \
    }

static void dq_generic(const QArgs *a, float *dst, int64_t n, int64_t count, float *sc) {
    DEQUANT_BY_BITS(a, dst, n, count, sc)
}

#if HAVE_X86_DISPATCH
TARGET_AVX2 static void dq_avx2(const QArgs *a, float *dst, int64_t n, int64_t count,
                                float *sc) {
    DEQUANT_BY_BITS(a, dst, n, count, sc)
}
#endif

static void *dq_worker(void *arg) {
    DJob *job = arg;
    float *sc = malloc((size_t)2 * job->args->groups * sizeof(float));
    if (!sc) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
        return NULL;
    }
    for (;;) {
        int64_t start = job->n0 + __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED) * job->chunk;
        if (start >= job->n1) break;
        int64_t count = job->n1 - start < job->chunk ? job->n1 - start : job->chunk;
        job->fn(job->args, job->dst + (start - job->n0) * job->args->depth, start, count, sc);
    }
    free(sc);
    return NULL;
}

/* dst [n1 - n0, K] float32 = rows n0 .. n1 of the weight (w, scales, biases as for
 * mlxgw_quantized_matmul, out_features N). Returns 0, 1 (arguments) or 2 (memory). */
EXPORT int mlxgw_dequantize(const uint32_t *w, const void *scales, const void *biases,
                            float *dst, int64_t n0, int64_t n1, int64_t in_features,
                            int64_t out_features, int32_t bits, int32_t group_size,
                            int32_t stype, int32_t threads, int32_t generic) {
    if (stype & MLXGW_LANES) {
        MlxgwStandard st;
        if (n0 < 0 || n1 > out_features || n0 >= n1 || group_size < 1 ||
            in_features % group_size != 0)
            return 1;
        if (mlxgw_lanes_standard(w, scales, biases, stype, n0, n1, in_features, bits,
                                 group_size, &st) != 0)
            return 2;
        const int status = mlxgw_dequantize(st.w, st.scales, st.biases, dst, n0 - st.base,
                                            n1 - st.base, in_features, st.end - st.base, bits,
                                            group_size, stype & ~MLXGW_LANES, threads, generic);
        free(st.block);
        return status;
    }
    const int32_t sym = (stype & MLXGW_SYMMETRIC) != 0;
    stype &= ~MLXGW_SYMMETRIC;
    if (!valid_format(bits, group_size, stype) || n0 < 0 || n1 > out_features || n0 >= n1 ||
        in_features < group_size || in_features % group_size != 0)
        return 1;
    QArgs a = {NULL, w, scales, biases, NULL, NULL, 0, in_features, out_features,
               in_features / group_size, bits, group_size, stype, sym};
    if (threads < 1) threads = 1;
    DJob job = {&a, dst, n0, n1, 0, span_items(n1 - n0, threads, QCHUNK), dq_generic, 0};
#if HAVE_X86_DISPATCH
    if (use_avx2(generic)) job.fn = dq_avx2;
#else
    (void)generic;
#endif
    int64_t items = (n1 - n0 + job.chunk - 1) / job.chunk;
    if (threads > items) threads = (int32_t)items;
    run_threads(dq_worker, &job, threads);
    return job.failed ? 2 : 0;
}
