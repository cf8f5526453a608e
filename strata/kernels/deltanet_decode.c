/* A decode token's Gated DeltaNet layer half, x + DeltaNet(norm(x)), in one call
 * (strata/kernels/decode_ops.py try_gdn_block; the torch form is models/gated_deltanet.py):
 *
 *     n = rms_norm(x);  [qkv | z | b | a] = W n             (one projection group, qmm.c)
 *     c = silu(causal_conv(conv state, qkv))                (the conv state shifts by one row)
 *     q, k = l2norm per key head (q times d_k^-1/2);  v
 *     beta = sigmoid(b);  decay = exp(ssm_a * softplus(a + dt_bias))
 *     o = the gated delta rule's step on the state          (strata_gdn_step, in place)
 *     y = rms_norm_dv(o) * ssm_norm * act(z)                (act: silu, or sigmoid for qwen4exp)
 *     out = x + W_out y
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
void strata_gdn_step(float *S, const float *q, const float *k, const float *v, const float *decay,
                     const float *beta, float *out, int64_t bh, int64_t dk, int64_t dv, int nth);
void strata_rms_norm(const float *x, const float *w, int64_t n, float eps, float *y);

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

/* fns / W / rows: the group [attn_qkv (conv_dim rows) | attn_gate (nv * dv) | beta (nv) | alpha (nv)]
 * over hidden columns. conv_state: (kernel - 1, conv_dim) floats, oldest row first, shifted in
 * place; conv_taps: (kernel, conv_dim), tap-major. S: (nv, dk, dv), updated in place. Value head h
 * reads key head h / (nv / nk). gate_sigmoid: the output gate is sigmoid(z), else silu(z).
 * 0 (nothing written, state untouched) when no memory or the shapes do not chain. */
__attribute__((optimize("fp-contract=off")))
int strata_gdn_decode(const float *x, int64_t hidden, const float *norm_w, float eps, void *const *fns,
                      const void *const *W, const int64_t *rows, int64_t nk, int64_t nv, int64_t dk, int64_t dv,
                      float *conv_state, const float *conv_taps, int64_t kernel, const float *dt_bias,
                      const float *ssm_a, float *S, const float *ssm_norm_w, float ssm_eps, int gate_sigmoid,
                      void *o_fn, const void *o_W, float *out, int nth) {
    const int64_t key_dim = nk * dk, value_dim = nv * dv, conv_dim = 2 * key_dim + value_dim;
    if (nk <= 0 || nv % nk || kernel < 1 || rows[0] != conv_dim || rows[1] != value_dim || rows[2] != nv
        || rows[3] != nv)
        return 0;
    const int64_t r = nv / nk, proj = conv_dim + value_dim + 2 * nv;
    float *buf = malloc(sizeof(float) * (size_t)(hidden + proj + conv_dim + 2 * nv * dk + 2 * nv + 2 * value_dim
                                                 + hidden) + 64);
    if (!buf) return 0;
    float *n = buf, *p = n + hidden, *c = p + proj, *qe = c + conv_dim, *ke = qe + nv * dk, *decay = ke + nv * dk,
          *beta = decay + nv, *o = beta + nv, *y = o + value_dim, *w_out = y + value_dim;
    const float *qkv = p, *z = p + conv_dim, *b = z + value_dim, *a = b + nv;
    const float *const bias[4] = {NULL, NULL, NULL, NULL};
    strata_rms_norm(x, norm_w, hidden, eps, n);
    strata_qmm_group(4, fns, W, rows, hidden, n, 1, bias, p, NULL, nth);

    /* the conv over [state rows, this token], then SiLU; the state keeps the last kernel-1 rows */
    const int64_t last = kernel - 1;
    for (int64_t i = 0; i < conv_dim; i++) {
        const float x0 = last ? conv_state[i] : qkv[i];
        c[i] = x0 * conv_taps[i];
    }
    for (int64_t j = 1; j < kernel; j++) {
        const float *xj = j < last ? conv_state + j * conv_dim : qkv;
        const float *wj = conv_taps + j * conv_dim;
        for (int64_t i = 0; i < conv_dim; i++) c[i] = fmaf(xj[i], wj[i], c[i]);
    }
    if (last) {
        memmove(conv_state, conv_state + conv_dim, sizeof(float) * (size_t)((last - 1) * conv_dim));
        memcpy(conv_state + (last - 1) * conv_dim, qkv, sizeof(float) * (size_t)conv_dim);
    }
    for (int64_t i = 0; i < conv_dim; i++) c[i] = c[i] * sigmoid(c[i]);

    /* q, k per key head, L2-normalised (q then scaled), copied out per value head for the step */
    const float scale = 1.0f / sqrtf((float)dk);
    float *cq = c, *ck = c + key_dim;
    const float *v = c + 2 * key_dim;
    for (int64_t h = 0; h < nk; h++) {
        l2norm(cq + h * dk, dk, scale);
        l2norm(ck + h * dk, dk, 1.0f);
    }
    for (int64_t h = 0; h < nv; h++) {
        memcpy(qe + h * dk, cq + (h / r) * dk, sizeof(float) * (size_t)dk);
        memcpy(ke + h * dk, ck + (h / r) * dk, sizeof(float) * (size_t)dk);
        beta[h] = sigmoid(b[h]);
        decay[h] = expf(ssm_a[h] * softplus(a[h] + dt_bias[h]));
    }
    strata_gdn_step(S, qe, ke, v, decay, beta, o, nv, dk, dv, nth);

    /* per value head: RMS norm over d_v, times ssm_norm, times the gate */
    for (int64_t h = 0; h < nv; h++) {
        const float *oh = o + h * dv, *zh = z + h * dv;
        float *yh = y + h * dv, ss = 0.0f;
        for (int64_t i = 0; i < dv; i++) ss += oh[i] * oh[i];
        const float rn = 1.0f / sqrtf(ss / (float)dv + ssm_eps);
        for (int64_t i = 0; i < dv; i++) {
            const float g = gate_sigmoid ? sigmoid(zh[i]) : zh[i] * sigmoid(zh[i]);
            yh[i] = (ssm_norm_w[i] * (oh[i] * rn)) * g;
        }
    }
    ((qmm_fn)o_fn)((const uint8_t *)o_W, hidden, value_dim, y, 1, w_out, nth);
    for (int64_t i = 0; i < hidden; i++) out[i] = x[i] + w_out[i];
    free(buf);
    return 1;
}
