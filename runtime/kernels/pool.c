/* A persistent thread pool for the kernels' run_threads (common.h).
 *
 * A decode step calls a kernel for every weight matrix, a few hundred times a step, many
 * of them a few microseconds of work; starting threads per call (pthread_create and join,
 * tens of microseconds) cost as much as the work. The pool's threads wait for the next
 * call spinning briefly, then asleep on a condition variable, so back-to-back calls find
 * them awake and a quiet server costs no CPU.
 *
 * One call uses the pool at a time (a try-lock); a call that finds it busy (another
 * thread's kernel) starts its own threads as before. After fork() the child has no pool
 * threads, so it starts a new pool.
 */

#include <pthread.h>
#include <stdint.h>

#include "common.h"

#if defined(__x86_64__) || defined(__i386__)
#define PAUSE() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define PAUSE() __asm__ __volatile__("yield")
#else
#define PAUSE() ((void)0)
#endif

enum { POOL_MAX = 255, SPIN = 1000 };

static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static int started;                /* pool threads running */
/* per call: a count bumped by one, times 2^16, plus the number of pool threads that take
 * part in the call; one word, so that a thread never pairs one call with another's count */
static uint64_t generation;
static int remaining;              /* of those, still working (atomic) */
static void *(*task_fn)(void *);
static void *task_job;
static uint64_t born[POOL_MAX]; /* the generation each pool thread was started in */
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void child_after_fork(void) {
    pthread_mutex_init(&busy, NULL);
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
    pthread_cond_init(&done, NULL);
    started = 0;
    generation = 0;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, child_after_fork); }

static void *pool_thread(void *arg) {
    const int index = (int)(intptr_t)arg;
    /* not the current generation: a thread started for a call may first run after the
     * call's bump, and must still take part in it */
    uint64_t seen = born[index];
    for (;;) {
        uint64_t now = seen;
        for (int i = 0; i < SPIN && now == seen; i++) {
            PAUSE();
            now = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        }
        if (now == seen) {
            pthread_mutex_lock(&lock);
            while ((now = __atomic_load_n(&generation, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&wake, &lock);
            pthread_mutex_unlock(&lock);
        }
        seen = now;
        if (index >= (int)(now & 0xffffu)) continue;
        task_fn(task_job);
        if (__atomic_sub_fetch(&remaining, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&lock);
            pthread_cond_signal(&done);
            pthread_mutex_unlock(&lock);
        }
    }
    return NULL;
}

/* Start pool threads up to `want`; the number running. */
static int grow(int want) {
    if (want > POOL_MAX) want = POOL_MAX;
    while (started < want) {
        pthread_t id;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        born[started] = __atomic_load_n(&generation, __ATOMIC_ACQUIRE);
        int failed = pthread_create(&id, &attr, pool_thread, (void *)(intptr_t)started);
        pthread_attr_destroy(&attr);
        if (failed) break;
        started++;
    }
    return started;
}

void mlxgw_pool_run(void *(*worker)(void *), void *job, int threads) {
    if (threads <= 1) {
        worker(job);
        return;
    }
    pthread_once(&atfork_once, register_atfork);
    if (pthread_mutex_trylock(&busy) != 0) {
        spawn_threads(worker, job, threads);
        return;
    }
    int helpers = grow(threads - 1);
    if (helpers > threads - 1) helpers = threads - 1;
    task_fn = worker;
    task_job = job;
    __atomic_store_n(&remaining, helpers, __ATOMIC_RELEASE);
    pthread_mutex_lock(&lock);
    uint64_t next = ((__atomic_load_n(&generation, __ATOMIC_ACQUIRE) >> 16) + 1) << 16;
    __atomic_store_n(&generation, next | (uint64_t)helpers, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
    worker(job); /* the caller is one of the threads */
    for (int i = 0; i < SPIN && __atomic_load_n(&remaining, __ATOMIC_ACQUIRE) > 0; i++) PAUSE();
    if (__atomic_load_n(&remaining, __ATOMIC_ACQUIRE) > 0) {
        pthread_mutex_lock(&lock);
        while (__atomic_load_n(&remaining, __ATOMIC_ACQUIRE) > 0) pthread_cond_wait(&done, &lock);
        pthread_mutex_unlock(&lock);
    }
    pthread_mutex_unlock(&busy);
}
