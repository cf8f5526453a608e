/* The kernels' thread pool (every .c file of the library runs its tiles here) and its profile:
 * per-side CPU times (strata_pool_timing/_times) and a timeline of its jobs (strata_pool_trace,
 * read by bench/decode_profile.py). Built into the kernel library by strata/kernels/_build.py.
 */

#include <stdint.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif
#include "pool.h"

/* ------------------------------------------------------------------ thread pool
 *
 * Rows are cut into tiles that threads claim one at a time from a shared counter; the calling
 * thread works too and returns as soon as every tile is done. A helper that the OS has not
 * scheduled yet simply claims nothing, so on a busy machine a call degrades to the speed of
 * the threads that do run, instead of waiting at a barrier for one that does not (which made
 * OpenMP's `parallel for` 10x slower than one thread on a loaded 2-core box).
 *
 * Each of a job's nth threads owns a contiguous share of its tiles, a range word on its own cache
 * line packing (epoch:32 | next:16 | end:16): it claims its tiles from the front, one CAS each on
 * a line no other thread touches while it has tiles left, and, its range empty, steals the others'
 * from their back, one at a time. So a thread streams one contiguous run of weight rows (the
 * hardware prefetchers follow it), and a helper the OS has not scheduled yet holds no tile: its
 * share is stolen tile by tile. (One shared counter, which the threads claimed 16-row tiles from
 * in turn, moved its line between the cores at every claim, ~11,000 times a qwen3-30b token.)
 * A claim checks the job's epoch in the same word, so it always belongs to the job it read; the
 * job's arguments are written before its epoch is published (pool_state: epoch:32 | tiles:16)
 * and stay valid until all its claimed tiles are done. Each thread adds the tiles it ran to the
 * job's done count once, when it finds none left.
 */
typedef struct {
    void (*fn)(const void *args, int64_t tile);
    const void *args;
} job_t;

#define MAX_HELPERS 63
#define SPIN_ROUNDS 2000 /* the caller: ~40 us of polling for a helper's last tile, then sched_yield */

static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cv = PTHREAD_COND_INITIALIZER;
static _Atomic uint64_t pool_state;
static _Atomic int64_t pool_done;
static _Atomic int pool_wanted; /* helpers with index < wanted take part in the current job */
static _Atomic int pool_sleepers;
static job_t pool_job;
static int pool_size;
static int pool_nth; /* the current job's threads (range owners 0 .. pool_nth - 1; 0 is the caller) */
typedef struct {
    _Atomic uint64_t w; /* (epoch:32 | next:16 | end:16) */
    char pad[56];
} pool_range_t;
static pool_range_t pool_range[MAX_HELPERS + 1] __attribute__((aligned(64)));
static _Atomic int64_t pool_jobs; /* pool_run calls so far (a test counts a decode layer's) */
int64_t strata_pool_jobs(void) { return atomic_load(&pool_jobs); }
static _Atomic int64_t pool_helper_tiles, pool_caller_tiles; /* who ran the shared jobs' tiles */
/* out[0]: tiles of shared jobs run by helpers, out[1]: by the calling thread (bench/decode_profile). */
void strata_pool_tiles(int64_t *out) {
    out[0] = atomic_load(&pool_helper_tiles);
    out[1] = atomic_load(&pool_caller_tiles);
}

/* How an idle helper waits for the next job: it polls (pause) for spin_ns, then, for yield_ns more,
 * polls between sched_yield calls (handing the core to any other runnable thread), then sleeps on a
 * condition variable until the next job wakes it. The gaps between a decode step's jobs are
 * microseconds (its layers run in C: decode_stack.c), so on an idle machine the poll keeps the
 * helper through a token and it sleeps once per token, in the Python between two. On a loaded
 * machine (load 8 on 2 cores) a yielding helper spends the process's share of the cores on polling:
 * SmolLM2 at 2 threads, 9 alternating runs, decoded 20.8 tok/s with a 4 ms yield phase, 23.5 with
 * 0.3 ms and 27.2 with none, though without one nearly every job has to wake the helper (its 40 us
 * poll runs out while it or the caller is descheduled). So by default it does not yield-poll;
 * strata_set_pool_yield sets the phase for such comparisons. */
static const int64_t spin_ns = 40000;
static int64_t yield_ns = 0;
void strata_set_pool_yield(int64_t ns) { yield_ns = ns; }

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Whether nth - 1 helpers exist and none is asleep (a racy read: only a hint for small products). */
int pool_awake(int nth) {
    return nth > 1 && pool_size >= nth - 1 && atomic_load_explicit(&pool_sleepers, memory_order_relaxed) == 0;
}

