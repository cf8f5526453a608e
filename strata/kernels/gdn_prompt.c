/* A prompt's gated delta rule (Gated DeltaNet, models/gated_deltanet.py), token by token: per token
 * t of value head h, with q, k L2-normalised (q times d_k^-1/2) and d = exp(g_t),
 *
 *     S <- d S;  delta = (v_t - k^T S) beta_t;  S <- S + k delta^T;  o_t = q^T S
 *
 * with the decode step's products (qmm.c's gdn_head: k^T S summed as k_j (S_j d) in j's order).
 *
 * torch ran a prompt in the chunked form (a triangular solve per chunk, ~40 operators), on one
 * thread: at 2 threads each operator waited for a descheduled peer (Qwen3-Next's 32 heads of
 * 128 x 128 over 512 tokens: 70 ms of CPU, the other core idle). Column c of S evolves alone
 * (delta_c and o_c read column c only), so here a pool tile takes a block of 16 or 32 columns of
 * one head over a block of tokens: the state block (d_k x 32 floats, 16 KiB, packed) stays in L1,
 * and one pass over it per token both finishes token t and sums token t+1's k^T S. A first pool
 * pass L2-normalises the token block's q and k once (each tile had normalised them again: 8 times
 * per key head on Qwen3-Next).
 *
 * Subnormals: a decay under float32's normal range is taken as 0 (as gdn_head), and a tile runs
 * with flush-to-zero and denormals-are-zero (a strongly forgetting head's state shrinks toward
 * subnormal values, each product of which costs ~20x on x86; they are below 1.2e-38).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "pool.h"
void *strata_pp_malloc(size_t bytes); /* prefill.c: malloc, or NULL where its test hook refuses */

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4))); /* unaligned loads and stores */

#define GDN_TOKENS 128 /* tokens per block: their normalised q and k, 2 x 128 x H_k x d_k floats */

typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t q_b, q_t, k_b, k_t, v_b, v_t; /* batch and token strides, in floats */
    float *S, *out;
    int64_t T, hk, hv, dk, dv;
    int64_t t0, nt; /* this block's tokens */
    float *qn, *kn; /* (B, GDN_TOKENS, hk, dk): the block's q (times d_k^-1/2) and k, normalised */
    int64_t blocks; /* column tiles per head: d_v / 32 where 32 divides d_v, else d_v / 16 */
    int nb;         /* a column tile's width in 16-column vectors: 2 or 1 */
} gdn_prompt_args;

/* y = x / sqrt(sum x^2 + 1e-6), then times scale where it is not 1 (transformers' l2norm, then q's
 * scale); the squares summed in 16 lanes */
__attribute__((optimize("fp-contract=off")))
static void l2norm_to(const float *x, float *y, int64_t n, float scale) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16 xi = *(const v16u *)(x + i);
        acc += xi * xi;
    }
    float ss = 0.0f;
    for (int j = 0; j < 16; j++) ss += acc[j];
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + 1e-6f);
    for (i = 0; i < n; i++) y[i] = x[i] * r;
    if (scale != 1.0f)
        for (i = 0; i < n; i++) y[i] = y[i] * scale;
}

/* tile (b, t): token t0 + t of row b, every key head's q and k normalised into qn, kn */
static void norm_tile(const void *a_, int64_t tile) {
    const gdn_prompt_args *a = a_;
    const int64_t b = tile / a->nt, t = tile % a->nt, dk = a->dk, at = (b * GDN_TOKENS + t) * a->hk * dk;
    const float *q = a->q + b * a->q_b + (a->t0 + t) * a->q_t, *k = a->k + b * a->k_b + (a->t0 + t) * a->k_t;
    const float scale = 1.0f / sqrtf((float)dk);
    for (int64_t h = 0; h < a->hk; h++) {
        l2norm_to(q + h * dk, a->qn + at + h * dk, dk, scale);
        l2norm_to(k + h * dk, a->kn + at + h * dk, dk, 1.0f);
    }
}

static float decay_at(const gdn_prompt_args *a, int64_t at) {
    const float e = expf(a->g[at]);
    return e < 1.17549435e-38f ? 0.0f : e;
}

