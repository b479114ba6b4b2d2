/* What the sources in runtime/kernels share: the vector type (GCC/clang vector extension,
 * 8 floats), the run-time AVX2+FMA choice and the thread runner. Every function here is static, so
 * each source gets its own copy and the library exports only the EXPORT functions. */

#ifndef MLXGW_COMMON_H
#define MLXGW_COMMON_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* the vector helpers are always inlined, so no 32-byte vector crosses a call boundary */
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpsabi"
#elif defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#define EXPORT __attribute__((visibility("default")))
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 8")

#if defined(__x86_64__) || defined(__i386__)
#define HAVE_X86_DISPATCH 1
#define TARGET_AVX2 __attribute__((target("avx2,fma")))
#else
#define HAVE_X86_DISPATCH 0
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

INLINE v8f vload(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE void vstore(float *p, v8f v) { memcpy(p, &v, sizeof v); }

INLINE v8f vsplat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

INLINE v8i vsplati(int32_t x) { return (v8i){x, x, x, x, x, x, x, x}; }

INLINE float hsum(v8f v) {
    float t = 0.0f;
    for (int i = 0; i < 8; i++) t += v[i];
    return t;
}

INLINE v8f vselect(v8i mask, v8f yes, v8f no) {
    return (v8f)((mask & (v8i)yes) | (~mask & (v8i)no));
}

INLINE v8f vmax(v8f a, v8f b) { return vselect(a > b, a, b); }

INLINE v8f vmin(v8f a, v8f b) { return vselect(a < b, a, b); }

/* 2^x, about 1 ulp: x = n + f with n an integer and |f| <= 1/2, 2^f by its Taylor series
 * to degree 6, 2^n by building the exponent bits. Exactly 0 below -126 (and for -inf and
 * NaN, which the masked scores use); saturates at 2^127. */
INLINE v8f vexp2(v8f x) {
    const v8f magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v8i keep = x >= vsplat(-126.0f);
    x = vmin(vmax(x, vsplat(-126.0f)), vsplat(127.0f));
    v8f t = x + magic;
    v8f n = t - magic;
    v8f f = x - n;
    v8f p = vsplat(1.5403530393381606e-4f);
    p = p * f + vsplat(1.3333558146428443e-3f);
    p = p * f + vsplat(9.6181291076284772e-3f);
    p = p * f + vsplat(5.5504108664821580e-2f);
    p = p * f + vsplat(2.4022650695910071e-1f);
    p = p * f + vsplat(6.9314718055994531e-1f);
    p = p * f + vsplat(1.0f);
    v8i bits = ((v8i)t - (v8i)magic + vsplati(127)) << 23;
    return (v8f)((v8i)(p * (v8f)bits) & keep);
}

/* 1 where the AVX2+FMA code should run: the CPU has it and the caller did not ask for the
 * portable code (`generic`, for tests) */
static inline int use_avx2(int generic) {
#if HAVE_X86_DISPATCH
    return !generic && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    (void)generic;
    return 0;
#endif
}

/* Run `worker(job)` on `threads` threads that start for this call, the caller being one
 * of them. A thread that cannot be started leaves its share to the others (workers take
 * items from a shared counter until none is left). */
static inline void spawn_threads(void *(*worker)(void *), void *job, int threads) {
    enum { MAX_THREADS = 256 };
    pthread_t ids[MAX_THREADS];
    int started = 0;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    for (int i = 1; i < threads; i++) {
        if (pthread_create(&ids[started], NULL, worker, job) == 0) started++;
    }
    worker(job);
    for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
}

/* The same on the persistent pool's threads (pool.c). */
__attribute__((visibility("hidden"))) void mlxgw_pool_run(void *(*worker)(void *), void *job,
                                                          int threads);

/* The work-item size for `n` output features over `threads` threads: each thread's share
 * in about 4 contiguous spans, a multiple of `unit`. A thread that streams through long
 * runs of weight rows keeps the hardware prefetchers ahead of it; items of 16 features
 * interleaved between two threads made each read a strided pattern, and two threads ran
 * slower than one (a 151936 x 896 8-bit head: 7.8 ms on one thread, 9.7 ms on two; with
 * spans 2.9-4.7 ms). */
static inline int64_t span_items(int64_t n, int threads, int64_t unit) {
    const int64_t spans = 4 * (int64_t)(threads < 1 ? 1 : threads);
    int64_t size = (n + spans - 1) / spans;
    size = (size + unit - 1) / unit * unit;
    return size < unit ? unit : size;
}

static inline void run_threads(void *(*worker)(void *), void *job, int threads) {
    mlxgw_pool_run(worker, job, threads);
}

#endif