static inline uint32_t st_epoch(uint64_t s) { return (uint32_t)(s >> 32); }

/* Where the pool's time goes (bench/decode_profile), counted only while strata_pool_timing(1):
 * (CPU ns of the thread counted) [0] ns the calling thread spent in its tiles, [1] ns it then waited for the helpers' last tiles,
 * [2] ns helpers spent in tiles, [3] ns the calling thread spent in pool_run (the rest of its
 * time is the serial work between jobs), [4] jobs shared with helpers, [5] jobs run alone, [6] jobs
 * that had to wake a sleeping helper, [7] ns the calling thread spent waking them. */
/* Each job and each helper's share of one reads the flag once: one that read it off at its start and
 * on at its end (the profiler turning it on while a helper left its last tile) would add its
 * thread's whole CPU time. */
static _Atomic int pool_timing;
static _Atomic int64_t pool_times[8];
/* This thread's CPU time: on a shared machine a wall clock would count the time it was descheduled. */
static inline int64_t cpu_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
void strata_pool_timing(int on) { atomic_store(&pool_timing, on); }
void strata_pool_times(int64_t *out) {
    for (int i = 0; i < 8; i++) out[i] = atomic_load(&pool_times[i]);
}

/* A timeline of the pool's jobs (bench/decode_profile.py's timeline view), recorded only while
 * strata_pool_trace(1): per job, CLOCK_MONOTONIC ns (Python's time.monotonic_ns) at the call, at
 * its publication (after any wake-up), when the calling thread ran out of tiles and when the last
 * tile was done; when the helpers claimed their first tile and finished their last; the tiles each
 * side ran; and what the job was (a call site's tag and info, else 0 and the tile function). A job
 * run alone has t_pub = t_caller and no helper times. Marks (strata_pool_mark) note where a caller
 * is (a layer half's start) in the same buffer. With several helpers their times are the last
 * writer's: a profile, not a count. */
typedef struct {
    int64_t t_in, t_pub, t_caller, t_out, h_first, h_last;
    int64_t tag, info, fn, n_tiles, caller_tiles, helper_tiles;
    int64_t c_in, c_out; /* the calling thread's CPU ns (CLOCK_THREAD_CPUTIME_ID) at the call and at its end */
    int64_t bytes;       /* weight bytes the job reads, where its call site says (else 0) */
} pool_event;
#define TRACE_MAX 16384
static pool_event trace_buf[TRACE_MAX];
static _Atomic int64_t trace_n;
static _Atomic int trace_on;
static pool_event *_Atomic trace_cur; /* the shared job being run (helpers write their times into it) */
/* what the next job is, set by its call site; per thread: a second Python thread runs its jobs alone
 * meanwhile, and its labels must not land on the first one's */
__thread int64_t pool_tag, pool_info, pool_bytes;
void strata_pool_trace(int on) {
    if (on) atomic_store(&trace_n, 0);
    atomic_store(&trace_on, on);
}
/* Copies up to max events into out (`fields` int64 each, the caller's idea of a pool_event);
 * returns how many there are, or -1 (nothing copied) when `fields` is not this build's count: a
 * caller sized for an older event would have its buffer overrun. */
int64_t strata_pool_trace_read(int64_t *out, int64_t max, int64_t fields) {
    if (fields != (int64_t)(sizeof(pool_event) / sizeof(int64_t))) return -1;
    int64_t n = atomic_load(&trace_n);
    if (n > TRACE_MAX) n = TRACE_MAX;
    if (n > max) n = max;
    memcpy(out, trace_buf, sizeof(pool_event) * (size_t)n);
    return n;
}
static pool_event *trace_new(void) {
    if (!atomic_load_explicit(&trace_on, memory_order_relaxed)) return NULL;
    const int64_t i = atomic_fetch_add(&trace_n, 1);
    if (i >= TRACE_MAX) return NULL;
    pool_event *e = &trace_buf[i];
    memset(e, 0, sizeof *e);
    return e;
}
void strata_pool_mark(int64_t tag, int64_t info) {
    pool_event *e = trace_new();
    if (e) {
        e->t_in = e->t_pub = e->t_caller = e->t_out = now_ns();
        e->c_in = e->c_out = cpu_ns();
        e->tag = -tag;
        e->info = info;
    }
}

