/* The causal depthwise conv of a Gated DeltaNet layer's prefill: out[b, t, c] = sum_j x[b, t + j, c] w[j, c]
 * over the window [conv state (K-1 rows), this step's T rows] (K taps, oldest first).
 *
 * torch's form makes a (T, C) temporary per tap and passes over the output K times (a 512-token
 * prompt of Qwen3-Next: 16 MiB each); here a tile of rows is summed one output row at a time,
 * which stays in L1/L2 across the taps. The order of operations is torch's in-place form's: the
 * first tap's product, then one fused multiply-add per later tap.
 *
 * Built into the same library as qmm.c, whose thread pool runs the tiles (row blocks).
 */
#include <math.h>
#include <stdint.h>

#include "pool.h"

#define CONV_TILE_ROWS 16

typedef struct {
    const float *x;  /* (B, K-1+T, C) */
    const float *w;  /* (K, C): tap-major */
    float *out;      /* (B, T, C) */
    int64_t t, c, k, tiles_per_row;
} conv_args;

static void conv_tile(const void *p, int64_t tile) {
    const conv_args *a = p;
    const int64_t row = tile / a->tiles_per_row, t0 = (tile % a->tiles_per_row) * CONV_TILE_ROWS;
    const int64_t t1 = t0 + CONV_TILE_ROWS < a->t ? t0 + CONV_TILE_ROWS : a->t, c = a->c;
    const float *x = a->x + row * (a->t + a->k - 1) * c;
    float *out = a->out + row * a->t * c;
    for (int64_t t = t0; t < t1; t++) {
        float *restrict o = out + t * c;
        const float *restrict x0 = x + t * c, *restrict w0 = a->w;
        for (int64_t i = 0; i < c; i++) o[i] = x0[i] * w0[i];
        for (int64_t j = 1; j < a->k; j++) {
            const float *restrict xj = x + (t + j) * c, *restrict wj = a->w + j * c;
            for (int64_t i = 0; i < c; i++) o[i] = fmaf(xj[i], wj[i], o[i]);
        }
    }
}

void strata_causal_conv(const float *x, const float *w, float *out, int64_t b, int64_t t, int64_t c, int64_t k,
                        int nth) {
    if (b <= 0 || t <= 0) return;
    const int64_t per_row = (t + CONV_TILE_ROWS - 1) / CONV_TILE_ROWS;
    const conv_args a = {x, w, out, t, c, k, per_row};
    strata_pool_run(conv_tile, &a, b * per_row, nth < 1 ? 1 : nth);
}
