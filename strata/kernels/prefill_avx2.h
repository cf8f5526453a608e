/* Prompt-sized quantized products on AVX2 + FMA (no AMX): Y[t, r] = sum_k W[r, k] * X[t, k] in
 * float32, included by prefill.c where AMX-BF16 is not built in. The same entry points and the same
 * expert calls (strata_pp_swiglu / strata_pp_moe, written once in prefill.c) as the AMX products,
 * over this file's pack / run_packed / release_pack.
 *
 * Exact float32: each weight is decoded to the float32 value gguf-py's decoder gives (the own
 * decoders below: scale products first, then the integer value times the scale, minus the
 * minimum), and the products are float32 FMAs; no bfloat16 or int8 rounding of x or W.
 *
 * Layout. X is packed once per call, k-major in groups of 16 rows of x: xt[g][k][16] (rows past
 * the last zero). A job takes a panel of up to PV_PANEL weight rows; per 256-value k-chunk it
 * decodes the panel's rows into a float32 block (PV_PANEL x 256, ~48 KiB, stays in L2) and runs
 * every group of x against it with a register-tiled micro-kernel: 6 weight rows x 16 rows of x
 * (12 ymm accumulators; each weight a broadcast, each 8 rows of x one load), or 12 weight rows x 8
 * rows of x for a last group of at most 8 rows. Partial sums over the k-chunks wait in a per-job
 * float32 block c[g][row][16]; at the panel's end it is written transposed into Y. W is never
 * dequantized whole.
 */
#include <immintrin.h>


#define PV_INLINE static inline __attribute__((always_inline))
#ifndef PV_PANEL
#define PV_PANEL 48 /* weight rows per job: a multiple of 12 */
#endif
#define PV_KC 256   /* k values per chunk: a multiple of every block size */

/* ------------------------------------------------------------------ own row decoders (float32) */

/* the 8 low bytes of q (unsigned / signed) as floats */
PV_INLINE __m256 u8f(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
PV_INLINE __m256 i8f(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
PV_INLINE __m128i hi8(__m128i q) { return _mm_srli_si128(q, 8); }

/* y[0..15] = (16 unsigned bytes q) * d - m (m 0: none), the product rounded first as gguf-py */
PV_INLINE void fms16u(float *y, __m128i q, float d, float m) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    __m256 a = _mm256_mul_ps(u8f(q), dv), b = _mm256_mul_ps(u8f(hi8(q)), dv);
    /* keep the product rounded before the subtraction (no contraction into an FMA) */
    __asm__("" : "+x"(a), "+x"(b));
    _mm256_storeu_ps(y, _mm256_sub_ps(a, mv));
    _mm256_storeu_ps(y + 8, _mm256_sub_ps(b, mv));
}

/* y[0..15] = (16 signed bytes q) * d */
PV_INLINE void mul16i(float *y, __m128i q, float d) {
    const __m256 dv = _mm256_set1_ps(d);
    _mm256_storeu_ps(y, _mm256_mul_ps(i8f(q), dv));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(i8f(hi8(q)), dv));
}

static void pv_q8_0(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 32, b += 34) {
        const float d = rd_f16(b);
        mul16i(y + o, _mm_loadu_si128((const __m128i *)(b + 2)), d);
        mul16i(y + o + 16, _mm_loadu_si128((const __m128i *)(b + 18)), d);
    }
}

static void pv_q4_0(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15), off = _mm_set1_epi8(8);
    for (int64_t o = 0; o < n; o += 32, b += 18) {
        const float d = rd_f16(b);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
        mul16i(y + o, _mm_sub_epi8(_mm_and_si128(q, m4), off), d);
        mul16i(y + o + 16, _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), off), d);
    }
}

static void pv_q4_1(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t o = 0; o < n; o += 32, b += 20) {
        const float d = rd_f16(b), m = rd_f16(b + 2);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
        fms16u(y + o, _mm_and_si128(q, m4), d, -m); /* q d + m */
        fms16u(y + o + 16, _mm_and_si128(_mm_srli_epi16(q, 4), m4), d, -m);
    }
}

