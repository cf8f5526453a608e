/* Prompt-sized quantized products on AMX: Y[t, r] = sum_k W[r, k] * X[t, k] for many rows t.
 *
 * A decode step multiplies by each weight once per token, so the 8-bit kernels of qmm.c read each
 * block and take integer dot products. A prompt multiplies the same weights by hundreds of rows:
 * here each weight is dequantized once per call into bfloat16 tiles and multiplied by all rows on
 * the CPU's AMX units (TDPBF16PS: 16x16 float32 outputs += 16x32 by 32x16 bfloat16, float32
 * accumulation throughout; torch's bf16 matmul would round every output to bfloat16).
 *
 * Precision: a float32 value v is split into hi = bf16(v) and lo = bf16(v - hi), so v is kept to
 * about 2^-17. With terms = 3, each product sums W_hi X_hi + W_hi X_lo + W_lo X_hi (the dropped
 * W_lo X_lo is ~2^-18 of it): close to float32 math on the dequantized weights. terms = 1 keeps
 * W_hi X_hi alone (bfloat16 rounding of both sides, ~2^-9 per value).
 *
 * Layout. A (weights): 16 rows x 32 values of one k-chunk, row-major, 1 KiB per tile; a job
 * dequantizes a panel of up to 64 weight rows (4 tiles high) over all of K into a thread-local
 * buffer, then runs every 16-row group of X against it. B (activations): 16 pairs of k x 16 rows
 * of X, the VNNI pair layout AMX reads, packed once per call. C: up to 4 tiles, one per 16 weight
 * rows, for one group of 16 rows of X.
 *
 * Built into the same library as qmm.c (whose thread pool runs the panels); without AMX-BF16 at
 * build time but with AVX2 + FMA + F16C, prefill_avx2.h's exact float32 products stand behind the
 * same entry points (own AVX2 decoders into float32 tiles, an FMA micro-kernel) and share this
 * file's SwiGLU / MoE calls; strata_pp_backend() says which (1 AMX, 2 AVX2). Without either, or
 * without the kernel's permission to use AMX state, strata_pp_available() is 0 and callers keep
 * their other path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include "blocks.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define PP_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef void (*pp_to_float)(const void *row, float *out, int64_t n);

#if !defined(PP_AMX) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PP_AVX2 1 /* no AMX: prefill_avx2.h's float32 products behind the same entry points */
#endif

#include "pool.h"
/* from qmm.c: ggml's to_float (NULL without ggml) */
void *strata_to_float_fn(int type);

#define PP_MAX_TYPES 64

/* Test hook: buffer requests numbered from the call to strata_pp_test_fail_allocs; requests
 * first .. first + count - 1 are refused as if memory had run out (count 0: none). Tests reach each
 * out-of-memory path with it; the requests are every buffer this file and deltanet_decode.c get. */
static atomic_long alloc_serial, fail_first, fail_end;

void strata_pp_test_fail_allocs(long first, long count) {
    atomic_store(&fail_end, 0);
    atomic_store(&alloc_serial, 0);
    atomic_store(&fail_first, first);
    atomic_store(&fail_end, first + count);
}

/* 1 when this buffer request is to be refused (the test hook) */
int strata_pp_alloc_refused(void) {
    if (atomic_load_explicit(&fail_end, memory_order_relaxed) <= 0) return 0;
    const long n = atomic_fetch_add(&alloc_serial, 1);
    return n >= atomic_load(&fail_first) && n < atomic_load(&fail_end);
}

/* malloc, or NULL where the test hook refuses the request */
void *strata_pp_malloc(size_t bytes) { return strata_pp_alloc_refused() ? NULL : malloc(bytes); }

#if defined(PP_AMX) || defined(PP_AVX2)
/* grow a thread's buffer to n elements of `size` bytes (64-byte aligned); 0 when out of memory
 * (the buffer then kept as it was) */
static int grow(void **buf, int64_t *cap, int64_t n, size_t size) {
    if (strata_pp_alloc_refused()) return 0;
    if (*cap >= n) return 1;
    free(*buf);
    *buf = aligned_alloc(64, ((size_t)n * size + 63) / 64 * 64);
    *cap = *buf ? n : 0;
    return *buf != NULL;
}
#endif

#ifdef PP_AMX

/* ------------------------------------------------------------------ own row decoders
 * Field for field as gguf-py's numpy decoders (strata/quant mirrors them): float32 scale products
 * first, then the integer value times the scale (minus the minimum).
 *
 * Each decoder is written once (PP_BODY) against a sink and built twice: deq_* writes a float32
 * row (tests compare it with gguf-py), tiles_* writes the values straight into a panel's AMX
 * A tiles as their bfloat16 hi and lo parts (split16 below), so a prompt's weights are not
 * stored as float32 and read back before the product. Both see the same float32 value. */

/* Where a decoder's vectors go: float32 at y[o], or (tiles) value o's bfloat16 parts at
 * hi / lo [(o / 32) * stride + o % 32]: a 32-value chunk is one 64-byte tile row, the next chunk
 * `stride` values on (512 in a panel: the next tile). lo NULL: hi only (terms 1). In tiles a
 * chunk's first 16 values wait in `half` for the rest, so each tile row is written
 * whole, once: chunks lie 1 KiB apart, and half-written rows were evicted before their other half
 * came (L1 sets alias at that stride). A decoder emits each chunk's halves in order, with at most
 * the next chunk's first half between them (Q4_K, Q5_K). */
typedef struct {
    int tiles; /* a constant in each build of a decoder, so each keeps one kind of store */
    float *y;
    uint16_t *hi, *lo;
    int64_t stride;
    __m512 half[2]; /* by chunk parity */
} pp_sink;

#define PP_INLINE static inline __attribute__((always_inline))

/* 32 floats -> 32 bf16 hi (nearest even) and 32 bf16 lo = bf16(v - hi) */
PP_INLINE void split_pair(__m512 a, __m512 b, uint16_t *hi, uint16_t *lo) {
    const __m512bh h = _mm512_cvtne2ps_pbh(b, a);
    _mm512_storeu_si512(hi, (__m512i)h);
    if (!lo) return;
    const __m512i hw = (__m512i)h;
    /* hi back to float32: each bf16 is the upper half of its float */
    const __m512 ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hw)), 16));
    const __m512 hb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hw, 1)), 16));
    _mm512_storeu_si512(lo, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha)));
}

PP_INLINE void put16(pp_sink *out, int64_t o, __m512 v) {
    if (!out->tiles) {
        _mm512_storeu_ps(out->y + o, v);
        return;
    }
    const int parity = (int)((o >> 5) & 1);
    if (!(o & 16)) {
        out->half[parity] = v;
        return;
    }
    const int64_t at = (o >> 5) * out->stride;
    split_pair(out->half[parity], v, out->hi + at, out->lo ? out->lo + at : NULL);
}

#define PP_BODY(name) PP_INLINE void body_##name(const void *w, pp_sink *out, int64_t n)


PP_BODY(q8_0) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 32, b += 34) {
        const __m512 d = _mm512_set1_ps(rd_f16(b));
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        put16(out, o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d));
        put16(out, o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d));
    }
}

