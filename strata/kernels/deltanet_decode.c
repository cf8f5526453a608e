/* Decode tokens' Gated DeltaNet layer half, x + DeltaNet(norm(x)), in one call
 * (strata/kernels/decode_ops.py try_gdn_block / try_gdn_mixer; the torch form is
 * models/gated_deltanet.py), for B rows of T positions each (a decode batch: T = 1; a speculative
 * verify pass: T = k + 1, right-padded), per token:
 *
 *     n = rms_norm(x);  [qkv | z | b | a] = W n             (one projection group, qmm.c)
 *     c = silu(causal_conv(conv state, qkv))                (the conv state shifts by one row)
 *     q, k = l2norm per key head (q times d_k^-1/2);  v
 *     beta = sigmoid(b);  decay = exp(ssm_a * softplus(a + dt_bias))
 *     o = the gated delta rule's step on the state          (strata_gdn_step, in place)
 *     y = rms_norm_dv(o) * ssm_norm * act(z)                (act: silu, or sigmoid for qwen4exp)
 *     out = x + W_out y[order]                              (order: qwen4exp's tiled value heads)
 *
 * The recurrence steps each row's state position by position; a padded position (t >= n_new[b])
 * has decay 1 and beta 0, so its state passes through unchanged, as in the torch form.
 *
 * In torch this was ~70 operators per layer and token (3-5 us each) on the calling thread alone,
 * while the kernels' helper threads slept. The products go through qmm.c's entry points; the
 * order of operations is the torch path's (the conv: first tap's product, then one fused
 * multiply-add per tap), but sums of squares run in index order, so the two differ by rounding.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*qmm_fn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int);
void strata_qmm_group(int n, void *const *fns, const void *const *W, const int64_t *rows, int64_t cols,
                      const float *X, int64_t B, const float *const *bias, float *out, float *scratch, int nth);
void strata_gdn_step_from(const float *src, float *S, const float *q, const float *k, const float *v,
                          const float *decay, const float *beta, float *out, int64_t bh, int64_t dk, int64_t dv,
                          int nth);
void strata_rms_norm(const float *x, const float *w, int64_t n, float eps, float *y);
void *strata_pp_malloc(size_t bytes); /* prefill.c: malloc, or NULL where its test hook refuses */

static inline float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

/* torch's softplus (beta 1, threshold 20) */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* x * 1/sqrt(sum x^2 + 1e-6), then times scale where it is not 1 (transformers' l2norm, then q's scale) */
__attribute__((optimize("fp-contract=off")))
static void l2norm(float *x, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * r;
    if (scale != 1.0f)
        for (int64_t i = 0; i < n; i++) x[i] = x[i] * scale;
}

/* x, out: (B, T, hidden); n_new: (B,) real positions per row (the rest is right padding).
 * norm_w: the input RMS norm (NULL: x is the mixer's input as it is, qwen4exp's hyper-connection
 * mix); residual: out = x + W_out y, else out = W_out y.
 * fns / W / rows: the group [attn_qkv (conv_dim rows) | attn_gate (nv * dv) | beta (nv) | alpha (nv)]
 * over hidden columns. conv_state: (B, kernel - 1, conv_dim) floats, oldest row first; each row's
 * becomes its last kernel-1 real inputs. window: NULL, or (B, kernel - 1 + T, conv_dim) receiving
 * [the conv state before, this call's conv inputs] per row (a rollback re-reads it).
 * conv_taps: (kernel, conv_dim), tap-major. S: (B, nv, dk, dv); with steps NULL it is stepped in
 * place, else it is only read and steps (T, B, nv, dk, dv) receives the state after each position.
 * Value head h reads key head h / (nv / nk). gate_sigmoid: the output gate is sigmoid(z), else
 * silu(z). o_order: NULL, or W_out's input column i reads y[o_order[i]].
 * 0 (nothing written, state untouched) when no memory or the shapes do not chain. */
