/* A decode token through a stack of llama-style layers in one call (strata/kernels/decode_stack.py).
 *
 * Per layer, x + attention(norm(x)) (or a Gated DeltaNet mixer, Qwen3-Next's linear-attention
 * layers) then h + ffn(norm(h)) (a dense SwiGLU or a routed MoE with an optional, optionally
 * sigmoid-gated, shared expert), by the same layer halves the one-call-per-half path uses (qmm.c:
 * strata_attn_decode, strata_ffn_decode, strata_moe_decode; deltanet_decode.c: strata_gdn_decode),
 * so the result is that path's, bit for bit. What one call saves is the Python between the halves (the module checks, argument packing
 * and ctypes trips: ~0.1 ms a layer), which ran on the calling thread while the pool's helper had
 * nothing to do and fell asleep, to be woken again by the next product. Here the gaps between pool
 * jobs are microseconds, so the helper stays awake through the whole stack.
 *
 * The layer descriptions are built once in Python (ctypes mirrors strata_layer field for field;
 * every field is 8 bytes wide, so there is no padding to agree on). The KV cache pointers are
 * rewritten there when a cache grows, and a DeltaNet layer's conv / state pointers when its cache
 * holds other tensors (a new request, a rollback, a row selection).
 */
#include <stdint.h>

int strata_attn_decode(const float *x, int64_t hidden, const float *norm_w, float eps, void *const *fns,
                       const void *const *W, const int64_t *rows, const float *const *bias, int64_t n_heads,
                       int64_t n_kv, int64_t head_dim, const float *qn_w, const float *kn_w, float qk_eps,
                       const float *cs, const float *sn, int64_t rot, int interleaved, float *kc, float *vc,
                       int64_t cap, int64_t pos, void *o_fn, const void *o_W, int gated, float *out, int nth);
int strata_ffn_decode(const float *h, int64_t hidden, const float *norm_w, float eps, void *const *fns,
                      const void *const *W, int64_t ffn, void *down_fn, const void *down_W, float *out, int nth);
int strata_moe_decode(const float *h, int64_t hidden, const float *norm_w, float eps, const float *router,
                      int64_t n_exp, int k, int normalize, const uint8_t *gate, int64_t gs, const uint8_t *up,
                      int64_t us, const uint8_t *down, int64_t ds, void *gate_fn, void *up_fn, void *down_fn,
                      int64_t ffn, void *const *sh_fns, const void *const *sh_W, int64_t sh_ffn,
                      const float *sh_gate, int64_t *ids_out, float *w_out, float *out, int nth);
int strata_gdn_decode(const float *x, int64_t B, int64_t T, const int64_t *n_new, int64_t hidden,
                      const float *norm_w, float eps, void *const *fns, const void *const *W, const int64_t *rows,
                      int64_t nk, int64_t nv, int64_t dk, int64_t dv, float *conv_state, float *window,
                      const float *conv_taps, int64_t kernel, const float *dt_bias, const float *ssm_a, float *S,
                      float *steps, const float *ssm_norm_w, float ssm_eps, int gate_sigmoid, void *o_fn,
                      const void *o_W, const int64_t *o_order, int residual, float *out, int nth);

#include "pool.h"
void strata_rms_norm(const float *x, const float *w, int64_t n, float eps, float *y);
int strata_dequant(int type, const uint8_t *W, int64_t rows, int64_t cols, int64_t wrow, void *Y, int bf16, int nth);
typedef void (*qmm_fn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int);

#define STACK_MAX_K 128

typedef struct {
    /* attention half: x + W_o attn(q, k, v), q/k/v = group(norm(x)) */
    const float *attn_norm;
    double attn_eps;
    void *qkv_fn[3];
    const void *qkv_w[3];
    int64_t qkv_rows[3];
    const float *qkv_bias[3];
    int64_t n_heads, n_kv, head_dim;
    const float *q_norm, *k_norm; /* per-head RMS norms (NULL: none) */
    double qk_eps;
    int64_t rot, interleaved, gated;
    float *kc, *vc; /* [n_kv, cap, head_dim] */
    int64_t cap;
    void *o_fn;
    const void *o_w;
    /* FFN half: h + ffn(norm(h)) */
    const float *ffn_norm;
    double ffn_eps;
    int64_t moe;        /* 0: the dense SwiGLU below; 1: routed experts (plus the shared one below, if ffn_rows) */
    void *ffn_fn[3];    /* gate, up, down of the dense FFN or of the shared expert */
    const void *ffn_w[3];
    int64_t ffn_rows;   /* their intermediate size (0 in a MoE layer: no shared expert) */
    const float *sh_gate; /* the shared expert's sigmoid gate row (NULL: none) */
    const float *router; /* [n_exp, hidden] float32 */
    int64_t n_exp, k, normalize;
    const void *exp_w[3]; /* stacked experts: expert e's matrix j at exp_w[j] + e * exp_stride[j] */
    int64_t exp_stride[3];
    void *exp_fn[3];
    int64_t exp_ffn;
    /* a Gated DeltaNet mixer in place of the attention (gdn 1; deltanet_decode.c): attn_norm,
     * attn_eps, o_fn and o_w above are its input norm and ssm_out */
    int64_t gdn;
    void *gdn_fn[4];     /* the in-projection group: attn_qkv | attn_gate | beta | alpha */
    const void *gdn_w[4];
    int64_t gdn_rows[4];
    int64_t nk, nv, dk, dv;
    float *conv;         /* (1, kernel - 1, conv_dim): the conv state, shifted in place */
    const float *taps;   /* (kernel, conv_dim), tap-major */
    int64_t kernel;
    const float *dt_bias, *ssm_a;
    float *state;        /* (1, nv, dk, dv): the delta-rule state, stepped in place */
    const float *ssm_norm;
    double ssm_eps;
    int64_t gate_sigmoid;
    const int64_t *order; /* ssm_out's input order (NULL: its own) */
} strata_layer;