/* Q5_0 / Q5_1: 16 low nibbles | the fifth bits `from`.. of h (as 16) */
PV_INLINE __m128i q5_bits(__m128i nib, uint32_t h, int from) {
    /* byte j takes bit (from + j) of h */
    const __m128i hv = _mm_set1_epi16((short)(h >> from));
    const __m128i bytes = _mm_shuffle_epi8(hv, _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m128i bit = _mm_set_epi8((char)0x80, 64, 32, 16, 8, 4, 2, 1, (char)0x80, 64, 32, 16, 8, 4, 2, 1);
    const __m128i set = _mm_cmpeq_epi8(_mm_and_si128(bytes, bit), bit);
    return _mm_or_si128(nib, _mm_and_si128(set, _mm_set1_epi8(16)));
}

static void pv_q5_0(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15), off = _mm_set1_epi8(16);
    for (int64_t o = 0; o < n; o += 32, b += 22) {
        const float d = rd_f16(b);
        const uint32_t h = rd_u32(b + 2);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 6));
        mul16i(y + o, _mm_sub_epi8(q5_bits(_mm_and_si128(q, m4), h, 0), off), d);
        mul16i(y + o + 16, _mm_sub_epi8(q5_bits(_mm_and_si128(_mm_srli_epi16(q, 4), m4), h, 16), off), d);
    }
}

static void pv_q5_1(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t o = 0; o < n; o += 32, b += 24) {
        const float d = rd_f16(b), m = rd_f16(b + 2);
        const uint32_t h = rd_u32(b + 4);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 8));
        fms16u(y + o, q5_bits(_mm_and_si128(q, m4), h, 0), d, -m);
        fms16u(y + o + 16, q5_bits(_mm_and_si128(_mm_srli_epi16(q, 4), m4), h, 16), d, -m);
    }
}

static void pv_q4_k(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t o = 0; o < n; o += 256, b += 144) {
        const float d = rd_f16(b), dmin = rd_f16(b + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const uint8_t *qs = b + 16;
        for (int p = 0; p < 4; p++) {
            const float d0 = d * (float)sc[2 * p], m0 = dmin * (float)mn[2 * p];
            const float d1 = d * (float)sc[2 * p + 1], m1 = dmin * (float)mn[2 * p + 1];
            for (int h = 0; h < 2; h++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(qs + 32 * p + 16 * h));
                fms16u(y + o + 64 * p + 16 * h, _mm_and_si128(q, m4), d0, m0);
                fms16u(y + o + 64 * p + 32 + 16 * h, _mm_and_si128(_mm_srli_epi16(q, 4), m4), d1, m1);
            }
        }
    }
}

static void pv_q5_k(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15), one = _mm_set1_epi8(1);
    for (int64_t o = 0; o < n; o += 256, b += 176) {
        const float d = rd_f16(b), dmin = rd_f16(b + 2);
        uint8_t sc[8], mn[8];
        scale_min_k4(b + 4, sc, mn);
        const uint8_t *qh = b + 16, *qs = b + 48;
        for (int p = 0; p < 4; p++) {
            const float d0 = d * (float)sc[2 * p], m0 = dmin * (float)mn[2 * p];
            const float d1 = d * (float)sc[2 * p + 1], m1 = dmin * (float)mn[2 * p + 1];
            for (int h = 0; h < 2; h++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(qs + 32 * p + 16 * h));
                const __m128i hb = _mm_loadu_si128((const __m128i *)(qh + 16 * h));
                const __m128i h0 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 2 * p), one), 4);
                const __m128i h1 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 2 * p + 1), one), 4);
                fms16u(y + o + 64 * p + 16 * h, _mm_or_si128(_mm_and_si128(q, m4), h0), d0, m0);
                fms16u(y + o + 64 * p + 32 + 16 * h, _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), m4), h1), d1, m1);
            }
        }
    }
}