PP_BODY(q4_0) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t o = 0; o < n; o += 32, b += 18) {
        const __m512 d = _mm512_set1_ps(rd_f16(b)), off = _mm512_set1_ps(-8.0f);
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m4)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4)));
        put16(out, o, _mm512_mul_ps(_mm512_add_ps(lo, off), d));
        put16(out, o + 16, _mm512_mul_ps(_mm512_add_ps(hi, off), d));
    }
}

/* 16 values q (as floats) * d - m, stored at y */
PP_INLINE void fms16(pp_sink *out, int64_t o, __m512 q, float d, float m) {
    put16(out, o, _mm512_sub_ps(_mm512_mul_ps(q, _mm512_set1_ps(d)), _mm512_set1_ps(m)));
}

PP_BODY(q4_k) {
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
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m4)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4)));
                fms16(out, o + 64 * p + 16 * h, lo, d0, m0);
                fms16(out, o + 64 * p + 32 + 16 * h, hi, d1, m1);
            }
        }
    }
}

PP_BODY(q5_k) {
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
                const __m128i lo = _mm_or_si128(_mm_and_si128(q, m4), h0);
                const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), m4), h1);
                fms16(out, o + 64 * p + 16 * h, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d0, m0);
                fms16(out, o + 64 * p + 32 + 16 * h, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d1, m1);
            }
        }
    }
}

PP_BODY(q6_k) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15), m2 = _mm_set1_epi8(3);
    const __m512 off = _mm512_set1_ps(32.0f);
    for (int64_t o = 0; o < n; o += 256, b += 210) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = rd_f16(b + 208);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++) { /* 32 values: low or high nibbles of ql, bits 2t of qh */
                const uint8_t *pl = ql + h * 64 + (t & 1) * 32, *ph = qh + h * 32;
                for (int s = 0; s < 2; s++) {
                    __m128i l = _mm_loadu_si128((const __m128i *)(pl + 16 * s));
                    if (t >> 1) l = _mm_srli_epi16(l, 4);
                    const __m128i hb = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(ph + 16 * s)), 2 * t), m2);
                    const __m128i q = _mm_or_si128(_mm_and_si128(l, m4), _mm_slli_epi16(hb, 4));
                    const __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), off);
                    put16(out, o + h * 128 + t * 32 + 16 * s,
                                     _mm512_mul_ps(v, _mm512_set1_ps(d * (float)sc[h * 8 + t * 2 + s])));
                }
            }
    }
}

PP_BODY(q4_1) {
    const uint8_t *b = w;
    const __m128i m4 = _mm_set1_epi8(15);
    for (int64_t o = 0; o < n; o += 32, b += 20) {
        const __m512 d = _mm512_set1_ps(rd_f16(b)), m = _mm512_set1_ps(rd_f16(b + 2));
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
        const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m4)));
        const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4)));
        put16(out, o, _mm512_add_ps(_mm512_mul_ps(lo, d), m));
        put16(out, o + 16, _mm512_add_ps(_mm512_mul_ps(hi, d), m));
    }
}

/* the 16 fifth bits of a Q5 block half (bits `from`..from+15 of h) as 0 or 16 per byte */
static inline __m128i fifth_bits(uint32_t h, int from) {
    const __mmask16 k = (__mmask16)(h >> from);
    return _mm_maskz_mov_epi8(k, _mm_set1_epi8(16));
}

PP_INLINE void deq_q5(const uint8_t *qs, uint32_t h, float d, float m, int with_min, pp_sink *out, int64_t o) {
    const __m128i m4 = _mm_set1_epi8(15);
    const __m128i q = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_or_si128(_mm_and_si128(q, m4), fifth_bits(h, 0));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), m4), fifth_bits(h, 16));
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
    const __m512 dv = _mm512_set1_ps(d);
    if (with_min) {
        put16(out, o, _mm512_add_ps(_mm512_mul_ps(a, dv), _mm512_set1_ps(m)));
        put16(out, o + 16, _mm512_add_ps(_mm512_mul_ps(c, dv), _mm512_set1_ps(m)));
    } else {
        const __m512 off = _mm512_set1_ps(16.0f);
        put16(out, o, _mm512_mul_ps(_mm512_sub_ps(a, off), dv));
        put16(out, o + 16, _mm512_mul_ps(_mm512_sub_ps(c, off), dv));
    }
}

PP_BODY(q5_0) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 32, b += 22) {
        uint32_t h;
        memcpy(&h, b + 2, 4);
        deq_q5(b + 6, h, rd_f16(b), 0.0f, 0, out, o);
    }
}

PP_BODY(q5_1) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 32, b += 24) {
        uint32_t h;
        memcpy(&h, b + 4, 4);
        deq_q5(b + 8, h, rd_f16(b), rd_f16(b + 2), 1, out, o);
    }
}

PP_BODY(q2_k) {
    const uint8_t *b = w;
    const __m128i m2 = _mm_set1_epi8(3);
    for (int64_t o = 0; o < n; o += 256, b += 84) {
        const uint8_t *sc = b, *qs = b + 16;
        const float d = rd_f16(b + 80), dmin = rd_f16(b + 82);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int k = 0; k < 2; k++) { /* 16 values of one sub-block */
                    const int sub = h * 8 + s * 2 + k;
                    const __m128i q = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(qs + h * 32 + 16 * k)), 2 * s), m2);
                    fms16(out, o + h * 128 + s * 32 + 16 * k, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)),
                          d * (float)(sc[sub] & 0xF), dmin * (float)(sc[sub] >> 4));
                }
    }
}

PP_BODY(q3_k) {
    const uint8_t *b = w;
    const __m128i m2 = _mm_set1_epi8(3);
    for (int64_t o = 0; o < n; o += 256, b += 110) {
        const uint8_t *hm = b, *qs = b + 32;
        float dl[16];
        q3k_sub_scales(b, dl);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int k = 0; k < 2; k++) {
                    const __m128i ql = _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)(qs + h * 32 + 16 * k)), 2 * s), m2);
                    const __m128i hb = _mm_loadu_si128((const __m128i *)(hm + 16 * k));
                    /* the value is ql - 4 where the high bit is clear */
                    const __mmask16 clear = _mm_testn_epi8_mask(hb, _mm_set1_epi8((char)(1 << (h * 4 + s))));
                    const __m512i v = _mm512_sub_epi32(_mm512_cvtepu8_epi32(ql),
                                                       _mm512_maskz_mov_epi32(clear, _mm512_set1_epi32(4)));
                    put16(out, o + h * 128 + s * 32 + 16 * k,
                                     _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(dl[h * 8 + s * 2 + k])));
                }
    }
}

/* 32 table values of 16 packed nibbles (low nibbles first, then high), times d */
PP_INLINE void lut32(const uint8_t *q, __m128i table, float d, pp_sink *out, int64_t o) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(raw, m4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
    const __m512 dv = _mm512_set1_ps(d);
    put16(out, o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)), dv));
    put16(out, o + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)), dv));
}

PP_BODY(iq4_nl) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 32, b += 18) lut32(b + 2, (__m128i)IQ4_NL_I8, rd_f16(b), out, o);
}