__attribute__((optimize("fp-contract=off")))
int strata_gdn_decode(const float *x, int64_t B, int64_t T, const int64_t *n_new, int64_t hidden,
                      const float *norm_w, float eps, void *const *fns, const void *const *W, const int64_t *rows,
                      int64_t nk, int64_t nv, int64_t dk, int64_t dv, float *conv_state, float *window,
                      const float *conv_taps, int64_t kernel, const float *dt_bias, const float *ssm_a, float *S,
                      float *steps, const float *ssm_norm_w, float ssm_eps, int gate_sigmoid, void *o_fn,
                      const void *o_W, const int64_t *o_order, int residual, float *out, int nth) {
    const int64_t key_dim = nk * dk, value_dim = nv * dv, conv_dim = 2 * key_dim + value_dim;
    if (B < 1 || T < 1 || nk <= 0 || nv % nk || kernel < 1 || rows[0] != conv_dim || rows[1] != value_dim
        || rows[2] != nv || rows[3] != nv)
        return 0;
    for (int64_t b = 0; b < B; b++)
        if (n_new[b] < 0 || n_new[b] > T) return 0;
    const int64_t r = nv / nk, proj = conv_dim + value_dim + 2 * nv, N = B * T, last = kernel - 1, wrows = last + T;
    const size_t floats = (size_t)(N * hidden + N * proj + N * conv_dim
                                   + 2 * B * nv * dk + B * value_dim + 2 * N * nv + 2 * N * value_dim + B * value_dim
                                   + N * hidden + N * (proj > hidden ? proj : hidden));
    float *buf = strata_pp_malloc(sizeof(float) * floats + 64);
    if (!buf) return 0;
    float *n = buf, *p = n + N * hidden, *c = p + N * proj, *qe = c + N * conv_dim, *ke = qe + B * nv * dk,
          *vs = ke + B * nv * dk, *decay = vs + B * value_dim, *beta = decay + N * nv, *o = beta + N * nv,
          *y = o + N * value_dim, *os = y + N * value_dim, *w_out = os + B * value_dim, *scratch = w_out + N * hidden;
    const float *const bias[4] = {NULL, NULL, NULL, NULL};
    const float *xin = x;
    if (norm_w) {
        for (int64_t i = 0; i < N; i++) strata_rms_norm(x + i * hidden, norm_w, hidden, eps, n + i * hidden);
        xin = n;
    }
    strata_qmm_group(4, fns, W, rows, hidden, xin, N, bias, p, scratch, nth);

    /* per row: the conv over the window [conv state, this call's qkv rows], then SiLU; the state
     * keeps the last kernel-1 real rows, window rows n_new .. n_new + kernel - 2 (moved up in
     * place: each row is read before it is overwritten); a verify pass keeps the window too */
    for (int64_t b = 0; b < B; b++) {
        float *cs = conv_state + b * last * conv_dim;
        const float *qkv_b = p + b * T * proj;
#define WIN_ROW(w) ((w) < last ? cs + (w) * conv_dim : qkv_b + ((w) - last) * proj)
        if (window) {
            float *wb = window + b * wrows * conv_dim;
            for (int64_t w = 0; w < wrows; w++) memcpy(wb + w * conv_dim, WIN_ROW(w), sizeof(float) * (size_t)conv_dim);
        }
        for (int64_t t = 0; t < T; t++) {
            float *ct = c + (b * T + t) * conv_dim;
            const float *x0 = WIN_ROW(t);
            for (int64_t i = 0; i < conv_dim; i++) ct[i] = x0[i] * conv_taps[i];
            for (int64_t j = 1; j < kernel; j++) {
                const float *xj = WIN_ROW(t + j), *wj = conv_taps + j * conv_dim;
                for (int64_t i = 0; i < conv_dim; i++) ct[i] = fmaf(xj[i], wj[i], ct[i]);
            }
            for (int64_t i = 0; i < conv_dim; i++) ct[i] = ct[i] * sigmoid(ct[i]);
        }
        for (int64_t w = 0; w < last; w++)
            if (n_new[b])
                memmove(cs + w * conv_dim, WIN_ROW(n_new[b] + w), sizeof(float) * (size_t)conv_dim);
#undef WIN_ROW
    }

    /* q, k per key head, L2-normalised (q then scaled); beta and the decay per value head */
    const float scale = 1.0f / sqrtf((float)dk);
    for (int64_t i = 0; i < N; i++) {
        float *ci = c + i * conv_dim;
        const int real = i % T < n_new[i / T];
        for (int64_t h = 0; h < nk; h++) {
            l2norm(ci + h * dk, dk, scale);
            l2norm(ci + key_dim + h * dk, dk, 1.0f);
        }
        const float *b_ = p + i * proj + conv_dim + value_dim, *a_ = b_ + nv;
        for (int64_t h = 0; h < nv; h++) {
            beta[i * nv + h] = real ? sigmoid(b_[h]) : 0.0f;
            decay[i * nv + h] = real ? expf(ssm_a[h] * softplus(a_[h] + dt_bias[h])) : 1.0f;
        }
    }

    /* the delta rule, one position of every row per step: q, k per value head, v, out gathered
     * row-major over (row, head); the state from S, or from the last position's in steps */
    const int64_t sz = B * nv * dk * dv;
    for (int64_t t = 0; t < T; t++) {
        float db[B * nv], bb[B * nv];
        for (int64_t b = 0; b < B; b++) {
            const float *ci = c + (b * T + t) * conv_dim;
            for (int64_t h = 0; h < nv; h++) {
                memcpy(qe + (b * nv + h) * dk, ci + (h / r) * dk, sizeof(float) * (size_t)dk);
                memcpy(ke + (b * nv + h) * dk, ci + key_dim + (h / r) * dk, sizeof(float) * (size_t)dk);
                db[b * nv + h] = decay[(b * T + t) * nv + h];
                bb[b * nv + h] = beta[(b * T + t) * nv + h];
            }
            memcpy(vs + b * value_dim, ci + 2 * key_dim, sizeof(float) * (size_t)value_dim);
        }
        const float *src = steps ? (t ? steps + (t - 1) * sz : S) : S;
        float *dst = steps ? steps + t * sz : S;
        strata_gdn_step_from(src, dst, qe, ke, vs, db, bb, os, B * nv, dk, dv, nth);
        for (int64_t b = 0; b < B; b++)
            memcpy(o + (b * T + t) * value_dim, os + b * value_dim, sizeof(float) * (size_t)value_dim);
    }

    /* per token and value head: RMS norm over d_v, times ssm_norm, times the gate; then W_out's
     * column order */
    for (int64_t i = 0; i < N; i++)
        for (int64_t h = 0; h < nv; h++) {
            const float *oh = o + i * value_dim + h * dv, *zh = p + i * proj + conv_dim + h * dv;
            float *yh = y + i * value_dim + h * dv, ss = 0.0f;
            for (int64_t j = 0; j < dv; j++) ss += oh[j] * oh[j];
            const float rn = 1.0f / sqrtf(ss / (float)dv + ssm_eps);
            for (int64_t j = 0; j < dv; j++) {
                const float g = gate_sigmoid ? sigmoid(zh[j]) : zh[j] * sigmoid(zh[j]);
                yh[j] = (ssm_norm_w[j] * (oh[j] * rn)) * g;
            }
        }
    const float *yo = y;
    if (o_order) {
        float *yp = o; /* o is spent: y reordered into it */
        for (int64_t i = 0; i < N; i++)
            for (int64_t j = 0; j < value_dim; j++) yp[i * value_dim + j] = y[i * value_dim + o_order[j]];
        yo = yp;
    }
    ((qmm_fn)o_fn)((const uint8_t *)o_W, hidden, value_dim, yo, N, w_out, nth);
    for (int64_t i = 0; i < N * hidden; i++) out[i] = residual ? x[i] + w_out[i] : w_out[i];
    free(buf);
    return 1;
}