static void pv_q6_k(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15), m2 = _mm_set1_epi8(3), off = _mm_set1_epi8(32);
    for (int64_t o = 0; o < n; o += 256, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = rd_f16(b + 208);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 2; s++) {
                const __m128i l0 = _mm_loadu_si128((const __m128i *)(ql + h * 64 + 16 * s));
                const __m128i l1 = _mm_loadu_si128((const __m128i *)(ql + h * 64 + 32 + 16 * s));
                const __m128i hb = _mm_loadu_si128((const __m128i *)(qh + h * 32 + 16 * s));
                const __m128i lo[4] = {_mm_and_si128(l0, m4), _mm_and_si128(l1, m4),
                                       _mm_and_si128(_mm_srli_epi16(l0, 4), m4), _mm_and_si128(_mm_srli_epi16(l1, 4), m4)};
                for (int t = 0; t < 4; t++) { /* 16 values: nibbles of ql, bits 2t of qh; q - 32 in int8 */
                    const __m128i hi = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 2 * t), m2), 4);
                    mul16i(y + o + h * 128 + t * 32 + 16 * s, _mm_sub_epi8(_mm_or_si128(lo[t], hi), off),
                           d * (float)sc[h * 8 + t * 2 + s]);
                }
            }
    }
}

/* 32 table values of 16 packed nibbles (low nibbles first, then high), times d */
PV_INLINE void pv_lut32(const uint8_t *q, __m128i table, float d, float *y) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(15);
    mul16i(y, _mm_shuffle_epi8(table, _mm_and_si128(raw, m4)), d);
    mul16i(y + 16, _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), m4)), d);
}

static void pv_iq4_nl(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 32, b += 18) pv_lut32(b + 2, (__m128i)IQ4_NL_I8, rd_f16(b), y + o);
}

static void pv_iq4_xs(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 136) {
        const float d = rd_f16(b);
        for (int j = 0; j < 8; j++) pv_lut32(b + 8 + 16 * j, (__m128i)IQ4_NL_I8, d * (float)iq4xs_scale(b, j), y + o + 32 * j);
    }
}

/* 8 codebook bytes * db * 8 signs (+-1, exact) */
PV_INLINE void grid8(float *y, const uint8_t *g, float db, const float *sg) {
    const __m256 v = _mm256_mul_ps(u8f(_mm_loadl_epi64((const __m128i *)g)), _mm256_set1_ps(db));
    _mm256_storeu_ps(y, _mm256_mul_ps(v, _mm256_load_ps(sg)));
}

/* IQ2_XS {f16 d; u16 qs[32]; u8 scales[8]}: entry k of sub-block p is qs[4 p + k] & 511, its sign
 * index qs >> 9; scale nibble 0 (k < 2) or 1 of scales[p] */
static void pv_iq2_xs(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 74) {
        const float d = rd_f16(b);
        const uint8_t *sc = b + 66;
        for (int p = 0; p < 8; p++)
            for (int k = 0; k < 4; k++) {
                const float db = d * (0.5f + (float)((sc[p] >> (4 * (k >> 1))) & 0xF)) * 0.25f;
                const unsigned q = rd_u16(b + 2 + 8 * p + 2 * k);
                grid8(y + o + 32 * p + 8 * k, GRID_IQ2_XS[q & 511], db, KSIGNS[q >> 9]);
            }
    }
}

/* IQ2_XXS {f16 d; per sub-block s: u8 grid ids[4], u32 aux}: scale aux >> 28, sign index of entry
 * k at aux >> 7 k */
static void pv_iq2_xxs(const void *w, float *y, int64_t n) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 66) {
        const float d = rd_f16(b);
        for (int s = 0; s < 8; s++) {
            const uint8_t *q = b + 2 + 8 * s;
            const uint32_t aux = rd_u32(q + 4);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
            for (int k = 0; k < 4; k++) grid8(y + o + 32 * s + 8 * k, GRID_IQ2_XXS[q[k]], db, KSIGNS[(aux >> (7 * k)) & 0x7F]);
        }
    }
}

/* the own decoders by ggml type */
static const pp_to_float OWN[PP_MAX_TYPES] = {
    [2] = pv_q4_0,  [3] = pv_q4_1,  [6] = pv_q5_0,  [7] = pv_q5_1,      [8] = pv_q8_0,     [12] = pv_q4_k,
    [13] = pv_q5_k, [14] = pv_q6_k, [16] = pv_iq2_xxs, [17] = pv_iq2_xs, [20] = pv_iq4_nl, [23] = pv_iq4_xs,
};

static pp_to_float dequantizer(int type) {
    return type < 0 || type >= PP_MAX_TYPES ? NULL : OWN[type];
}

static int backend_ok(void) { return 1; }

/* ------------------------------------------------------------------ x packing */

typedef struct {
    float *x; /* xt[g][k][16] */
    int64_t groups, tokens;
} packed_x;