PP_BODY(iq4_xs) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 136) {
        const float d = rd_f16(b);
        const uint8_t *qs = b + 8;
        for (int j = 0; j < 8; j++) lut32(qs + 16 * j, (__m128i)IQ4_NL_I8, d * (float)iq4xs_scale(b, j), out, o + 32 * j);
    }
}

PP_BODY(mxfp4) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 32, b += 17) lut32(b + 1, (__m128i)E2M1_I8, e8m0_half(b[0]), out, o);
}

/* ------------------------------------------------------------------ IQ codebook dequantizers
 * 16 values at a time from two 8-value (or four 4-value) codebook entries of qmm.c's tables
 * (blocks.h); the scale products in gguf-py's order, then the value times the scale and the sign
 * (a negation, as gguf-py's multiply by -1). */

static const __m512 ZERO16 = {0};

/* 16 bytes (as unsigned ints) * db, negated where `neg` has a bit, stored at y */
PP_INLINE void grid16_u8(__m128i g, float db, __mmask16 neg, pp_sink *out, int64_t o) {
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(g)), _mm512_set1_ps(db));
    put16(out, o, _mm512_mask_sub_ps(v, neg, ZERO16, v));
}

static inline __m128i two8(const uint8_t *g0, const uint8_t *g1) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)g0), _mm_loadl_epi64((const __m128i *)g1));
}

static inline __m128i four4(const uint8_t *g0, const uint8_t *g1, const uint8_t *g2, const uint8_t *g3) {
    return _mm_set_epi32((int)rd_u32(g3), (int)rd_u32(g2), (int)rd_u32(g1), (int)rd_u32(g0));
}

/* IQ2_XS {f16 d; u16 qs[32]; u8 scales[8]}: entry k of sub-block p is qs[4 p + k] & 511, its 7 sign
 * bits qs >> 9 (KSIGNS8: the 8-value negation mask); scale nibble 0 (k < 2) or 1 of scales[p].
 * Two entries (16 values) at a time, through the codebook helpers below. */
PP_BODY(iq2_xs) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 74) {
        const float d = rd_f16(b);
        const uint8_t *sc = b + 66;
        for (int p = 0; p < 8; p++)
            for (int h = 0; h < 2; h++) {
                const float db = d * (0.5f + (float)((sc[p] >> (4 * h)) & 0xF)) * 0.25f;
                const unsigned q0 = rd_u16(b + 2 + 8 * p + 4 * h), q1 = rd_u16(b + 4 + 8 * p + 4 * h);
                grid16_u8(two8(GRID_IQ2_XS[q0 & 511], GRID_IQ2_XS[q1 & 511]), db,
                          (__mmask16)(KSIGNS8[q0 >> 9] | KSIGNS8[q1 >> 9] << 8), out, o + 32 * p + 16 * h);
            }
    }
}

/* The negation mask of entries 2 h and 2 h + 1 (16 values) of a sub-block whose four 7-bit
 * sign indices into ksigns are packed in aux (IQ2_XXS, IQ3_XXS). */
PP_INLINE __mmask16 ksigns16(uint32_t aux, int h) {
    return (__mmask16)(KSIGNS8[(aux >> (14 * h)) & 0x7F] | KSIGNS8[(aux >> (14 * h + 7)) & 0x7F] << 8);
}

/* IQ2_XXS {f16 d; per sub-block s: u8 grid ids[4], u32 aux}: scale aux >> 28, 7 sign bits of entry k
 * at aux >> 7 k. */
PP_BODY(iq2_xxs) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 66) {
        const float d = rd_f16(b);
        for (int s = 0; s < 8; s++) {
            const uint8_t *q = b + 2 + 8 * s;
            const uint32_t aux = rd_u32(q + 4);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
            for (int h = 0; h < 2; h++)
                grid16_u8(two8(GRID_IQ2_XXS[q[2 * h]], GRID_IQ2_XXS[q[2 * h + 1]]), db,
                          ksigns16(aux, h), out, o + 32 * s + 16 * h);
        }
    }
}

/* IQ2_S {f16 d; u8 qs[32], signs[32], qh[8], scales[8]}: 8-value entry k of sub-block ib is
 * qs[4 ib + k] | 2 bits of qh[ib] << 8; scale nibble 0 (k < 2) or 1 of scales[ib]. */
PP_BODY(iq2_s) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 82) {
        const float d = rd_f16(b);
        const uint8_t *qs = b + 2, *sg = b + 34, *qh = b + 66, *sc = b + 74;
        for (int ib = 0; ib < 8; ib++)
            for (int h = 0; h < 2; h++) {
                const int k = 4 * ib + 2 * h;
                const float db = d * (0.5f + (float)((sc[ib] >> (4 * h)) & 0xF)) * 0.25f;
                const int i0 = qs[k] | ((qh[ib] >> (4 * h)) & 3) << 8, i1 = qs[k + 1] | ((qh[ib] >> (4 * h + 2)) & 3) << 8;
                grid16_u8(two8(GRID_IQ2_S[i0], GRID_IQ2_S[i1]), db, rd_u16(sg + k), out, o + 32 * ib + 16 * h);
            }
    }
}

/* IQ3_S {f16 d; u8 qs[64], qh[8], signs[32], scales[4]}: 4-value entry k of sub-block ib is
 * qs[8 ib + k] | bit k of qh[ib] << 8; scale 1 + 2 * nibble ib of scales. */
PP_BODY(iq3_s) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 110) {
        const float d = rd_f16(b);
        const uint8_t *qs = b + 2, *qh = b + 66, *sg = b + 74, *sc = b + 106;
        for (int ib = 0; ib < 8; ib++) {
            const float db = d * (float)(1 + 2 * ((sc[ib / 2] >> (4 * (ib & 1))) & 0xF));
            for (int h = 0; h < 2; h++) {
                const uint8_t *q = qs + 8 * ib + 4 * h;
                const int hb = qh[ib] >> (4 * h);
                grid16_u8(four4(GRID_IQ3_S[q[0] | (hb & 1) << 8], GRID_IQ3_S[q[1] | (hb >> 1 & 1) << 8],
                                GRID_IQ3_S[q[2] | (hb >> 2 & 1) << 8], GRID_IQ3_S[q[3] | (hb >> 3 & 1) << 8]),
                          db, rd_u16(sg + 4 * ib + 2 * h), out, o + 32 * ib + 16 * h);
            }
        }
    }
}

/* IQ3_XXS {f16 d; u8 qs[64]; u32 aux[8]}: sub-block ib takes 8 4-value entries qs[8 ib ..], the
 * scale aux >> 28 and four 7-bit sign indices into ksigns (KSIGNS8). */
PP_BODY(iq3_xxs) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 98) {
        const float d = rd_f16(b);
        for (int ib = 0; ib < 8; ib++) {
            const uint8_t *q = b + 2 + 8 * ib;
            const uint32_t aux = rd_u32(b + 66 + 4 * ib);
            const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
            for (int h = 0; h < 2; h++, q += 4) {
                const __mmask16 neg = ksigns16(aux, h);
                grid16_u8(four4(GRID_IQ3_XXS[q[0]], GRID_IQ3_XXS[q[1]], GRID_IQ3_XXS[q[2]], GRID_IQ3_XXS[q[3]]), db, neg,
                          out, o + 32 * ib + 16 * h);
            }
        }
    }
}