/* columns c0 .. c0 + 16 NB of head `head` (b * hv + h) over the block's tokens */
static inline __attribute__((always_inline)) void columns(const gdn_prompt_args *a, int64_t head, int64_t c0, const int NB) {
    const int64_t dk = a->dk, dv = a->dv, hv = a->hv, hk = a->hk, b = head / hv, h = head % hv, kh = h / (hv / hk);
    const int64_t w = 16 * NB, nt = a->nt;
    /* the block's rows lie dv floats apart in S (512 bytes for d_v 128: a few L1 sets would hold
     * them all); the tile steps a packed copy, rows 16 NB floats apart, and writes it back */
    float *state = a->S + head * dk * dv + c0, S[dk * 16 * NB] __attribute__((aligned(64)));
    for (int64_t j = 0; j < dk; j++) memcpy(S + j * w, state + j * dv, sizeof(float) * (size_t)w);
    const float *qn = a->qn + (b * GDN_TOKENS * hk + kh) * dk, *kn = a->kn + (b * GDN_TOKENS * hk + kh) * dk;
    const int64_t step = hk * dk; /* one token to the next in qn, kn */
    const float *vb = a->v + b * a->v_b + a->t0 * a->v_t + h * dv + c0;
    const int64_t at0 = (b * a->T + a->t0) * hv + h; /* g / beta index of the block's first token */
    static const float zeros[1024];
    v16 acc[NB]; /* k_t^T (d_t S): token t's, summed in the pass before */
    float d = decay_at(a, at0);
    for (int n = 0; n < NB; n++) acc[n] = (v16){0};
    for (int64_t j = 0; j < dk; j++)
        for (int n = 0; n < NB; n++) acc[n] += kn[j] * (*(const v16 *)(S + j * w + 16 * n) * d);
    for (int64_t t = 0; t < nt; t++) {
        const int64_t at = at0 + t * hv;
        if (t + 2 < nt)
            for (int64_t i = 0; i < w; i += 16) __builtin_prefetch(vb + (t + 2) * a->v_t + i);
        const float *qt = qn + t * step, *kt = kn + t * step;
        const float *k1 = t + 1 < nt ? kt + step : zeros; /* the next token's k (zeros after the last: unused) */
        const float d1 = t + 1 < nt ? decay_at(a, at + hv) : 0.0f, beta = a->beta[at];
        v16 delta[NB], o[NB];
        for (int n = 0; n < NB; n++) {
            delta[n] = (*(const v16u *)(vb + t * a->v_t + 16 * n) - acc[n]) * beta;
            o[n] = (v16){0};
            acc[n] = (v16){0};
        }
        for (int64_t j = 0; j < dk; j++) {
            const float kj = kt[j], qj = qt[j], kj1 = k1[j];
            float *row = S + j * w;
            for (int n = 0; n < NB; n++) {
                const v16 s = *(const v16 *)(row + 16 * n) * d + kj * delta[n];
                *(v16 *)(row + 16 * n) = s;
                o[n] += qj * s;
                acc[n] += kj1 * (s * d1);
            }
        }
        float *out = a->out + at * dv + c0;
        for (int n = 0; n < NB; n++) *(v16u *)(out + 16 * n) = o[n];
        d = d1;
    }
    for (int64_t j = 0; j < dk; j++) memcpy(state + j * dv, S + j * w, sizeof(float) * (size_t)w);
}

static void column_tile(const void *a_, int64_t tile) {
    const gdn_prompt_args *a = a_;
    const int64_t blocks = a->blocks;
#if defined(__SSE__)
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040); /* FTZ | DAZ */
#endif
    if (a->nb == 2) columns(a, tile / blocks, (tile % blocks) * 32, 2);
    else columns(a, tile / blocks, (tile % blocks) * 16, 1);
#if defined(__SSE__)
    _mm_setcsr(csr);
#endif
}

/* q, k: (B, T, hk, dk) at batch / token strides q_b, q_t (k_b, k_t), heads dk apart; v: (B, T, hv,
 * dv) likewise; g (log decay), beta: (B, T, hv) contiguous; S: (B, hv, dk, dv), stepped in place
 * over the T positions; out: (B, T, hv, dv). Value head h reads key head h / (hv / hk). A padded
 * position (g = beta = 0) leaves the state as it was. 0 (nothing written) when the shapes do not
 * chain, d_v is not a multiple of 16, or there is no memory for the normalised q and k. */
int strata_gdn_prompt(const float *q, int64_t q_b, int64_t q_t, const float *k, int64_t k_b, int64_t k_t,
                      const float *v, int64_t v_b, int64_t v_t, const float *g, const float *beta, float *S,
                      float *out, int64_t B, int64_t T, int64_t hk, int64_t hv, int64_t dk, int64_t dv, int nth) {
    if (B < 1 || T < 1 || hk < 1 || hv % hk || dk < 1 || dk > 1024 || dv < 16 || dv % 16) return 0;
    const size_t n = (size_t)(B * GDN_TOKENS * hk * dk);
    float *buf = strata_pp_malloc(sizeof(float) * 2 * n);
    if (!buf) return 0;
    nth = nth < 1 ? 1 : nth;
    const int nb = dv % 32 ? 1 : 2; /* 32-column tiles where d_v allows: half the passes over qn, kn */
    for (int64_t t0 = 0; t0 < T; t0 += GDN_TOKENS) {
        const int64_t nt = T - t0 < GDN_TOKENS ? T - t0 : GDN_TOKENS;
        const gdn_prompt_args a = {q, k, v, g, beta, q_b, q_t, k_b, k_t, v_b, v_t, S, out, T, hk, hv, dk, dv,
                                   t0, nt, buf, buf + n, dv / (16 * nb), nb};
        strata_pool_run(norm_tile, &a, B * nt, nth);
        strata_pool_run(column_tile, &a, B * hv * a.blocks, nth);
    }
    free(buf);
    return 1;
}
