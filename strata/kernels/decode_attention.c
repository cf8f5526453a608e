/* One decode token's attention over its KV cache (strata_attn_decode's core, qmm.c): for query head
 * h, softmax(q_h . K_g / sqrt(D)) V_g over the S cached positions of its kv head g = h / (n_heads /
 * n_kv).
 *
 * The form it replaces summed each q . k in index order, one dependent float add at a time (~4
 * cycles each), head by head on the calling thread: at 2,000 cached tokens a Qwen3-Next attention
 * layer (16 heads of 256) took ~8 ms per token, where reading its K and V takes ~0.7 ms. Here a
 * pool tile takes one kv head and its query heads (or a share of them, so every thread has one):
 * each key row is read once for all of them and each dot product is summed in 16 independent lanes
 * (a fixed order, whatever the thread count), and the softmax's exponentials are vectorized.
 */
#include <math.h>
#include <stdint.h>

#include "pool.h"

#define ATT_LANES 16

typedef struct {
    const float *q, *kc, *vc;
    float *scores, *att;
    int64_t cap, S, D, grp, split, per;
    float scale;
} attend_args;

typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4))); /* unaligned loads */

static inline float dot_lanes(const float *restrict a, const float *restrict b, int64_t n) {
    v8f s0 = {0}, s1 = {0};
    int64_t i = 0;
    for (; i + ATT_LANES <= n; i += ATT_LANES) {
        s0 += *(const v8fu *)(a + i) * *(const v8fu *)(b + i);
        s1 += *(const v8fu *)(a + i + 8) * *(const v8fu *)(b + i + 8);
    }
    float acc[8];
    for (int j = 0; j < 8; j++) acc[j] = s0[j] + s1[j];
    for (int j = 0; i < n; i++, j = (j + 1) % 8) acc[j] += a[i] * b[i];
    for (int width = 4; width > 0; width /= 2)
        for (int j = 0; j < width; j++) acc[j] += acc[j + width];
    return acc[0];
}

/* p[i] = exp(p[i]) for the softmax's p[i] <= 0 (Cephes' expf: 2^k e^r, |r| <= ln2 / 2, a degree-6
 * polynomial, ~1 ulp), in a form the compiler vectorizes; glibc's expf is a call per value (a fifth
 * of this function's time at 2,000 positions). Below -87 (e^-87 = 1.6e-38, nothing beside the
 * largest term's 1) it returns e^-87 rather than a subnormal. */
static void exp_nonpositive(float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = p[i] < -87.0f ? -87.0f : p[i];
        const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln2) */
        const float r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
        float y = 1.9875691500e-4f;
        y = y * r + 1.3981999507e-3f;
        y = y * r + 8.3334519073e-3f;
        y = y * r + 4.1665795894e-2f;
        y = y * r + 1.6666665459e-1f;
        y = y * r + 5.0000001201e-1f;
        y = y * (r * r) + r + 1.0f;
        union { int32_t i; float f; } two_k = {.i = ((int32_t)k + 127) << 23};
        p[i] = y * two_k.f;
    }
}

/* p[0..S) to its softmax, in place: one order of operations for every attention here, so a
 * verify pass's row equals its one-token step's bit for bit. */
static void softmax_inplace(float *p, int64_t S) {
    float m = -INFINITY, sum = 0.0f;
    for (int64_t s = 0; s < S; s++) m = p[s] > m ? p[s] : m;
    for (int64_t s = 0; s < S; s++) p[s] = p[s] - m;
    exp_nonpositive(p, S);
    for (int64_t s = 0; s < S; s++) sum += p[s];
    for (int64_t s = 0; s < S; s++) p[s] = p[s] / sum;
}

static void attend_tile(const void *a_, int64_t tile) {
    const attend_args *a = a_;
    const int64_t g = tile / a->split, h0 = g * a->grp + (tile % a->split) * a->per;
    const int64_t h1 = h0 + a->per < (g + 1) * a->grp ? h0 + a->per : (g + 1) * a->grp;
    const int64_t S = a->S, D = a->D;
    const float *K = a->kc + g * a->cap * D, *V = a->vc + g * a->cap * D;
    if (h0 >= h1) return;
    for (int64_t s = 0; s < S; s++)
        for (int64_t h = h0; h < h1; h++) a->scores[h * S + s] = dot_lanes(a->q + h * D, K + s * D, D) * a->scale;
    for (int64_t h = h0; h < h1; h++) {
        softmax_inplace(a->scores + h * S, S);
        float *ah = a->att + h * D;
        for (int64_t i = 0; i < D; i++) ah[i] = 0.0f;
    }
    for (int64_t s = 0; s < S; s++) {
        const float *vs = V + s * D;
        for (int64_t h = h0; h < h1; h++) {
            const float ps = a->scores[h * S + s];
            float *restrict ah = a->att + h * D;
            for (int64_t i = 0; i < D; i++) ah[i] += ps * vs[i];
        }
    }
}