/* 16 int8 values (8 * grid + the delta's sign, exact) * dl / 8, stored at y: gguf-py's
 * dl * (grid + delta) with delta = +-1/8, the same float product since dl / 8 is exact. */
PP_INLINE void iq1_16(__m128i v, float dl, pp_sink *out, int64_t o) {
    put16(out, o, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), _mm512_set1_ps(dl * 0.125f)));
}

/* IQ1_S {f16 d; u8 qs[32]; u16 qh[8]}: entry k of sub-block ib is qs[4 ib + k] | 3 bits of qh[ib]
 * << 8; qh's bits 12-14 are the scale, bit 15 the delta's sign. */
PP_BODY(iq1_s) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 50) {
        const float d = rd_f16(b);
        const uint8_t *qs = b + 2;
        for (int ib = 0; ib < 8; ib++) {
            const unsigned q = rd_u16(b + 34 + 2 * ib);
            const float dl = d * (float)(2 * ((q >> 12) & 7) + 1);
            const __m128i delta = _mm_set1_epi8(q & 0x8000 ? -1 : 1);
            for (int h = 0; h < 2; h++) {
                const int k = 4 * ib + 2 * h;
                const int i0 = qs[k] | ((q >> (6 * h)) & 7) << 8, i1 = qs[k + 1] | ((q >> (6 * h + 3)) & 7) << 8;
                iq1_16(_mm_add_epi8(two8((const uint8_t *)GRID_IQ1_S8[i0], (const uint8_t *)GRID_IQ1_S8[i1]), delta), dl,
                       out, o + 32 * ib + 16 * h);
            }
        }
    }
}

/* IQ1_M {u8 qs[32], qh[16]; u16 scales[4]}: f16 d from the top nibbles of the 4 scales; entry k
 * is qs[k] | 3 bits of nibble k of qh << 8, the nibble's bit 3 the delta's sign; 3-bit scale k / 2. */
PP_BODY(iq1_m) {
    const uint8_t *b = w;
    for (int64_t o = 0; o < n; o += 256, b += 56) {
        const uint8_t *qs = b, *qh = b + 32;
        uint16_t sc[4];
        memcpy(sc, b + 48, 8);
        const float d = iq1m_d(b);
        for (int j = 0; j < 16; j++) { /* 16 values: entries 2 j and 2 j + 1, nibbles of qh[j] */
            const float dl = d * (float)(2 * ((sc[j / 4] >> (3 * (j % 4))) & 7) + 1);
            const int lo = qh[j] & 0xF, hi = qh[j] >> 4;
            const __m128i delta = _mm_unpacklo_epi64(_mm_set1_epi8(lo & 8 ? -1 : 1), _mm_set1_epi8(hi & 8 ? -1 : 1));
            const int i0 = qs[2 * j] | (lo & 7) << 8, i1 = qs[2 * j + 1] | (hi & 7) << 8;
            iq1_16(_mm_add_epi8(two8((const uint8_t *)GRID_IQ1_S8[i0], (const uint8_t *)GRID_IQ1_S8[i1]), delta), dl,
                   out, o + 16 * j);
        }
    }
}

typedef void (*pp_to_tiles)(const void *row, uint16_t *hi, uint16_t *lo, int64_t stride, int64_t n);

#define PP_BUILD(name)                                                                               \
    static void deq_##name(const void *w, float *y, int64_t n) {                                     \
        pp_sink out = {.tiles = 0, .y = y};                                                          \
        body_##name(w, &out, n);                                                                     \
    }                                                                                                \
    static void tiles_##name(const void *w, uint16_t *hi, uint16_t *lo, int64_t stride, int64_t n) { \
        pp_sink out = {.tiles = 1, .hi = hi, .lo = lo, .stride = stride};                            \
        body_##name(w, &out, n);                                                                     \
    }
PP_BUILD(q4_0)
PP_BUILD(q4_1)
PP_BUILD(q5_0)
PP_BUILD(q5_1)
PP_BUILD(q8_0)
PP_BUILD(q2_k)
PP_BUILD(q3_k)
PP_BUILD(q4_k)
PP_BUILD(q5_k)
PP_BUILD(q6_k)
PP_BUILD(iq2_xxs)
PP_BUILD(iq2_xs)
PP_BUILD(iq4_nl)
PP_BUILD(iq4_xs)
PP_BUILD(mxfp4)
PP_BUILD(iq3_xxs)
PP_BUILD(iq1_s)
PP_BUILD(iq3_s)
PP_BUILD(iq2_s)
PP_BUILD(iq1_m)

/* the own decoders by ggml type (the codebooks they read are qmm.c's, set at load) */
static const pp_to_float OWN[PP_MAX_TYPES] = {
    [2] = deq_q4_0,     [3] = deq_q4_1,    [6] = deq_q5_0,     [7] = deq_q5_1,     [8] = deq_q8_0,
    [10] = deq_q2_k,    [11] = deq_q3_k,   [12] = deq_q4_k,    [13] = deq_q5_k,    [14] = deq_q6_k,
    [16] = deq_iq2_xxs, [17] = deq_iq2_xs, [20] = deq_iq4_nl,  [23] = deq_iq4_xs,  [39] = deq_mxfp4,
    [18] = deq_iq3_xxs, [19] = deq_iq1_s,  [21] = deq_iq3_s,   [22] = deq_iq2_s,   [29] = deq_iq1_m,
};


static const pp_to_tiles OWN_TILES[PP_MAX_TYPES] = {
    [2] = tiles_q4_0,     [3] = tiles_q4_1,    [6] = tiles_q5_0,     [7] = tiles_q5_1,     [8] = tiles_q8_0,
    [10] = tiles_q2_k,    [11] = tiles_q3_k,   [12] = tiles_q4_k,    [13] = tiles_q5_k,    [14] = tiles_q6_k,
    [16] = tiles_iq2_xxs, [17] = tiles_iq2_xs, [20] = tiles_iq4_nl,  [23] = tiles_iq4_xs,  [39] = tiles_mxfp4,
    [18] = tiles_iq3_xxs, [19] = tiles_iq1_s,  [21] = tiles_iq3_s,   [22] = tiles_iq2_s,   [29] = tiles_iq1_m,
};

/* ------------------------------------------------------------------ bf16 splitting */

/* 32 floats -> their bf16 hi and lo parts (split_pair) */
static inline void split32(const float *v, uint16_t *hi, uint16_t *lo) {
    split_pair(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16), hi, lo);
}

/* ------------------------------------------------------------------ AMX */

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = -1; /* -1 unknown, 0 refused, 1 granted */

static int amx_ok(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* Loaded at the start of every panel and released at its end: oneDNN (torch's bf16 matmuls) runs
 * its own tile configurations on the same threads. */
static void configure_tiles(void) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.colsb[i] = 64;
        c.rows[i] = 16;
    }
    _tile_loadconfig(&c);
}

typedef struct {
    const uint8_t *W;
    int64_t rows, cols, wrow;
    const uint16_t *xh, *xl; /* packed X: [group][k-chunk] tiles of 512 bf16 */
    int64_t groups, tokens;
    float *Y; /* tokens x rows */
    int terms;
    pp_to_tiles t; /* this file's decoder, or NULL: */
    pp_to_float f; /* ggml's to_float, then split32 */
    atomic_int *failed; /* set by a panel that could not get its buffers (its rows of Y not written) */
} pp_args;