/* 8 rows of 8 floats (at r[i], i < 8) -> their transpose: out[k * 16 + i] = r[i][k] */
PV_INLINE void transpose8(const float *const r[8], float *out) {
    __m256 a0 = _mm256_loadu_ps(r[0]), a1 = _mm256_loadu_ps(r[1]), a2 = _mm256_loadu_ps(r[2]), a3 = _mm256_loadu_ps(r[3]);
    __m256 a4 = _mm256_loadu_ps(r[4]), a5 = _mm256_loadu_ps(r[5]), a6 = _mm256_loadu_ps(r[6]), a7 = _mm256_loadu_ps(r[7]);
    __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1), t2 = _mm256_unpacklo_ps(a2, a3);
    __m256 t3 = _mm256_unpackhi_ps(a2, a3), t4 = _mm256_unpacklo_ps(a4, a5), t5 = _mm256_unpackhi_ps(a4, a5);
    __m256 t6 = _mm256_unpacklo_ps(a6, a7), t7 = _mm256_unpackhi_ps(a6, a7);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE), s2 = _mm256_shuffle_ps(t1, t3, 0x44);
    __m256 s3 = _mm256_shuffle_ps(t1, t3, 0xEE), s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(out + 0 * 16, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(out + 1 * 16, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(out + 2 * 16, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(out + 3 * 16, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(out + 4 * 16, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(out + 5 * 16, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(out + 6 * 16, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(out + 7 * 16, _mm256_permute2f128_ps(s3, s7, 0x31));
}

#define PP_KEEP_PACK ((int64_t)16 << 20)
static __thread float *pack_buf;
static __thread int64_t pack_cap;
static const float PV_ZERO[8] __attribute__((aligned(32))) = {0};

/* X (tokens x cols, cols a multiple of 32) -> xt[g][k][16], rows past `tokens` zero */
static int pack(const float *X, int64_t tokens, int64_t cols, int terms, packed_x *p) {
    (void)terms;
    p->groups = (tokens + 15) / 16;
    p->tokens = tokens;
    if (!grow((void **)&pack_buf, &pack_cap, p->groups * cols * 16, sizeof(float))) return 0;
    p->x = pack_buf;
    for (int64_t g = 0; g < p->groups; g++)
        for (int h = 0; h < 2; h++) {
            const float *r[8];
            int64_t step[8];
            for (int i = 0; i < 8; i++) {
                const int64_t t = 16 * g + 8 * h + i;
                r[i] = t < tokens ? X + t * cols : PV_ZERO;
                step[i] = t < tokens ? 8 : 0;
            }
            float *out = p->x + g * cols * 16 + 8 * h;
            for (int64_t k = 0; k < cols; k += 8, out += 8 * 16) {
                transpose8(r, out);
                for (int i = 0; i < 8; i++) r[i] += step[i];
            }
        }
    return 1;
}

static void release_pack(void) {
    if (pack_cap * (int64_t)sizeof(float) > PP_KEEP_PACK) {
        free(pack_buf);
        pack_buf = NULL;
        pack_cap = 0;
    }
}

/* ------------------------------------------------------------------ micro-kernels
 * c[i * 16 + l] (+)= sum_k w[i * ws + k] * xt[k * 16 + l] over kn values of k: 6 weight rows x 16
 * lanes, or 12 x 8 (lanes 0-7). first: start from zero, not c. */
PV_INLINE void ker6x16(const float *w, int64_t ws, const float *xt, int64_t kn, float *c, int first) {
    __m256 a00, a01, a10, a11, a20, a21, a30, a31, a40, a41, a50, a51;
    if (first) {
        a00 = a01 = a10 = a11 = a20 = a21 = a30 = a31 = a40 = a41 = a50 = a51 = _mm256_setzero_ps();
    } else {
        a00 = _mm256_load_ps(c + 0), a01 = _mm256_load_ps(c + 8), a10 = _mm256_load_ps(c + 16), a11 = _mm256_load_ps(c + 24);
        a20 = _mm256_load_ps(c + 32), a21 = _mm256_load_ps(c + 40), a30 = _mm256_load_ps(c + 48), a31 = _mm256_load_ps(c + 56);
        a40 = _mm256_load_ps(c + 64), a41 = _mm256_load_ps(c + 72), a50 = _mm256_load_ps(c + 80), a51 = _mm256_load_ps(c + 88);
    }
    const float *w0 = w, *w1 = w + ws, *w2 = w + 2 * ws, *w3 = w + 3 * ws, *w4 = w + 4 * ws, *w5 = w + 5 * ws;
    for (int64_t k = 0; k < kn; k++, xt += 16) {
        const __m256 x0 = _mm256_load_ps(xt), x1 = _mm256_load_ps(xt + 8);
        __m256 b;
        b = _mm256_broadcast_ss(w0 + k), a00 = _mm256_fmadd_ps(b, x0, a00), a01 = _mm256_fmadd_ps(b, x1, a01);
        b = _mm256_broadcast_ss(w1 + k), a10 = _mm256_fmadd_ps(b, x0, a10), a11 = _mm256_fmadd_ps(b, x1, a11);
        b = _mm256_broadcast_ss(w2 + k), a20 = _mm256_fmadd_ps(b, x0, a20), a21 = _mm256_fmadd_ps(b, x1, a21);
        b = _mm256_broadcast_ss(w3 + k), a30 = _mm256_fmadd_ps(b, x0, a30), a31 = _mm256_fmadd_ps(b, x1, a31);
        b = _mm256_broadcast_ss(w4 + k), a40 = _mm256_fmadd_ps(b, x0, a40), a41 = _mm256_fmadd_ps(b, x1, a41);
        b = _mm256_broadcast_ss(w5 + k), a50 = _mm256_fmadd_ps(b, x0, a50), a51 = _mm256_fmadd_ps(b, x1, a51);
    }
    _mm256_store_ps(c + 0, a00), _mm256_store_ps(c + 8, a01), _mm256_store_ps(c + 16, a10), _mm256_store_ps(c + 24, a11);
    _mm256_store_ps(c + 32, a20), _mm256_store_ps(c + 40, a21), _mm256_store_ps(c + 48, a30), _mm256_store_ps(c + 56, a31);
    _mm256_store_ps(c + 64, a40), _mm256_store_ps(c + 72, a41), _mm256_store_ps(c + 80, a50), _mm256_store_ps(c + 88, a51);
}

PV_INLINE void ker12x8(const float *w, int64_t ws, const float *xt, int64_t kn, float *c, int first) {
    __m256 a[12];
    for (int i = 0; i < 12; i++) a[i] = first ? _mm256_setzero_ps() : _mm256_load_ps(c + 16 * i);
    for (int64_t k = 0; k < kn; k++, xt += 16) {
        const __m256 x0 = _mm256_load_ps(xt);
        for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + i * ws + k), x0, a[i]);
    }
    for (int i = 0; i < 12; i++) _mm256_store_ps(c + 16 * i, a[i]);
}

#if defined(__AVX512F__)
/* ker6x16's tile in 512-bit registers, 12 weight rows x 16 lanes (each weight an embedded broadcast
 * into its FMA): each lane's FMAs in ker6x16's order, so the same bits. Twice the FMA width where
 * the cores have full 512-bit units (Zen 5: bench_kernels --prompt-avx2, 512 rows of 768x2048 at one
 * thread 13.4 -> 8.1 ms). */
PV_INLINE void ker12x16(const float *w, int64_t ws, const float *xt, int64_t kn, float *c, int first) {
    __m512 a[12];
    for (int i = 0; i < 12; i++) a[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + 16 * i);
    for (int64_t k = 0; k < kn; k++, xt += 16) {
        const __m512 x = _mm512_loadu_ps(xt);
        #pragma GCC unroll 12
        for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(w[i * ws + k]), x, a[i]);
    }
    for (int i = 0; i < 12; i++) _mm512_storeu_ps(c + 16 * i, a[i]);
}
#endif

/* ------------------------------------------------------------------ panels on the pool */

typedef struct {
    const uint8_t *W;
    int64_t rows, cols, wrow;
    const float *xt;
    int64_t groups, tokens;
    float *Y; /* tokens x rows */
    pp_to_float f;
    atomic_int *failed;
} pv_args;

static __thread float *wblock_buf, *cblock_buf;
static __thread int64_t wblock_cap, cblock_cap;

static void pv_panel(const void *a_, int64_t panel) {
    const pv_args *a = a_;
    const int64_t r0 = panel * PV_PANEL, nr = a->rows - r0 < PV_PANEL ? a->rows - r0 : PV_PANEL;
    const int64_t nr12 = (nr + 11) / 12 * 12, groups = a->groups, cols = a->cols;
    if (atomic_load_explicit(a->failed, memory_order_relaxed)) return;
    if (!grow((void **)&wblock_buf, &wblock_cap, PV_PANEL * PV_KC, sizeof(float))
        || !grow((void **)&cblock_buf, &cblock_cap, groups * PV_PANEL * 16, sizeof(float))) {
        atomic_store(a->failed, 1);
        return;
    }
    float *wb = wblock_buf, *cb = cblock_buf;
    const int tail8 = a->tokens - 16 * (groups - 1) <= 8; /* the last group: 12 x 8 tiles */
    for (int64_t kc = 0; kc < cols; kc += PV_KC) {
        const int64_t kn = cols - kc < PV_KC ? cols - kc : PV_KC;
        for (int64_t r = 0; r < nr; r++) a->f(a->W + (r0 + r) * a->wrow + kc * a->wrow / cols, wb + r * PV_KC, kn);
        if (kc == 0)
            for (int64_t r = nr; r < nr12; r++) memset(wb + r * PV_KC, 0, sizeof(float) * PV_KC);
        for (int64_t g = 0; g < groups; g++) {
            const float *xt = a->xt + (g * cols + kc) * 16;
            float *c = cb + g * PV_PANEL * 16;
            if (g == groups - 1 && tail8)
                for (int64_t r = 0; r < nr12; r += 12) ker12x8(wb + r * PV_KC, PV_KC, xt, kn, c + r * 16, kc == 0);
            else
#if defined(__AVX512F__)
                for (int64_t r = 0; r < nr12; r += 12) ker12x16(wb + r * PV_KC, PV_KC, xt, kn, c + r * 16, kc == 0);
#else
                for (int64_t r = 0; r < nr12; r += 6) ker6x16(wb + r * PV_KC, PV_KC, xt, kn, c + r * 16, kc == 0);
#endif
        }
    }
    for (int64_t g = 0; g < groups; g++) {
        const int64_t t0 = 16 * g, tn = a->tokens - t0 < 16 ? a->tokens - t0 : 16;
        const float *c = cb + g * PV_PANEL * 16;
        for (int64_t t = 0; t < tn; t++) {
            float *y = a->Y + (t0 + t) * a->rows + r0;
            for (int64_t r = 0; r < nr; r++) y[r] = c[r * 16 + t];
        }
    }
}

/* Y = X W^T over the pool by PV_PANEL-row panels; 0 when a panel could not get its buffers */
static int run_packed(int type, const uint8_t *W, int64_t rows, int64_t cols, int64_t wrow, const packed_x *p,
                      float *Y, int terms, int nth) {
    (void)terms;
    atomic_int failed = 0;
    const pv_args a = {W, rows, cols, wrow, p->x, p->groups, p->tokens, Y, dequantizer(type), &failed};
    if (!a.f) return 0;
    strata_pool_run(pv_panel, &a, (rows + PV_PANEL - 1) / PV_PANEL, nth < 1 ? 1 : nth);
    return !atomic_load(&failed);
}

int strata_pp_available(void) { return 1; }

/* 1 if `type` has a decoder here (own only: ggml's to_float is not used by this backend) */
int strata_pp_has_type(int type, int own_only) {
    (void)own_only;
    return dequantizer(type) != NULL;
}

/* Y (tokens x rows float32) = X (tokens x cols float32) W^T; 0 where the type, the shape or memory
 * is missing (Y then holds nothing to use) */
int strata_pp_matmul(int type, const uint8_t *W, int64_t rows, int64_t cols, int64_t wrow, const float *X,
                     int64_t tokens, float *Y, int terms, int nth) {
    if (!dequantizer(type) || cols % 32 || rows <= 0 || tokens <= 0) return 0;
    packed_x p;
    if (!pack(X, tokens, cols, terms, &p)) return 0;
    const int ok = run_packed(type, W, rows, cols, wrow, &p, Y, terms, nth);
    release_pack();
    return ok;
}
