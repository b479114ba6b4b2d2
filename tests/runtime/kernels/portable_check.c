/* The kernels' portable code against naive references, as a program of its own: built
 * for another architecture (aarch64, by test_portable.py) and run under qemu-user, it
 * checks the code paths that x86 machines only reach with MLX_GATEWAY_CPU_ISA=generic.
 *
 * Prints one line per failing case and closes with "N passed, M failed"; exits 1 on any
 * failure. Compiled together with kernels.c, quantized.c, qdot.c and pool.c. */

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quantized.h"

static int passed, failed;
static uint64_t rng_state = 88172645463325252ull;

static double uniform(void) { /* xorshift64, in [-1, 1) */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / (double)(1ull << 52) - 1.0;
}

static void check(int ok, const char *what, double error) {
    if (ok) {
        passed++;
    } else {
        failed++;
        printf("FAILED %s (error %g)\n", what, error);
    }
}

/* the bits of value k of a row packed as a little-endian bit stream */
static void pack(uint32_t *row, int k, int bits, unsigned value) {
    uint8_t *bytes = (uint8_t *)row;
    for (int i = 0; i < bits; i++) {
        int bit = k * bits + i;
        if (value >> i & 1u) bytes[bit / 8] |= (uint8_t)(1u << (bit % 8));
    }
}

static uint16_t to_half(float f) { /* normal values only: the test's scales are */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int exp = (int)((u >> 23) & 255) - 127 + 15;
    uint32_t man = (u >> 13) & 1023u;
    return (uint16_t)(sign | (uint32_t)exp << 10 | man);
}

static float from_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 1023u;
    uint32_t u = sign | (exp + 112) << 23 | man << 13;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void quantized_case(int bits, int gs, int stype, int rows, int cols, int depth,
                           int threads) {
    int groups = depth / gs, words = depth * bits / 32;
    uint32_t *w = calloc((size_t)cols * words, 4);
    float *s32 = malloc((size_t)cols * groups * 4), *b32 = malloc((size_t)cols * groups * 4);
    uint16_t *s16 = malloc((size_t)cols * groups * 2), *b16 = malloc((size_t)cols * groups * 2);
    double *dense = malloc((size_t)cols * depth * sizeof(double));
    float *x = malloc((size_t)rows * depth * 4), *out = malloc((size_t)rows * cols * 4);
    float *dq = malloc((size_t)cols * depth * 4);
    for (int n = 0; n < cols; n++)
        for (int g = 0; g < groups; g++) {
            float sc = (float)(0.01 + 0.05 * (uniform() + 1.0)), bi = (float)(0.3 * uniform());
            s16[n * groups + g] = to_half(sc);
            b16[n * groups + g] = to_half(bi);
            s32[n * groups + g] = stype ? from_half(s16[n * groups + g]) : sc;
            b32[n * groups + g] = stype ? from_half(b16[n * groups + g]) : bi;
        }
    for (int n = 0; n < cols; n++)
        for (int k = 0; k < depth; k++) {
            unsigned q = (unsigned)((uniform() + 1.0) / 2.0 * ((1 << bits) - 1) + 0.5);
            pack(w + (size_t)n * words, k, bits, q);
            int g = n * groups + k / gs;
            dense[(size_t)n * depth + k] = (double)s32[g] * q + b32[g];
        }
    for (int i = 0; i < rows * depth; i++) x[i] = (float)uniform();
    const void *sp = stype ? (const void *)s16 : (const void *)s32;
    const void *bp = stype ? (const void *)b16 : (const void *)b32;
    char what[160];
    snprintf(what, sizeof what, "quantized_matmul bits %d gs %d stype %d rows %d cols %d depth %d",
             bits, gs, stype, rows, cols, depth);
    int status = mlxgw_quantized_matmul(x, w, sp, bp, out, rows, depth, cols, bits, gs, stype,
                                        threads, 1);
    double worst = 0;
    for (int m = 0; m < rows; m++)
        for (int n = 0; n < cols; n++) {
            double exact = 0, size = 1e-30;
            for (int k = 0; k < depth; k++) {
                double t = (double)x[m * depth + k] * dense[(size_t)n * depth + k];
                exact += t;
                size += fabs(t);
            }
            double e = fabs(out[m * cols + n] - exact) / size;
            worst = e > worst ? e : worst;
        }
    check(status == 0 && worst <= 1e-5, what, worst);
    status = mlxgw_dequantize(w, sp, bp, dq, 0, cols, depth, cols, bits, gs, stype, threads, 1);
    worst = 0;
    for (int i = 0; i < cols * depth; i++) {
        double e = fabs(dq[i] - dense[i]);
        worst = e > worst ? e : worst;
    }
    snprintf(what, sizeof what, "dequantize bits %d gs %d stype %d", bits, gs, stype);
    check(status == 0 && worst <= 1e-5, what, worst);
    /* the integer kernel is x86-only: anywhere else it declines, and the float one runs */
#if !defined(__x86_64__)
    status = mlxgw_qdot(x, w, sp, bp, out, rows, depth, cols, bits, gs, stype, 16, threads, 0);
    check(status == 1, "qdot declines off x86", status);
#endif
    free(w), free(s32), free(b32), free(s16), free(b16), free(dense), free(x), free(out), free(dq);
}