static __thread uint16_t *panel_buf;
static __thread float *row_buf;
static __thread int64_t panel_cap, row_cap;

/* C tiles 0..NT-1 (weight tiles of the panel) for one group of 16 rows of X, over all k-chunks:
 * tile 4/5 = X hi/lo, tile 6/7 = W hi/lo. */
#define PP_PANEL(NT)                                                                                   \
    static void pp_group##NT(const uint16_t *ah, const uint16_t *al, const uint16_t *bh,              \
                             const uint16_t *bl, int64_t kcn, int terms, float *cbuf) {                \
        _tile_zero(0);                                                                                 \
        if (NT > 1) _tile_zero(1);                                                                     \
        if (NT > 2) _tile_zero(2);                                                                     \
        if (NT > 3) _tile_zero(3);                                                                     \
        for (int64_t kc = 0; kc < kcn; kc++) {                                                         \
            _tile_loadd(4, bh + kc * 512, 64);                                                         \
            if (terms > 1) _tile_loadd(5, bl + kc * 512, 64);                                          \
            PP_STEP(0, NT)                                                                             \
            PP_STEP(1, NT)                                                                             \
            PP_STEP(2, NT)                                                                             \
            PP_STEP(3, NT)                                                                             \
        }                                                                                              \
        _tile_stored(0, cbuf, 64);                                                                     \
        if (NT > 1) _tile_stored(1, cbuf + 256, 64);                                                   \
        if (NT > 2) _tile_stored(2, cbuf + 512, 64);                                                   \
        if (NT > 3) _tile_stored(3, cbuf + 768, 64);                                                   \
    }

/* weight tile I of the panel: its A tiles lie kcn * 512 values apart */
#define PP_STEP(I, NT)                                                                                 \
    if (NT > I) {                                                                                      \
        _tile_loadd(6, ah + ((I) * kcn + kc) * 512, 64);                                               \
        _tile_dpbf16ps(I, 6, 4);                                                                       \
        if (terms > 1) {                                                                               \
            _tile_dpbf16ps(I, 6, 5);                                                                   \
            _tile_loadd(7, al + ((I) * kcn + kc) * 512, 64);                                           \
            _tile_dpbf16ps(I, 7, 4);                                                                   \
        }                                                                                              \
    }

PP_PANEL(1)
PP_PANEL(2)
PP_PANEL(3)
PP_PANEL(4)

static void pp_panel(const void *a_, int64_t panel) {
    const pp_args *a = a_;
    const int64_t r0 = panel * 64, kcn = a->cols / 32;
    const int64_t nr = a->rows - r0 < 64 ? a->rows - r0 : 64;
    const int nt = (int)((nr + 15) / 16);
    const int64_t need = (int64_t)nt * 16 * a->cols * 2; /* hi and lo */
    if (atomic_load_explicit(a->failed, memory_order_relaxed)) return; /* the product is lost already */
    if (!grow((void **)&panel_buf, &panel_cap, need, sizeof(uint16_t))
        || (!a->t && !grow((void **)&row_buf, &row_cap, (a->cols + 15) / 16 * 16, sizeof(float)))) {
        atomic_store(a->failed, 1); /* out of memory: the caller learns that Y is incomplete */
        return;
    }
    uint16_t *ah = panel_buf, *al = panel_buf + (int64_t)nt * 16 * a->cols;
    for (int r = 0; r < nt * 16; r++) {
        const int64_t tile = r / 16, in = r % 16, at0 = tile * kcn * 512 + in * 32;
        uint16_t *lo = a->terms > 1 ? al + at0 : NULL;
        if (r >= nr) { /* rows past the weight's end: zero */
            for (int64_t kc = 0; kc < kcn; kc++) {
                memset(ah + at0 + kc * 512, 0, 64);
                if (lo) memset(lo + kc * 512, 0, 64);
            }
        } else if (a->t) {
            a->t(a->W + (r0 + r) * a->wrow, ah + at0, lo, 512, a->cols);
        } else {
            a->f(a->W + (r0 + r) * a->wrow, row_buf, a->cols);
            for (int64_t kc = 0; kc < kcn; kc++) split32(row_buf + kc * 32, ah + at0 + kc * 512, lo ? lo + kc * 512 : NULL);
        }
    }
    configure_tiles();
    float cbuf[1024] __attribute__((aligned(64)));
    for (int64_t g = 0; g < a->groups; g++) {
        const uint16_t *bh = a->xh + g * kcn * 512, *bl = a->terms > 1 ? a->xl + g * kcn * 512 : NULL;
        switch (nt) {
            case 1: pp_group1(ah, al, bh, bl, kcn, a->terms, cbuf); break;
            case 2: pp_group2(ah, al, bh, bl, kcn, a->terms, cbuf); break;
            case 3: pp_group3(ah, al, bh, bl, kcn, a->terms, cbuf); break;
            default: pp_group4(ah, al, bh, bl, kcn, a->terms, cbuf); break;
        }
        /* C tile I holds [weight row 16 I + i][token t] at cbuf[256 I + 16 i + t]: token t's 16 values
         * of tile I are a column, gathered at stride 16 and stored as one row piece of Y */
        const int64_t t0 = g * 16, tn = a->tokens - t0 < 16 ? a->tokens - t0 : 16;
        const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(16));
        for (int64_t t = 0; t < tn; t++) {
            float *y = a->Y + (t0 + t) * a->rows + r0;
            const __m512i idx = _mm512_add_epi32(col, _mm512_set1_epi32((int)t));
            for (int i = 0; i < nt; i++) {
                const int64_t left = nr - 16 * i;
                const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
                _mm512_mask_storeu_ps(y + 16 * i, m, _mm512_i32gather_ps(idx, cbuf + 256 * i, 4));
            }
        }
    }
    _tile_release();
}

/* X (tokens x cols float32) -> B tiles: xh[(g * kcn + kc) * 512 + kp * 32 + t * 2 + j] =
 * hi(X[16 g + t][32 kc + 2 kp + j]), rows past `tokens` zero; xl likewise for lo. */
static void pack_x(const float *X, int64_t tokens, int64_t cols, int64_t groups, uint16_t *xh, uint16_t *xl) {
    const int64_t kcn = cols / 32;
    uint16_t th[16][32] __attribute__((aligned(64))), tl[16][32] __attribute__((aligned(64)));
    for (int64_t g = 0; g < groups; g++)
        for (int64_t kc = 0; kc < kcn; kc++) {
            for (int t = 0; t < 16; t++) {
                const int64_t row = g * 16 + t;
                if (row < tokens) {
                    split32(X + row * cols + kc * 32, th[t], xl ? tl[t] : NULL);
                } else {
                    memset(th[t], 0, sizeof th[t]);
                    memset(tl[t], 0, sizeof tl[t]);
                }
            }
            uint32_t *oh = (uint32_t *)(xh + (g * kcn + kc) * 512);
            uint32_t *ol = xl ? (uint32_t *)(xl + (g * kcn + kc) * 512) : NULL;
            for (int kp = 0; kp < 16; kp++)
                for (int t = 0; t < 16; t++) {
                    oh[kp * 16 + t] = ((const uint32_t *)th[t])[kp];
                    if (ol) ol[kp * 16 + t] = ((const uint32_t *)tl[t])[kp];
                }
        }
}