/* q: [n_heads, D]; kc, vc: [n_kv, cap, D] holding S positions; scores: n_heads * S floats of
 * scratch; att: [n_heads, D] out. */
void strata_attend_decode(const float *q, const float *kc, const float *vc, int64_t cap, int64_t S, int64_t n_heads,
                          int64_t n_kv, int64_t D, float *scores, float *att, int nth) {
    if (nth < 1) nth = 1;
    const int64_t grp = n_heads / n_kv;
    int64_t split = (nth + n_kv - 1) / n_kv; /* tiles per kv head: at least one per thread */
    if (split > grp) split = grp;
    const int64_t per = (grp + split - 1) / split;
    const attend_args a = {q, kc, vc, scores, att, cap, S, D, grp, split, per, 1.0f / sqrtf((float)D)};
    strata_pool_run(attend_tile, &a, n_kv * split, nth);
}

/* ------------------------------------------------------------------ several new tokens a row
 *
 * A verify pass (a row's k + 1 new tokens) or a decode batch (B rows of one) attended in torch:
 * a (B, 1, T, S) mask built per layer, then scaled_dot_product_attention over a few query rows,
 * each a handful of torch operators per layer. Here a pool tile takes one (row, query head, new
 * token): new token t of row b attends keys 0 .. start[b] + t of its kv head, by the arithmetic of
 * attend_tile above (the same dot products, softmax and sums in the same order), so each row's
 * attention equals its one-token step's. */
typedef struct {
    const float *q, *kc, *vc;
    const int64_t *start;
    float *scores, *att;
    int64_t q_b, q_h, q_t; /* q's strides, in floats (D values contiguous) */
    int64_t n_heads, n_kv, T, cap, D, most; /* most: scores per tile */
    float scale;
} rows_args;

static void rows_tile(const void *a_, int64_t tile) {
    const rows_args *a = a_;
    const int64_t t = tile % a->T, h = (tile / a->T) % a->n_heads, b = tile / (a->T * a->n_heads);
    const int64_t g = h / (a->n_heads / a->n_kv), D = a->D, S = a->start[b] + t + 1;
    const float *q = a->q + b * a->q_b + h * a->q_h + t * a->q_t;
    const float *K = a->kc + (b * a->n_kv + g) * a->cap * D, *V = a->vc + (b * a->n_kv + g) * a->cap * D;
    float *p = a->scores + tile * a->most;
    for (int64_t s = 0; s < S; s++) p[s] = dot_lanes(q, K + s * D, D) * a->scale;
    softmax_inplace(p, S);
    float *restrict ah = a->att + ((b * a->T + t) * a->n_heads + h) * D;
    for (int64_t i = 0; i < D; i++) ah[i] = 0.0f;
    for (int64_t s = 0; s < S; s++) {
        const float ps = p[s], *vs = V + s * D;
        for (int64_t i = 0; i < D; i++) ah[i] += ps * vs[i];
    }
}

/* q: (B, n_heads, T, D) at strides q_b, q_h, q_t (floats); kc, vc: (B, n_kv, cap, D) holding each
 * row's start[b] + T positions; new token t of row b attends keys 0 .. start[b] + t. scores:
 * B * n_heads * T * (max start + T) floats of scratch; att: (B, T, n_heads, D) out. 0 (nothing
 * written) when a row's keys pass cap. */
int strata_attend_rows(const float *q, int64_t q_b, int64_t q_h, int64_t q_t, const float *kc, const float *vc,
                       int64_t cap, const int64_t *start, int64_t B, int64_t T, int64_t n_heads, int64_t n_kv,
                       int64_t D, float *scores, float *att, int nth) {
    if (B < 1 || T < 1 || n_kv < 1 || n_heads % n_kv) return 0;
    int64_t most = 0;
    for (int64_t b = 0; b < B; b++) {
        if (start[b] < 0 || start[b] + T > cap) return 0;
        most = start[b] + T > most ? start[b] + T : most;
    }
    const rows_args a = {q, kc, vc, start, scores, att, q_b, q_h, q_t, n_heads, n_kv, T, cap, D, most,
                         1.0f / sqrtf((float)D)};
    strata_pool_run(rows_tile, &a, B * n_heads * T, nth < 1 ? 1 : nth);
    return 1;
}
