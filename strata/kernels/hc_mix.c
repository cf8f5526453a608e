/* The hyper-connection mix of a decode step (strata/models/hyper_connections.py), one C call.
 * Built into the kernel library by strata/kernels/_build.py; its products are qmm.c's float16 ones.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

void strata_f16mm(const uint16_t *W, int64_t rows, int64_t cols, const float *X, int64_t B, float *Y, int nth);

/* One hyper-connection mix (strata/models/hyper_connections.py: HyperConnection.mix) of B rows of
 * x (B x hc*hidden) with float16 down (rank x width), up (width x rank) and inject (hc x width, or
 * NULL for the output mixer): each stream RMS-normed and scaled by norm, gate = sigmoid(up .
 * silu(down . xn / hc)), mixed (B x hidden) = the streams' mean of gate * xn, weights (B x hc) =
 * 2 sigmoid(inject . xn / hc). One call where the torch form ran ~15 operators around the three
 * products, 0.5-0.8 ms a mix (97 a flagship token). The products are strata_f16mm's; each row is
 * computed alone, as a one-token step would. 0 when a size is not positive or its scratch cannot be
 * had (nothing written). */
int strata_hc_mix(const float *X, int64_t B, int64_t hc, int64_t hidden, const float *norm, float eps,
                  const uint16_t *down, const uint16_t *up, const uint16_t *inject, int64_t rank,
                  float *mixed, float *weights, int nth) {
    if (B < 1 || hc < 1 || hidden < 1 || rank < 1) return 0; /* try_hc_mix checks these; here they let GCC see xn written */
    const int64_t width = hc * hidden;
    /* one scratch block for xn, gate (B x width each) and h (B x max(rank, hc)) */
    float *xn = malloc((size_t)(B * (2 * width + (rank > hc ? rank : hc))) * sizeof(float));
    if (!xn) return 0;
    float *gate = xn + B * width, *h = gate + B * width;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < hc; s++) {
            const float *x = X + b * width + s * hidden;
            double ss = 0.0;
            for (int64_t i = 0; i < hidden; i++) ss += (double)x[i] * x[i];
            const float r = 1.0f / sqrtf((float)(ss / (double)hidden) + eps);
            float *y = xn + b * width + s * hidden;
            const float *w = norm + s * hidden;
            for (int64_t i = 0; i < hidden; i++) y[i] = (x[i] * r) * w[i];
        }
    strata_f16mm(down, rank, width, xn, B, h, nth);
    for (int64_t i = 0; i < B * rank; i++) {
        const float v = h[i] / (float)hc;
        h[i] = v / (1.0f + expf(-v));
    }
    strata_f16mm(up, width, rank, h, B, gate, nth);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < hidden; i++) {
            float sum = 0.0f;
            for (int64_t s = 0; s < hc; s++) {
                const int64_t k = b * width + s * hidden + i;
                sum += (1.0f / (1.0f + expf(-gate[k]))) * xn[k];
            }
            mixed[b * hidden + i] = sum / (float)hc;
        }
    if (inject != NULL && weights != NULL) {
        strata_f16mm(inject, hc, width, xn, B, h, 1);
        for (int64_t i = 0; i < B * hc; i++) weights[i] = 2.0f / (1.0f + expf(-h[i] / (float)hc));
    }
    free(xn);
    return 1;
}