int strata_pp_available(void) { return amx_ok(); }

/* 1 if `type` (a ggml type id) has a dequantizer here (own, else ggml's). */
int strata_pp_has_type(int type, int own_only) {
    if (type < 0 || type >= PP_MAX_TYPES) return 0;
    return OWN[type] != NULL || (!own_only && strata_to_float_fn(type) != NULL);
}

static pp_to_float dequantizer(int type) {
    if (type < 0 || type >= PP_MAX_TYPES) return NULL;
    return OWN[type] ? OWN[type] : (pp_to_float)strata_to_float_fn(type);
}

/* X packed for AMX: hi and (terms 3) lo tiles */
typedef struct {
    uint16_t *h, *l;
    int64_t groups, tokens;
} packed_x;

/* Each thread packs into one buffer, kept between calls up to PP_KEEP_PACK bytes: a fresh buffer a
 * product was mapped and zeroed page by page (a third of a pp512's page faults). One packing at a
 * time per thread (release_pack ends it). */
#define PP_KEEP_PACK ((int64_t)16 << 20)
static __thread uint16_t *pack_buf;
static __thread int64_t pack_cap;

static int pack(const float *X, int64_t tokens, int64_t cols, int terms, packed_x *p) {
    p->groups = (tokens + 15) / 16;
    p->tokens = tokens;
    const int64_t n = p->groups * (cols / 32) * 512;
    if (!grow((void **)&pack_buf, &pack_cap, n * (terms > 1 ? 2 : 1), sizeof(uint16_t))) return 0;
    p->h = pack_buf;
    p->l = terms > 1 ? p->h + n : NULL;
    pack_x(X, tokens, cols, p->groups, p->h, p->l);
    return 1;
}

static void release_pack(void) {
    if (pack_cap * (int64_t)sizeof(uint16_t) > PP_KEEP_PACK) {
        free(pack_buf);
        pack_buf = NULL;
        pack_cap = 0;
    }
}

/* Y = X W^T over the pool by 64-row panels; 0 when a panel could not get its buffers (Y then
 * incomplete: the caller discards it) */
static int run_packed(int type, const uint8_t *W, int64_t rows, int64_t cols, int64_t wrow, const packed_x *p,
                      float *Y, int terms, int nth) {
    atomic_int failed = 0;
    const pp_args a = {W, rows, cols, wrow, p->h, p->l, p->groups, p->tokens, Y, terms > 1 ? 3 : 1, OWN_TILES[type],
                       OWN_TILES[type] ? NULL : dequantizer(type), &failed};
    strata_pool_run(pp_panel, &a, (rows + 63) / 64, nth < 1 ? 1 : nth);
    return !atomic_load(&failed);
}

/* Y (tokens x rows float32) = X (tokens x cols float32) W^T, W rows x cols of `type` (wrow bytes a
 * row; cols a multiple of 32). Returns 0 when AMX, the type or memory is missing (Y then holds
 * nothing to use: out of memory part way, some panels were written). */
int strata_pp_matmul(int type, const uint8_t *W, int64_t rows, int64_t cols, int64_t wrow, const float *X,
                     int64_t tokens, float *Y, int terms, int nth) {
    if (!amx_ok() || !dequantizer(type) || cols % 32 || rows <= 0 || tokens <= 0) return 0;
    packed_x p;
    if (!pack(X, tokens, cols, terms, &p)) return 0;
    const int ok = run_packed(type, W, rows, cols, wrow, &p, Y, terms, nth);
    release_pack();
    return ok;
}

static int backend_ok(void) { return amx_ok(); }

/* 1: AMX-BF16 tiles; 2: AVX2 + FMA float32 (prefill_avx2.h); 0: none */
int strata_pp_backend(void) { return amx_ok() ? 1 : 0; }

#elif defined(PP_AVX2)
#include "prefill_avx2.h"

int strata_pp_backend(void) { return 2; }
#endif

#if defined(PP_AMX) || defined(PP_AVX2)

/* ------------------------------------------------------------------ SwiGLU experts
 *
 * A prompt's routed experts: each expert's rows gathered, gate and up from one packing of them,
 * silu(gate) * up, down, and the weighted rows added to their tokens, without a torch operation in
 * between (on a shared 2-core machine each small torch op was a barrier for its OpenMP team).
 * Experts with fewer than min_rows[m] rows take qmm.c's decode kernel `small[m]` for matrix m
 * (gate, up, down) when one is given: below a few rows it is faster. */
typedef void (*qmm_fn)(const uint8_t *W, int64_t rows, int64_t cols, const float *X, int64_t B, float *Y, int nth);

typedef struct {
    int type[3];
    int64_t wrow[3];
    qmm_fn small[3];
    int min_rows[3];
    int64_t hidden, ffn;
    int terms, nth;
} swiglu_spec;

