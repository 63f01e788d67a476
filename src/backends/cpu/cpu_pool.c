/*
 * cpu_pool.c - the CPU backend's worker threads.
 *
 * A small persistent pool: n_threads - 1 workers sleep on a condition
 * variable; a job is published under the mutex with a new generation number,
 * every worker takes the range of its own index, and the caller runs range 0
 * and then waits for the others. Ranges are contiguous and fixed by
 * (n, number of ranges), and ops compute every item independently, so a
 * result never depends on how many threads ran it.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/cpu_internal.h"

typedef struct pool_worker {
    cpu_pool *pool;
    int index; /* 1 .. n_threads - 1; the caller is 0 */
} pool_worker;

struct cpu_pool {
    int n_threads;
    int n_started; /* workers actually running */
    pthread_t *threads;
    pool_worker *workers;
    pthread_mutex_t call_mu; /* one job at a time */
    pthread_mutex_t mu;
    pthread_cond_t wake; /* a new generation (or stop) */
    pthread_cond_t done; /* pending reached 0 */
    uint64_t generation;
    int pending; /* workers that have not finished the current generation */
    bool stop;
    /* the current job */
    cpu_range_fn fn;
    void *ctx;
    int64_t n;
    int n_parts;
};

static void run_part(cpu_range_fn fn, void *ctx, int64_t n, int n_parts, int part) {
    if (part >= n_parts) return;
    const int64_t begin = n * part / n_parts;
    const int64_t end = n * (part + 1) / n_parts;
    if (begin < end) fn(ctx, begin, end, part);
}

static void *worker_main(void *arg) {
    pool_worker *self = arg;
    cpu_pool *pool = self->pool;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool->mu);
    for (;;) {
        while (!pool->stop && pool->generation == seen) pthread_cond_wait(&pool->wake, &pool->mu);
        if (pool->stop) break;
        seen = pool->generation;
        cpu_range_fn fn = pool->fn;
        void *ctx = pool->ctx;
        int64_t n = pool->n;
        int n_parts = pool->n_parts;
        pthread_mutex_unlock(&pool->mu);

        run_part(fn, ctx, n, n_parts, self->index);

        pthread_mutex_lock(&pool->mu);
        if (--pool->pending == 0) pthread_cond_signal(&pool->done);
    }
    pthread_mutex_unlock(&pool->mu);
    return NULL;
}

void cpu_pool_destroy(cpu_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    pool->stop = true;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->n_started; i++) pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->done);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->mu);
    pthread_mutex_destroy(&pool->call_mu);
    free(pool->threads);
    free(pool->workers);
    free(pool);
}

ds4_status cpu_pool_create(int n_threads, cpu_pool **out, ds4_error *err) {
    *out = NULL;
    cpu_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return ds4_error_set(err, DS4_ERR_NOMEM, "cpu backend: out of memory for the thread pool");
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->call_mu, NULL);
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof *pool->threads);
        pool->workers = calloc((size_t)n_threads - 1, sizeof *pool->workers);
        if (!pool->threads || !pool->workers) {
            cpu_pool_destroy(pool);
            return ds4_error_set(err, DS4_ERR_NOMEM, "cpu backend: out of memory for %d threads", n_threads);
        }
        for (int i = 0; i < n_threads - 1; i++) {
            pool->workers[i] = (pool_worker){ pool, i + 1 };
            int rc = pthread_create(&pool->threads[i], NULL, worker_main, &pool->workers[i]);
            if (rc != 0) {
                cpu_pool_destroy(pool);
                return ds4_error_set(err, DS4_ERR_NOMEM, "cpu backend: cannot start worker thread %d of %d: %s",
                                     i + 1, n_threads, strerror(rc));
            }
            pool->n_started++;
        }
    }
    *out = pool;
    return DS4_OK;
}

/* Below this many multiply-adds a job runs on the caller: waking the workers
 * costs a few microseconds. */
#define CPU_PARALLEL_MIN_WORK 32768

void cpu_parallel_for(ds4_backend *be, int64_t n, int64_t cost, cpu_range_fn fn, void *ctx) {
    if (n <= 0) return;
    cpu_pool *pool = cpu_impl(be)->pool;
    int64_t parts = pool->n_threads;
    if (parts > n) parts = n;
    if (cost < 1) cost = 1;
    if (parts <= 1 || n * cost < CPU_PARALLEL_MIN_WORK) {
        fn(ctx, 0, n, 0);
        return;
    }
    pthread_mutex_lock(&pool->call_mu);
    pthread_mutex_lock(&pool->mu);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->n = n;
    pool->n_parts = (int)parts;
    pool->pending = pool->n_started;
    pool->generation++;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->mu);

    run_part(fn, ctx, n, (int)parts, 0);

    pthread_mutex_lock(&pool->mu);
    while (pool->pending > 0) pthread_cond_wait(&pool->done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
    pthread_mutex_unlock(&pool->call_mu);
}