static inline int64_t rg_next(uint64_t w) { return (int64_t)((w >> 16) & 0xFFFF); }
static inline int64_t rg_end(uint64_t w) { return (int64_t)(w & 0xFFFF); }

/* One tile of job `epoch` from range word r: its front (own) or its back (steal); -1: none left. */
static inline int64_t claim(_Atomic uint64_t *r, uint32_t epoch, int back) {
    uint64_t w = atomic_load_explicit(r, memory_order_acquire);
    while (st_epoch(w) == epoch && rg_next(w) < rg_end(w)) {
        if (atomic_compare_exchange_weak_explicit(r, &w, back ? w - 1 : w + (1u << 16), memory_order_acq_rel,
                                                  memory_order_acquire))
            return back ? rg_end(w) - 1 : rg_next(w);
    }
    return -1;
}

/* Run tiles of job `epoch` as thread `me` of it, its own share first, then the others', until
 * none is left; returns how many were run. */
static int64_t pool_work(int who, int me, uint32_t epoch) {
    int64_t ran = 0;
    const int timing = atomic_load_explicit(&pool_timing, memory_order_relaxed);
    const int64_t t0 = timing ? cpu_ns() : 0;
    pool_event *ev = who == 2 ? atomic_load_explicit(&trace_cur, memory_order_acquire) : NULL;
    const job_t job = pool_job; /* (claims of `epoch` succeed only while these are its arguments) */
    const int nth = pool_nth;
    /* A helper that read pool_wanted of job `epoch` and pool_nth of a later one with fewer threads
     * (parallel_threads sizes each job) is no thread of it: `epoch` is over (its claims would all
     * fail) and the steal loop below would never come back round to `me`. */
    if (me >= nth) return 0;
    for (int victim = me;;) {
        int64_t tile = claim(&pool_range[victim].w, epoch, victim != me);
        while (tile < 0) {
            victim = (victim + 1) % nth;
            if (victim == me) break;
            tile = claim(&pool_range[victim].w, epoch, 1);
        }
        if (tile < 0) break;
        if (ev && !ran) ev->h_first = now_ns();
        job.fn(job.args, tile);
        if (ev) ev->h_last = now_ns();
        ran++;
    }
    if (ran) atomic_fetch_add_explicit(&pool_done, ran, memory_order_release);
    if (timing) atomic_fetch_add_explicit(&pool_times[who], cpu_ns() - t0, memory_order_relaxed);
    return ran;
}