/* y (n x hidden) = down(silu(gate x) * up x) for one expert; scratch: 2 n ffn floats. */
static int swiglu(const swiglu_spec *s, const uint8_t *G, const uint8_t *U, const uint8_t *D, const float *x, int64_t n,
                  float *y, float *scratch) {
    float *g = scratch, *u = scratch + n * s->ffn;
    const int amx_g = !s->small[0] || n >= s->min_rows[0], amx_u = !s->small[1] || n >= s->min_rows[1];
    packed_x p = {0};
    if ((amx_g || amx_u) && !pack(x, n, s->hidden, s->terms, &p)) return 0;
    int ok = 1;
    if (amx_g) ok = run_packed(s->type[0], G, s->ffn, s->hidden, s->wrow[0], &p, g, s->terms, s->nth);
    else s->small[0](G, s->ffn, s->hidden, x, n, g, s->nth);
    if (ok && amx_u) ok = run_packed(s->type[1], U, s->ffn, s->hidden, s->wrow[1], &p, u, s->terms, s->nth);
    else if (ok) s->small[1](U, s->ffn, s->hidden, x, n, u, s->nth);
    release_pack();
    if (!ok) return 0;
    for (int64_t i = 0; i < n * s->ffn; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    if (!s->small[2] || n >= s->min_rows[2]) {
        if (!pack(g, n, s->ffn, s->terms, &p)) return 0;
        ok = run_packed(s->type[2], D, s->hidden, s->ffn, s->wrow[2], &p, y, s->terms, s->nth);
        release_pack();
        return ok;
    } else {
        s->small[2](D, s->hidden, s->ffn, g, n, y, s->nth);
    }
    return 1;
}

static int make_spec(swiglu_spec *s, const int *types, const int64_t *wrow, void *const *small, const int *min_rows,
                     int64_t hidden, int64_t ffn, int terms, int nth) {
    if (!backend_ok() || hidden % 32 || ffn % 32) return 0;
    for (int m = 0; m < 3; m++) {
        s->type[m] = types[m];
        if (!dequantizer(types[m])) return 0;
        s->wrow[m] = wrow[m];
        s->small[m] = small ? (qmm_fn)small[m] : NULL;
        s->min_rows[m] = min_rows ? min_rows[m] : 0;
    }
    s->hidden = hidden, s->ffn = ffn, s->terms = terms, s->nth = nth;
    return 1;
}

/* One expert: Y (n x hidden) = down(silu(gate X) * up X). types, wrow, small, min_rows: per matrix
 * (gate, up, down); small may be NULL. Returns 0 (Y untouched) where it cannot run. */
int strata_pp_swiglu(const int *types, const int64_t *wrow, void *const *small, const int *min_rows,
                     const uint8_t *G, const uint8_t *U, const uint8_t *D, const float *X, int64_t n,
                     int64_t hidden, int64_t ffn, float *Y, int terms, int nth) {
    swiglu_spec s;
    if (n <= 0 || !make_spec(&s, types, wrow, small, min_rows, hidden, ffn, terms, nth)) return 0;
    float *scratch = strata_pp_malloc(sizeof(float) * (size_t)(2 * n * ffn));
    if (!scratch) return 0;
    const int ok = swiglu(&s, G, U, D, X, n, Y, scratch);
    free(scratch);
    return ok;
}

/* ------------------------------------------------------------------ a layer's experts on the pool
 *
 * A prompt's experts are many and small (qwen3-next: 512 used, ~10 rows each): split matrix by
 * matrix over the pool, each took 3 pool calls and left its gather, packing, SwiGLU and weighted
 * sum to the calling thread while the helpers waited. Here the pool takes whole experts (each
 * expert on one thread, its products inline), writing each route pair's output row; then the rows
 * are summed into out token by token, in the route table's order: the same additions in the same
 * order as one expert after another, so out is bit for bit the same. The pair rows are kept for a
 * batch of experts at a time (PP_PAIR_BYTES). */
#define PP_PAIR_BYTES ((int64_t)8 << 20)

typedef struct {
    const swiglu_spec *s; /* nth 1 */
    const void *const *G, *const *U, *const *D;
    const int64_t *counts, *starts, *token;
    const float *X;
    int e0;
    int64_t pair0;
    float *ys; /* pair rows of the batch, from pair0 */
    atomic_int *failed;
} experts_job;

static __thread float *expert_buf;
static __thread int64_t expert_cap;

static void expert_tile(const void *a_, int64_t tile) {
    const experts_job *a = a_;
    const swiglu_spec *s = a->s;
    const int i = a->e0 + (int)tile;
    const int64_t n = a->counts[i], start = a->starts[i];
    if (n <= 0 || atomic_load_explicit(a->failed, memory_order_relaxed)) return;
    if (!grow((void **)&expert_buf, &expert_cap, n * (s->hidden + 2 * s->ffn), sizeof(float))) {
        atomic_store(a->failed, 1);
        return;
    }
    float *xs = expert_buf, *scratch = xs + n * s->hidden;
    for (int64_t j = 0; j < n; j++)
        memcpy(xs + j * s->hidden, a->X + a->token[start + j] * s->hidden, sizeof(float) * (size_t)s->hidden);
    if (!swiglu(s, a->G[i], a->U[i], a->D[i], xs, n, a->ys + (start - a->pair0) * s->hidden, scratch))
        atomic_store(a->failed, 1);
}

typedef struct {
    const int64_t *by_token, *token_start; /* pair ids sorted by token (stable), each token's first */
    int64_t *cursor;                       /* each token's next pair in by_token */
    const float *weight, *ys; /* ys: pair rows from pair0 */
    int64_t pair0, pair1, hidden, tokens;
    float *out;
} pair_sum_job;

/* 16 tokens: out[token] += weight * row for the token's pairs below pair1, in table order */
static void pair_sum_tile(const void *a_, int64_t tile) {
    const pair_sum_job *a = a_;
    const int64_t t1 = (tile + 1) * 16 < a->tokens ? (tile + 1) * 16 : a->tokens;
    for (int64_t t = tile * 16; t < t1; t++) {
        float *o = a->out + t * a->hidden;
        int64_t c = a->cursor[t];
        for (; c < a->token_start[t + 1] && a->by_token[c] < a->pair1; c++) {
            const int64_t p = a->by_token[c];
            const float w = a->weight[p], *yj = a->ys + (p - a->pair0) * a->hidden;
            for (int64_t k = 0; k < a->hidden; k++) o[k] += w * yj[k];
        }
        a->cursor[t] = c;
    }
}

static __thread float *pair_buf;
static __thread int64_t pair_cap;

/* strata_pp_moe on the pool by whole experts; 0 (out untouched) if memory ran out before any sum */
static int moe_by_expert(const swiglu_spec *spec, const void *const *G, const void *const *U, const void *const *D,
                         const int64_t *counts, int n_used, const int64_t *token, const float *weight, const float *X,
                         float *out, int nth) {
    const int64_t hidden = spec->hidden;
    int64_t pairs = 0, tokens = 0, most = 0;
    for (int i = 0; i < n_used; i++) pairs += counts[i] > 0 ? counts[i] : 0, most = counts[i] > most ? counts[i] : most;
    for (int64_t p = 0; p < pairs; p++) tokens = token[p] + 1 > tokens ? token[p] + 1 : tokens;
    int64_t *idx = strata_pp_malloc(sizeof(int64_t) * (size_t)(n_used + pairs + 2 * (tokens + 1)));
    if (!idx) return 0;
    int64_t *starts = idx, *by_token = starts + n_used, *token_start = by_token + pairs, *cursor = token_start + tokens + 1;
    for (int64_t i = 0, s = 0; i < n_used; s += counts[i] > 0 ? counts[i] : 0, i++) starts[i] = s;
    memset(token_start, 0, sizeof(int64_t) * (size_t)(tokens + 1));
    for (int64_t p = 0; p < pairs; p++) token_start[token[p] + 1]++;
    for (int64_t t = 0; t < tokens; t++) token_start[t + 1] += token_start[t];
    memcpy(cursor, token_start, sizeof(int64_t) * (size_t)tokens);
    for (int64_t p = 0; p < pairs; p++) by_token[cursor[token[p]]++] = p; /* stable: pairs in table order */
    memcpy(cursor, token_start, sizeof(int64_t) * (size_t)tokens);
    const int64_t batch_pairs = PP_PAIR_BYTES / (int64_t)sizeof(float) / hidden;
    if (!grow((void **)&pair_buf, &pair_cap, (most > batch_pairs ? most : batch_pairs) * hidden, sizeof(float))) {
        free(idx);
        return 0;
    }
    swiglu_spec one = *spec;
    one.nth = 1;
    atomic_int failed = 0;
    int rc = 1;
    for (int e0 = 0; e0 < n_used && rc == 1;) {
        int e1 = e0;
        int64_t in_batch = 0;
        while (e1 < n_used && (e1 == e0 || in_batch + counts[e1] <= batch_pairs)) in_batch += counts[e1] > 0 ? counts[e1] : 0, e1++;
        const experts_job ej = {&one, G, U, D, counts, starts, token, X, e0, starts[e0], pair_buf, &failed};
        strata_pool_run(expert_tile, &ej, e1 - e0, nth);
        if (atomic_load(&failed)) {
            rc = e0 == 0 ? 0 : -1; /* -1: out already holds the earlier batches */
            break;
        }
        const int64_t pair1 = starts[e0] + in_batch;
        const pair_sum_job sj = {by_token, token_start, cursor, weight, pair_buf, starts[e0], pair1, hidden, tokens, out};
        strata_pool_run(pair_sum_tile, &sj, (tokens + 15) / 16, nth);
        e0 = e1;
    }
    free(idx);
    return rc;
}

/* A layer's routed experts over a prompt: expert i (matrices G[i], U[i], D[i]) takes the counts[i]
 * consecutive pairs of the route table (token, weight), in order; out (tokens x hidden) +=
 * weight * expert(X[token]), expert by expert. Returns 0 (out untouched) where it cannot run, -1
 * when memory ran out part way (out holds some experts' rows). With more than one thread and
 * enough experts the pool takes whole experts (moe_by_expert), else each product is split. */
int strata_pp_moe(const int *types, const int64_t *wrow, void *const *small, const int *min_rows,
                  const void *const *G, const void *const *U, const void *const *D, const int64_t *counts, int n_used,
                  const int64_t *token, const float *weight, const float *X, int64_t hidden, int64_t ffn, float *out,
                  int terms, int nth) {
    swiglu_spec s;
    if (!make_spec(&s, types, wrow, small, min_rows, hidden, ffn, terms, nth)) return 0;
    if (nth > 1 && n_used >= 4 * nth) return moe_by_expert(&s, G, U, D, counts, n_used, token, weight, X, out, nth);
    int64_t most = 0;
    for (int i = 0; i < n_used; i++) most = counts[i] > most ? counts[i] : most;
    float *xs = strata_pp_malloc(sizeof(float) * (size_t)(most * (2 * hidden + 2 * ffn)));
    if (!xs) return 0;
    float *ys = xs + most * hidden, *scratch = ys + most * hidden;
    int64_t start = 0;
    for (int i = 0; i < n_used; start += counts[i], i++) {
        const int64_t n = counts[i];
        if (n <= 0) continue;
        for (int64_t j = 0; j < n; j++) memcpy(xs + j * hidden, X + token[start + j] * hidden, sizeof(float) * (size_t)hidden);
        if (!swiglu(&s, G[i], U[i], D[i], xs, n, ys, scratch)) { /* out of memory: report how far it got */
            free(xs);
            return start == 0 ? 0 : -1;
        }
        for (int64_t j = 0; j < n; j++) {
            float *o = out + token[start + j] * hidden;
            const float w = weight[start + j], *yj = ys + j * hidden;
            for (int64_t c = 0; c < hidden; c++) o[c] += w * yj[c];
        }
    }
    free(xs);
    return 1;
}

/* y (n float32) = one row of W dequantized here (tests compare it with the reference decoder) */
int strata_pp_dequant_row(int type, const uint8_t *w, int64_t n, float *y) {
    if (type < 0 || type >= PP_MAX_TYPES || !OWN[type]) return 0;
    OWN[type](w, y, n);
    return 1;
}

#ifdef PP_AMX
/* hi, lo (n bfloat16 each) = one row of W by the decoder prompt products use, straight into
 * bfloat16 parts (tests compare them with gguf-py's values split the same way); lo may be NULL */
int strata_pp_decode_bf16(int type, const uint8_t *w, int64_t n, uint16_t *hi, uint16_t *lo) {
    if (type < 0 || type >= PP_MAX_TYPES || !OWN_TILES[type] || n % 32) return 0;
    OWN_TILES[type](w, hi, lo, 32, n);
    return 1;
}
#else
int strata_pp_decode_bf16(int type, const uint8_t *w, int64_t n, uint16_t *hi, uint16_t *lo) {
    (void)type, (void)w, (void)n, (void)hi, (void)lo;
    return 0; /* the float32 products decode no bfloat16 */
}
#endif

#else /* neither AMX-BF16 nor AVX2 + FMA at build time */

int strata_pp_available(void) { return 0; }
int strata_pp_backend(void) { return 0; }
int strata_pp_has_type(int type, int own_only) { (void)type, (void)own_only; return 0; }
int strata_pp_matmul(int type, const uint8_t *W, int64_t rows, int64_t cols, int64_t wrow, const float *X,
                     int64_t tokens, float *Y, int terms, int nth) {
    (void)type, (void)W, (void)rows, (void)cols, (void)wrow, (void)X, (void)tokens, (void)Y, (void)terms, (void)nth;
    return 0;
}
int strata_pp_dequant_row(int type, const uint8_t *w, int64_t n, float *y) {
    (void)type, (void)w, (void)n, (void)y;
    return 0;
}
int strata_pp_decode_bf16(int type, const uint8_t *w, int64_t n, uint16_t *hi, uint16_t *lo) {
    (void)type, (void)w, (void)n, (void)hi, (void)lo;
    return 0;
}
int strata_pp_swiglu(const int *types, const int64_t *wrow, void *const *small, const int *min_rows,
                     const uint8_t *G, const uint8_t *U, const uint8_t *D, const float *X, int64_t n,
                     int64_t hidden, int64_t ffn, float *Y, int terms, int nth) {
    (void)types, (void)wrow, (void)small, (void)min_rows, (void)G, (void)U, (void)D, (void)X, (void)n;
    (void)hidden, (void)ffn, (void)Y, (void)terms, (void)nth;
    return 0;
}
int strata_pp_moe(const int *types, const int64_t *wrow, void *const *small, const int *min_rows,
                  const void *const *G, const void *const *U, const void *const *D, const int64_t *counts, int n_used,
                  const int64_t *token, const float *weight, const float *X, int64_t hidden, int64_t ffn, float *out,
                  int terms, int nth) {
    (void)types, (void)wrow, (void)small, (void)min_rows, (void)G, (void)U, (void)D, (void)counts, (void)n_used;
    (void)token, (void)weight, (void)X, (void)hidden, (void)ffn, (void)out, (void)terms, (void)nth;
    return 0;
}

#endif

/* ------------------------------------------------------------------ a prompt's RMS norms
 *
 * y[r] = w * (x[r] * 1 / sqrt(mean(x[r]^2) + eps)) for `rows` rows of n floats, on the calling
 * thread. A prompt's norms in torch (square, mean, rsqrt, two products) were five OpenMP regions
 * each; at 2 threads on a shared machine every one waits for a descheduled peer (bench: a
 * 512 x 32 x 128 q norm 47 ms wall against 5 ms at 1 thread). The squares are summed in 16
 * float lanes, then the lanes pairwise (torch's vectorised order is alike but not identical). */
void strata_pp_rmsnorm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *y) {
    for (int64_t r = 0; r < rows; r++, x += n, y += n) {
        float acc[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= n; i += 16)
            for (int j = 0; j < 16; j++) acc[j] += x[i + j] * x[i + j];
        for (int j = 0; i < n; i++, j++) acc[j] += x[i] * x[i];
        for (int s = 8; s > 0; s /= 2)
            for (int j = 0; j < s; j++) acc[j] += acc[j + s];
        const float inv = 1.0f / sqrtf(acc[0] / (float)n + eps);
        for (i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
    }
}
