/* Quantized matrix products with few rows (decode steps) for MLX's affine quantization.
 *
 *   mlxgw_quantized_matmul: out[m, n] = sum_k x[m, k] * (s[n, g] * q[n, k] + b[n, g]),
 *   g = k / group_size, the layout mx.quantize writes: w uint32 [N, K * bits / 32] with
 *   the first value in the lowest bits of each word, scales and biases float32 [N, K / gs].
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

typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint64_t v4q __attribute__((vector_size(32)));

#if defined(__clang__)
#define SHUFFLE8(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SHUFFLE8(v, ...) __builtin_shuffle(v, (v8u){__VA_ARGS__})
#endif

/* QNB features x QROWS rows per register block: 8 accumulators, 2 x and 1 q input. QKC
 * values of each of the QNB features per unpacked slice: 8 KB of floats. QCHUNK features
 * per work item. */
enum { QNB = 4, QROWS = 2, QKC = 512, QCHUNK = 16 };

typedef struct {
    const float *x;       /* [rows, K] */
    const uint32_t *w;    /* [N, K * bits / 32] */
    const float *scales;  /* [N, K / gs] */
    const float *biases;  /* [N, K / gs] */
    float *out;           /* [rows, N] */
    const float *xsum;    /* [rows, K / gs]: sum of x over each group */
    int64_t rows, depth, cols, groups;
    int32_t bits, group_size;
} QArgs;

typedef struct {
    float *qf;   /* [QNB, QKC]: the unpacked, scaled slice */
    float *tot;  /* [rows, QNB, 8]: vector accumulators of s * sum x * (q - half) */
    float *bias; /* [groups]: one feature's biases, adjusted for the centring */
} QScratch;

/* 8 consecutive values from element e of one feature's packed row, centred. bits is a
 * constant after inlining. */
INLINE v8f unpack8(int bits, const uint32_t *wrow, uint64_t e) {
    v8u v;
    if (bits == 4) {
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
    memset(s->tot, 0, (size_t)a->rows * QNB * 8 * sizeof(float));
    for (int64_t k0 = 0; k0 < depth; k0 += QKC) {
        int kc = depth - k0 < QKC ? (int)(depth - k0) : QKC;
        UNROLL for (int j = 0; j < nb; j++)
            unpack_slice(bits, gs, a->w + (n + j) * words, a->scales + (n + j) * groups, k0, kc,
                         s->qf + j * QKC);
        int64_t m = 0;
        for (; m + QROWS <= a->rows; m += QROWS)
            dot_block(nb, QROWS, s->qf, a->x + m * depth, depth, k0, kc, s->tot + m * QNB * 8);
        if (m < a->rows) dot_block(nb, 1, s->qf, a->x + m * depth, depth, k0, kc,
                                   s->tot + m * QNB * 8);
    }
    const float half = (float)(1 << (bits - 1));
    for (int j = 0; j < nb; j++) {
        const float *sc = a->scales + (n + j) * groups, *bi = a->biases + (n + j) * groups;
        for (int64_t g = 0; g < groups; g++) s->bias[g] = bi[g] + half * sc[g];
        for (int64_t m = 0; m < a->rows; m++)
            a->out[m * a->cols + n + j] = hsum(vload(s->tot + (m * QNB + j) * 8)) +
                                          dotf(s->bias, a->xsum + m * groups, groups);
    }
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

static void qmm_generic(const QArgs *a, QScratch *s, int64_t n0, int64_t n1) {
    if (a->bits == 4)
        feature_range(4, a, s, n0, n1);
    else
        feature_range(8, a, s, n0, n1);
}

#if HAVE_X86_DISPATCH
TARGET_AVX2 static void qmm_avx2(const QArgs *a, QScratch *s, int64_t n0, int64_t n1) {
    if (a->bits == 4)
        feature_range(4, a, s, n0, n1);
    else
        feature_range(8, a, s, n0, n1);
}
#endif

typedef struct {
    const QArgs *args;
    void (*fn)(const QArgs *, QScratch *, int64_t, int64_t);
    int64_t next; /* next work item (QCHUNK features), taken with an atomic add */
    int failed;   /* a worker could not allocate its scratch */
} QJob;

static void *qmm_worker(void *arg) {
    QJob *job = arg;
    const QArgs *a = job->args;
    QScratch s;
    s.qf = malloc((size_t)QNB * QKC * sizeof(float));
    s.tot = malloc((size_t)a->rows * QNB * 8 * sizeof(float));
    s.bias = malloc((size_t)a->groups * sizeof(float));
    if (!s.qf || !s.tot || !s.bias) {
        __atomic_store_n(&job->failed, 1, __ATOMIC_RELAXED);
    } else {
        for (;;) {
            int64_t start = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED) * QCHUNK;
            if (start >= a->cols) break;
            int64_t end = start + QCHUNK < a->cols ? start + QCHUNK : a->cols;
            job->fn(a, &s, start, end);
        }
    }
    free(s.qf);
    free(s.tot);
    free(s.bias);
    return NULL;
}

/* x [rows, K] float32, w/scales/biases as mx.quantize writes them for a [N, K] weight, out
 * [rows, N] float32; bits 4 or 8, group_size 32, 64 or 128, K a multiple of group_size;
 * generic: the portable code even where AVX2 is available (tests). Returns 0 on success,
 * 1 for arguments it does not handle, 2 when out of memory. */
EXPORT int mlxgw_quantized_matmul(const float *x, const uint32_t *w, const float *scales,
                                  const float *biases, float *out, int64_t rows,
                                  int64_t in_features, int64_t out_features, int32_t bits,
                                  int32_t group_size, int32_t threads, int32_t generic) {
    if ((bits != 4 && bits != 8) ||
        (group_size != 32 && group_size != 64 && group_size != 128) || rows < 1 ||
        out_features < 1 || in_features < group_size || in_features % group_size != 0)
        return 1;
    QArgs a = {x, w, scales, biases, out, NULL, rows, in_features, out_features,
               in_features / group_size, bits, group_size};
    float *xsum = malloc((size_t)rows * a.groups * sizeof(float));
    if (!xsum) return 2;
    for (int64_t i = 0; i < rows * a.groups; i++) {
        const float *xp = x + i * group_size; /* groups are consecutive along each row */
        v8f acc = vsplat(0.0f);
        for (int k = 0; k < group_size; k += 8) acc += vload(xp + k);
        xsum[i] = hsum(acc);
    }
    a.xsum = xsum;
    QJob job = {&a, qmm_generic, 0, 0};
#if HAVE_X86_DISPATCH
    if (use_avx2(generic)) job.fn = qmm_avx2;
#else
    (void)generic;
#endif
    int64_t items = (out_features + QCHUNK - 1) / QCHUNK;
    if (threads < 1) threads = 1;
    if (threads > items) threads = (int32_t)items;
    run_threads(qmm_worker, &job, threads);
    free(xsum);
    return job.failed ? 2 : 0;
}
