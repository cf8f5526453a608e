/* The kernel thread pool (pool.c), for the library's other .c files. */
#ifndef STRATA_POOL_H
#define STRATA_POOL_H

#include <stdint.h>

/* Run fn(args, t) for t in [0, n_tiles) on up to nth threads (the caller included). */
void strata_pool_run(void (*fn)(const void *, int64_t), const void *args, int64_t n_tiles, int nth);
/* A mark in the pool's timeline (strata_pool_trace): where a caller is, e.g. a layer's start. */
void strata_pool_mark(int64_t tag, int64_t info);

/* Inside the library only (qmm.c): the same pool_run without the exported wrapper, whether nth - 1
 * helpers exist and none is asleep (a racy hint for small products), and what the calling
 * thread's next job is in the timeline (its call site's tag and info, the weight bytes it reads). */
#define STRATA_INTERNAL __attribute__((visibility("hidden")))
STRATA_INTERNAL void pool_run(void (*fn)(const void *, int64_t), const void *args, int64_t n_tiles, int nth);
STRATA_INTERNAL int pool_awake(int nth);
STRATA_INTERNAL extern __thread int64_t pool_tag, pool_info, pool_bytes;

#endif