static void *pool_helper(void *arg) {
    const int index = (int)(intptr_t)arg;
#if defined(__linux__)
    prctl(PR_SET_NAME, "strata-pool", 0, 0, 0); /* bench/decode_profile tells its CPU time from the others' */
#endif
    uint32_t seen = 0;
    for (;;) {
        uint64_t s = atomic_load_explicit(&pool_state, memory_order_acquire);
        if (st_epoch(s) != seen) {
            seen = st_epoch(s);
            if (index < atomic_load_explicit(&pool_wanted, memory_order_relaxed))
                atomic_fetch_add_explicit(&pool_helper_tiles, pool_work(2, index + 1, seen), memory_order_relaxed);
            continue;
        }
        const int64_t t0 = now_ns();
        int changed = 0;
        for (int spun = 1;; spun++) {
            if (st_epoch(atomic_load_explicit(&pool_state, memory_order_acquire)) != seen) {
                changed = 1;
                break;
            }
            if (spun % 64 == 0) {
                const int64_t idle = now_ns() - t0;
                if (idle > spin_ns + yield_ns) break;
                if (idle > spin_ns) {
                    sched_yield();
                    continue;
                }
            }
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
        if (changed) continue;
        pthread_mutex_lock(&wake_mu);
        atomic_fetch_add(&pool_sleepers, 1);
        while (st_epoch(atomic_load(&pool_state)) == seen) pthread_cond_wait(&wake_cv, &wake_mu);
        atomic_fetch_sub(&pool_sleepers, 1);
        pthread_mutex_unlock(&wake_mu);
    }
    return NULL;
}

/* Run fn(args, t) for t in [0, n_tiles) on up to nth threads (the caller included). */
void pool_run(void (*fn)(const void *, int64_t), const void *args, int64_t n_tiles, int nth) {
    atomic_fetch_add_explicit(&pool_jobs, 1, memory_order_relaxed);
    if (nth > n_tiles) nth = (int)n_tiles;
    if (nth > MAX_HELPERS + 1) nth = MAX_HELPERS + 1;
    const int timing = atomic_load_explicit(&pool_timing, memory_order_relaxed);
    const int64_t t_in = timing ? cpu_ns() : 0;
    pool_event *ev = trace_new();
    if (ev) {
        ev->t_in = now_ns();
        ev->c_in = cpu_ns();
        ev->tag = pool_tag;
        ev->info = pool_info;
        ev->bytes = pool_bytes;
        ev->fn = (int64_t)(intptr_t)fn;
        ev->n_tiles = n_tiles;
    }
    pool_tag = pool_info = pool_bytes = 0;
    /* One job at a time; a second caller (another Python thread) runs its job alone. */
    if (nth <= 1 || n_tiles > 0xFFFF || pthread_mutex_trylock(&call_mu) != 0) {
        for (int64_t t = 0; t < n_tiles; t++) fn(args, t);
        if (ev) {
            ev->t_pub = ev->t_caller = ev->t_out = now_ns();
            ev->c_out = cpu_ns();
            ev->caller_tiles = n_tiles;
        }
        if (timing) {
            const int64_t d = cpu_ns() - t_in;
            atomic_fetch_add_explicit(&pool_times[0], d, memory_order_relaxed);
            atomic_fetch_add_explicit(&pool_times[3], d, memory_order_relaxed);
            atomic_fetch_add_explicit(&pool_times[5], 1, memory_order_relaxed);
        }
        return;
    }
    while (pool_size < nth - 1) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int ok = pthread_create(&th, &attr, pool_helper, (void *)(intptr_t)pool_size) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool_size++;
    }
    pool_job.fn = fn;
    pool_job.args = args;
    atomic_store_explicit(&pool_done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool_wanted, nth - 1, memory_order_relaxed);
    atomic_store_explicit(&trace_cur, ev, memory_order_relaxed);
    const uint64_t old = atomic_load_explicit(&pool_state, memory_order_relaxed);
    const uint32_t epoch = st_epoch(old) + 1;
    pool_nth = nth;
    for (int p = 0; p < nth; p++) /* contiguous shares, in order: the caller's first */
        atomic_store_explicit(&pool_range[p].w, (uint64_t)epoch << 32 | (uint64_t)(p * n_tiles / nth) << 16 |
                                                    (uint64_t)((p + 1) * n_tiles / nth), memory_order_relaxed);
    /* seq_cst store, then load: pairs with the helper's sleepers++ then state load, so either
     * the helper sees the new epoch or we see it about to sleep and wake it. */
    atomic_store(&pool_state, (uint64_t)epoch << 32 | (uint64_t)n_tiles);
    if (atomic_load(&pool_sleepers) > 0) {
        const int64_t t_wake = timing ? cpu_ns() : 0;
        pthread_mutex_lock(&wake_mu);
        pthread_cond_broadcast(&wake_cv);
        pthread_mutex_unlock(&wake_mu);
        if (timing) {
            atomic_fetch_add_explicit(&pool_times[6], 1, memory_order_relaxed);
            atomic_fetch_add_explicit(&pool_times[7], cpu_ns() - t_wake, memory_order_relaxed);
        }
    }
    if (ev) ev->t_pub = now_ns();
    const int64_t mine = pool_work(0, 0, epoch);
    atomic_fetch_add_explicit(&pool_caller_tiles, mine, memory_order_relaxed);
    if (ev) ev->t_caller = now_ns(), ev->caller_tiles = mine;
    const int64_t t_wait = timing ? cpu_ns() : 0;
    /* A helper may hold a claimed tile while descheduled: poll briefly, then yield the core to it. */
    for (int spun = 0; atomic_load_explicit(&pool_done, memory_order_acquire) < n_tiles; spun++) {
        if (spun < SPIN_ROUNDS) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();
        }
    }
    if (timing) {
        const int64_t t_out = cpu_ns();
        atomic_fetch_add_explicit(&pool_times[1], t_out - t_wait, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool_times[3], t_out - t_in, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool_times[4], 1, memory_order_relaxed);
    }
    if (ev) ev->t_out = now_ns(), ev->c_out = cpu_ns(), ev->helper_tiles = n_tiles - mine;
    atomic_store_explicit(&trace_cur, NULL, memory_order_relaxed);
    pthread_mutex_unlock(&call_mu);
}

/* For the library's other .c files (prefill.c, decode_attention.c ...): the pool by an exported name. */
void strata_pool_run(void (*fn)(const void *, int64_t), const void *args, int64_t n_tiles, int nth) {
    pool_run(fn, args, n_tiles, nth);
}