static void attention_case(int causal, int length, int keys, int dim, int threads, int decode) {
    const int batch = 1, hq = 4, hkv = 2;
    size_t nq = (size_t)batch * hq * length * dim, nk = (size_t)batch * hkv * keys * dim;
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *out = malloc(nq * 4);
    for (size_t i = 0; i < nq; i++) q[i] = (float)uniform();
    for (size_t i = 0; i < nk; i++) k[i] = (float)uniform(), v[i] = (float)uniform();
    AttnArgs a = {q, k, v, out,
                  {(int64_t)hq * length * dim, (int64_t)length * dim, dim},
                  {(int64_t)hkv * keys * dim, (int64_t)keys * dim, dim},
                  {(int64_t)hkv * keys * dim, (int64_t)keys * dim, dim},
                  {(int64_t)hq * length * dim, (int64_t)length * dim, dim},
                  batch, hq, hkv, length, keys, dim, 1.0f / sqrtf((float)dim), causal,
                  threads, 1, NULL};
    int status = decode ? mlxgw_attention_decode(&a) : mlxgw_attention(&a);
    double worst = 0, *p = malloc((size_t)keys * sizeof(double));
    for (int h = 0; h < hq; h++)
        for (int i = 0; i < length; i++) {
            const float *qi = q + ((size_t)h * length + i) * dim;
            const float *kh = k + (size_t)(h / (hq / hkv)) * keys * dim;
            const float *vh = v + (size_t)(h / (hq / hkv)) * keys * dim;
            int last = causal ? keys - length + i : keys - 1;
            double mx = -1e300, sum = 0;
            for (int j = 0; j <= last; j++) {
                double t = 0;
                for (int d = 0; d < dim; d++) t += (double)qi[d] * kh[(size_t)j * dim + d];
                p[j] = t * a.scale;
                mx = p[j] > mx ? p[j] : mx;
            }
            for (int j = 0; j <= last; j++) sum += p[j] = exp(p[j] - mx);
            for (int d = 0; d < dim; d++) {
                double o = 0;
                for (int j = 0; j <= last; j++) o += p[j] / sum * vh[(size_t)j * dim + d];
                double e = fabs(out[((size_t)h * length + i) * dim + d] - o);
                worst = e > worst ? e : worst;
            }
        }
    char what[96];
    snprintf(what, sizeof what, "%s causal %d length %d keys %d dim %d",
             decode ? "decode attention" : "attention", causal, length, keys, dim);
    check(status == 0 && worst <= 1e-5, what, worst);
    free(q), free(k), free(v), free(out), free(p);
}

static void gemm_and_gate_cases(int threads) {
    const int rows = 5, cols = 37, depth = 70, n = 1000;
    float *x = malloc(rows * depth * 4), *w = malloc(cols * depth * 4), *out = malloc(rows * cols * 4);
    for (int i = 0; i < rows * depth; i++) x[i] = (float)uniform();
    for (int i = 0; i < cols * depth; i++) w[i] = (float)uniform();
    int status = mlxgw_small_gemm(x, w, out, rows, cols, depth, threads, 1);
    double worst = 0;
    for (int m = 0; m < rows; m++)
        for (int c = 0; c < cols; c++) {
            double t = 0;
            for (int k = 0; k < depth; k++) t += (double)x[m * depth + k] * w[c * depth + k];
            double e = fabs(out[m * cols + c] - t);
            worst = e > worst ? e : worst;
        }
    check(status == 0 && worst <= 1e-4, "small_gemm", worst);
    float *g = malloc(n * 4), *u = malloc(n * 4), *o = malloc(n * 4);
    for (int i = 0; i < n; i++) g[i] = (float)(6 * uniform()), u[i] = (float)uniform();
    status = mlxgw_gated_mul(g, u, o, n, 0, threads, 1);
    worst = 0;
    for (int i = 0; i < n; i++) {
        double want = g[i] / (1 + exp(-(double)g[i])) * u[i];
        double e = fabs(o[i] - want) / (fabs(want) + 1e-6);
        worst = e > worst && fabs(want) > 1e-4 ? e : worst;
    }
    check(status == 0 && worst <= 1e-5, "gated_mul silu", worst);
    free(x), free(w), free(out), free(g), free(u), free(o);
}

int main(void) {
    static const int widths[] = {2, 3, 4, 5, 6, 8}, sizes[] = {32, 64, 128};
    for (int wi = 0; wi < 6; wi++)
        for (int si = 0; si < 3; si++)
            for (int stype = 0; stype < 2; stype++) {
                quantized_case(widths[wi], sizes[si], stype, 1 + (wi + si) % 5, 19, 256, 1 + wi % 3);
                quantized_case(widths[wi], sizes[si], stype, 17, 5, 384, 2);
            }
    attention_case(1, 33, 70, 64, 2, 0);
    attention_case(0, 5, 40, 32, 1, 0);
    attention_case(1, 1, 200, 128, 3, 0);
    attention_case(1, 1, 200, 128, 3, 1);  /* decode: keys in chunks across threads */
    attention_case(1, 1, 1000, 64, 2, 1);
    attention_case(1, 1, 3, 32, 1, 1);
    gemm_and_gate_cases(2);
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