int64_t strata_layer_size(void) { return (int64_t)sizeof(strata_layer); }

/* x (hidden floats) through layers L[0..n) at cache position pos, in place; cs / sn: the token's
 * rotary cos / sin (rot / 2 each, shared by the layers); tmp: hidden floats. The number of layer
 * halves run, 2 n when done: a half that found no memory stops the stack, with x the input of layer
 * r / 2 and, r odd, tmp its h = x + mixer(norm(x)), so the caller runs the rest (a DeltaNet state
 * must not be stepped twice). */
int64_t strata_decode_stack(const strata_layer *L, int64_t n, int64_t hidden, float *x, const float *cs,
                        const float *sn, int64_t pos, float *tmp, int nth) {
    int64_t ids[STACK_MAX_K];
    float w[STACK_MAX_K];
    const int64_t one = 1;
    for (int64_t i = 0; i < n; i++) {
        const strata_layer *l = &L[i];
        strata_pool_mark(10, i); /* the timeline's layer boundaries */
        if (l->gdn) {
            if (!strata_gdn_decode(x, 1, 1, &one, hidden, l->attn_norm, (float)l->attn_eps, l->gdn_fn, l->gdn_w,
                                   l->gdn_rows, l->nk, l->nv, l->dk, l->dv, l->conv, (float *)0, l->taps, l->kernel,
                                   l->dt_bias, l->ssm_a, l->state, (float *)0, l->ssm_norm, (float)l->ssm_eps,
                                   (int)l->gate_sigmoid, l->o_fn, l->o_w, l->order, 1, tmp, nth))
                return 2 * i;
        } else if (!strata_attn_decode(x, hidden, l->attn_norm, (float)l->attn_eps, l->qkv_fn, l->qkv_w, l->qkv_rows,
                                l->qkv_bias, l->n_heads, l->n_kv, l->head_dim, l->q_norm, l->k_norm,
                                (float)l->qk_eps, cs, sn, l->rot, (int)l->interleaved, l->kc, l->vc, l->cap, pos,
                                l->o_fn, l->o_w, (int)l->gated, tmp, nth))
            return 2 * i;
        int ok;
        strata_pool_mark(11, i);
        if (l->moe) {
            if (l->k <= 0 || l->k > STACK_MAX_K) return 2 * i + 1;
            ok = strata_moe_decode(tmp, hidden, l->ffn_norm, (float)l->ffn_eps, l->router, l->n_exp, (int)l->k,
                                   (int)l->normalize, (const uint8_t *)l->exp_w[0], l->exp_stride[0],
                                   (const uint8_t *)l->exp_w[1], l->exp_stride[1], (const uint8_t *)l->exp_w[2],
                                   l->exp_stride[2], l->exp_fn[0], l->exp_fn[1], l->exp_fn[2], l->exp_ffn,
                                   l->ffn_rows ? l->ffn_fn : (void *const *)0,
                                   l->ffn_rows ? l->ffn_w : (const void *const *)0, l->ffn_rows, l->sh_gate, ids, w,
                                   x, nth);
        } else {
            ok = strata_ffn_decode(tmp, hidden, l->ffn_norm, (float)l->ffn_eps, l->ffn_fn, l->ffn_w, l->ffn_rows,
                                   l->ffn_fn[2], l->ffn_w[2], x, nth);
        }
        if (!ok) return 2 * i + 1;
    }
    strata_pool_mark(12, n);
    return 2 * n;
}

/* logits = W_out rms_norm(x) for one decode token (xn: hidden floats of scratch): the final norm and
 * the output head by its strata_qmm_* kernel. The model calls it after the layers whichever way they
 * ran (strata_decode_token below, or block by block), so both give the same logits. */
void strata_decode_head(const float *x, int64_t hidden, const float *norm_w, float eps, void *head_fn,
                        const void *head_w, int64_t vocab, float *xn, float *logits, int nth) {
    strata_rms_norm(x, norm_w, hidden, eps, xn);
    ((qmm_fn)head_fn)((const uint8_t *)head_w, vocab, hidden, xn, 1, logits, nth);
}

/* A whole decode token in one call: x = the embedding row (ggml type embd_type at embd_row, by
 * ggml's to_float as the model's Embedding decodes it; embd_row NULL: x holds it already), then
 * strata_decode_stack, then, all layers done, strata_decode_head into logits. What it saves is the
 * Python around the stack (the embedding's and the head's module calls, the final norm's torch
 * operators: ~1 ms of a qwen3-30b token at 2 threads, while the pool's helper had nothing to do).
 * Returns what strata_decode_stack returns, or -1 (nothing run) when the embedding's type has no
 * to_float. */
int64_t strata_decode_token(const strata_layer *L, int64_t n, int64_t hidden, float *x, const float *cs,
                            const float *sn, int64_t pos, float *tmp, int nth, int embd_type, const uint8_t *embd_row,
                            int64_t embd_bytes, const float *norm_w, float eps, void *head_fn, const void *head_w,
                            int64_t vocab, float *logits) {
    if (embd_row && !strata_dequant(embd_type, embd_row, 1, hidden, embd_bytes, x, 0, 1)) return -1;
    const int64_t done = strata_decode_stack(L, n, hidden, x, cs, sn, pos, tmp, nth);
    if (done == 2 * n) strata_decode_head(x, hidden, norm_w, eps, head_fn, head_w, vocab, tmp, logits, nth);
    return done;
}
