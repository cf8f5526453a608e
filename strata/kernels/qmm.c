/* Quantized matrix products for the expert miss path: Y[b, r] = sum_k W[r, k] * X[b, k].
 *
 * W stays in its ggml block format; every 8 weights are decoded into one vector register and
 * used at once for up to 8 batch rows, so an expert is never dequantized as a whole.
 * These decoders keep x in float32 (or int16 for some types), so results agree with "dequantize,
 * then matmul" up to summation order; by default a product with ggml's kernels loaded quantizes
 * x to 8 bits and takes their integer dot products instead (see "ggml's dot products").
 *
 * The decoders mirror strata/quant (and so gguf-py) field for field; see those files for the
 * layout of each block. Built by strata/kernels/_build.py with -O3 -march=native -pthread;
 * no -ffast-math: only the order of the additions differs from the reference.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include "blocks.h"
#include "pool.h"

typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));  /* unaligned loads */


/* ------------------------------------------------------------------ tables (declared in blocks.h) */

uint8_t GRID_IQ2_XXS[256][8];
uint8_t GRID_IQ2_XS[512][8];
uint8_t GRID_IQ3_XXS[256][4];
float KSIGNS[128][8] __attribute__((aligned(32)));
int16_t KSIGNS16[128][8] __attribute__((aligned(16))); /* +-1 as int16, for the int16 kernels */

/* The grids of the IQ types as levels for the permute kernels (dot2_iq2_xs_perm): each value is its
 * index in the type's few magnitudes (2 bits: IQ2's 8, 25, 43 and IQ1's -1, 0, 1; 3 bits: IQ3's
 * eight), and byte i of half h holds entry i's values of that half (4 of 8, or 2 of 4), so that 64
 * entries come out of a few byte permutes per half. A *_ok flag is 0 if a grid held any other value,
 * and that type's permute kernel is then not used. */
static uint8_t IQ2XS_LEVELS[2][512] __attribute__((aligned(64)));
static uint8_t IQ2XXS_LEVELS[2][256] __attribute__((aligned(64)));
static uint8_t IQ2S_LEVELS[2][1024] __attribute__((aligned(64)));
static uint8_t IQ1S_LEVELS[2][2048] __attribute__((aligned(64))); /* IQ1_S's grid, also IQ1_M's */
static uint8_t IQ3XXS_LEVELS[2][256] __attribute__((aligned(64)));
static uint8_t IQ3S_LEVELS[2][512] __attribute__((aligned(64)));
static int iq2xs_ok, iq2xxs_ok, iq2s_ok, iq1s_ok, iq3xxs_ok, iq3s_ok;

/* grid: `entries` x `per` values (per 8: 2-bit levels, per 4: 3-bit), each one of mag[0..nmag). */
static int grid_levels(const uint8_t *grid, int entries, int per, const uint8_t *mag, int nmag, uint8_t *levels) {
    const int bits = per == 8 ? 2 : 3, half = per / 2;
    memset(levels, 0, (size_t)(2 * entries));
    int ok = 1;
    for (int i = 0; i < entries; i++)
        for (int k = 0; k < per; k++) {
            int l = 0;
            while (l < nmag && mag[l] != grid[per * i + k]) l++;
            ok &= l < nmag;
            levels[(k / half) * entries + i] |= (uint8_t)(l << (bits * (k % half)));
        }
    return ok;
}

static const uint8_t IQ2_MAG[3] = {8, 25, 43};

/* The codebooks come from gguf-py at load time, so they are the reference decoder's own. */
void strata_init_tables(const uint8_t *iq2xxs, const uint8_t *iq2xs, const uint8_t *iq3xxs,
                        const uint8_t *ksigns) {
    memcpy(GRID_IQ2_XXS, iq2xxs, sizeof GRID_IQ2_XXS);
    memcpy(GRID_IQ2_XS, iq2xs, sizeof GRID_IQ2_XS);
    memcpy(GRID_IQ3_XXS, iq3xxs, sizeof GRID_IQ3_XXS);
    static const uint8_t iq3xxs_mag[8] = {4, 12, 20, 28, 36, 44, 52, 62};
    iq2xs_ok = grid_levels(&GRID_IQ2_XS[0][0], 512, 8, IQ2_MAG, 3, &IQ2XS_LEVELS[0][0]);
    iq2xxs_ok = grid_levels(&GRID_IQ2_XXS[0][0], 256, 8, IQ2_MAG, 3, &IQ2XXS_LEVELS[0][0]);
    iq3xxs_ok = grid_levels(&GRID_IQ3_XXS[0][0], 256, 4, iq3xxs_mag, 8, &IQ3XXS_LEVELS[0][0]);
    for (int i = 0; i < 128; i++)
        for (int j = 0; j < 8; j++) {
            KSIGNS[i][j] = (ksigns[i] >> j) & 1 ? -1.0f : 1.0f;
            KSIGNS16[i][j] = (ksigns[i] >> j) & 1 ? -1 : 1;
        }
}

/* The codebooks of IQ1_S / IQ1_M (2048 x 8 values in {-1, 0, 1}, kept here times 8 so that
 * 8 * grid + delta is one int8 per value), IQ2_S (1024 x 8 magnitudes) and IQ3_S (512 x 4), from
 * gguf-py at load time like the others; KSIGNS8 is ksigns_iq2xs (7 sign bits + their parity). */
int8_t GRID_IQ1_S8[2048][8] __attribute__((aligned(64)));
uint8_t GRID_IQ2_S[1024][8] __attribute__((aligned(64)));
uint8_t GRID_IQ3_S[512][4] __attribute__((aligned(64)));
uint8_t KSIGNS8[128];

void strata_init_tables_iq(const int8_t *iq1s, const uint8_t *iq2s, const uint8_t *iq3s) {
    for (int i = 0; i < 2048 * 8; i++) GRID_IQ1_S8[i / 8][i % 8] = (int8_t)(8 * iq1s[i]);
    memcpy(GRID_IQ2_S, iq2s, sizeof GRID_IQ2_S);
    memcpy(GRID_IQ3_S, iq3s, sizeof GRID_IQ3_S);
    for (int i = 0; i < 128; i++) KSIGNS8[i] = (uint8_t)(i | (__builtin_parity((unsigned)i) << 7));
    static const uint8_t iq1s_mag[3] = {0xFF, 0, 1}; /* -1, 0, 1 as bytes: level g + 1 */
    static const uint8_t iq3s_mag[8] = {1, 3, 5, 7, 9, 11, 13, 15};
    iq2s_ok = grid_levels(&GRID_IQ2_S[0][0], 1024, 8, IQ2_MAG, 3, &IQ2S_LEVELS[0][0]);
    iq1s_ok = grid_levels((const uint8_t *)iq1s, 2048, 8, iq1s_mag, 3, &IQ1S_LEVELS[0][0]);
    iq3s_ok = grid_levels(&GRID_IQ3_S[0][0], 512, 4, iq3s_mag, 8, &IQ3S_LEVELS[0][0]);
}

/* ------------------------------------------------------------------ vectors
 * GCC/Clang vector extensions: 8 lanes of 32 bits. With -march=native on x86 these become AVX2
 * (vpmovzxbd, vcvtdq2ps, vfmadd, vpshufb); elsewhere the compiler picks the native width.
 */
typedef uint8_t v8u8 __attribute__((vector_size(8), aligned(1)));
typedef int8_t v8i8 __attribute__((vector_size(8), aligned(1)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef int8_t v16i8u __attribute__((vector_size(16), aligned(1)));

static const v8u IOTA = {0, 1, 2, 3, 4, 5, 6, 7};

static inline v8f splat(float f) { return (v8f){f, f, f, f, f, f, f, f}; }
static inline v8f ldu(const float *p) { return *(const v8fu *)p; }
#if defined(__AVX2__)
/* GCC 12 widens a v8u8 byte by byte; say vpmovzxbd/vpmovsxbd outright. */
static inline v8i ld_u8(const uint8_t *p) { return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline v8i ld_i8(const int8_t *p) { return (v8i)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#else
static inline v8i ld_u8(const uint8_t *p) { return __builtin_convertvector(*(const v8u8 *)p, v8i); }
static inline v8i ld_i8(const int8_t *p) { return __builtin_convertvector(*(const v8i8 *)p, v8i); }
#endif
static inline v8f cvt(v8i v) { return __builtin_convertvector(v, v8f); }
static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* 16 table lookups at once (pshufb): out[i] = table[idx[i] & 15], written to out[0..15]. */
static inline void lookup16(v16i8 table, const uint8_t *q, int shift, int8_t *out) {
#if defined(__AVX2__)
    const __m128i raw = _mm_loadu_si128((const __m128i *)q);
    const __m128i idx = _mm_and_si128(shift ? _mm_srli_epi16(raw, 4) : raw, _mm_set1_epi8(15));
    _mm_storeu_si128((__m128i *)out, _mm_shuffle_epi8((__m128i)table, idx));
#else
    const v16i8 idx = (*(const v16i8u *)q >> shift) & 15; /* the mask undoes the sign extension */
    v16i8 v = __builtin_shuffle(table, idx);
    memcpy(out, &v, 16);
#endif
}


/* ------------------------------------------------------------------ blocks
 * blk_T(b, x, xs, acc, NB): for NB batch rows (x, x + xs, ...) starting at this block's first
 * value, acc[r] += w * x_r over the block, 8 values at a time. Each 8 weights are decoded once
 * and used for every batch row; NB is a constant after inlining, so acc stays in registers.
 */
#define BLOCK(NAME) \
    static inline __attribute__((always_inline)) void blk_##NAME(const uint8_t *restrict b, \
        const float *restrict x, const int64_t xs, v8f *restrict acc, const int NB)
/* Small NB gets several accumulators per row (picked by `lane`, a constant of the unrolled inner loop), so consecutive
 * FMAs do not wait on each other's latency; lanes(NB) * NB <= 8 registers. */
#define LANES(NB) ((NB) == 1 ? 4 : (NB) == 2 ? 2 : 1)
#define EMIT(w, off, lane)                                                                    \
    do {                                                                                      \
        const v8f w_ = (w);                                                                   \
        const int l_ = (lane) & (LANES(NB) - 1);                                              \
        for (int r_ = 0; r_ < NB; r_++) acc[r_ * LANES(NB) + l_] += w_ * ldu(x + r_ * xs + (off)); \
    } while (0)

BLOCK(q4_0) {
    const v8f d = splat(rd_f16(b));
    const uint8_t *q = b + 2;
    #pragma GCC unroll 4
    for (int g = 0; g < 2; g++) {
        const v8i v = ld_u8(q + 8 * g);
        EMIT(cvt((v & 15) - 8) * d, 8 * g, g);
        EMIT(cvt((v >> 4) - 8) * d, 16 + 8 * g, g + 2);
    }
}

BLOCK(q4_1) {
    const v8f d = splat(rd_f16(b)), m = splat(rd_f16(b + 2));
    const uint8_t *q = b + 4;
    #pragma GCC unroll 4
    for (int g = 0; g < 2; g++) {
        const v8i v = ld_u8(q + 8 * g);
        EMIT(cvt(v & 15) * d + m, 8 * g, g);
        EMIT(cvt(v >> 4) * d + m, 16 + 8 * g, g + 2);
    }
}

BLOCK(q5_0) {
    const v8f d = splat(rd_f16(b));
    const v8u h = (v8u){0} + rd_u32(b + 2);
    const uint8_t *q = b + 6;
    #pragma GCC unroll 4
    for (int g = 0; g < 2; g++) {
        const v8i v = ld_u8(q + 8 * g);
        const v8i h0 = (v8i)((h >> (IOTA + 8 * g)) & 1) << 4, h1 = (v8i)((h >> (IOTA + 16 + 8 * g)) & 1) << 4;
        EMIT(cvt(((v & 15) | h0) - 16) * d, 8 * g, g);
        EMIT(cvt(((v >> 4) | h1) - 16) * d, 16 + 8 * g, g + 2);
    }
}

BLOCK(q5_1) {
    const v8f d = splat(rd_f16(b)), m = splat(rd_f16(b + 2));
    const v8u h = (v8u){0} + rd_u32(b + 4);
    const uint8_t *q = b + 8;
    #pragma GCC unroll 4
    for (int g = 0; g < 2; g++) {
        const v8i v = ld_u8(q + 8 * g);
        const v8i h0 = (v8i)((h >> (IOTA + 8 * g)) & 1) << 4, h1 = (v8i)((h >> (IOTA + 16 + 8 * g)) & 1) << 4;
        EMIT(cvt((v & 15) | h0) * d + m, 8 * g, g);
        EMIT(cvt((v >> 4) | h1) * d + m, 16 + 8 * g, g + 2);
    }
}

BLOCK(q8_0) {
    const v8f d = splat(rd_f16(b));
    const int8_t *q = (const int8_t *)(b + 2);
    #pragma GCC unroll 4
    for (int g = 0; g < 4; g++) EMIT(cvt(ld_i8(q + 8 * g)) * d, 8 * g, g);
}

BLOCK(q2_k) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = rd_f16(b + 80), dmin = rd_f16(b + 82);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            #pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int sub = h * 8 + s * 2 + (k >> 1);
                const v8f dl = splat(d * (float)(sc[sub] & 0xF)), ml = splat(dmin * (float)(sc[sub] >> 4));
                const v8i q = (ld_u8(qs + h * 32 + 8 * k) >> (2 * s)) & 3;
                EMIT(cvt(q) * dl - ml, h * 128 + s * 32 + 8 * k, k);
            }
}

BLOCK(q3_k) {
    const uint8_t *hm = b, *qs = b + 32;
    float dl[16];
    q3k_sub_scales(b, dl);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            #pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const v8i ql = (ld_u8(qs + h * 32 + 8 * k) >> (2 * s)) & 3;
                const v8i bit = (ld_u8(hm + 8 * k) >> (h * 4 + s)) & 1;
                EMIT(cvt(ql - ((bit ^ 1) << 2)) * splat(dl[h * 8 + s * 2 + (k >> 1)]), h * 128 + s * 32 + 8 * k, k);
            }
}

BLOCK(q4_k) {
    const float d = rd_f16(b), dmin = rd_f16(b + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    const uint8_t *qs = b + 16;
    for (int p = 0; p < 4; p++) {
        const v8f d0 = splat(d * (float)sc[2 * p]), m0 = splat(dmin * (float)mn[2 * p]);
        const v8f d1 = splat(d * (float)sc[2 * p + 1]), m1 = splat(dmin * (float)mn[2 * p + 1]);
        #pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const v8i v = ld_u8(qs + 32 * p + 8 * k);
            EMIT(cvt(v & 15) * d0 - m0, 64 * p + 8 * k, k);
            EMIT(cvt(v >> 4) * d1 - m1, 64 * p + 32 + 8 * k, k ^ 2);
        }
    }
}

BLOCK(q5_k) {
    const float d = rd_f16(b), dmin = rd_f16(b + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int p = 0; p < 4; p++) {
        const v8f d0 = splat(d * (float)sc[2 * p]), m0 = splat(dmin * (float)mn[2 * p]);
        const v8f d1 = splat(d * (float)sc[2 * p + 1]), m1 = splat(dmin * (float)mn[2 * p + 1]);
        #pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const v8i v = ld_u8(qs + 32 * p + 8 * k), h = ld_u8(qh + 8 * k);
            EMIT(cvt((v & 15) | (((h >> (2 * p)) & 1) << 4)) * d0 - m0, 64 * p + 8 * k, k);
            EMIT(cvt((v >> 4) | (((h >> (2 * p + 1)) & 1) << 4)) * d1 - m1, 64 * p + 32 + 8 * k, k ^ 2);
        }
    }
}

BLOCK(q6_k) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = rd_f16(b + 208);
    for (int h = 0; h < 2; h++)
        for (int t = 0; t < 4; t++) {
            const uint8_t *pl = ql + h * 64 + (t & 1) * 32, *ph = qh + h * 32;
            const int sl = 4 * (t >> 1), sh = 2 * t;
            #pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const v8i q = (((ld_u8(pl + 8 * k) >> sl) & 15) | (((ld_u8(ph + 8 * k) >> sh) & 3) << 4)) - 32;
                EMIT(cvt(q) * splat(d * (float)sc[h * 8 + t * 2 + (k >> 1)]), h * 128 + t * 32 + 8 * k, k);
            }
        }
}

BLOCK(iq2_xxs) {
    const float d = rd_f16(b);
    for (int s = 0; s < 8; s++) {
        const uint8_t *q = b + 2 + 8 * s;
        const uint32_t aux = rd_u32(q + 4);
        const v8f db = splat(d * (0.5f + (float)(aux >> 28)) * 0.25f);
        #pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const v8f sg = *(const v8f *)KSIGNS[(aux >> (7 * k)) & 0x7F];
            EMIT(db * cvt(ld_u8(GRID_IQ2_XXS[q[k]])) * sg, 32 * s + 8 * k, k);
        }
    }
}

BLOCK(iq2_xs) {
    const float d = rd_f16(b);
    const uint8_t *sc = b + 66;
    for (int p = 0; p < 8; p++) { /* 32 values: two 16-value sub-blocks with 4-bit scales */
        const v8f db0 = splat(d * (0.5f + (float)(sc[p] & 0xF)) * 0.25f);
        const v8f db1 = splat(d * (0.5f + (float)(sc[p] >> 4)) * 0.25f);
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const uint16_t q = rd_u16(b + 2 + 8 * p + 2 * k);
            EMIT((k < 2 ? db0 : db1) * cvt(ld_u8(GRID_IQ2_XS[q & 511])) * *(const v8f *)KSIGNS[q >> 9],
                 32 * p + 8 * k, k);
        }
    }
}

BLOCK(iq3_xxs) {
    const float d = rd_f16(b);
    const uint8_t *qs = b + 2;
    for (int s = 0; s < 8; s++) {
        const uint32_t aux = rd_u32(b + 66 + 4 * s);
        const v8f db = splat(d * (0.5f + (float)(aux >> 28)) * 0.5f);
        #pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            uint8_t g[8];
            memcpy(g, GRID_IQ3_XXS[qs[s * 8 + k * 2]], 4);
            memcpy(g + 4, GRID_IQ3_XXS[qs[s * 8 + k * 2 + 1]], 4);
            EMIT(db * cvt(ld_u8(g)) * *(const v8f *)KSIGNS[(aux >> (7 * k)) & 0x7F], 32 * s + 8 * k, k);
        }
    }
}

BLOCK(iq4_nl) {
    const v8f d = splat(rd_f16(b));
    int8_t v[32];
    lookup16(IQ4_NL_I8, b + 2, 0, v);
    lookup16(IQ4_NL_I8, b + 2, 4, v + 16);
    #pragma GCC unroll 4
    for (int g = 0; g < 4; g++) EMIT(cvt(ld_i8(v + 8 * g)) * d, 8 * g, g);
}

BLOCK(iq4_xs) {
    const float d = rd_f16(b);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 8; j++) {
        const v8f dl = splat(d * (float)iq4xs_scale(b, j));
        int8_t v[32];
        lookup16(IQ4_NL_I8, qs + 16 * j, 0, v);
        lookup16(IQ4_NL_I8, qs + 16 * j, 4, v + 16);
        #pragma GCC unroll 4
        for (int g = 0; g < 4; g++) EMIT(cvt(ld_i8(v + 8 * g)) * dl, 32 * j + 8 * g, g);
    }
}

BLOCK(mxfp4) {
    const v8f d = splat(e8m0_half(b[0]));
    int8_t v[32];
    lookup16(E2M1_I8, b + 1, 0, v);
    lookup16(E2M1_I8, b + 1, 4, v + 16);
    #pragma GCC unroll 4
    for (int g = 0; g < 4; g++) EMIT(cvt(ld_i8(v + 8 * g)) * d, 8 * g, g);
}


/* ------------------------------------------------------------------ drivers */

#define ROW_TILE 16

typedef struct {
    const uint8_t *W;
    int64_t rows, cols, nblk, B, tile_rows;
    const float *X;
    float *Y;
} qmm_args;

/* Rows [r0, r1) for NB batch rows starting at X; Y is [B, rows] row-major. */
#define DEFINE_ROWS(NAME, QK, TS, NB)                                                                \
    static void rows_##NAME##_##NB(const uint8_t *W, int64_t r0, int64_t r1, int64_t nblk,            \
                                   const float *X, int64_t cols, float *Y, int64_t rows) {           \
        for (int64_t r = r0; r < r1; r++) {                                                          \
            v8f acc[NB * LANES(NB)];                                                                 \
            for (int i = 0; i < NB * LANES(NB); i++) acc[i] = (v8f){0};                              \
            const uint8_t *wr = W + r * nblk * (TS);                                                 \
            for (int64_t j = 0; j < nblk; j++) blk_##NAME(wr + j * (TS), X + j * (QK), cols, acc, NB); \
            for (int i = 0; i < NB; i++) {                                                           \
                v8f s = acc[i * LANES(NB)];                                                          \
                for (int l = 1; l < LANES(NB); l++) s += acc[i * LANES(NB) + l];                     \
                Y[i * rows + r] = hsum8(s);                                                          \
            }                                                                                        \
        }                                                                                            \
    }

/* ------------------------------------------------------------------ int16 activations (AVX2)
 *
 * For the most used types a faster variant quantizes each row of x to int16 with one scale
 * (max |x| -> 32767: an error of at most 1.5e-5 of max |x| per element, far inside the 1e-3
 * the kernels are held to) and multiplies integer weights with vpmaddwd, 16 products per
 * instruction, converting to float once per 16 or 32 values to apply the block scales.
 * Sums stay exact in int32: |q| <= 128 and |x| <= 32767, at most 4 products per lane.
 * Mins (Q4_K's dmin * m) use per-32 sums of the quantized x.
 */
#if defined(__AVX2__)
#define HAVE_I16 1

typedef struct {
    const uint8_t *W;
    int64_t rows, cols, nblk, B, tile_rows, nsum;
    const int16_t *XQ; /* [B, cols] */
    const float *XS;   /* [B] scale of each row */
    const float *XSUM; /* [B, cols / 32] sums of XQ over 32 values */
    float *Y;
} qmm16_args;

static inline __m256i ld16(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline v8f cvt32(__m256i v) { return (v8f)_mm256_cvtepi32_ps(v); }
static inline __m256i lo16u(__m256i v) { return _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v)); }
static inline __m256i hi16u(__m256i v) { return _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1)); }
static inline __m256i lo16s(__m256i v) { return _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)); }
static inline __m256i hi16s(__m256i v) { return _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)); }

/* Quantize X rows; returns 0 (and leaves the float path to run) if some |x| is not finite. */
static int prep_x16(const float *X, int64_t B, int64_t cols, int16_t *xq, float *xs, float *xsum) {
    for (int64_t b = 0; b < B; b++) {
        const float *x = X + b * cols;
        float m = 0.0f;
        for (int64_t i = 0; i < cols; i++) {
            const float a = x[i] < 0 ? -x[i] : x[i];
            m = a > m ? a : m;
        }
        if (!(m <= 3.0e38f)) return 0; /* inf or nan */
        const float inv = m > 0 ? 32767.0f / m : 0.0f;
        xs[b] = m > 0 ? m / 32767.0f : 0.0f;
        int16_t *q = xq + b * cols;
        for (int64_t i = 0; i < cols; i++) q[i] = (int16_t)__builtin_lrintf(x[i] * inv);
        for (int64_t g = 0; g < cols / 32; g++) {
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) sum += q[32 * g + i];
            xsum[b * (cols / 32) + g] = (float)sum;
        }
    }
    return 1;
}

/* blk16_T(b, xq, xs, xsum, ss, acc, macc, NB): like blk_T, with int16 x (row stride xs), its
 * per-32 sums (row stride ss) and a scalar accumulator per row for the min terms. */
#define BLOCK16(NAME)                                                                               \
    static inline __attribute__((always_inline)) void blk16_##NAME(                                 \
        const uint8_t *restrict b, const int16_t *restrict xq, const int64_t xs,                    \
        const float *restrict xsum, const int64_t ss, v8f *restrict acc, v8f *restrict macc,      \
        const int NB)
#define EMIT16(isum, scale, lane)                                                                   \
    do {                                                                                            \
        const int l_ = (lane) & (LANES(NB) - 1);                                                    \
        acc[r_ * LANES(NB) + l_] += cvt32(isum) * (scale);                                          \
    } while (0)

BLOCK16(q8_0) {
    (void)xsum; (void)ss; (void)macc;
    const v8f d = splat(rd_f16(b));
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2));
    const __m256i q0 = lo16s(q), q1 = hi16s(q);
    for (int r_ = 0; r_ < NB; r_++) {
        const int16_t *x = xq + r_ * xs;
        EMIT16(_mm256_add_epi32(_mm256_madd_epi16(q0, ld16(x)), _mm256_madd_epi16(q1, ld16(x + 16))), d, 0);
    }
}

BLOCK16(q4_k) {
    const float d = rd_f16(b), dmin = rd_f16(b + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    /* the min terms, dmin * m_j * sum(x over sub-block j), for all 8 sub-blocks at once */
    v8f mv;
    for (int i = 0; i < 8; i++) mv[i] = dmin * (float)mn[i];
    for (int r_ = 0; r_ < NB; r_++) macc[r_] += mv * ldu(xsum + r_ * ss);
    const __m256i m4 = _mm256_set1_epi8(15);
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * p));
        const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        const __m256i l0 = lo16u(lo), l1 = hi16u(lo), h0 = lo16u(hi), h1 = hi16u(hi);
        const v8f dl = splat(d * (float)sc[2 * p]), dh = splat(d * (float)sc[2 * p + 1]);
        for (int r_ = 0; r_ < NB; r_++) {
            const int16_t *x = xq + r_ * xs + 64 * p;
            EMIT16(_mm256_add_epi32(_mm256_madd_epi16(l0, ld16(x)), _mm256_madd_epi16(l1, ld16(x + 16))), dl, 2 * p);
            EMIT16(_mm256_add_epi32(_mm256_madd_epi16(h0, ld16(x + 32)), _mm256_madd_epi16(h1, ld16(x + 48))), dh,
                   2 * p + 1);
        }
    }
}

BLOCK16(q6_k) {
    (void)xsum; (void)ss; (void)macc;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = rd_f16(b + 208);
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3), c32 = _mm256_set1_epi8(32);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const __m256i qa = _mm256_loadu_si256((const __m256i *)(b + h * 64));
        const __m256i qb = _mm256_loadu_si256((const __m256i *)(b + h * 64 + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + h * 32));
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(qa, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(qb, m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const __m256i qs = _mm256_sub_epi8(q[t], c32);
            const __m256i w0 = lo16s(qs), w1 = hi16s(qs);
            const v8f s0 = splat(d * (float)sc[h * 8 + t * 2]), s1 = splat(d * (float)sc[h * 8 + t * 2 + 1]);
            for (int r_ = 0; r_ < NB; r_++) {
                const int16_t *x = xq + r_ * xs + h * 128 + t * 32;
                EMIT16(_mm256_madd_epi16(w0, ld16(x)), s0, 2 * t);
                EMIT16(_mm256_madd_epi16(w1, ld16(x + 16)), s1, 2 * t + 1);
            }
        }
    }
}

BLOCK16(q5_k) {
    const float d = rd_f16(b), dmin = rd_f16(b + 2);
    uint8_t sc[8], mn[8];
    scale_min_k4(b + 4, sc, mn);
    /* the min terms, dmin * m_j * sum(x over sub-block j), for all 8 sub-blocks at once */
    v8f mv;
    for (int i = 0; i < 8; i++) mv[i] = dmin * (float)mn[i];
    for (int r_ = 0; r_ < NB; r_++) macc[r_] += mv * ldu(xsum + r_ * ss);
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * p));
        const __m256i bl = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4);
        const __m256i bh = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, m4), bl);
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), bh);
        const __m256i l0 = lo16u(lo), l1 = hi16u(lo), h0 = lo16u(hi), h1 = hi16u(hi);
        const v8f dl = splat(d * (float)sc[2 * p]), dh = splat(d * (float)sc[2 * p + 1]);
        for (int r_ = 0; r_ < NB; r_++) {
            const int16_t *x = xq + r_ * xs + 64 * p;
            EMIT16(_mm256_add_epi32(_mm256_madd_epi16(l0, ld16(x)), _mm256_madd_epi16(l1, ld16(x + 16))), dl, 2 * p);
            EMIT16(_mm256_add_epi32(_mm256_madd_epi16(h0, ld16(x + 32)), _mm256_madd_epi16(h1, ld16(x + 48))), dh,
                   2 * p + 1);
        }
    }
}

/* 32 table values of a 16-byte nibble run (low nibbles = values 0-15), as two int16 vectors. */
static inline void lookup32_i16(__m128i table, const uint8_t *q, __m256i *w0, __m256i *w1) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(15);
    *w0 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(v, m4)));
    *w1 = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), m4)));
}

#define BLOCK16_LOOKUP32(NAME, TABLE, SCALE, QOFF)                                                    \
    BLOCK16(NAME) {                                                                                 \
        (void)xsum; (void)ss; (void)macc;                                                           \
        const v8f d = splat(SCALE);                                                                 \
        __m256i w0, w1;                                                                             \
        lookup32_i16((__m128i)TABLE, b + (QOFF), &w0, &w1);                                         \
        for (int r_ = 0; r_ < NB; r_++) {                                                           \
            const int16_t *x = xq + r_ * xs;                                                        \
            EMIT16(_mm256_add_epi32(_mm256_madd_epi16(w0, ld16(x)), _mm256_madd_epi16(w1, ld16(x + 16))), d, 0); \
        }                                                                                           \
    }
BLOCK16_LOOKUP32(iq4_nl, IQ4_NL_I8, rd_f16(b), 2)
BLOCK16_LOOKUP32(mxfp4, E2M1_I8, e8m0_half(b[0]), 1)

BLOCK16(iq4_xs) {
    (void)xsum; (void)ss; (void)macc;
    const float d = rd_f16(b);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        const v8f dl = splat(d * (float)iq4xs_scale(b, j));
        __m256i w0, w1;
        lookup32_i16((__m128i)IQ4_NL_I8, b + 8 + 16 * j, &w0, &w1);
        for (int r_ = 0; r_ < NB; r_++) {
            const int16_t *x = xq + r_ * xs + 32 * j;
            EMIT16(_mm256_add_epi32(_mm256_madd_epi16(w0, ld16(x)), _mm256_madd_epi16(w1, ld16(x + 16))), dl, j);
        }
    }
}

/* Two 8-value grid rows (uint8) with their sign rows -> 16 signed int16 weights. */
static inline __m256i grid16(const uint8_t *g0, const uint8_t *g1, int s0, int s1) {
    uint64_t a, c;
    memcpy(&a, g0, 8);
    memcpy(&c, g1, 8);
    const __m256i g = _mm256_cvtepu8_epi16(_mm_set_epi64x((long long)c, (long long)a));
    const __m256i sg = _mm256_set_m128i(_mm_load_si128((const __m128i *)KSIGNS16[s1]),
                                        _mm_load_si128((const __m128i *)KSIGNS16[s0]));
    return _mm256_sign_epi16(g, sg);
}

BLOCK16(iq2_xxs) {
    (void)xsum; (void)ss; (void)macc;
    const float d = rd_f16(b);
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        const uint8_t *q = b + 2 + 8 * s;
        const uint32_t aux = rd_u32(q + 4);
        const v8f db = splat(d * (0.5f + (float)(aux >> 28)) * 0.25f);
        const __m256i w0 = grid16(GRID_IQ2_XXS[q[0]], GRID_IQ2_XXS[q[1]], aux & 127, (aux >> 7) & 127);
        const __m256i w1 = grid16(GRID_IQ2_XXS[q[2]], GRID_IQ2_XXS[q[3]], (aux >> 14) & 127, (aux >> 21) & 127);
        for (int r_ = 0; r_ < NB; r_++) {
            const int16_t *x = xq + r_ * xs + 32 * s;
            EMIT16(_mm256_add_epi32(_mm256_madd_epi16(w0, ld16(x)), _mm256_madd_epi16(w1, ld16(x + 16))), db, s);
        }
    }
}

BLOCK16(iq2_xs) {
    (void)xsum; (void)ss; (void)macc;
    const float d = rd_f16(b);
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) { /* 16 values: two grid rows sharing one 4-bit scale */
        const uint16_t q0 = rd_u16(b + 2 + 4 * s), q1 = rd_u16(b + 4 + 4 * s);
        const v8f db = splat(d * (0.5f + (float)((b[66 + s / 2] >> (4 * (s & 1))) & 0xF)) * 0.25f);
        const __m256i w = grid16(GRID_IQ2_XS[q0 & 511], GRID_IQ2_XS[q1 & 511], q0 >> 9, q1 >> 9);
        for (int r_ = 0; r_ < NB; r_++) EMIT16(_mm256_madd_epi16(w, ld16(xq + r_ * xs + 16 * s)), db, s);
    }
}

#define DEFINE_ROWS16(NAME, QK, TS, NB)                                                               \
    static void rows16_##NAME##_##NB(const qmm16_args *a, int64_t r0, int64_t r1, int64_t b0) {        \
        const int16_t *xq = a->XQ + b0 * a->cols;                                                     \
        const float *xsum = a->XSUM + b0 * a->nsum;                                                   \
        for (int64_t r = r0; r < r1; r++) {                                                           \
            v8f acc[NB * LANES(NB)];                                                                  \
            v8f macc[NB];                                                                             \
            for (int i = 0; i < NB * LANES(NB); i++) acc[i] = (v8f){0};                               \
            for (int i = 0; i < NB; i++) macc[i] = (v8f){0};                                          \
            const uint8_t *wr = a->W + r * a->nblk * (TS);                                            \
            for (int64_t j = 0; j < a->nblk; j++)                                                     \
                blk16_##NAME(wr + j * (TS), xq + j * (QK), a->cols, xsum + j * ((QK) / 32), a->nsum,  \
                             acc, macc, NB);                                                          \
            for (int i = 0; i < NB; i++) {                                                            \
                v8f s = acc[i * LANES(NB)];                                                           \
                for (int l = 1; l < LANES(NB); l++) s += acc[i * LANES(NB) + l];                      \
                a->Y[(b0 + i) * a->rows + r] = hsum8(s - macc[i]) * a->XS[b0 + i];                    \
            }                                                                                         \
        }                                                                                             \
    }

#define DEFINE_QMM16(NAME, QK, TS)                                                                     \
    DEFINE_ROWS16(NAME, QK, TS, 1) DEFINE_ROWS16(NAME, QK, TS, 2) DEFINE_ROWS16(NAME, QK, TS, 4)       \
    DEFINE_ROWS16(NAME, QK, TS, 8)                                                                     \
    static void tile16_##NAME(const void *a_, int64_t tile) {                                         \
        const qmm16_args *a = (const qmm16_args *)a_;                                                 \
        const int64_t t0 = tile * a->tile_rows;                                                       \
        const int64_t t1 = t0 + a->tile_rows < a->rows ? t0 + a->tile_rows : a->rows;                 \
        for (int64_t b0 = 0; b0 < a->B;) {                                                            \
            const int64_t left = a->B - b0;                                                           \
            if (left >= 8) { rows16_##NAME##_8(a, t0, t1, b0); b0 += 8; }                             \
            else if (left >= 4) { rows16_##NAME##_4(a, t0, t1, b0); b0 += 4; }                        \
            else if (left >= 2) { rows16_##NAME##_2(a, t0, t1, b0); b0 += 2; }                        \
            else { rows16_##NAME##_1(a, t0, t1, b0); b0 += 1; }                                       \
        }                                                                                             \
    }                                                                                                 \
    static int qmm16_##NAME(const uint8_t *W, int64_t rows, int64_t cols, const float *X, int64_t B,  \
                            float *Y, int nth) {                                                      \
        int16_t *xq = malloc(sizeof(int16_t) * B * cols);                                             \
        float *xs = malloc(sizeof(float) * (B + B * (cols / 32)));                                    \
        int ok = xq && xs && prep_x16(X, B, cols, xq, xs, xs + B);                                    \
        if (ok) {                                                                                     \
            int64_t tile_rows = ROW_TILE;                                                             \
            while ((rows + tile_rows - 1) / tile_rows > 0xFFFF) tile_rows *= 2;                       \
            const qmm16_args a = {W, rows, cols, cols / (QK), B, tile_rows, cols / 32, xq, xs, xs + B, Y}; \
            pool_run(tile16_##NAME, &a, (rows + tile_rows - 1) / tile_rows, nth < 1 ? 1 : nth);       \
        }                                                                                             \
        free(xq);                                                                                     \
        free(xs);                                                                                     \
        return ok;                                                                                    \
    }

DEFINE_QMM16(q8_0, 32, 34)
DEFINE_QMM16(q4_k, 256, 144)
DEFINE_QMM16(q5_k, 256, 176)
DEFINE_QMM16(q6_k, 256, 210)
DEFINE_QMM16(iq2_xxs, 256, 66)
DEFINE_QMM16(iq2_xs, 256, 74)
DEFINE_QMM16(iq4_nl, 32, 18)
DEFINE_QMM16(iq4_xs, 256, 136)
DEFINE_QMM16(mxfp4, 32, 17)
#endif

/* ------------------------------------------------------------------ ggml's dot products
 *
 * llama.cpp's own CPU kernels (libggml-cpu, from ggml-python or llama-cpp-python) as a library:
 * strata/kernels/_ggml.py hands over, per ggml type, the `vec_dot` of its type traits and the
 * `from_float` of its activation type (q8_0, q8_1 or q8_K). A product then quantizes each row
 * of x once and takes ggml's integer dot products (AVX-512 VNNI / AVX-VNNI / AVX2, whatever
 * that library was built for) row by row, on this file's thread pool, not ggml's.
 */
typedef void (*ggml_vec_dot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by,
                                int nrc);
typedef void (*ggml_from_float_fn)(const float *x, void *y, int64_t k);

typedef void (*ggml_to_float_fn)(const void *x, float *y, int64_t k);

typedef struct {
    ggml_vec_dot_fn dot;
    ggml_from_float_fn quant;
    int64_t qblk, qsize;      /* block size and bytes per block of the activation type */
} ext_kernel;

#define MAX_EXT 64
static ext_kernel EXT[MAX_EXT];

void strata_set_ext(int type, void *dot, void *quant, int64_t qblk, int64_t qsize) {
    if (type < 0 || type >= MAX_EXT) return;
    EXT[type].dot = (ggml_vec_dot_fn)dot;
    EXT[type].quant = (ggml_from_float_fn)quant;
    EXT[type].qblk = qblk;
    EXT[type].qsize = qsize;
}

/* Software prefetch of the weight stream: one core's hardware prefetchers left the products at
 * ~6 GB/s from DRAM on a shared machine; asking for the bytes PREFETCH_AHEAD ahead keeps more
 * cache-line reads in flight (a prefetch never faults, past the matrix or not). The one-pass
 * kernels ask block by block (stream_prefetch: a line or two per block, spread through their
 * arithmetic); ggml's dot products get each row's bytes in one burst before the row
 * (prefetch_ahead). The burst left a qwen3 Q4_K_M decode token waiting on full fill buffers for a
 * third of its time: 26.7 -> 23.3 ms CPU per token at 1 thread with the kernels asking. */
#define PREFETCH_AHEAD 4096
static inline void prefetch_ahead(const uint8_t *row, int64_t wrow, const uint8_t *end) {
    const uint8_t *p = row + PREFETCH_AHEAD, *q = p + wrow;
    if (q > end) q = end;
    for (; p < q; p += 64) __builtin_prefetch(p, 0, 2);
}

/* The PREFETCH_AHEAD-th bytes past a block of ts bytes at b, one prefetch per cache line. */
static inline __attribute__((always_inline)) void stream_prefetch(const uint8_t *b, const int ts) {
    for (int o = 0; o < ts; o += 64) __builtin_prefetch(b + PREFETCH_AHEAD + o, 0, 2);
}

static int act_mode = 3;

/* ------------------------------------------------------------------ q8x2 in one pass (AVX-512 VNNI)
 *
 * "q8x2" takes two 8-bit dot products per weight row: x's 8-bit value and its 8-bit residual.
 * Through ggml's vec_dot that is two passes, each unpacking the weight blocks again, which made
 * q8x2 1.7-1.9x the time of llama.cpp's single pass at one thread. For Q2_K to Q6_K (the
 * K-quant mixes of the common releases), Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
 * IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS and MXFP4 these kernels unpack each weight block once and feed both activations to vpdpbusd
 * (64 products per instruction), keeping
 * the two integer sums apart until the float scales apply: the same arithmetic as the two
 * passes up to the order of float additions. Activation blocks are ggml's, from its own quantizer.
 */
/* A multi-row kernel: nr <= DOT2M_ROWS rows of x (row r's activations at xq + xoff[r], xr + xoff[r],
 * the layout its one-row kernel takes) against one weight row, into y[0..nr). It unpacks each weight
 * block once for all rows (a verify pass's or a decode batch's rows each unpacked it again: their
 * products cost ~0.85x a one-row product per row), and each result is bit for bit its one-row
 * kernel's: the same integer sums, and per row the same float operations in the same order. */
#define DOT2M_ROWS 32
/* Bytes of "q8c" activations per 256 values (q8c_prep: f32 d; i8 q[256]; i16 bsums[16]; i16 m[8]). */
#define Q8C_BLOCK 308
typedef void (*dot2m_fn)(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr, const int64_t *xoff, int nr,
                         float *y);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_FUSED2 1

typedef float (*dot2_fn)(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr);

/* lanes of v (16 x int32, each |v| < 2^15) times s (16 x int32 with |s| < 2^15), added to acc:
 * vpdpwssd on the low int16 halves (s's high halves are 0), one instruction for mullo + add. */
static inline __m512i madd_lo16(__m512i acc, __m512i v, __m512i s) { return _mm512_dpwssd_epi32(acc, v, s); }

/* Two 32-value blocks' integer products over x's 8-bit value and residual, scaled by their
 * per-lane activation scales (8 lanes per block): the lanes a block's weight scale multiplies. */
static inline __m512 pair_products(__m512i pq, __m512i pr, const float *dq, const float *dr) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(pq), _mm512_loadu_ps(dq),
                           _mm512_mul_ps(_mm512_cvtepi32_ps(pr), _mm512_loadu_ps(dr)));
}

/* The f16 scales at the start of two blocks, each across its block's 8 lanes. */
static inline __m512 f16_pair(const uint8_t *b0, const uint8_t *b1) {
    uint16_t h0, h1;
    memcpy(&h0, b0, 2);
    memcpy(&h1, b1, 2);
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16((short)h0)),
                                                   _mm_set1_epi16((short)h1), 1));
}

/* A K-quant block sum: the scaled products' lanes minus the mins' lanes (the mins' sum first). */
static inline float sum_minus_mins(__m512 acc, __m256 accm) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(accm), _mm256_extractf128_ps(accm, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm512_reduce_add_ps(acc) - _mm_cvtss_f32(m);
}

/* Q4_K: {f16 d, dmin; u8 scales[12]; u8 qs[128]} x q8_K {f32 d; i8 qs[256]; i16 bsums[16]}.
 *
 * Q4_K, Q5_K and Q6_K take their activations from q8k_prep: x's q8_K blocks, then its residual's,
 * then per 16 values the float sum dq * bsum_q + dr * bsum_r, which every weight row's mins (Q6_K's
 * offset of 32) multiply: laid out once per x, one multiply-add per block and row instead of two
 * integer sums, conversions and multiply-adds. */
static int64_t q8k_prep_bytes(int64_t n) { const int64_t nb = n / 256; return nb * (2 * 292 + 16 * 4); }

static void q8k_prep(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out) {
    const int64_t nb = n / 256;
    memcpy(out, xq, (size_t)(nb * 292));
    memcpy(out + nb * 292, xr, (size_t)(nb * 292));
    float *bf = (float *)(out + 2 * nb * 292);
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *q = xq + i * 292, *r = xr + i * 292;
        float dq, dr;
        memcpy(&dq, q, 4);
        memcpy(&dr, r, 4);
        for (int k = 0; k < 16; k++) {
            int16_t a, c;
            memcpy(&a, q + 260 + 2 * k, 2);
            memcpy(&c, r + 260 + 2 * k, 2);
            bf[16 * i + k] = dq * (float)a + dr * (float)c;
        }
    }
}

/* Q5_K: {f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]} x q8_K: Q4_K with a fifth bit per
 * value from qh (bit 2j / 2j+1 of qh[l] for value l of sub-block 2j / 2j+1), u8 weights 0..31.
 * `five` is a constant in each caller, so each gets its own loop without the other's work. */
static inline __attribute__((always_inline)) float dot2_q45_k(int64_t n, const uint8_t *w, const uint8_t *prep,
                                                              const int five) {
    const int64_t nb = n / 256;
    const uint8_t *xq = prep, *xr = prep + nb * 292;
    const float *bf = (const float *)(prep + 2 * nb * 292);
    const __m256i m4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * (five ? 176 : 144), *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, five ? 176 : 144);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b), dmin = rd_f16(b + 2);
        uint64_t sc, mn;
        k4_scales_mins(b + 4, &sc, &mn);
        const __m512i sc32 = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc));
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
        __m512i sq = _mm512_setzero_si512(), sr = _mm512_setzero_si512();
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (five ? 48 : 16) + 32 * j));
            /* the fifth bit of value l of sub-block 2j (2j+1) is bit 2j (2j+1) of qh[l] */
            const __mmask32 h0 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << (2 * j))));
            const __mmask32 h1 = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(2 << (2 * j))));
            const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            const __m512i w8 = five ? _mm512_inserti64x4(
                                          _mm512_castsi256_si512(_mm256_or_si256(lo, _mm256_maskz_mov_epi8(h0, bit4))),
                                          _mm256_or_si256(hi, _mm256_maskz_mov_epi8(h1, bit4)), 1)
                                    : _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            const __m512i idx = _mm512_set_epi32(2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1,
                                                 2 * j + 1, 2 * j + 1, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j, 2 * j);
            const __m512i s = _mm512_permutexvar_epi32(idx, sc32);
            const __m512i pq = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(yq + 4 + 64 * j));
            const __m512i pr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(yr + 4 + 64 * j));
            sq = madd_lo16(sq, pq, s);
            sr = madd_lo16(sr, pr, s);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
        /* mins: dmin * m_j * (sum of x over sub-block j), x's sums per 16 values from q8k_prep */
        const __m512 m16 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_shuffle_epi8(_mm_cvtsi64_si128((long long)mn), _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0))));
        accm = _mm512_fmadd_ps(_mm512_mul_ps(m16, _mm512_set1_ps(dmin)), _mm512_loadu_ps(bf + 16 * i), accm);
    }
    return _mm512_reduce_add_ps(acc) - _mm512_reduce_add_ps(accm);
}

static float dot2_q4_k(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    return dot2_q45_k(n, w, prep, 0);
}

static float dot2_q5_k(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    return dot2_q45_k(n, w, prep, 1);
}

/* Q2_K: {u8 scales[16]; u8 qs[64]; f16 d, dmin} x q8_K. Value 128h + 32j + l is bits 2j..2j+1 of
 * qs[32h + l] (u8 0..3); each 16 values take a 4-bit scale (low nibble) and a 4-bit min (high
 * nibble), the mins through the activation's bsums as for Q4_K. */
static float dot2_q2_k(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m256i m3 = _mm256_set1_epi8(3);
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 84, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 84);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b + 80), dmin = rd_f16(b + 82);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)b);
        const __m512i sc32 = _mm512_cvtepu8_epi32(_mm_and_si128(sc8, _mm_set1_epi8(15)));
        __m512i sq = _mm512_setzero_si512(), sr = _mm512_setzero_si512();
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) { /* 64 values: half c / 2, shifts 4 (c % 2) and 4 (c % 2) + 2 */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (c / 2)));
            const int sh = 4 * (c % 2);
            const __m512i w8 = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi16(raw, sh), m3)),
                _mm256_and_si256(_mm256_srli_epi16(raw, sh + 2), m3), 1);
            const __m512i idx = _mm512_set_epi32(4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 2, 4 * c + 2,
                                                 4 * c + 2, 4 * c + 2, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                                 4 * c, 4 * c, 4 * c, 4 * c);
            const __m512i s = _mm512_permutexvar_epi32(idx, sc32);
            const __m512i pq = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(yq + 4 + 64 * c));
            const __m512i pr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(yr + 4 + 64 * c));
            sq = madd_lo16(sq, pq, s);
            sr = madd_lo16(sr, pr, s);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
        const __m256i m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), _mm_set1_epi8(15)));
        const __m256i bq = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(yq + 260)), m16);
        const __m256i br = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(yr + 260)), m16);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bq), _mm256_set1_ps(dmin * dq), accm);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(br), _mm256_set1_ps(dmin * dr), accm);
    }
    return sum_minus_mins(acc, accm);
}

/* Q3_K: {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d} x q8_K. Value 128h + 32j + l is bits
 * 2j..2j+1 of qs[32h + l] minus 4 where bit 4h + j of hmask[l] is clear; taken as u8 0..7 (that
 * value + 4), the 4 coming off through the bsums with the signed 6-bit scales (per 16 values). */
static float dot2_q3_k(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 110, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 110);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b + 108);
        uint32_t s4[4];
        q3k_scales_u32(b + 96, s4);
        const __m128i sc8 = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)s4), _mm_set1_epi8(32));
        const __m512i sc32 = _mm512_and_si512(_mm512_cvtepi8_epi32(sc8), _mm512_set1_epi32(0xFFFF));
        const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
        __m512i sq = _mm512_setzero_si512(), sr = _mm512_setzero_si512();
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) { /* 64 values: half h = c / 2, j = 2 (c % 2) and 2 (c % 2) + 1 */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (c / 2)));
            const int sh = 4 * (c % 2), hb = 4 * (c / 2) + 2 * (c % 2);
            const __mmask32 h0 = _mm256_test_epi8_mask(hm, _mm256_set1_epi8((char)(1 << hb)));
            const __mmask32 h1 = _mm256_test_epi8_mask(hm, _mm256_set1_epi8((char)(1 << (hb + 1))));
            const __m512i w8 = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, sh), m3),
                                                       _mm256_maskz_mov_epi8(h0, four))),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, sh + 2), m3), _mm256_maskz_mov_epi8(h1, four)), 1);
            const __m512i idx = _mm512_set_epi32(4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 3, 4 * c + 2, 4 * c + 2,
                                                 4 * c + 2, 4 * c + 2, 4 * c + 1, 4 * c + 1, 4 * c + 1, 4 * c + 1,
                                                 4 * c, 4 * c, 4 * c, 4 * c);
            const __m512i s = _mm512_permutexvar_epi32(idx, sc32);
            const __m512i pq = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(yq + 4 + 64 * c));
            const __m512i pr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(yr + 4 + 64 * c));
            sq = madd_lo16(sq, pq, s);
            sr = madd_lo16(sr, pr, s);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
        const __m256i s16 = _mm256_cvtepi8_epi16(sc8);
        const __m256i bq = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(yq + 260)), s16);
        const __m256i br = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(yr + 260)), s16);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bq), _mm256_set1_ps(4.0f * d * dq), accm);
        accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(br), _mm256_set1_ps(4.0f * d * dr), accm);
    }
    return sum_minus_mins(acc, accm);
}

/* Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d} x q8_K. Weights as u8 0..63 (q + 32); the
 * 32 comes off through the bsums, which are per 16 values like Q6_K's scales. */
static float dot2_q6_k(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    const int64_t nb = n / 256;
    const uint8_t *xq = prep, *xr = prep + nb * 292;
    const float *bf = (const float *)(prep + 2 * nb * 292);
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
    const __m512i sh_a = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0), sh_b = _mm512_set_epi64(6, 6, 6, 6, 4, 4, 4, 4);
    __m512 acc = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 210, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 210);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b + 208);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(b + 192));
        const __m512i sc32 = _mm512_cvtepi8_epi32(sc8), sc16 = _mm512_and_si512(sc32, _mm512_set1_epi32(0xFFFF));
        __m512i sq = _mm512_setzero_si512(), sr = _mm512_setzero_si512();
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512(b + 64 * h);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            const __m512i qhz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
            const __m512i wa = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(qhz, sh_a), m2), 4));
            const __m512i wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                               _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(qhz, sh_b), m2), 4));
            const int g = 8 * h; /* scale groups of 16 values: wa covers g..g+3, wb g+4..g+7 */
            const __m512i ia = _mm512_set_epi32(g + 3, g + 3, g + 3, g + 3, g + 2, g + 2, g + 2, g + 2, g + 1, g + 1,
                                                g + 1, g + 1, g, g, g, g);
            const __m512i ib = _mm512_add_epi32(ia, _mm512_set1_epi32(4));
            const __m512i sa = _mm512_permutexvar_epi32(ia, sc16), sb = _mm512_permutexvar_epi32(ib, sc16);
            const uint8_t *xa = yq + 4 + 128 * h, *ra = yr + 4 + 128 * h;
            sq = madd_lo16(sq, _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, _mm512_loadu_si512(xa)), sa);
            sq = madd_lo16(sq, _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb, _mm512_loadu_si512(xa + 64)), sb);
            sr = madd_lo16(sr, _mm512_dpbusd_epi32(_mm512_setzero_si512(), wa, _mm512_loadu_si512(ra)), sa);
            sr = madd_lo16(sr, _mm512_dpbusd_epi32(_mm512_setzero_si512(), wb, _mm512_loadu_si512(ra + 64)), sb);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
        accm = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sc32), _mm512_set1_ps(32.0f * d)),
                               _mm512_loadu_ps(bf + 16 * i), accm);
    }
    return _mm512_reduce_add_ps(acc) - _mm512_reduce_add_ps(accm);
}

/* Q4_1: {f16 d, m; u8 qs[16]} x q8_1 {f16 d, s; i8 qs[32]}. What does not depend on the weight row
 * is laid out once per product by q4_1_prep (x's 8-bit values and residuals back to back, their
 * block scales spread over 8 lanes each, and each block's sum of x as an exact integer sum times
 * its scales, where q8_1 keeps an f16), so a row costs two vpdpbusd per two blocks and its scales. */
static int64_t q4_1_prep_bytes(int64_t n) { const int64_t nb = n / 32; return nb * 64 + nb * 8 * 4 * 2 + nb * 4; }

static void q4_1_prep(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out) {
    const int64_t nb = n / 32;
    int8_t *vq = (int8_t *)out, *vr = vq + nb * 32;
    float *dq = (float *)(out + nb * 64), *dr = dq + nb * 8, *xs = dr + nb * 8;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *q = xq + i * 36, *r = xr + i * 36;
        memcpy(vq + i * 32, q + 4, 32);
        memcpy(vr + i * 32, r + 4, 32);
        const float a = rd_f16(q), c = rd_f16(r);
        int32_t sq = 0, sr = 0;
        for (int l = 0; l < 32; l++) {
            sq += ((const int8_t *)(q + 4))[l];
            sr += ((const int8_t *)(r + 4))[l];
        }
        for (int l = 0; l < 8; l++) {
            dq[i * 8 + l] = a;
            dr[i * 8 + l] = c;
        }
        xs[i] = a * (float)sq + c * (float)sr;
    }
}

static float dot2_q4_1(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    const int64_t nb = n / 32;
    const int8_t *vq = (const int8_t *)prep, *vr = vq + nb * 32;
    const float *dq = (const float *)(prep + nb * 64), *dr = dq + nb * 8, *xs = dr + nb * 8;
    const __m256i m4 = _mm256_set1_epi8(15);
    __m512 acc = _mm512_setzero_ps();
    float mins = 0.0f;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const uint8_t *b0 = w + i * 20, *b1 = b0 + 20;
        stream_prefetch(b0, 2 * 20);
        const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 4))),
                                                    _mm_loadu_si128((const __m128i *)(b1 + 4)), 1);
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, m4)),
                                             _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), 1);
        const __m512i w8 = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)); /* lo0 hi0 lo1 hi1 */
        const __m512i pq = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(vq + i * 32));
        const __m512i pr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(vr + i * 32));
        const __m512 t = pair_products(pq, pr, dq + i * 8, dr + i * 8);
        const __m512 dw = f16_pair(b0, b1);
        acc = _mm512_fmadd_ps(t, dw, acc);
        mins += rd_f16(b0 + 2) * xs[i] + rd_f16(b1 + 2) * xs[i + 1];
    }
    float tail = 0.0f;
    for (; i < nb; i++) { /* an odd last block */
        const uint8_t *b = w + i * 20;
        int32_t pq = 0, pr = 0;
        for (int l = 0; l < 16; l++) {
            const int lo = b[4 + l] & 15, hi = b[4 + l] >> 4;
            pq += lo * vq[i * 32 + l] + hi * vq[i * 32 + l + 16];
            pr += lo * vr[i * 32 + l] + hi * vr[i * 32 + l + 16];
        }
        tail += rd_f16(b) * (dq[i * 8] * (float)pq + dr[i * 8] * (float)pr) + rd_f16(b + 2) * xs[i];
    }
    return _mm512_reduce_add_ps(acc) + mins + tail;
}

/* Q5_1: {f16 d, m; u32 qh; u8 qs[16]} x q8_1, as Q4_1 with each value's fifth bit from qh (bit l
 * for value l), set by a byte mask: the same prepared activations (q4_1_prep). Its exact block
 * sums matter most here: with q8_1's f16 sums a Q5_1 model's logits missed transformers' by 2e-2. */
static float dot2_q5_1(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    const int64_t nb = n / 32;
    const int8_t *vq = (const int8_t *)prep, *vr = vq + nb * 32;
    const float *dq = (const float *)(prep + nb * 64), *dr = dq + nb * 8, *xs = dr + nb * 8;
    const __m256i m4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    __m512 acc = _mm512_setzero_ps();
    float mins = 0.0f;
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const uint8_t *b0 = w + i * 24, *b1 = b0 + 24;
        stream_prefetch(b0, 2 * 24);
        uint32_t h0, h1;
        memcpy(&h0, b0 + 4, 4);
        memcpy(&h1, b1 + 4, 4);
        const __m128i r0 = _mm_loadu_si128((const __m128i *)(b0 + 8)), r1 = _mm_loadu_si128((const __m128i *)(b1 + 8));
        /* per block [lo | hi] nibbles, then the fifth bits: value l of a block is bit l of its qh */
        const __m256i v0 = _mm256_or_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(r0, _mm256_castsi256_si128(m4))),
                                                                    _mm_and_si128(_mm_srli_epi16(r0, 4), _mm256_castsi256_si128(m4)), 1),
                                           _mm256_maskz_mov_epi8((__mmask32)h0, bit4));
        const __m256i v1 = _mm256_or_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(r1, _mm256_castsi256_si128(m4))),
                                                                    _mm_and_si128(_mm_srli_epi16(r1, 4), _mm256_castsi256_si128(m4)), 1),
                                           _mm256_maskz_mov_epi8((__mmask32)h1, bit4));
        const __m512i w8 = _mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1);
        const __m512i pq = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(vq + i * 32));
        const __m512i pr = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w8, _mm512_loadu_si512(vr + i * 32));
        const __m512 t = pair_products(pq, pr, dq + i * 8, dr + i * 8);
        const __m512 dw = f16_pair(b0, b1);
        acc = _mm512_fmadd_ps(t, dw, acc);
        mins += rd_f16(b0 + 2) * xs[i] + rd_f16(b1 + 2) * xs[i + 1];
    }
    float tail = 0.0f;
    for (; i < nb; i++) { /* an odd last block */
        const uint8_t *b = w + i * 24;
        const uint32_t h = rd_u32(b + 4);
        int32_t pq = 0, pr = 0;
        for (int l = 0; l < 16; l++) {
            const int lo = (b[8 + l] & 15) | (((h >> l) & 1) << 4), hi = (b[8 + l] >> 4) | (((h >> (l + 16)) & 1) << 4);
            pq += lo * vq[i * 32 + l] + hi * vq[i * 32 + l + 16];
            pr += lo * vr[i * 32 + l] + hi * vr[i * 32 + l + 16];
        }
        tail += rd_f16(b) * (dq[i * 8] * (float)pq + dr[i * 8] * (float)pr) + rd_f16(b + 2) * xs[i];
    }
    return _mm512_reduce_add_ps(acc) + mins + tail;
}

/* IQ2_XS: {f16 d; u16 qs[32]; u8 scales[8]} x q8_K. Each u16 holds a grid index (low 9 bits: 8
 * magnitudes of {8, 25, 43} from GRID_IQ2_XS) and a 7-bit sign index whose 8th sign is the parity
 * of the 7 (ksigns_iq2xs; worked out for all 32 at once); 16-value sub-blocks scale by 2s+1
 * over a common 1/8. One vpgatherqq brings 64 magnitudes, which vpdpbusd takes as u8 against the
 * activations with the signs put on them (s8: q8_K's values are within +-127, so a negation never
 * overflows), so every integer sum is exact like ggml's. (The signs on the weights instead need x
 * as u8, x + 128, and one more vpdpbusd for the 128 * sum(w) per lane: 1.3-1.5x this kernel's
 * time, same sums bit for bit.) */
static float dot2_iq2_xs(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m128i m15x = _mm_set1_epi8(15), one8 = _mm_set1_epi8(1);
    const __m512i m511 = _mm512_set1_epi16(511), zero = _mm512_setzero_si512();
#if !defined(__AVX512BITALG__)
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512i parity4 = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0));
#endif
    /* vpackssdw of groups j and j + 1 puts, in 128-bit lane k, 4 sums of sub-block 4j + k, then
     * 4 of sub-block 4j + 4 + k: the 16-bit scales in that order, for j = 0 and j = 2 */
    const __m512i pair0 = _mm512_set_epi16(7, 7, 7, 7, 3, 3, 3, 3, 6, 6, 6, 6, 2, 2, 2, 2,
                                           5, 5, 5, 5, 1, 1, 1, 1, 4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i pair1 = _mm512_add_epi16(pair0, _mm512_set1_epi16(8));
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 74, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 74);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b);
        uint64_t s8;
        memcpy(&s8, b + 66, 8);
        const __m128i sb = _mm_cvtsi64_si128((long long)s8);
        /* sub-block g's scale is nibble g (low nibble first): 2s + 1 as 16 words */
        const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(sb, m15x), _mm_and_si128(_mm_srli_epi16(sb, 4), m15x));
        const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_add_epi8(_mm_add_epi8(nib, nib), one8)));
        const __m512i scale[2] = {_mm512_permutexvar_epi16(pair0, sc16), _mm512_permutexvar_epi16(pair1, sc16)};
        const __m512i q = _mm512_loadu_si512(b + 2); /* the 32 u16 */
        const __m512i s7 = _mm512_srli_epi16(q, 9);
        /* each u16's sign byte: its 7 bits and their parity as bit 7 (the byte's low 8 bits) */
#if defined(__AVX512BITALG__)
        const __m512i sgn = _mm512_or_si512(s7, _mm512_slli_epi16(_mm512_popcnt_epi16(s7), 7));
#else
        const __m512i par = _mm512_xor_si512(_mm512_shuffle_epi8(parity4, _mm512_and_si512(s7, m15)),
                                             _mm512_shuffle_epi8(parity4, _mm512_srli_epi16(s7, 4)));
        const __m512i sgn = _mm512_or_si512(s7, _mm512_slli_epi16(par, 7));
#endif
        uint64_t neg[4]; /* group j's 64 sign bits: the 8 sign bytes of its 8 u16 */
        _mm256_storeu_si256((__m256i *)neg, _mm512_cvtepi16_epi8(sgn));
        /* the 32 grid indices as i32, 16 at a time: group j's 8 are half j & 1 of idx[j >> 1] */
        const __m512i gi = _mm512_and_si512(q, m511);
        const __m512i idx[2] = {_mm512_cvtepu16_epi32(_mm512_castsi512_si256(gi)),
                                _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(gi, 1))};
        __m512i sq = zero, sr = zero, pq[2], pr[2];
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* 64 values: 8 grid entries, sub-blocks 4j..4j+3 */
            const __m256i ij = (j & 1) ? _mm512_extracti64x4_epi64(idx[j >> 1], 1) : _mm512_castsi512_si256(idx[j >> 1]);
            const __m512i g = _mm512_i32gather_epi64(ij, (const void *)GRID_IQ2_XS, 8);
            const __m512i vq = _mm512_loadu_si512(yq + 4 + 64 * j), vr = _mm512_loadu_si512(yr + 4 + 64 * j);
            /* each i32 sum of 4 products is within 4 * 43 * 127: it packs to 16 bits exactly */
            pq[j & 1] = _mm512_dpbusd_epi32(zero, g, _mm512_mask_sub_epi8(vq, (__mmask64)neg[j], zero, vq));
            pr[j & 1] = _mm512_dpbusd_epi32(zero, g, _mm512_mask_sub_epi8(vr, (__mmask64)neg[j], zero, vr));
            if (j & 1) {
                sq = _mm512_dpwssd_epi32(sq, _mm512_packs_epi32(pq[0], pq[1]), scale[j >> 1]);
                sr = _mm512_dpwssd_epi32(sr, _mm512_packs_epi32(pr[0], pr[1]), scale[j >> 1]);
            }
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
    }
    return 0.125f * _mm512_reduce_add_ps(acc);
}

#if defined(__AVX512VBMI__) && defined(__AVX512BITALG__)
#define HAVE_PERM 1
/* The grid types by byte permutes (AVX-512 VBMI; the table PERM below lists them). IQ2_XS and IQ2_XXS: two blocks' 64 grid indices go through
 * vpermi2b over the grid as 2-bit levels (IQ2XS_LEVELS: 4 x 128 entries a half, bits 7 and 8 of
 * the index pick among them; IQ2XXS_LEVELS: 2 x 128), and vpshufb turns each value's level into its
 * magnitude. The k-th value of every index comes out in one register, so x is laid out the same
 * way once per product (perm8_prep): per pair of blocks, x's value k of each of the 64 indices,
 * k = 0..7, for x's 8-bit value and then its residual, then the 4 block scales. vpmaddubsw sums the
 * two indices of a 16-value sub-block (within 2 * 43 * 127), vpdpwssd scales each sub-block by
 * 2s + 1; the integer sums are those of dot2_iq2_xs / dot2_iq2_xxs and ggml. On Zen 5,
 * `bench_kernels --threads 1 --batch 1`, ms per 768x2048 / 2048x768 product (x's quantization
 * included), against the kernels this CPU took before (the 256-bit ones for IQ2_XS and IQ2_XXS, the
 * AVX-512 gather one for IQ2_S): IQ2_XS 0.046 / 0.057 against 0.081 / 0.081 (perm_dot_x2 takes
 * the 768-value rows: 0.065 without it), IQ2_XXS 0.045 / 0.049 against 0.110 / 0.120, IQ2_S
 * 0.049 / 0.063 against 0.105 / 0.110. */
enum { PERM8_PAIR = 1040 }; /* prepared bytes per pair of blocks: 2 x 8 x 64 values, 4 floats */

static int64_t perm8_prep_bytes(int64_t n) { return (n / 256 + 1) / 2 * PERM8_PAIR; }

/* Within 64 bytes (8 indices x 8 values), value k of each index to bytes 8k..8k+7. */
static const uint8_t BY_VALUE8[64] __attribute__((aligned(64))) = {
    0, 8, 16, 24, 32, 40, 48, 56, 1, 9, 17, 25, 33, 41, 49, 57, 2, 10, 18, 26, 34, 42, 50, 58, 3, 11, 19, 27, 35, 43, 51, 59,
    4, 12, 20, 28, 36, 44, 52, 60, 5, 13, 21, 29, 37, 45, 53, 61, 6, 14, 22, 30, 38, 46, 54, 62, 7, 15, 23, 31, 39, 47, 55, 63};

/* The pairs `stride` bytes apart (PERM8_PAIR, or more where a kernel keeps more after them). */
static void perm8_prep_strided(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out, const int64_t stride) {
    const int64_t nb = n / 256;
    const __m512i p = _mm512_load_si512(BY_VALUE8);
    memset(out, 0, (size_t)((nb + 1) / 2 * stride));
    /* an odd last block goes into both halves of its pair: dot2x2_perm puts two weight rows' last
     * blocks in one pair (the one-row kernel's second block is then all zero) */
    for (int64_t j = 0; j < nb + (nb & 1); j++) {
        const int64_t i = j < nb ? j : nb - 1;
        uint8_t *o = out + j / 2 * stride;
        const int h = (int)(j & 1);
        for (int pass = 0; pass < 2; pass++) {
            const uint8_t *x = (pass ? xr : xq) + i * 292;
            memcpy(o + 1024 + 4 * (2 * pass + h), x, 4);
            for (int c = 0; c < 4; c++) { /* indices 8c..8c+7 */
                uint64_t t[8];
                _mm512_storeu_si512(t, _mm512_permutexvar_epi8(p, _mm512_loadu_si512(x + 4 + 64 * c)));
                for (int k = 0; k < 8; k++) memcpy(o + 512 * pass + 64 * k + 32 * h + 8 * c, &t[k], 8);
            }
        }
    }
}

static void perm8_prep(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out) {
    perm8_prep_strided(n, xq, xr, out, PERM8_PAIR);
}

/* Each byte's 7 sign bits with their parity as bit 7 (ksigns_iq2xs). */
static inline __attribute__((always_inline)) __m512i signs8(const __m512i s7) {
    const __m512i par = _mm512_and_si512(_mm512_slli_epi16(_mm512_popcnt_epi8(s7), 7), _mm512_set1_epi8((char)0x80));
    return _mm512_or_si512(s7, par);
}

/* The 32 sub-block scales 2s + 1 as words from the 32 nibbles of two blocks' 8 scale bytes. */
static inline __attribute__((always_inline)) __m512i nibble_scales(const long long c0, const long long c1) {
    const __m128i sb = _mm_set_epi64x(c1, c0), m15x = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(sb, m15x), hi = _mm_and_si128(_mm_srli_epi16(sb, 4), m15x);
    const __m512i s = _mm512_cvtepu8_epi16(_mm256_setr_m128i(_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi)));
    return _mm512_add_epi16(_mm512_add_epi16(s, s), _mm512_set1_epi16(1));
}

/* Entries of one half of a levels table (128 << (1 + nhigh) of them) for 64 indices: idx holds
 * their bits 0-7 (vpermi2b takes bits 0-6, bit 7 picks between table pairs), high[j] their bit 8 + j. */
static inline __attribute__((always_inline)) __m512i levels_lookup(const uint8_t *levels, const __m512i idx,
                                                                  const __mmask64 *high, const int nhigh) {
    const __m512i *t = (const __m512i *)levels;
    __m512i p[16];
    for (int j = 0; j < 2 << nhigh; j++) p[j] = _mm512_permutex2var_epi8(t[2 * j], idx, t[2 * j + 1]);
    const __mmask64 m7 = _mm512_movepi8_mask(idx);
    for (int j = 0; j < 1 << nhigh; j++) p[j] = _mm512_mask_blend_epi8(m7, p[2 * j], p[2 * j + 1]);
    for (int b = 0; b < nhigh; b++)
        for (int j = 0; j < 1 << (nhigh - 1 - b); j++) p[j] = _mm512_mask_blend_epi8(high[b], p[2 * j], p[2 * j + 1]);
    return p[0];
}

/* IQ2_XS ({f16 d; u16 qs[32]; u8 scales[8]}), the pair of blocks b, b1 (b alone if b1 is NULL):
 * the levels of values 0-3 and 4-7 of each of the 64 indices (lv0, lv1), the 64 sign bytes and the
 * 32 sub-block scales. */
static inline __attribute__((always_inline)) void iq2_xs_perm_unpack(const uint8_t *b, const uint8_t *b1, __m512i *lv0,
                                                                   __m512i *lv1, __m512i *sgn, __m512i *sc) {
    const __m512i zero = _mm512_setzero_si512(), bit8 = _mm512_set1_epi16(256);
    const __m512i q0 = _mm512_loadu_si512(b + 2), q1 = b1 ? _mm512_loadu_si512(b1 + 2) : zero;
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(q0)), _mm512_cvtepi16_epi8(q1), 1);
    const __mmask64 m8 = _mm512_kunpackd(_mm512_test_epi16_mask(q1, bit8), _mm512_test_epi16_mask(q0, bit8));
    const __m512i s0 = _mm512_srli_epi16(q0, 9), s1 = _mm512_srli_epi16(q1, 9);
    *sgn = signs8(_mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(s0)), _mm512_cvtepi16_epi8(s1), 1));
    long long c0, c1 = 0;
    memcpy(&c0, b + 66, 8);
    if (b1) memcpy(&c1, b1 + 66, 8);
    *sc = nibble_scales(c0, c1);
    *lv0 = levels_lookup(IQ2XS_LEVELS[0], idx, &m8, 1);
    *lv1 = levels_lookup(IQ2XS_LEVELS[1], idx, &m8, 1);
}

/* Index i of a pair of IQ2_XXS blocks: byte i % 4 of group i / 4 (64 + : the second block's). */
static const uint8_t IQ2XXS_PICK[64] __attribute__((aligned(64))) = {
    0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27, 32, 33, 34, 35, 40, 41, 42, 43, 48, 49, 50, 51, 56, 57, 58, 59,
    64, 65, 66, 67, 72, 73, 74, 75, 80, 81, 82, 83, 88, 89, 90, 91, 96, 97, 98, 99, 104, 105, 106, 107, 112, 113, 114, 115, 120, 121, 122, 123};
/* Word m (indices 2m, 2m + 1) takes the scale byte of group m / 2 (of 16): byte 4 of its qword. */
static const uint8_t IQ2XXS_SCALE_PICK[64] __attribute__((aligned(64))) = {
    4, 0, 4, 0, 12, 0, 12, 0, 20, 0, 20, 0, 28, 0, 28, 0, 36, 0, 36, 0, 44, 0, 44, 0, 52, 0, 52, 0, 60, 0, 60, 0,
    68, 0, 68, 0, 76, 0, 76, 0, 84, 0, 84, 0, 92, 0, 92, 0, 100, 0, 100, 0, 108, 0, 108, 0, 116, 0, 116, 0, 124, 0, 124, 0};

/* IQ2_XXS ({f16 d; 8 x (u8 grid[4]; u32 signs 4 x 7 bits | scale << 28)}): as iq2_xs_perm_unpack.
 * One vpermt2b gathers both blocks' 64 index bytes; vpmultishiftqb cuts each group's u32 into its
 * 4 sign fields and its scale, which the same gather puts in index order. */
static inline __attribute__((always_inline)) void iq2_xxs_perm_unpack(const uint8_t *b, const uint8_t *b1, __m512i *lv0,
                                                                    __m512i *lv1, __m512i *sgn, __m512i *sc) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i pk = _mm512_load_si512(IQ2XXS_PICK), sp = _mm512_load_si512(IQ2XXS_SCALE_PICK);
    const __m512i g0 = _mm512_loadu_si512(b + 2), g1 = b1 ? _mm512_loadu_si512(b1 + 2) : zero;
    const __m512i idx = _mm512_permutex2var_epi8(g0, pk, g1);
    /* bytes 0-3: the sign fields at bits 32 + 7j; byte 4: bits 60-67, the scale in its low nibble */
    const __m512i ctl = _mm512_set1_epi64((long long)0x000000003C352E2720ull);
    const __m512i f0 = _mm512_multishift_epi64_epi8(ctl, g0), f1 = _mm512_multishift_epi64_epi8(ctl, g1);
    *sgn = signs8(_mm512_and_si512(_mm512_permutex2var_epi8(f0, pk, f1), _mm512_set1_epi8(127)));
    const __m512i s = _mm512_and_si512(_mm512_permutex2var_epi8(f0, sp, f1), _mm512_set1_epi16(15));
    *sc = _mm512_add_epi16(_mm512_add_epi16(s, s), _mm512_set1_epi16(1));
    *lv0 = levels_lookup(IQ2XXS_LEVELS[0], idx, NULL, 0);
    *lv1 = levels_lookup(IQ2XXS_LEVELS[1], idx, NULL, 0);
}

/* IQ2_S ({f16 d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]}, 10-bit indices into the
 * 1024-entry grid): as iq2_xs_perm_unpack, 8 permutes a half (bits 7, 8 and 9 of the index pick among
 * them; vpmultishiftqb cuts the 2 high bits of each from qh) and the sign bytes as they are. */
static inline __attribute__((always_inline)) void iq2_s_perm_unpack(const uint8_t *b, const uint8_t *b1, __m512i *lv0,
                                                                  __m512i *lv1, __m512i *sgn, __m512i *sc) {
    const __m256i z = _mm256_setzero_si256();
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                           b1 ? _mm256_loadu_si256((const __m256i *)(b1 + 2)) : z, 1);
    *sgn = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 34))),
                              b1 ? _mm256_loadu_si256((const __m256i *)(b1 + 34)) : z, 1);
    long long h0, h1 = 0, c0, c1 = 0;
    memcpy(&h0, b + 66, 8);
    memcpy(&c0, b + 74, 8);
    if (b1) {
        memcpy(&h1, b1 + 66, 8);
        memcpy(&c1, b1 + 74, 8);
    }
    *sc = nibble_scales(c0, c1);
    /* qh byte g holds indices 4g..4g+3's bits 8-9 (2 bits each): qword q gets bytes 2q, 2q + 1 */
    const __m512i u = _mm512_cvtepu16_epi64(_mm_set_epi64x(h1, h0));
    const __m512i hb = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x0E0C0A0806040200ll), u);
    const __mmask64 high[2] = {_mm512_test_epi8_mask(hb, _mm512_set1_epi8(1)), _mm512_test_epi8_mask(hb, _mm512_set1_epi8(2))};
    *lv0 = levels_lookup(IQ2S_LEVELS[0], idx, high, 2);
    *lv1 = levels_lookup(IQ2S_LEVELS[1], idx, high, 2);
}

typedef void (*perm_unpack_fn)(const uint8_t *b, const uint8_t *b1, __m512i *lv0, __m512i *lv1, __m512i *sgn,
                               __m512i *sc);

/* Value k's magnitudes from 2-bit levels: its 2 bits of lv0 (k < 4) or lv1, through vpshufb of the
 * nibble that holds them (lut_lo: the low 2 bits' magnitude, lut_hi: the high 2 bits'). */
static inline __attribute__((always_inline)) __m512i level2_mag(const __m512i lv0, const __m512i lv1, const int k,
                                                               const __m512i lut_lo, const __m512i lut_hi) {
    const __m512i m15 = _mm512_set1_epi8(15), lv = k < 4 ? lv0 : lv1;
    const __m512i nib = k & 2 ? _mm512_and_si512(_mm512_srli_epi16(lv, 4), m15) : _mm512_and_si512(lv, m15);
    return _mm512_shuffle_epi8(k & 1 ? lut_hi : lut_lo, nib);
}
#define IQ2_LUT_LO _mm512_broadcast_i32x4(_mm_setr_epi8(8, 25, 43, 0, 8, 25, 43, 0, 8, 25, 43, 0, 8, 25, 43, 0))
#define IQ2_LUT_HI _mm512_broadcast_i32x4(_mm_setr_epi8(8, 8, 8, 8, 25, 25, 25, 25, 43, 43, 43, 43, 0, 0, 0, 0))

/* One prepared pair o against an unpacked pair: the integer sums of x's value (*sq) and residual
 * (*sr), 8 lanes per block. */
static inline __attribute__((always_inline)) void perm_sums(const uint8_t *o, const __m512i lv0, const __m512i lv1,
                                                           const __m512i sgn, const __m512i sc, __m512i *sq, __m512i *sr) {
    const __m512i zero = _mm512_setzero_si512(), lut_lo = IQ2_LUT_LO, lut_hi = IQ2_LUT_HI;
    __m512i aq[2] = {zero, zero}, ar[2] = {zero, zero}; /* two chains each: vpdpwssd's latency */
    #pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m512i mag = level2_mag(lv0, lv1, k, lut_lo, lut_hi);
        const __mmask64 neg = _mm512_test_epi8_mask(sgn, _mm512_set1_epi8((char)(1 << k)));
        const __m512i vq = _mm512_loadu_si512(o + 64 * k), vr = _mm512_loadu_si512(o + 512 + 64 * k);
        aq[k & 1] = _mm512_dpwssd_epi32(aq[k & 1], _mm512_maddubs_epi16(mag, _mm512_mask_sub_epi8(vq, neg, zero, vq)), sc);
        ar[k & 1] = _mm512_dpwssd_epi32(ar[k & 1], _mm512_maddubs_epi16(mag, _mm512_mask_sub_epi8(vr, neg, zero, vr)), sc);
    }
    *sq = _mm512_add_epi32(aq[0], aq[1]);
    *sr = _mm512_add_epi32(ar[0], ar[1]);
}

/* acc += a pair's sums times d0 * dq, d0 * dr (lanes 0-7) and d1 * dq, d1 * dr (lanes 8-15), the
 * block scales of x at o + 1024. */
static inline __attribute__((always_inline)) __m512 perm_scale(__m512 acc, const uint8_t *o, const __m512i sq,
                                                              const __m512i sr, const float d0, const float d1) {
    float dd[4];
    memcpy(dd, o + 1024, 16);
    const __m512 fq = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d0 * dd[0])), _mm256_set1_ps(d1 * dd[1]), 1);
    const __m512 fr = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d0 * dd[2])), _mm256_set1_ps(d1 * dd[3]), 1);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), fq, acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), fr, acc);
}

/* One weight row of ts-byte blocks against a perm8_prep row. */
static inline __attribute__((always_inline)) float perm_dot(int64_t n, const uint8_t *w, const uint8_t *prep, const int ts,
                                                           const perm_unpack_fn unpack) {
    const int64_t nb = n / 256;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i += 2) {
        const uint8_t *b = w + i * ts, *b1 = i + 1 < nb ? b + ts : NULL, *o = prep + i / 2 * PERM8_PAIR;
        stream_prefetch(b, 2 * ts);
        __m512i lv0, lv1, sgn, sc, sq, sr;
        unpack(b, b1, &lv0, &lv1, &sgn, &sc);
        perm_sums(o, lv0, lv1, sgn, sc, &sq, &sr);
        acc = perm_scale(acc, o, sq, sr, rd_f16(b), b1 ? rd_f16(b1) : 0.0f);
    }
    return 0.125f * _mm512_reduce_add_ps(acc);
}

/* The two-row kernels' end: the shared last pair's sums, row 0's in lanes 0-7 and row 1's in 8-15,
 * each scaled onto its row (row 1's moved to lanes 0-7, where its one-row kernel has them), then y. */
static inline __attribute__((always_inline)) void x2_finish(__m512 acc0, __m512 acc1, const uint8_t *o, const __m512i sq,
                                                           const __m512i sr, const float d0, const float d1, float y[2]) {
    acc0 = perm_scale(acc0, o, sq, sr, d0, 0.0f);
    acc1 = perm_scale(acc1, o, _mm512_shuffle_i64x2(sq, sq, 0x4E), _mm512_shuffle_i64x2(sr, sr, 0x4E), d1, 0.0f);
    y[0] = 0.125f * _mm512_reduce_add_ps(acc0);
    y[1] = 0.125f * _mm512_reduce_add_ps(acc1);
}

/* Weight rows w and w + wrow of a row length with an odd number of blocks: each row's whole pairs
 * as perm_dot takes them, and the two last blocks in one pair (the one-row kernel fills half a pair
 * with each), so a 768-value row (3 blocks) takes 3 pairs for two rows, not 4. Each result is
 * perm_dot's bit for bit: the other row's lanes are scaled by 0, and the second row's sums move to
 * lanes 0-7, where its one-row kernel has them. */
static inline __attribute__((always_inline)) void perm_dot_x2(int64_t n, const uint8_t *w, int64_t wrow,
                                                             const uint8_t *prep, float y[2], const int ts,
                                                             const perm_unpack_fn unpack) {
    const int64_t nb = n / 256, last = nb - 1;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m512i lv0, lv1, sgn, sc, sq, sr;
    for (int64_t i = 0; i < last; i += 2) {
        const uint8_t *b = w + i * ts, *o = prep + i / 2 * PERM8_PAIR;
        stream_prefetch(b, 2 * ts);
        stream_prefetch(b + wrow, 2 * ts);
        unpack(b, b + ts, &lv0, &lv1, &sgn, &sc);
        perm_sums(o, lv0, lv1, sgn, sc, &sq, &sr);
        acc0 = perm_scale(acc0, o, sq, sr, rd_f16(b), rd_f16(b + ts));
        unpack(b + wrow, b + wrow + ts, &lv0, &lv1, &sgn, &sc);
        perm_sums(o, lv0, lv1, sgn, sc, &sq, &sr);
        acc1 = perm_scale(acc1, o, sq, sr, rd_f16(b + wrow), rd_f16(b + wrow + ts));
    }
    const uint8_t *b = w + last * ts, *o = prep + last / 2 * PERM8_PAIR;
    unpack(b, b + wrow, &lv0, &lv1, &sgn, &sc);
    perm_sums(o, lv0, lv1, sgn, sc, &sq, &sr);
    x2_finish(acc0, acc1, o, sq, sr, rd_f16(b), rd_f16(b + wrow), y);
}

/* nr <= DOT2M_ROWS prepared rows against one weight row: each pair unpacked once per 8 rows, its
 * magnitudes and sign masks once for them; every row's arithmetic that of perm_dot, so each result
 * is its one-row kernel's bit for bit. vpmaddubsw's pair sums are within 2 * 43 * 127 = 10922, so
 * values 0-2, 3-5 and 6-7 add up within int16 before their vpdpwssd (B = 8: 0.216 -> 0.195 ms). */
static inline __attribute__((always_inline)) void perm_dot_rows(int64_t n, const uint8_t *w, const uint8_t *xq,
                                                               const int64_t *xoff, int nr, float *y, const int ts,
                                                               const perm_unpack_fn unpack) {
    enum { GROUP = 8 };
    const int64_t nb = n / 256;
    const __m512i zero = _mm512_setzero_si512(), lut_lo = IQ2_LUT_LO, lut_hi = IQ2_LUT_HI;
    for (int r0 = 0; r0 < nr; r0 += GROUP) {
        const int g = nr - r0 < GROUP ? nr - r0 : GROUP;
        __m512 acc[GROUP];
        for (int r = 0; r < g; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < nb; i += 2) {
            const uint8_t *b = w + i * ts, *b1 = i + 1 < nb ? b + ts : NULL;
            if (r0 == 0) stream_prefetch(b, 2 * ts);
            __m512i lv0, lv1, sgn, sc, mag[8];
            __mmask64 neg[8];
            unpack(b, b1, &lv0, &lv1, &sgn, &sc);
            #pragma GCC unroll 8
            for (int k = 0; k < 8; k++) { /* as perm_sums */
                mag[k] = level2_mag(lv0, lv1, k, lut_lo, lut_hi);
                neg[k] = _mm512_test_epi8_mask(sgn, _mm512_set1_epi8((char)(1 << k)));
            }
            const float d0 = rd_f16(b), d1 = b1 ? rd_f16(b1) : 0.0f;
            for (int r = 0; r < g; r++) {
                const uint8_t *o = xq + xoff[r0 + r] + i / 2 * PERM8_PAIR;
                __m512i aq = zero, ar = zero, pq = zero, pr = zero;
                #pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    const __m512i vq = _mm512_loadu_si512(o + 64 * k), vr = _mm512_loadu_si512(o + 512 + 64 * k);
                    const __m512i tq = _mm512_maddubs_epi16(mag[k], _mm512_mask_sub_epi8(vq, neg[k], zero, vq));
                    const __m512i tr = _mm512_maddubs_epi16(mag[k], _mm512_mask_sub_epi8(vr, neg[k], zero, vr));
                    pq = k % 3 ? _mm512_add_epi16(pq, tq) : tq;
                    pr = k % 3 ? _mm512_add_epi16(pr, tr) : tr;
                    if (k % 3 == 2 || k == 7) {
                        aq = _mm512_dpwssd_epi32(aq, pq, sc);
                        ar = _mm512_dpwssd_epi32(ar, pr, sc);
                    }
                }
                acc[r] = perm_scale(acc[r], o, aq, ar, d0, d1);
            }
        }
        for (int r = 0; r < g; r++) y[r0 + r] = 0.125f * _mm512_reduce_add_ps(acc[r]);
    }
}

/* One type's permute kernels: one row (dot2_T_perm), several rows of x (dot2m_T_perm), and two weight
 * rows of a row length with an odd number of blocks (dot2x2_T_perm), from FAMILY's (perm: perm_dot,
 * perm_dot_rows, perm_dot_x2; perm1: the IQ1 types'). */
#define PERM_KERNELS(NAME, TS, FAMILY)                                                                        \
    static float dot2_##NAME##_perm(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) { \
        (void)unused;                                                                                         \
        return FAMILY##_dot(n, w, prep, TS, NAME##_perm_unpack);                                              \
    }                                                                                                         \
    static void dot2m_##NAME##_perm(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr,        \
                                    const int64_t *xoff, int nr, float *y) {                                  \
        (void)xr;                                                                                             \
        FAMILY##_dot_rows(n, w, xq, xoff, nr, y, TS, NAME##_perm_unpack);                                     \
    }                                                                                                         \
    static void dot2x2_##NAME##_perm(int64_t n, const uint8_t *w, int64_t wrow, const uint8_t *prep, float y[2]) { \
        FAMILY##_dot_x2(n, w, wrow, prep, y, TS, NAME##_perm_unpack);                                         \
    }
PERM_KERNELS(iq2_xs, 74, perm)
PERM_KERNELS(iq2_xxs, 66, perm)
PERM_KERNELS(iq2_s, 82, perm)

/* IQ3_XXS ({f16 d; u8 grid[64]; 8 x u32: 4 x 7 sign bits | scale << 28}, 4-value entries of
 * GRID_IQ3_XXS) by the same byte permutes: a block's 64 indices fill one register, the grid as
 * 3-bit levels in two 256-entry halves (values 0-1, 2-3: IQ3XXS_LEVELS), vpshufb to the magnitudes
 * (4 .. 62), x laid out by value position once per product (perm4_prep: per block x's value k of
 * each index, k = 0..3, value then residual, then the 2 scales). A 7-bit sign field covers two
 * indices (8 values; its parity the 8th), a scale 2s + 1 eight. vpmaddubsw's pair sums (one field's
 * 8 values) are within 2 * 62 * 127. On Zen 5, as above: 0.050 / 0.055 ms against 0.145 / 0.153
 * (the 256-bit kernel). */
enum { PERM4_BLOCK = 520 }; /* prepared bytes per block: 2 x 4 x 64 values, 2 floats */

static int64_t perm4_prep_bytes(int64_t n) { return n / 256 * PERM4_BLOCK; }

/* Within 64 bytes (16 indices x 4 values), value k of each index to bytes 16k..16k+15. */
static const uint8_t BY_VALUE4[64] __attribute__((aligned(64))) = {
    0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61,
    2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63};

static void perm4_prep(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out) {
    const __m512i p = _mm512_load_si512(BY_VALUE4);
    for (int64_t i = 0; i < n / 256; i++) {
        uint8_t *o = out + i * PERM4_BLOCK;
        for (int pass = 0; pass < 2; pass++) {
            const uint8_t *x = (pass ? xr : xq) + i * 292;
            memcpy(o + 512 + 4 * pass, x, 4);
            for (int c = 0; c < 4; c++) { /* indices 16c..16c+15 */
                uint8_t t[64];
                _mm512_storeu_si512(t, _mm512_permutexvar_epi8(p, _mm512_loadu_si512(x + 4 + 64 * c)));
                for (int k = 0; k < 4; k++) memcpy(o + 256 * pass + 64 * k + 16 * c, t + 16 * k, 16);
            }
        }
    }
}

/* Block b: the levels of values 0-1 (lv0) and 2-3 (lv1) of its 64 indices, each index's 4 sign bits
 * (bits 0-3 of its byte), the 32 word scales (a word: indices 2m, 2m + 1). */
static inline __attribute__((always_inline)) void iq3_xxs_perm_unpack(const uint8_t *b, __m512i *lv0, __m512i *lv1,
                                                                    __m512i *sgn, __m512i *sc) {
    const __m512i idx = _mm512_loadu_si512(b + 2);
    *lv0 = levels_lookup(IQ3XXS_LEVELS[0], idx, NULL, 0);
    *lv1 = levels_lookup(IQ3XXS_LEVELS[1], idx, NULL, 0);
    /* u32 j (indices 8j..8j+7) into qword j: lanes 8j + t take its field t / 2 (bits 7 (t / 2)), the
     * words its scale (bits 28-31) */
    const __m512i u = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(b + 66)));
    const __m512i f = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x15150E0E07070000ll), u);
    const __m512i s8 = signs8(_mm512_and_si512(f, _mm512_set1_epi8(127)));
    /* an odd index takes its field's signs 4-7 (the 8th the parity) */
    *sgn = _mm512_mask_blend_epi8((__mmask64)0xAAAAAAAAAAAAAAAAull, s8, _mm512_srli_epi16(s8, 4));
    const __m512i s = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x381C381C381C381Cll), u);
    *sc = _mm512_add_epi16(_mm512_add_epi16(s, s), _mm512_set1_epi16(1));
}

/* One prepared block o against an unpacked block: the integer sums of x's value and residual; lut:
 * the 8 levels' magnitudes. */
#define IQ3XXS_LUT _mm512_broadcast_i32x4(_mm_setr_epi8(4, 12, 20, 28, 36, 44, 52, 62, 0, 0, 0, 0, 0, 0, 0, 0))
#define IQ3S_LUT _mm512_broadcast_i32x4(_mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0))
static inline __attribute__((always_inline)) void perm4_sums(const uint8_t *o, const __m512i lv0, const __m512i lv1,
                                                            const __m512i sgn, const __m512i sc, const __m512i lut,
                                                            __m512i *sq, __m512i *sr) {
    const __m512i zero = _mm512_setzero_si512(), m7 = _mm512_set1_epi8(7);
    __m512i aq[2] = {zero, zero}, ar[2] = {zero, zero};
    #pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m512i lv = k < 2 ? lv0 : lv1;
        const __m512i mag = _mm512_shuffle_epi8(lut, _mm512_and_si512(k & 1 ? _mm512_srli_epi16(lv, 3) : lv, m7));
        const __mmask64 neg = _mm512_test_epi8_mask(sgn, _mm512_set1_epi8((char)(1 << k)));
        const __m512i vq = _mm512_loadu_si512(o + 64 * k), vr = _mm512_loadu_si512(o + 256 + 64 * k);
        aq[k & 1] = _mm512_dpwssd_epi32(aq[k & 1], _mm512_maddubs_epi16(mag, _mm512_mask_sub_epi8(vq, neg, zero, vq)), sc);
        ar[k & 1] = _mm512_dpwssd_epi32(ar[k & 1], _mm512_maddubs_epi16(mag, _mm512_mask_sub_epi8(vr, neg, zero, vr)), sc);
    }
    *sq = _mm512_add_epi32(aq[0], aq[1]);
    *sr = _mm512_add_epi32(ar[0], ar[1]);
}

typedef void (*perm4_unpack_fn)(const uint8_t *b, __m512i *lv0, __m512i *lv1, __m512i *sgn, __m512i *sc);

/* acc += block b's sums against prepared block o times d * dq, d * dr. */
static inline __attribute__((always_inline)) __m512 perm4_block(__m512 acc, const uint8_t *o, const uint8_t *b,
                                                               const __m512i lv0, const __m512i lv1, const __m512i sgn,
                                                               const __m512i sc, const __m512i lut) {
    __m512i sq, sr;
    perm4_sums(o, lv0, lv1, sgn, sc, lut, &sq, &sr);
    float dd[2];
    memcpy(dd, o + 512, 8);
    const float d = rd_f16(b);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dd[0]), acc);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dd[1]), acc);
}

/* One weight row of ts-byte blocks against a perm4_prep row, times the type's common factor. */
static inline __attribute__((always_inline)) float perm4_dot(int64_t n, const uint8_t *w, const uint8_t *prep, const int ts,
                                                            const perm4_unpack_fn unpack, const __m512i lut,
                                                            const float factor) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *b = w + i * ts;
        stream_prefetch(b, ts);
        __m512i lv0, lv1, sgn, sc;
        unpack(b, &lv0, &lv1, &sgn, &sc);
        acc = perm4_block(acc, prep + i * PERM4_BLOCK, b, lv0, lv1, sgn, sc, lut);
    }
    return factor * _mm512_reduce_add_ps(acc);
}

/* nr <= DOT2M_ROWS prepared rows against one weight row: each block unpacked once per 8 rows, every
 * row's arithmetic that of perm4_dot (bit for bit). */
static inline __attribute__((always_inline)) void perm4_dot_rows(int64_t n, const uint8_t *w, const uint8_t *xq,
                                                                const int64_t *xoff, int nr, float *y, const int ts,
                                                                const perm4_unpack_fn unpack, const __m512i lut,
                                                                const float factor) {
    enum { GROUP = 8 };
    for (int r0 = 0; r0 < nr; r0 += GROUP) {
        const int g = nr - r0 < GROUP ? nr - r0 : GROUP;
        __m512 acc[GROUP];
        for (int r = 0; r < g; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < n / 256; i++) {
            const uint8_t *b = w + i * ts;
            if (r0 == 0) stream_prefetch(b, ts);
            __m512i lv0, lv1, sgn, sc;
            unpack(b, &lv0, &lv1, &sgn, &sc);
            for (int r = 0; r < g; r++)
                acc[r] = perm4_block(acc[r], xq + xoff[r0 + r] + i * PERM4_BLOCK, b, lv0, lv1, sgn, sc, lut);
        }
        for (int r = 0; r < g; r++) y[r0 + r] = factor * _mm512_reduce_add_ps(acc[r]);
    }
}

/* One 4-value grid type's permute kernels (one row, several rows of x); lut: its magnitudes, factor:
 * its common scale. */
#define PERM4_KERNELS(NAME, TS, LUT, FACTOR)                                                                  \
    static float dot2_##NAME##_perm(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) { \
        (void)unused;                                                                                         \
        return perm4_dot(n, w, prep, TS, NAME##_perm_unpack, LUT, FACTOR);                                    \
    }                                                                                                         \
    static void dot2m_##NAME##_perm(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr,        \
                                    const int64_t *xoff, int nr, float *y) {                                  \
        (void)xr;                                                                                             \
        perm4_dot_rows(n, w, xq, xoff, nr, y, TS, NAME##_perm_unpack, LUT, FACTOR);                           \
    }
PERM4_KERNELS(iq3_xxs, 98, IQ3XXS_LUT, 0.25f)

/* Lane i takes sign byte i / 2; word m the scale of group m / 4 (as 16-bit lanes). */
static const uint8_t BYTE_TO_LANE_PAIR[64] __attribute__((aligned(64))) = {
    0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15,
    16, 16, 17, 17, 18, 18, 19, 19, 20, 20, 21, 21, 22, 22, 23, 23, 24, 24, 25, 25, 26, 26, 27, 27, 28, 28, 29, 29, 30, 30, 31, 31};
static const uint16_t IQ3S_SCALE_WORDS[32] __attribute__((aligned(64))) = {
    0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7};

/* IQ3_S ({f16 d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]}, 9-bit indices into the 512 x 4
 * grid of 1, 3, .., 15): as IQ3_XXS, 4 permutes a half (bit 8 of index i is bit i of qh), the sign
 * bytes as they are (a byte: two indices), scales 2s + 1 per 32 values and no common factor. Zen 5,
 * as for IQ2_XS: 0.052 / 0.057 ms against 0.148 / 0.150 (the gather kernel). */
static inline __attribute__((always_inline)) void iq3_s_perm_unpack(const uint8_t *b, __m512i *lv0, __m512i *lv1,
                                                                  __m512i *sgn, __m512i *sc) {
    const __m512i idx = _mm512_loadu_si512(b + 2);
    uint64_t qh;
    memcpy(&qh, b + 66, 8);
    const __mmask64 m8 = (__mmask64)qh;
    *lv0 = levels_lookup(IQ3S_LEVELS[0], idx, &m8, 1);
    *lv1 = levels_lookup(IQ3S_LEVELS[1], idx, &m8, 1);
    /* sign byte m to lanes 2m, 2m + 1; the odd one takes its high nibble */
    const __m512i dup = _mm512_permutexvar_epi8(_mm512_load_si512(BYTE_TO_LANE_PAIR), _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 74))));
    *sgn = _mm512_mask_blend_epi8((__mmask64)0xAAAAAAAAAAAAAAAAull, dup, _mm512_srli_epi16(dup, 4));
    /* group g's scale (nibble g of scales) to words 4g..4g+3 */
    uint32_t c;
    memcpy(&c, b + 106, 4);
    const __m128i sb = _mm_cvtsi32_si128((int)c), m15 = _mm_set1_epi8(15);
    const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(sb, m15), _mm_and_si128(_mm_srli_epi16(sb, 4), m15));
    const __m512i w = _mm512_permutexvar_epi16(_mm512_load_si512(IQ3S_SCALE_WORDS), _mm512_cvtepu8_epi16(_mm256_castsi128_si256(nib)));
    *sc = _mm512_add_epi16(_mm512_add_epi16(w, w), _mm512_set1_epi16(1));
}

PERM4_KERNELS(iq3_s, 110, IQ3S_LUT, 1.0f)

/* IQ1_S ({f16 d; u8 qs[32]; u16 qh[8]}: 11-bit indices into the 2048 x 8 grid of -1, 0, 1, a scale
 * 2s + 1 and a shift of +-1/8 per 32 values) by the same byte permutes: 16 a half (bits 7-10 pick
 * among them), the grid as g + 1 in 2 bits. Each weight times 8 is 8g + shift (as dot2_iq1_s), taken
 * as the unsigned 8 (g + 1) + (shift + 1) in 0..18 against x, less 9 times x's sum over each 16 values
 * (q8_K's bsums, 9 * 16 * 127 within int16: perm8s_prep keeps them after the values). Zen 5,
 * as for IQ2_XS: 0.072 / 0.094 ms against 0.117 / 0.125 (the gather kernel). */
enum { PERM8S_PAIR = PERM8_PAIR + 128 }; /* perm8_prep's pair, then 9 x the 16-value sums: 32 words a pass */

static int64_t perm8s_prep_bytes(int64_t n) { return (n / 256 + 1) / 2 * PERM8S_PAIR; }

static void perm8s_prep(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out) {
    const int64_t nb = n / 256, np = (nb + 1) / 2;
    perm8_prep_strided(n, xq, xr, out, PERM8S_PAIR);
    for (int64_t p = 0; p < np; p++) {
        int16_t sums[64];
        for (int pass = 0; pass < 2; pass++)
            for (int m = 0; m < 32; m++) {
                int64_t blk = 2 * p + m / 16;
                if (blk >= nb) blk = nb - 1; /* the odd last block's copy, as perm8_prep */
                int16_t bs;
                memcpy(&bs, (pass ? xr : xq) + blk * 292 + 260 + 2 * (m % 16), 2);
                sums[32 * pass + m] = (int16_t)(9 * bs);
            }
        memcpy(out + p * PERM8S_PAIR + PERM8_PAIR, sums, sizeof sums);
    }
}

/* The pair of IQ1_S blocks b, b1 (b alone if NULL): levels (lv0, lv1), each lane's shift + 1 (0 or
 * 2), the 32 word scales, the blocks' d. */
static inline __attribute__((always_inline)) void iq1_s_perm_unpack(const uint8_t *b, const uint8_t *b1, __m512i *lv0,
                                                                   __m512i *lv1, __m512i *dplus, __m512i *sc, float *d0,
                                                                   float *d1) {
    const __m256i z = _mm256_setzero_si256();
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                           b1 ? _mm256_loadu_si256((const __m256i *)(b1 + 2)) : z, 1);
    /* qh[g] for groups 2q, 2q + 1 into qword q (lanes 8q..8q+7) */
    const __m512i u = _mm512_cvtepu32_epi64(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b + 34))),
                                                                     b1 ? _mm_loadu_si128((const __m128i *)(b1 + 34)) : _mm_setzero_si128(), 1));
    const __m512i hb = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x1916131009060300ll), u); /* bits 3l of qh[g] */
    const __mmask64 high[3] = {_mm512_test_epi8_mask(hb, _mm512_set1_epi8(1)), _mm512_test_epi8_mask(hb, _mm512_set1_epi8(2)),
                               _mm512_test_epi8_mask(hb, _mm512_set1_epi8(4))};
    const __m512i sh = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x1F1F1F1F0F0F0F0Fll), u); /* bit 15 */
    *dplus = _mm512_maskz_mov_epi8(~_mm512_test_epi8_mask(sh, _mm512_set1_epi8(1)), _mm512_set1_epi8(2));
    const __m512i s = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x281C281C280C280Cll), u),
                                       _mm512_set1_epi16(7)); /* bits 12-14 */
    *sc = _mm512_add_epi16(_mm512_add_epi16(s, s), _mm512_set1_epi16(1));
    *lv0 = levels_lookup(IQ1S_LEVELS[0], idx, high, 3);
    *lv1 = levels_lookup(IQ1S_LEVELS[1], idx, high, 3);
    *d0 = rd_f16(b);
    *d1 = b1 ? rd_f16(b1) : 0.0f;
}

/* IQ1_M ({u8 qs[32]; u8 qh[16]; u8 scales[8]}): the same grid; index i's high 3 bits and its shift's
 * sign are nibble i of qh, a scale 2s + 1 per 16 values (3 bits of scales), and the block's f16 d is
 * the top nibbles of the 4 scale words. Zen 5, as for IQ2_XS: 0.076 / 0.093 ms against
 * 0.108 / 0.114 (the gather kernel). */
static inline __attribute__((always_inline)) void iq1_m_perm_unpack(const uint8_t *b, const uint8_t *b1, __m512i *lv0,
                                                                   __m512i *lv1, __m512i *dplus, __m512i *sc, float *d0,
                                                                   float *d1) {
    const __m256i z = _mm256_setzero_si256();
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)b)),
                                           b1 ? _mm256_loadu_si256((const __m256i *)b1) : z, 1);
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 32)), q1 = b1 ? _mm_loadu_si128((const __m128i *)(b1 + 32)) : _mm_setzero_si128();
    const __m512i dup = _mm512_permutexvar_epi8(_mm512_load_si512(BYTE_TO_LANE_PAIR), _mm512_castsi256_si512(_mm256_setr_m128i(q0, q1)));
    const __m512i nib = _mm512_mask_blend_epi8((__mmask64)0xAAAAAAAAAAAAAAAAull, dup, _mm512_srli_epi16(dup, 4));
    const __mmask64 high[3] = {_mm512_test_epi8_mask(nib, _mm512_set1_epi8(1)), _mm512_test_epi8_mask(nib, _mm512_set1_epi8(2)),
                               _mm512_test_epi8_mask(nib, _mm512_set1_epi8(4))};
    *dplus = _mm512_maskz_mov_epi8(~_mm512_test_epi8_mask(nib, _mm512_set1_epi8(8)), _mm512_set1_epi8(2));
    long long c0, c1 = 0;
    memcpy(&c0, b + 48, 8);
    if (b1) memcpy(&c1, b1 + 48, 8);
    /* scale word j into qword j: word m takes bits 3 (m % 4) of word m / 4 */
    const __m512i u = _mm512_cvtepu16_epi64(_mm_set_epi64x(c1, c0));
    const __m512i s = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x3809380638033800ll), u),
                                       _mm512_set1_epi16(7));
    *sc = _mm512_add_epi16(_mm512_add_epi16(s, s), _mm512_set1_epi16(1));
    *lv0 = levels_lookup(IQ1S_LEVELS[0], idx, high, 3);
    *lv1 = levels_lookup(IQ1S_LEVELS[1], idx, high, 3);
    *d0 = iq1m_d(b);
    *d1 = b1 ? iq1m_d(b1) : 0.0f;
}

typedef void (*perm1_unpack_fn)(const uint8_t *b, const uint8_t *b1, __m512i *lv0, __m512i *lv1, __m512i *dplus,
                                __m512i *sc, float *d0, float *d1);

/* The pair's integer sums against prepared pair o (PERM8S_PAIR bytes), as perm_sums. */
static inline __attribute__((always_inline)) void iq1_s_perm_sums(const uint8_t *o, const __m512i lv0, const __m512i lv1,
                                                                 const __m512i dplus, const __m512i sc, __m512i *sq,
                                                                 __m512i *sr) {
    const __m512i zero = _mm512_setzero_si512();
    const __m512i lut_lo = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 8, 16, 0, 0, 8, 16, 0, 0, 8, 16, 0, 0, 8, 16, 0));
    const __m512i lut_hi = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 0, 0, 0, 0));
    __m512i aq[2] = {zero, zero}, ar[2] = {zero, zero};
    #pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m512i mag = _mm512_or_si512(level2_mag(lv0, lv1, k, lut_lo, lut_hi), dplus);
        aq[k & 1] = _mm512_dpwssd_epi32(aq[k & 1], _mm512_maddubs_epi16(mag, _mm512_loadu_si512(o + 64 * k)), sc);
        ar[k & 1] = _mm512_dpwssd_epi32(ar[k & 1], _mm512_maddubs_epi16(mag, _mm512_loadu_si512(o + 512 + 64 * k)), sc);
    }
    *sq = _mm512_sub_epi32(_mm512_add_epi32(aq[0], aq[1]), _mm512_madd_epi16(_mm512_loadu_si512(o + PERM8_PAIR), sc));
    *sr = _mm512_sub_epi32(_mm512_add_epi32(ar[0], ar[1]), _mm512_madd_epi16(_mm512_loadu_si512(o + PERM8_PAIR + 64), sc));
}

/* acc += the pair of blocks b, b1 (b alone if NULL) of ts bytes against prepared pair o. */
static inline __attribute__((always_inline)) __m512 perm1_pair(__m512 acc, const uint8_t *o, const uint8_t *b,
                                                              const uint8_t *b1, const perm1_unpack_fn unpack) {
    __m512i lv0, lv1, dplus, sc, sq, sr;
    float d0, d1;
    unpack(b, b1, &lv0, &lv1, &dplus, &sc, &d0, &d1);
    iq1_s_perm_sums(o, lv0, lv1, dplus, sc, &sq, &sr);
    return perm_scale(acc, o, sq, sr, d0, d1);
}

static inline __attribute__((always_inline)) float perm1_dot(int64_t n, const uint8_t *w, const uint8_t *prep, const int ts,
                                                            const perm1_unpack_fn unpack) {
    const int64_t nb = n / 256;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i += 2) {
        const uint8_t *b = w + i * ts;
        stream_prefetch(b, 2 * ts);
        acc = perm1_pair(acc, prep + i / 2 * PERM8S_PAIR, b, i + 1 < nb ? b + ts : NULL, unpack);
    }
    return 0.125f * _mm512_reduce_add_ps(acc);
}

/* Two weight rows of an odd number of blocks, their last blocks in one pair: perm_dot_x2's scheme. */
static inline __attribute__((always_inline)) void perm1_dot_x2(int64_t n, const uint8_t *w, int64_t wrow,
                                                              const uint8_t *prep, float y[2], const int ts,
                                                              const perm1_unpack_fn unpack) {
    const int64_t nb = n / 256, last = nb - 1;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < last; i += 2) {
        const uint8_t *b = w + i * ts, *o = prep + i / 2 * PERM8S_PAIR;
        stream_prefetch(b, 2 * ts);
        stream_prefetch(b + wrow, 2 * ts);
        acc0 = perm1_pair(acc0, o, b, b + ts, unpack);
        acc1 = perm1_pair(acc1, o, b + wrow, b + wrow + ts, unpack);
    }
    const uint8_t *b = w + last * ts, *o = prep + last / 2 * PERM8S_PAIR;
    __m512i lv0, lv1, dplus, sc, sq, sr;
    float d0, d1;
    unpack(b, b + wrow, &lv0, &lv1, &dplus, &sc, &d0, &d1);
    iq1_s_perm_sums(o, lv0, lv1, dplus, sc, &sq, &sr);
    x2_finish(acc0, acc1, o, sq, sr, d0, d1, y);
}

/* nr <= DOT2M_ROWS prepared rows against one weight row: each pair unpacked once for all rows, every
 * row's arithmetic that of perm1_dot (bit for bit). */
static inline __attribute__((always_inline)) void perm1_dot_rows(int64_t n, const uint8_t *w, const uint8_t *xq,
                                                                const int64_t *xoff, int nr, float *y, const int ts,
                                                                const perm1_unpack_fn unpack) {
    const int64_t nb = n / 256;
    __m512 acc[DOT2M_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i += 2) {
        const uint8_t *b = w + i * ts, *b1 = i + 1 < nb ? b + ts : NULL;
        stream_prefetch(b, 2 * ts);
        __m512i lv0, lv1, dplus, sc;
        float d0, d1;
        unpack(b, b1, &lv0, &lv1, &dplus, &sc, &d0, &d1);
        for (int r = 0; r < nr; r++) {
            const uint8_t *o = xq + xoff[r] + i / 2 * PERM8S_PAIR;
            __m512i sq, sr;
            iq1_s_perm_sums(o, lv0, lv1, dplus, sc, &sq, &sr);
            acc[r] = perm_scale(acc[r], o, sq, sr, d0, d1);
        }
    }
    for (int r = 0; r < nr; r++) y[r] = 0.125f * _mm512_reduce_add_ps(acc[r]);
}

PERM_KERNELS(iq1_s, 50, perm1)
PERM_KERNELS(iq1_m, 56, perm1)

/* The permute kernels, by ggml type: each with its multi-row form, its two-row form (NULL: the
 * 4-value grids, a block a register), the x layout it takes (fused2_prep's kinds) and the flag that
 * its grid's levels were built. */
typedef void (*dot2x2_fn)(int64_t n, const uint8_t *w, int64_t wrow, const uint8_t *prep, float y[2]);
static const struct {
    int type;
    dot2_fn dot2;
    dot2m_fn dot2m;
    dot2x2_fn dot2x2;
    int prep;
    const int *ok;
} PERM[] = {
    {17, dot2_iq2_xs_perm, dot2m_iq2_xs_perm, dot2x2_iq2_xs_perm, 6, &iq2xs_ok},
    {16, dot2_iq2_xxs_perm, dot2m_iq2_xxs_perm, dot2x2_iq2_xxs_perm, 6, &iq2xxs_ok},
    {22, dot2_iq2_s_perm, dot2m_iq2_s_perm, dot2x2_iq2_s_perm, 6, &iq2s_ok},
    {18, dot2_iq3_xxs_perm, dot2m_iq3_xxs_perm, NULL, 7, &iq3xxs_ok},
    {21, dot2_iq3_s_perm, dot2m_iq3_s_perm, NULL, 7, &iq3s_ok},
    {19, dot2_iq1_s_perm, dot2m_iq1_s_perm, dot2x2_iq1_s_perm, 8, &iq1s_ok},
    {29, dot2_iq1_m_perm, dot2m_iq1_m_perm, dot2x2_iq1_m_perm, 8, &iq1s_ok},
};
enum { N_PERM = sizeof PERM / sizeof PERM[0] };

/* The PERM entry of ggml type `type` whose grid is ready, or -1. */
static int perm_of_type(int type) {
    for (int i = 0; i < N_PERM; i++)
        if (PERM[i].type == type && *PERM[i].ok) return i;
    return -1;
}

/* The PERM entry of kernel `dot2`, or -1. */
static int perm_of_kernel(dot2_fn dot2) {
    for (int i = 0; i < N_PERM; i++)
        if (dot2 && PERM[i].dot2 == dot2) return i;
    return -1;
}

/* The two-row form of kernel `dot2` for rows of `cols` values (an odd number of blocks), or NULL. */
static dot2x2_fn dot2x2_of(dot2_fn dot2, int64_t cols) {
    const int i = (cols / 256) & 1 ? perm_of_kernel(dot2) : -1;
    return i < 0 ? NULL : PERM[i].dot2x2;
}
#endif

/* IQ2_XXS: {f16 d; 8 x (u8 grid[4]; u32 signs 4 x 7 bits | scale << 28)} x q8_K: IQ2_XS's
 * arithmetic with 8-bit indices into GRID_IQ2_XXS and one 4-bit scale (2s+1) per 32 values. */
static float dot2_iq2_xxs(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m128i m15 = _mm_set1_epi8(15), m127 = _mm_set1_epi32(127), sh7 = _mm_setr_epi32(0, 7, 14, 21);
    const __m128i grid_bytes = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i parity4 = _mm_setr_epi8(0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0);
    const __m512i x80 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 66, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 66);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b);
        __m512i sq = zero, sr = zero;
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* 64 values: two groups of 32 */
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * j));
            const __m512i g = _mm512_i64gather_epi64(_mm512_cvtepu8_epi64(_mm_shuffle_epi8(q, grid_bytes)),
                                                     (const void *)GRID_IQ2_XXS, 8);
            const __m128i sa = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(q, 0x55), sh7), m127);
            const __m128i sb = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(q, 0xFF), sh7), m127);
            const __m128i s7 = _mm_packus_epi32(sa, sb); /* 8 sign indices in u16 lanes */
            const __m128i par = _mm_xor_si128(_mm_shuffle_epi8(parity4, _mm_and_si128(s7, m15)),
                                              _mm_shuffle_epi8(parity4, _mm_srli_epi16(s7, 4)));
            const __m128i sg = _mm_or_si128(s7, _mm_slli_epi16(par, 7));
            const __mmask64 neg = (__mmask64)_mm_cvtsi128_si64(_mm_packus_epi16(sg, sg));
            const __m512i ws = _mm512_mask_sub_epi8(g, neg, zero, g);
            const __m512i c = _mm512_dpbusd_epi32(zero, x80, ws);
            const __m512i pq = _mm512_sub_epi32(
                _mm512_dpbusd_epi32(zero, _mm512_xor_si512(_mm512_loadu_si512(yq + 4 + 64 * j), x80), ws), c);
            const __m512i pr = _mm512_sub_epi32(
                _mm512_dpbusd_epi32(zero, _mm512_xor_si512(_mm512_loadu_si512(yr + 4 + 64 * j), x80), ws), c);
            const int l0 = 2 * (int)(rd_u32(b + 2 + 16 * j + 4) >> 28) + 1, l1 = 2 * (int)(rd_u32(b + 2 + 16 * j + 12) >> 28) + 1;
            const __m512i sc = _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32(l0), _mm512_set1_epi32(l1));
            sq = madd_lo16(sq, pq, sc);
            sr = madd_lo16(sr, pr, sc);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
    }
    return 0.125f * _mm512_reduce_add_ps(acc);
}

/* IQ3_XXS: {f16 d; u8 grid[64]; u32 signs 4 x 7 bits | scale << 28 per 32 values} x q8_K: as
 * IQ2_XXS with 4-value entries of GRID_IQ3_XXS (|w| <= 62: a lane's sum stays under 2^15) and a
 * common 1/4. */
static float dot2_iq3_xxs(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m128i m15 = _mm_set1_epi8(15), m127 = _mm_set1_epi32(127), sh7 = _mm_setr_epi32(0, 7, 14, 21);
    const __m128i parity4 = _mm_setr_epi8(0, 1, 1, 0, 1, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0);
    const __m512i x80 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 98, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 98);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b);
        __m512i sq = zero, sr = zero;
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* 64 values: two groups of 32 */
            const __m512i g = _mm512_i32gather_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * j))),
                                                     (const void *)GRID_IQ3_XXS, 4);
            const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 66 + 8 * j)); /* groups 2j, 2j+1 */
            const __m128i sa = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(q, 0x00), sh7), m127);
            const __m128i sb = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(q, 0x55), sh7), m127);
            const __m128i s7 = _mm_packus_epi32(sa, sb); /* 8 sign indices in u16 lanes */
            const __m128i par = _mm_xor_si128(_mm_shuffle_epi8(parity4, _mm_and_si128(s7, m15)),
                                              _mm_shuffle_epi8(parity4, _mm_srli_epi16(s7, 4)));
            const __m128i sg = _mm_or_si128(s7, _mm_slli_epi16(par, 7));
            const __mmask64 neg = (__mmask64)_mm_cvtsi128_si64(_mm_packus_epi16(sg, sg));
            const __m512i ws = _mm512_mask_sub_epi8(g, neg, zero, g);
            const __m512i c = _mm512_dpbusd_epi32(zero, x80, ws);
            const __m512i pq = _mm512_sub_epi32(
                _mm512_dpbusd_epi32(zero, _mm512_xor_si512(_mm512_loadu_si512(yq + 4 + 64 * j), x80), ws), c);
            const __m512i pr = _mm512_sub_epi32(
                _mm512_dpbusd_epi32(zero, _mm512_xor_si512(_mm512_loadu_si512(yr + 4 + 64 * j), x80), ws), c);
            const int l0 = 2 * (int)(rd_u32(b + 66 + 8 * j) >> 28) + 1, l1 = 2 * (int)(rd_u32(b + 70 + 8 * j) >> 28) + 1;
            const __m512i sc = _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32(l0), _mm512_set1_epi32(l1));
            sq = madd_lo16(sq, pq, sc);
            sr = madd_lo16(sr, pr, sc);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
    }
    return 0.25f * _mm512_reduce_add_ps(acc);
}

/* IQ4_XS: {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]} x q8_K. Nibbles index the 16 signed
 * IQ4_NL values (vpshufb), each 32 values scale by a 6-bit (lo | hi << 4) - 32; the activations go
 * in as u8 (x + 128) as for IQ2_XS. With |w| <= 127 a lane's sum passes 2^15, so the scales take
 * vpmulld instead of vpdpwssd. */
static float dot2_iq4_xs(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m512i values = _mm512_broadcast_i32x4((__m128i)IQ4_NL_I8);
    const __m512i x80 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 136, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 136);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b);
        __m512i sq = zero, sr = zero;
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* 64 values: sub-blocks 2j, 2j+1 */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + 8 + 32 * j));
            const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, m4)),
                                                 _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), 1);
            const __m512i ws = _mm512_shuffle_epi8(values, _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)));
            const __m512i c = _mm512_dpbusd_epi32(zero, x80, ws);
            const __m512i pq = _mm512_sub_epi32(
                _mm512_dpbusd_epi32(zero, _mm512_xor_si512(_mm512_loadu_si512(yq + 4 + 64 * j), x80), ws), c);
            const __m512i pr = _mm512_sub_epi32(
                _mm512_dpbusd_epi32(zero, _mm512_xor_si512(_mm512_loadu_si512(yr + 4 + 64 * j), x80), ws), c);
            const int l0 = iq4xs_scale(b, 2 * j), l1 = iq4xs_scale(b, 2 * j + 1);
            const __m512i sc = _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32(l0), _mm512_set1_epi32(l1));
            sq = _mm512_add_epi32(sq, _mm512_mullo_epi32(pq, sc));
            sr = _mm512_add_epi32(sr, _mm512_mullo_epi32(pr, sc));
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* Q8_0: {f16 d; i8 qs[32]} x q8_0 {f16 d; i8 qs[32]}. Both sides are signed, so q8_0_prep lays
 * the activations out as u8 (x + 128, the xor with 0x80) with their block scales spread over 8
 * lanes, and each row takes the weights as they are (s8), the 128 * sum(w) coming off per lane
 * (one vpdpbusd shared by both activations): exact integer block sums, as in ggml's vec_dot. */
static int64_t q8_0_prep_bytes(int64_t n) { const int64_t nb = n / 32; return nb * 64 + nb * 8 * 4 * 2; }

static void q8_0_prep(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out) {
    const int64_t nb = n / 32;
    uint8_t *vq = out, *vr = vq + nb * 32;
    float *dq = (float *)(out + nb * 64), *dr = dq + nb * 8;
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *q = xq + i * 34, *r = xr + i * 34;
        for (int l = 0; l < 32; l++) {
            vq[i * 32 + l] = q[2 + l] ^ 0x80;
            vr[i * 32 + l] = r[2 + l] ^ 0x80;
        }
        const float a = rd_f16(q), c = rd_f16(r);
        for (int l = 0; l < 8; l++) {
            dq[i * 8 + l] = a;
            dr[i * 8 + l] = c;
        }
    }
}

static float dot2_q8_0(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    const int64_t nb = n / 32;
    const uint8_t *vq = prep, *vr = vq + nb * 32;
    const float *dq = (const float *)(prep + nb * 64), *dr = dq + nb * 8;
    const __m512i x80 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const uint8_t *b0 = w + i * 34, *b1 = b0 + 34;
        stream_prefetch(b0, 2 * 34);
        const __m512i w8 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                              _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
        const __m512i c = _mm512_dpbusd_epi32(zero, x80, w8);
        const __m512i pq = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, _mm512_loadu_si512(vq + i * 32), w8), c);
        const __m512i pr = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, _mm512_loadu_si512(vr + i * 32), w8), c);
        const __m512 t = pair_products(pq, pr, dq + i * 8, dr + i * 8);
        const __m512 dw = f16_pair(b0, b1);
        acc = _mm512_fmadd_ps(t, dw, acc);
    }
    float tail = 0.0f;
    for (; i < nb; i++) { /* an odd last block */
        const uint8_t *b = w + i * 34;
        int32_t pq = 0, pr = 0, sw = 0; /* v * (u - 128) summed directly came out wrong from gcc 12 -O3 */
        for (int l = 0; l < 32; l++) {
            const int v = ((const int8_t *)(b + 2))[l];
            pq += v * (int)vq[i * 32 + l];
            pr += v * (int)vr[i * 32 + l];
            sw += v;
        }
        pq -= 128 * sw;
        pr -= 128 * sw;
        tail += rd_f16(b) * (dq[i * 8] * (float)pq + dr[i * 8] * (float)pr);
    }
    return _mm512_reduce_add_ps(acc) + tail;
}

/* 32-value blocks of 16 nibbles (value l: low nibble of qs[l], value l + 16: its high nibble)
 * through a table of 16 signed values, against Q8_0's prepared activations (q8_0_prep), the
 * 128 * sum(w) off per lane: MXFP4 {u8 e8m0; u8 qs[16]} (the E2M1 values doubled to integers,
 * half the e8m0 power), IQ4_NL {f16 d; u8 qs[16]}, Q4_0 {f16 d; u8 qs[16]} (values q - 8) and
 * Q5_0 {f16 d; u32 qh; u8 qs[16]} (values (q | bit l of qh << 4) - 16). */
static inline float block_scale(const uint8_t *b, int e8m0) { return e8m0 ? e8m0_half(b[0]) : rd_f16(b); }

static inline float dot2_nib32(int64_t n, const uint8_t *w, const uint8_t *prep, const int bsize, const int head,
                               const v16i8 table, const int e8m0, const int q5) {
    const int64_t nb = n / 32;
    const uint8_t *vq = prep, *vr = vq + nb * 32;
    const float *dq = (const float *)(prep + nb * 64), *dr = dq + nb * 8;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m512i values = _mm512_broadcast_i32x4((__m128i)table);
    const __m512i x80 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= nb; i += 2) {
        const uint8_t *b0 = w + i * bsize, *b1 = b0 + bsize;
        stream_prefetch(b0, 2 * bsize);
        const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + head))),
                                                    _mm_loadu_si128((const __m128i *)(b1 + head)), 1);
        const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(raw, m4)),
                                             _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), 1);
        __m512i w8 = _mm512_shuffle_epi8(values, _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0)));
        if (q5) /* Q5_0: table q - 16, plus 16 where value l's bit l of qh is set */
            w8 = _mm512_mask_add_epi8(w8, (__mmask64)rd_u32(b0 + 2) | ((__mmask64)rd_u32(b1 + 2) << 32), w8,
                                      _mm512_set1_epi8(16));
        const __m512i c = _mm512_dpbusd_epi32(zero, x80, w8);
        const __m512i pq = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, _mm512_loadu_si512(vq + i * 32), w8), c);
        const __m512i pr = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, _mm512_loadu_si512(vr + i * 32), w8), c);
        const __m512 t = pair_products(pq, pr, dq + i * 8, dr + i * 8);
        const __m512 dw = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(block_scale(b0, e8m0)),
                                               _mm512_set1_ps(block_scale(b1, e8m0)));
        acc = _mm512_fmadd_ps(t, dw, acc);
    }
    float tail = 0.0f;
    for (; i < nb; i++) { /* an odd last block */
        const uint8_t *b = w + i * bsize;
        int32_t pq = 0, pr = 0, sw = 0;
        for (int l = 0; l < 32; l++) {
            const int v = table[l < 16 ? b[head + l] & 15 : b[head + l - 16] >> 4] + (q5 && (rd_u32(b + 2) >> l) & 1 ? 16 : 0);
            pq += v * (int)vq[i * 32 + l];
            pr += v * (int)vr[i * 32 + l];
            sw += v;
        }
        pq -= 128 * sw;
        pr -= 128 * sw;
        tail += block_scale(b, e8m0) * (dq[i * 8] * (float)pq + dr[i * 8] * (float)pr);
    }
    return _mm512_reduce_add_ps(acc) + tail;
}

static const v16i8 Q4_0_I8 = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};

static float dot2_mxfp4(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    return dot2_nib32(n, w, prep, 17, 1, E2M1_I8, 1, 0);
}

static float dot2_iq4_nl(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    return dot2_nib32(n, w, prep, 18, 2, IQ4_NL_I8, 0, 0);
}

static float dot2_q4_0(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    return dot2_nib32(n, w, prep, 18, 2, Q4_0_I8, 0, 0);
}

static const v16i8 Q5_0_I8 = {-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1};

static float dot2_q5_0(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) {
    (void)unused;
    return dot2_nib32(n, w, prep, 22, 6, Q5_0_I8, 0, 1);
}

/* The IQ1/IQ2_S/IQ3_S kernels below share this step: 64 signed weights (s8) against both 8-bit
 * activations at yq / yr (u8 after the xor with 0x80, the 128 * sum(w) off per lane), each lane's
 * 4-value sum times its scale (`sc`, 16 lanes) into sq / sr. Exact integer sums as in ggml. */
static inline __attribute__((always_inline)) void pair_dot64(__m512i ws, __m512i sc, const uint8_t *yq,
                                                             const uint8_t *yr, __m512i *sq, __m512i *sr) {
    const __m512i x80 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    const __m512i c = _mm512_dpbusd_epi32(zero, x80, ws);
    const __m512i pq = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, _mm512_xor_si512(_mm512_loadu_si512(yq), x80), ws), c);
    const __m512i pr = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, _mm512_xor_si512(_mm512_loadu_si512(yr), x80), ws), c);
    *sq = madd_lo16(*sq, pq, sc);
    *sr = madd_lo16(*sr, pr, sc);
}

/* IQ1_S: {f16 d; u8 qs[32]; u16 qh[8]} x q8_K. Group g (32 values) has 4 entries of 8 values
 * from the 2048-entry grid (index qs[4g + l] | bits 3l..3l+2 of qh[g] << 8), a scale 2 * (qh[g]
 * >> 12 & 7) + 1 and a shift of -1/8 (qh[g] bit 15) or +1/8. ggml sums grid * x and the shifts
 * apart (sumi + 1/8 * sumi1); here each weight is 8 * grid + shift, an int8, and the block's sum
 * is divided by 8 at the end: the same integers. |w| <= 9, so a lane's sum stays under 2^15. */
static float dot2_iq1_s(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m512i sh3 = _mm512_setr_epi64(0, 3, 6, 9, 0, 3, 6, 9), m7 = _mm512_set1_epi64(7);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 50, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 50);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b);
        __m512i sq = _mm512_setzero_si512(), sr = _mm512_setzero_si512();
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* groups 2j, 2j+1 */
            const uint16_t h0 = rd_u16(b + 34 + 4 * j), h1 = rd_u16(b + 36 + 4 * j);
            const __m512i hv = _mm512_mask_blend_epi64((__mmask8)0xF0, _mm512_set1_epi64(h0), _mm512_set1_epi64(h1));
            const __m512i hi = _mm512_slli_epi64(_mm512_and_si512(_mm512_srlv_epi64(hv, sh3), m7), 8);
            const __m512i idx = _mm512_or_si512(_mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j))), hi);
            const __m512i g = _mm512_i64gather_epi64(idx, (const void *)GRID_IQ1_S8, 8);
            const __m512i delta = _mm512_mask_blend_epi64((__mmask8)0xF0, _mm512_set1_epi8(h0 & 0x8000 ? -1 : 1),
                                                          _mm512_set1_epi8(h1 & 0x8000 ? -1 : 1));
            const __m512i sc = _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32(2 * ((h0 >> 12) & 7) + 1),
                                                       _mm512_set1_epi32(2 * ((h1 >> 12) & 7) + 1));
            pair_dot64(_mm512_add_epi8(g, delta), sc, yq + 4 + 64 * j, yr + 4 + 64 * j, &sq, &sr);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
    }
    return 0.125f * _mm512_reduce_add_ps(acc);
}

/* IQ1_M: {u8 qs[32]; u8 qh[16]; u8 scales[8]} x q8_K. No d field: the f16 scale is the top
 * nibbles of the 4 u16 of `scales`. Entry k of 32-value group g: index qs[4g + k] | (nibble k of
 * qh[2g..2g+1]) & 7 << 8, shift -1/8 where that nibble's bit 3 is set; each 16 values scale by
 * 2 * (3 bits of scales) + 1, u16 j of scales holding groups 2j (bits 0-5) and 2j + 1 (6-11). */
static float dot2_iq1_m(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m512i sh4 = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28), m7 = _mm512_set1_epi64(7), b3 = _mm512_set1_epi64(8);
    const __m512i sh3 = _mm512_setr_epi32(0, 0, 0, 0, 3, 3, 3, 3, 6, 6, 6, 6, 9, 9, 9, 9);
    const __m512i one = _mm512_set1_epi8(1), minus = _mm512_set1_epi8(-1);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 56, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 56);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = iq1m_d(b);
        __m512i sq = _mm512_setzero_si512(), sr = _mm512_setzero_si512();
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* groups 2j, 2j+1: 8 entries, qh bytes 4j..4j+3 */
            const __m512i nib = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64(rd_u32(b + 32 + 4 * j)), sh4),
                                                 _mm512_set1_epi64(15));
            const __m512i idx = _mm512_or_si512(_mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(b + 8 * j))),
                                                _mm512_slli_epi64(_mm512_and_si512(nib, m7), 8));
            const __m512i g = _mm512_i64gather_epi64(idx, (const void *)GRID_IQ1_S8, 8);
            const __m512i delta = _mm512_mask_blend_epi64(_mm512_test_epi64_mask(nib, b3), one, minus);
            const __m512i sc = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(rd_u16(b + 48 + 2 * j)), sh3),
                                                   _mm512_set1_epi32(7)), 1), _mm512_set1_epi32(1));
            pair_dot64(_mm512_add_epi8(g, delta), sc, yq + 4 + 64 * j, yr + 4 + 64 * j, &sq, &sr);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
    }
    return 0.125f * _mm512_reduce_add_ps(acc);
}

/* IQ2_S: {f16 d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]} x q8_K. Entry k (8 values) of
 * group g: index qs[4g + k] | bits 2k..2k+1 of qh[g] << 8 into the 1024-entry grid, sign bits
 * signs[4g + k] as they are (no parity), 16-value scales 2 * nibble + 1 over a common 1/8. */
static float dot2_iq2_s(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m512i sh2 = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), m3 = _mm512_set1_epi64(3), m15 = _mm512_set1_epi32(15);
    const __m512i sh4 = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 82, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 82);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b);
        __m512i sq = zero, sr = zero;
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* groups 2j, 2j+1 */
            const __m512i hi = _mm512_slli_epi64(
                _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64(rd_u16(b + 66 + 2 * j)), sh2), m3), 8);
            const __m512i idx = _mm512_or_si512(_mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j))), hi);
            const __m512i g = _mm512_i64gather_epi64(idx, (const void *)GRID_IQ2_S, 8);
            uint64_t neg;
            memcpy(&neg, b + 34 + 8 * j, 8);
            const __m512i ws = _mm512_mask_sub_epi8(g, (__mmask64)neg, zero, g);
            const __m512i sc = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(rd_u16(b + 74 + 2 * j)), sh4), m15), 1),
                _mm512_set1_epi32(1));
            pair_dot64(ws, sc, yq + 4 + 64 * j, yr + 4 + 64 * j, &sq, &sr);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
    }
    return 0.125f * _mm512_reduce_add_ps(acc);
}

/* IQ3_S: {f16 d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]} x q8_K. Entry k (4 values) of
 * group g: index qs[8g + k] | bit k of qh[g] << 8 into the 512-entry grid (|w| <= 15), sign bits
 * as they are, 32-value scales 2 * nibble + 1 (scales[j]: groups 2j low, 2j + 1 high). */
static float dot2_iq3_s(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    const int64_t nb = n / 256;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * 110, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 110);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b);
        __m512i sq = zero, sr = zero;
        #pragma GCC unroll 4
        for (int j = 0; j < 4; j++) { /* groups 2j, 2j+1: 16 entries */
            const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(rd_u16(b + 66 + 2 * j)), iota), one), 8);
            const __m512i idx = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * j))), hi);
            const __m512i g = _mm512_i32gather_epi32(idx, (const void *)GRID_IQ3_S, 4);
            uint64_t neg;
            memcpy(&neg, b + 74 + 8 * j, 8);
            const __m512i ws = _mm512_mask_sub_epi8(g, (__mmask64)neg, zero, g);
            const uint8_t s = b[106 + j];
            const __m512i sc = _mm512_mask_blend_epi32((__mmask16)0xFF00, _mm512_set1_epi32(2 * (s & 15) + 1),
                                                       _mm512_set1_epi32(2 * (s >> 4) + 1));
            pair_dot64(ws, sc, yq + 4 + 64 * j, yr + 4 + 64 * j, &sq, &sr);
        }
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sq), _mm512_set1_ps(d * dq), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sr), _mm512_set1_ps(d * dr), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* The fused kernel for a ggml type and its activation layout (qblk, qsize), or NULL. */
static dot2_fn fused2_512(int type, int64_t qblk, int64_t qsize) {
#if defined(HAVE_PERM)
    const int perm = qblk == 256 && qsize == 292 ? perm_of_type(type) : -1;
    if (perm >= 0) return PERM[perm].dot2;
#endif
    if (type == 10 && qblk == 256 && qsize == 292) return dot2_q2_k;
    if (type == 11 && qblk == 256 && qsize == 292) return dot2_q3_k;
    if (type == 12 && qblk == 256 && qsize == 292) return dot2_q4_k;
    if (type == 13 && qblk == 256 && qsize == 292) return dot2_q5_k;
    if (type == 14 && qblk == 256 && qsize == 292) return dot2_q6_k;
    if (type == 3 && qblk == 32 && qsize == 36) return dot2_q4_1;
    if (type == 7 && qblk == 32 && qsize == 36) return dot2_q5_1;
    if (type == 16 && qblk == 256 && qsize == 292) return dot2_iq2_xxs;
    if (type == 18 && qblk == 256 && qsize == 292) return dot2_iq3_xxs;
    if (type == 23 && qblk == 256 && qsize == 292) return dot2_iq4_xs;
    if (type == 17 && qblk == 256 && qsize == 292) return dot2_iq2_xs;
    if (type == 8 && qblk == 32 && qsize == 34) return dot2_q8_0;
    if (type == 39 && qblk == 32 && qsize == 34) return dot2_mxfp4;
    if (type == 20 && qblk == 32 && qsize == 34) return dot2_iq4_nl;
    if (type == 2 && qblk == 32 && qsize == 34) return dot2_q4_0;
    if (type == 6 && qblk == 32 && qsize == 34) return dot2_q5_0;
    if (type == 19 && qblk == 256 && qsize == 292) return dot2_iq1_s;
    if (type == 29 && qblk == 256 && qsize == 292) return dot2_iq1_m;
    if (type == 22 && qblk == 256 && qsize == 292) return dot2_iq2_s;
    if (type == 21 && qblk == 256 && qsize == 292) return dot2_iq3_s;
    return NULL;
}
#else
typedef float (*dot2_fn)(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr);
static dot2_fn fused2_512(int type, int64_t qblk, int64_t qsize) { (void)type; (void)qblk; (void)qsize; return NULL; }
static int64_t q4_1_prep_bytes(int64_t n) { (void)n; return 0; }
static void q4_1_prep(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out) { (void)n; (void)xq; (void)xr; (void)out; }
static int64_t q8_0_prep_bytes(int64_t n) { (void)n; return 0; }
static void q8_0_prep(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out) { (void)n; (void)xq; (void)xr; (void)out; }
static int64_t q8k_prep_bytes(int64_t n) { (void)n; return 0; }
static void q8k_prep(int64_t n, const uint8_t *xq, const uint8_t *xr, uint8_t *out) { (void)n; (void)xq; (void)xr; (void)out; }
#endif


/* ------------------------------------------------------------------ q8x2 in one pass (AVX2 / AVX-VNNI)
 *
 * The same kernels in 256-bit registers (qmm_avx2.h), compiled for AVX2 + FMA + F16C and again
 * with AVX-VNNI whatever -march says, so a CPU without AVX-512 VNNI still takes one pass. Which
 * set runs is chosen at load from cpuid (the best the CPU and the OS support), or forced with
 * strata_set_fused_isa (STRATA_KERNEL_ISA=avx2|avxvnni|avx512vnni; tests compare them). GCC only:
 * other compilers keep the AVX-512 kernels (if -march has them) and ggml's two passes.
 */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#define HAVE_FUSED_256 1
#include <cpuid.h>
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define V2(name) name##_avx2
#define VNNI 0
#include "qmm_avx2.h"
#undef V2
#undef VNNI
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#define V2(name) name##_vnni
#define VNNI 1
#include "qmm_avx2.h"
#undef V2
#undef VNNI
#pragma GCC pop_options

/* The kernel sets this CPU and OS run, as bits: 1 << 3 AVX-512 VNNI (if compiled in), 1 << 2
 * AVX-VNNI, 1 << 1 AVX2. cpuid leaf 1 (FMA, F16C, OSXSAVE), leaf 7 (AVX2, AVX-512 F/BW/VL/VNNI;
 * sub-leaf 1: AVX-VNNI) and XCR0 (the OS saves ymm state, and zmm for AVX-512). */
static int cpu_isa_mask(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const int fma = (c >> 12) & 1, f16c = (c >> 29) & 1, osxsave = (c >> 27) & 1;
    if (!osxsave || !fma || !f16c) return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 6) != 6 || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((b >> 5) & 1)) return 0;
    int mask = 1 << 1;
#if defined(HAVE_FUSED2)
    if ((lo & 0xE6) == 0xE6 && ((b >> 16) & 1) && ((b >> 30) & 1) && ((b >> 31) & 1) && ((c >> 11) & 1)) mask |= 1 << 3;
#endif
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1)) mask |= 1 << 2;
    return mask;
}
#else
static int cpu_isa_mask(void) {
#if defined(HAVE_FUSED2)
    return 1 << 3;
#else
    return 0;
#endif
}
#endif

/* cpu_isa_mask, asked once: cpuid traps to the hypervisor in a VM (tens of us a call, which per
 * product made a 192x576 Q4_1 product 29 -> 65 us). */
static int fused_isa_mask(void) {
    static int mask = -1;
    if (mask < 0) mask = cpu_isa_mask();
    return mask;
}

static int fused_isa = -1; /* -1: not chosen yet; 0: none */
static int fused_mixed = 0; /* the 256-bit set prefer_256's types take beside AVX-512 VNNI (narrow_isa), or 0 */

static int best_fused_isa(void) {
    const int mask = fused_isa_mask();
    return mask & 8 ? 3 : mask & 4 ? 2 : mask & 2 ? 1 : 0;
}

/* AMD's AVX-512 CPUs, families 19h (Zen 4) and 1Ah (Zen 5): Zen 4 runs each 512-bit operation as
 * two 256-bit halves, so a 512-bit kernel gains nothing per instruction, and where the 256-bit kernel
 * is built differently it wins; Zen 5 (full 512-bit units, and AVX-VNNI) measured the same way
 * picks the same types (AVX-512 VNNI against AVX-VNNI, 768x2048 / 2048x768: IQ2_XS 0.093 / 0.097
 * against 0.084 / 0.086, IQ2_XXS 0.156 / 0.159 against 0.119 / 0.128, IQ3_XXS 0.190 / 0.190 against
 * 0.151 / 0.161, Q4_0 0.062 / 0.066 against 0.056 / 0.056, Q4_1 0.063 / 0.061 against 0.053 / 0.054,
 * IQ4_NL 0.061 / 0.065 against 0.062 / 0.062; Q4_K 0.041 / 0.047 against 0.048 / 0.052). Zen 4: bench_kernels --fused-ab --threads 1, ms per 768x2048 / 2048x768 product,
 * AVX-512 VNNI against AVX2 (no AVX-VNNI on Zen 4): IQ2_XS 0.200 / 0.212 against 0.165 / 0.174,
 * IQ2_XXS 0.306 / 0.308 against 0.279 / 0.283, IQ3_XXS 0.362 / 0.363 against 0.344 / 0.325, Q4_0
 * 0.137 / 0.154 against 0.112 / 0.126, Q4_1 0.150 / 0.153 against 0.124 / 0.118, IQ4_NL 0.147 /
 * 0.158 against 0.139 / 0.140; Q8_0 alike (0.141 / 0.137 against 0.135 / 0.134); the K-quants, IQ4_XS, Q5_0,
 * Q5_1 and MXFP4 ran faster in 512 bits. The 256-bit kernels also have multi-row versions. */
static int split_avx512(void) {
    static int split = -1; /* asked once, as fused_isa_mask */
    if (split >= 0) return split;
    split = 0;
#if defined(HAVE_FUSED_256)
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541u && c == 0x444d4163u && d == 0x69746e65u &&
        __get_cpuid(1, &a, &b, &c, &d))
        split = ((a >> 8) & 15) + ((a >> 20) & 255) >= 0x19;
#endif
    return split;
}

/* The best 256-bit set this CPU runs: 2 AVX-VNNI, 1 AVX2, 0 none. */
static int narrow_isa(void) {
    const int mask = fused_isa_mask();
    return mask & 4 ? 2 : mask & 2 ? 1 : 0;
}

/* ggml type ids: IQ2_XS 17, IQ2_XXS 16, IQ3_XXS 18, Q4_0 2, Q4_1 3, IQ4_NL 20; IQ2_XS, IQ2_XXS and
 * IQ3_XXS not where the AVX-512 set has their permute kernels (dot2_iq2_xs_perm, dot2_iq3_xxs_perm:
 * faster than both 256-bit sets). */
static int prefer_256(int type) {
#if defined(HAVE_PERM)
    if (perm_of_type(type) >= 0) return 0;
#endif
    return type == 17 || type == 16 || type == 18 || type == 2 || type == 3 || type == 20;
}

/* Force kernel set `isa` (1 AVX2, 2 AVX-VNNI, 3 AVX-512 VNNI: every type from that set; -1: the
 * best this CPU runs, per type where split_avx512); returns the set now in use, or -1 (nothing
 * changed) if this CPU or build cannot run it. */
int strata_set_fused_isa(int isa) {
    const int chosen = isa < 0;
    if (chosen) isa = best_fused_isa();
    else if (isa > 3 || !(fused_isa_mask() >> isa & 1)) return -1;
    fused_isa = isa;
    fused_mixed = chosen && isa == 3 && split_avx512() ? narrow_isa() : 0;
    return fused_isa;
}

/* Nonzero where the set in use takes some types from the 256-bit set (strata_set_fused_isa). */
int strata_fused_mixed(void) {
    if (fused_isa < 0) strata_set_fused_isa(-1);
    return fused_mixed != 0;
}

/* Tests: while the AVX-512 VNNI set is in use, take prefer_256's types from the best 256-bit set
 * (on) or not (off), whatever the CPU; returns whether they now are (0 where it cannot apply). */
int strata_set_fused_mixed(int on) {
    if (fused_isa < 0) strata_set_fused_isa(-1);
    fused_mixed = on && fused_isa == 3 ? narrow_isa() : 0;
    return fused_mixed != 0;
}

/* The kernel sets this CPU and build run (the bits of fused_isa_mask). */
int strata_fused_isas(void) { return fused_isa_mask(); }

/* The kernel set in use (0: none). */
int strata_fused_isa(void) {
    if (fused_isa < 0) strata_set_fused_isa(-1);
    return fused_isa;
}

static dot2_fn fused2_for(int type, int64_t qblk, int64_t qsize) {
    if (fused_isa < 0) strata_set_fused_isa(-1);
#if defined(HAVE_FUSED_256)
    if (fused_mixed && prefer_256(type)) {
        const dot2_fn f = fused_mixed == 2 ? fused2_for_vnni(type, qblk, qsize) : fused2_for_avx2(type, qblk, qsize);
        if (f) return f;
    }
    if (fused_isa == 2) return fused2_for_vnni(type, qblk, qsize);
    if (fused_isa == 1) return fused2_for_avx2(type, qblk, qsize);
#endif
    return fused_isa == 3 ? fused2_512(type, qblk, qsize) : NULL;
}

/* 1 (default): products of several rows of x take the multi-row kernels where a one-row kernel
 * has one; 0: each row its one-row kernel (tests and bench_kernels --multirow-ab compare the two). */
static int multirow_on = 1;
void strata_set_multirow(int on) { multirow_on = on; }

/* The multi-row kernel of one-row kernel dot2 (fused2_for's choice) for B rows, or NULL (none, or
 * fewer rows than it gains at): found from the kernel itself, so the two are always of one set. */
static dot2m_fn fused2m_of(dot2_fn dot2, int64_t B) {
    if (!dot2 || !multirow_on || B < 2) return NULL;
#if defined(HAVE_PERM)
    const int perm = perm_of_kernel(dot2);
    if (perm >= 0) return PERM[perm].dot2m;
#endif
#if defined(HAVE_FUSED_256)
    int min_rows = 2;
    dot2m_fn m = fused2m_of_vnni(dot2, &min_rows);
    if (!m) m = fused2m_of_avx2(dot2, &min_rows);
    return B >= min_rows ? m : NULL;
#else
    return NULL;
#endif
}

/* The 256-bit kernels' layout of one row of activations for 32-value weight blocks (the part
 * every weight row shares, built once per product): x in 16-bit integers, one float scale per 32
 * values (max |x| / 32767, so each value is within max |x| / 65534 of x: as close as x and its
 * 8-bit residual, "q8x2", and in one integer pass instead of two), then each block's scale times
 * the sum of its integers (the weight blocks' mins and offsets take it). */
static int64_t prep16_bytes(int64_t n) { const int64_t nb = n / 32; return nb * 64 + nb * 4 * 2; }

static void prep16(int64_t n, const float *x, uint8_t *out) {
    const int64_t nb = n / 32;
    int16_t *v = (int16_t *)out;
    float *dc = (float *)(out + nb * 64); /* per block its scale, then scale times sum: one 8-byte load */
    for (int64_t i = 0; i < nb; i++) {
        const float *xb = x + 32 * i;
        float amax = 0.0f;
        for (int l = 0; l < 32; l++) amax = fmaxf(amax, fabsf(xb[l]));
        const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int l = 0; l < 32; l++) {
            const float t = xb[l] * inv;
            int q = (int)(t + (t >= 0.0f ? 0.5f : -0.5f)); /* round half away from 0, as ggml's quantizers */
            q = q > 32767 ? 32767 : q < -32767 ? -32767 : q;
            v[32 * i + l] = (int16_t)q;
            sum += q;
        }
        dc[2 * i] = amax / 32767.0f;
        dc[2 * i + 1] = dc[2 * i] * (float)sum; /* |sum| < 2^21: exact in a float */
    }
}

/* "q8c" activations (Q8C_BLOCK bytes per 256 values: f32 d; i8 q[256]; i16 bsums[16]; i16 m[8]):
 * chunk j (32 values) is q * d * m_j, m_j = ceil(32 a_j / a) in 1..32 for the chunk's largest |x|
 * a_j and the block's a, d = a / (127 * 32); q = round(x / (d m_j)), within +-127. A block whose
 * largest |x| is under 1e-30 (or zero) is all zero. */
static int64_t q8c_prep_bytes(int64_t n) { return n / 256 * Q8C_BLOCK; }

static void q8c_prep(int64_t n, const float *x, uint8_t *out) {
    for (int64_t i = 0; i < n / 256; i++, x += 256, out += Q8C_BLOCK) {
        float a[8], amax = 0.0f;
        for (int j = 0; j < 8; j++) {
            float m = 0.0f;
            for (int l = 0; l < 32; l++) m = fmaxf(m, fabsf(x[32 * j + l]));
            a[j] = m;
            amax = fmaxf(amax, m);
        }
        memset(out, 0, Q8C_BLOCK);
        if (!(amax >= 1e-30f)) continue;
        const float d = amax / (127.0f * 32.0f);
        int8_t *q = (int8_t *)(out + 4);
        int16_t bs[16], mj[8];
        for (int j = 0; j < 8; j++) {
            int m = (int)ceilf(32.0f * a[j] / amax);
            m = m < 1 ? 1 : m > 32 ? 32 : m;
            mj[j] = (int16_t)m;
            const float inv = (127.0f * 32.0f) / (amax * (float)m);
            int s0 = 0, s1 = 0;
            for (int l = 0; l < 32; l++) {
                float t = rintf(x[32 * j + l] * inv);
                t = t > 127.0f ? 127.0f : t < -127.0f ? -127.0f : t;
                q[32 * j + l] = (int8_t)t;
                if (l < 16) s0 += (int)t;
                else s1 += (int)t;
            }
            bs[2 * j] = (int16_t)s0;
            bs[2 * j + 1] = (int16_t)s1;
        }
        memcpy(out, &d, 4);
        memcpy(out + 260, bs, 32);
        memcpy(out + 292, mj, 16);
    }
}

/* The "q8c" kernel for `type`, from the best 256-bit set this CPU runs (on every CPU: the AVX-512
 * set has none), or NULL: a type without one (the 32-value types) stays as in "q8x2", and so do
 * the grid types where the q8x2 set takes their permute kernels (strata_perm_kernel), which beat the one-pass
 * 256-bit ones (qwen3-30b-a3b 4L IQ2_XS decode at 2 threads on Zen 5: 201 against 177 tok/s). */
int strata_perm_kernel(int type);
static dot2_fn q8c_for(int type) {
#if defined(HAVE_PERM)
    if (strata_perm_kernel(type)) return NULL;
#endif
#if defined(HAVE_FUSED_256)
    const int isa = narrow_isa();
    return isa == 2 ? q8c_for_vnni(type) : isa == 1 ? q8c_for_avx2(type) : NULL;
#else
    (void)type;
    return NULL;
#endif
}

/* How kernel `dot2` (fused2_for's choice for `type`) wants its activations: 0 ggml's blocks as
 * they are, 1 q8_0_prep, 2 q4_1_prep (the AVX-512 kernels of q8_0 and q8_1 types), 3 prep16 (the
 * 256-bit kernels of the 32-value types, from x itself),
 * 4 q8k_prep (the AVX-512 Q4_K, Q5_K and Q6_K kernels), 6 perm8_prep (the permute kernels), 7 perm4_prep (IQ3_XXS's), 8 perm8s_prep (IQ1_S's). Decided from the kernel itself, so a set
 * switched meanwhile cannot pair one with another's layout. */
static int fused2_prep(int type, int64_t qblk, int64_t qsize, dot2_fn dot2) {
#if defined(HAVE_PERM)
    const int perm = perm_of_kernel(dot2);
    if (perm >= 0) return PERM[perm].prep;
#endif
    if (dot2 && (type == 12 || type == 13 || type == 14) && dot2 == fused2_512(type, qblk, qsize)) return 4;
    if (!dot2 || !(type == 3 || type == 7 || qsize == 34)) return 0;
    return dot2 != fused2_512(type, qblk, qsize) ? 3 : qsize == 34 ? 1 : 2;
}

static int64_t fused2_prep_bytes(int kind, int64_t cols) {
    return kind == 1 ? q8_0_prep_bytes(cols) : kind == 2 ? q4_1_prep_bytes(cols) : kind == 3 ? prep16_bytes(cols)
         : kind == 4 ? q8k_prep_bytes(cols) : kind == 5 ? q8c_prep_bytes(cols)
#if defined(HAVE_PERM)
         : kind == 6 ? perm8_prep_bytes(cols) : kind == 7 ? perm4_prep_bytes(cols) : kind == 8 ? perm8s_prep_bytes(cols)
#endif
         : 0;
}

static void fused2_prep_row(int kind, int64_t cols, const uint8_t *xq, const uint8_t *xr, uint8_t *out) {
    if (kind == 1) q8_0_prep(cols, xq, xr, out);
    else if (kind == 2) q4_1_prep(cols, xq, xr, out);
    else if (kind == 4) q8k_prep(cols, xq, xr, out);
#if defined(HAVE_PERM)
    else if (kind == 6) perm8_prep(cols, xq, xr, out);
    else if (kind == 7) perm4_prep(cols, xq, xr, out);
    else if (kind == 8) perm8s_prep(cols, xq, xr, out);
#endif
}

/* 1 (default): "q8x2" takes the fused kernels above where a type has one; 0: ggml's two passes
 * (tests compare the two). */
static int fused2_on = 1;
void strata_set_fused(int on) { fused2_on = on; }
static dot2_fn fused2_of_type(int type) {
    const int q8_1 = type == 3 || type == 7, q8_0 = type == 8 || type == 39 || type == 20 || type == 2 || type == 6;
    return fused2_for(type, q8_1 || q8_0 ? 32 : 256, q8_1 ? 36 : q8_0 ? 34 : 292);
}
int strata_fused_types(int type) { return fused2_of_type(type) != NULL; }
/* Whether the kernel set in use has a multi-row kernel for `type` (and they are on). */
int strata_multirow_types(int type) { return fused2m_of(fused2_of_type(type), DOT2M_ROWS) != NULL; }

/* 1 where "q8x2" takes a byte-permute kernel for `type` (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
 * IQ3_S): its prompt crossover differs, and "q8c" keeps it. */
int strata_perm_kernel(int type) {
#if defined(HAVE_PERM)
    return perm_of_kernel(fused2_of_type(type)) >= 0;
#else
    (void)type;
    return 0;
#endif
}

/* ggml's quantize_row_q8_K_ref in 16 lanes (ggml-cpu's q8_K from_float is the reference, a scalar
 * loop that took ~7 us per 2048 values, twice per x in "q8x2", on the calling thread while the
 * helpers waited): the same float operations, so the same bytes. Per 256 values: amax = max |x|,
 * max = the first x with |x| == amax, iscale = -127 / max, q = min(127, round-to-even(iscale * x)),
 * d = 1 / iscale, bsums per 16 values; an all-zero block is d = 0 with zero values and sums (the
 * reference leaves its sums unwritten). 1 when done, 0 without AVX-512 or AVX2 (callers use ggml's). */
int strata_q8k_quantize(const float *x, uint8_t *y, int64_t k) {
#if defined(HAVE_FUSED2)
    for (int64_t i = 0; i < k / 256; i++, x += 256, y += 292) {
        __m512 v[16], am = _mm512_setzero_ps();
        for (int j = 0; j < 16; j++) {
            v[j] = _mm512_loadu_ps(x + 16 * j);
            am = _mm512_max_ps(am, _mm512_abs_ps(v[j]));
        }
        const float amax = _mm512_reduce_max_ps(am);
        if (!amax) {
            memset(y, 0, 292);
            continue;
        }
        float max = 0.0f;
        for (int j = 0; j < 16; j++) {
            const __mmask16 m = _mm512_cmp_ps_mask(_mm512_abs_ps(v[j]), _mm512_set1_ps(amax), _CMP_EQ_OQ);
            if (m) {
                max = x[16 * j + __builtin_ctz(m)];
                break;
            }
        }
        const float iscale = -127.f / max;
        const __m512 is = _mm512_set1_ps(iscale);
        int16_t bs[16];
        for (int j = 0; j < 16; j++) {
            const __m512i q = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[j], is)), _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(y + 4 + 16 * j), _mm512_cvtepi32_epi8(q));
            bs[j] = (int16_t)_mm512_reduce_add_epi32(q);
        }
        memcpy(y + 260, bs, 32);
        const float d = 1 / iscale;
        memcpy(y, &d, 4);
    }
    return 1;
#elif defined(__AVX2__) && defined(__FMA__)
    /* the same in 8 lanes (AVX2 CPUs: ggml's scalar loop was 2 % of the full-size flagship's CPU) */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t i = 0; i < k / 256; i++, x += 256, y += 292) {
        __m256 v[32], am = _mm256_setzero_ps();
        for (int j = 0; j < 32; j++) {
            v[j] = _mm256_loadu_ps(x + 8 * j);
            am = _mm256_max_ps(am, _mm256_andnot_ps(sign, v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(am), _mm256_extractf128_ps(am, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        if (!amax) {
            memset(y, 0, 292);
            continue;
        }
        float max = 0.0f;
        for (int j = 0; j < 32; j++) {
            const int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, v[j]), _mm256_set1_ps(amax), _CMP_EQ_OQ));
            if (m) {
                max = x[8 * j + __builtin_ctz((unsigned)m)];
                break;
            }
        }
        const float iscale = -127.f / max;
        const __m256 is = _mm256_set1_ps(iscale);
        int16_t bs[16];
        for (int j = 0; j < 16; j++) { /* 16 values: two vectors of 8 */
            const __m256i q0 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j], is)), _mm256_set1_epi32(127));
            const __m256i q1 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[2 * j + 1], is)), _mm256_set1_epi32(127));
            const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8); /* 16 int16 in order */
            const __m128i b8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
            _mm_storeu_si128((__m128i *)(y + 4 + 16 * j), b8);
            const __m256i s8 = _mm256_add_epi32(q0, q1);
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
            bs[j] = (int16_t)_mm_cvtsi128_si32(s4);
        }
        memcpy(y + 260, bs, 32);
        const float d = 1 / iscale;
        memcpy(y, &d, 4);
    }
    return 1;
#else
    (void)x, (void)y, (void)k;
    return 0;
#endif
}

/* x back from ggml's 8-bit activation blocks: q8_0 {f16 d; i8 q[32]}, q8_1 {f16 d, s; i8 q[32]},
 * q8_K {f32 d; i8 q[256]; i16 bsums[16]}; returns 0 for any other layout. */
static int unquant8(const uint8_t *q, int64_t qblk, int64_t qsize, float *y, int64_t n) {
    int64_t head;
    if (qblk == 32 && qsize == 34) head = 2;
    else if (qblk == 32 && qsize == 36) head = 4;
    else if (qblk == 256 && qsize == 292) head = 4;
    else return 0;
    for (int64_t j = 0; j < n / qblk; j++) {
        const uint8_t *b = q + j * qsize;
        float d;
        if (qblk == 256) memcpy(&d, b, 4);
        else d = rd_f16(b);
        const int8_t *v = (const int8_t *)(b + head);
        for (int64_t i = 0; i < qblk; i++) y[j * qblk + i] = d * (float)v[i];
    }
    return 1;
}

/* Products reading fewer weight bytes (times batch rows) than this run on the calling thread alone:
 * a decode step of a small model makes hundreds of ~10 us products, and handing each to a helper
 * thread (a wake-up, then the caller's wait) cost more than the helper's share of the work. */
static int64_t min_parallel_bytes = 256 * 1024;
void strata_set_min_parallel(int64_t bytes) { min_parallel_bytes = bytes; }
/* ... unless the helpers are awake (polling after the last job): then from this many bytes on. */
static const int64_t min_warm_bytes = 32 * 1024;
static inline int parallel_threads(int64_t bytes, int nth) {
    return bytes >= min_parallel_bytes || (bytes >= min_warm_bytes && pool_awake(nth)) ? nth : 1;
}

/* ------------------------------------------------------------------ products over 8-bit x, in one parallel region
 *
 * A decode layer's products are small (a qwen3-30b expert's gate is 0.8 MiB, ~0.2 ms on one core)
 * and were one pool_run each: per MoE token 3k fork/joins, each x quantized again for every
 * expert's gate and up, and the helpers' share lost at every join. many_run takes n products of
 * the 8-bit modes ("q8", "q8x2") as one job: each distinct x quantized (and laid out) once, then
 * the tiles of all n products claimed from one counter, so all threads stay busy across the
 * products. A product may read chosen rows of its x (`pick`: a few tokens' experts, each over its
 * own tokens of one quantized x). Each row's arithmetic depends on that row alone (the same kernel
 * on the same quantized row), so results are bit-equal however the products are grouped. */
#define MANY_MAX 256

/* One product: Y [B, rows] = X[pick] W^T, W of ggml type `type` with wrow bytes per row; X has
 * xB rows of cols values, pick B indices into them (NULL: rows 0..B-1, xB == B). */
typedef struct {
    int type;
    const uint8_t *W;
    int64_t rows, cols, wrow;
    const float *X;
    int64_t xB;
    const int64_t *pick;
    int64_t B;
    float *Y;
    float *silu; /* non-NULL: this product is a gate and the next one its up (same rows, B and pick): each
                  * tile computes both and writes silu(gate) * up [B, rows] here */
} many_req;

typedef struct {
    const uint8_t *W;
    int64_t rows, cols, wrow, xrow, tile0, B;
    const int64_t *pick;
    const uint8_t *XQ, *XR;
    float *Y;
    dot2_fn dot2;         /* the one-pass kernel, or NULL: ggml's dot (twice with XR) */
    dot2m_fn dot2m;       /* its multi-row kernel for B > 1, or NULL: dot2 row by row */
    ggml_vec_dot_fn dot;
    int burst;            /* prefetch each row's bytes before it (ggml's dot; the one-pass kernels stream_prefetch) */
    const float *unscale; /* ggml's two passes: per x row, the inverse of the factor it was quantized at (or NULL) */
    float *silu;          /* many_req's: this item's tiles also run the next item's rows, then silu(gate) * up
                           * (that next item, the up, has no tiles of its own) */
} many_item;

typedef struct {
    const many_item *it;
    int n;
    int64_t tile_rows;
} many_args;

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

static void many_rows(const many_item *m, int64_t t0, int64_t t1);

static void tile_many(const void *a_, int64_t tile) {
    const many_args *a = (const many_args *)a_;
    int lo = 0, hi = a->n - 1; /* the item holding this tile: the last with tile0 <= tile (an up without
                                * tiles of its own shares its tile0 with the next item) */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (a->it[mid].tile0 <= tile) lo = mid;
        else hi = mid - 1;
    }
    const many_item *m = &a->it[lo];
    const int64_t t0 = (tile - m->tile0) * a->tile_rows;
    const int64_t t1 = t0 + a->tile_rows < m->rows ? t0 + a->tile_rows : m->rows;
    many_rows(m, t0, t1);
    if (m->silu) { /* the up's same rows, then the SwiGLU product of both (as the serial loop computed it) */
        const many_item *u = m + 1;
        many_rows(u, t0, t1);
        for (int64_t b = 0; b < m->B; b++)
            for (int64_t r = t0; r < t1; r++) m->silu[b * m->rows + r] = silu(m->Y[b * m->rows + r]) * u->Y[b * u->rows + r];
    }
}

/* Rows [t0, t1) of item m for all its batch rows by its multi-row kernel, DOT2M_ROWS batch rows
 * at a time: each weight row's blocks unpacked once per group, not once per batch row. */
static void many_rows_multi(const many_item *m, int64_t t0, int64_t t1) {
    int64_t xoff[DOT2M_ROWS];
    float y[DOT2M_ROWS];
    for (int64_t b0 = 0; b0 < m->B; b0 += DOT2M_ROWS) {
        const int nr = m->B - b0 < DOT2M_ROWS ? (int)(m->B - b0) : DOT2M_ROWS;
        for (int i = 0; i < nr; i++) xoff[i] = (m->pick ? m->pick[b0 + i] : b0 + i) * m->xrow;
        for (int64_t r = t0; r < t1; r++) {
            m->dot2m(m->cols, m->W + r * m->wrow, m->XQ, m->XR, xoff, nr, y);
            for (int i = 0; i < nr; i++) m->Y[(b0 + i) * m->rows + r] = y[i];
        }
    }
}

/* Rows [t0, t1) of item m, every batch row. */
static void many_rows(const many_item *m, int64_t t0, int64_t t1) {
    if (m->dot2m) {
        many_rows_multi(m, t0, t1);
        return;
    }
    const uint8_t *end = m->W + m->rows * m->wrow;
    for (int64_t b = 0; b < m->B; b++) {
        const int64_t xb = (m->pick ? m->pick[b] : b) * m->xrow;
        int64_t r = t0;
#if defined(HAVE_PERM)
        const dot2x2_fn x2 = dot2x2_of(m->dot2, m->cols);
        if (x2) /* row pairs from an even row: as any tiling */
            for (; r + 1 < t1; r += 2) {
                float y2[2];
                x2(m->cols, m->W + r * m->wrow, m->wrow, m->XQ + xb, y2);
                m->Y[b * m->rows + r] = y2[0];
                m->Y[b * m->rows + r + 1] = y2[1];
            }
#endif
        for (; r < t1; r++) {
            if (b == 0 && m->burst) prefetch_ahead(m->W + r * m->wrow, m->wrow, end);
            float *y = m->Y + b * m->rows + r;
            if (m->dot2) {
                *y = m->dot2(m->cols, m->W + r * m->wrow, m->XQ + xb, m->XR + xb);
            } else {
                m->dot((int)m->cols, y, 0, m->W + r * m->wrow, 0, m->XQ + xb, 0, 1);
                if (m->XR) {
                    float lo2;
                    m->dot((int)m->cols, &lo2, 0, m->W + r * m->wrow, 0, m->XR + xb, 0, 1);
                    *y += lo2;
                }
                if (m->unscale) *y *= m->unscale[m->pick ? m->pick[b] : b];
            }
        }
    }
}

/* One x prepared for one activation layout: ggml's blocks of x (and of its residual in "q8x2"),
 * or the q8_0 / q8_1 one-pass layout built from them. */
typedef struct {
    const float *X;
    int64_t cols, B;
    ggml_from_float_fn quant;
    int prep; /* fused2_prep's kinds: 0 blocks as they are, 1 q8_0_prep, 2 q4_1_prep, 3 prep16, 4 q8k_prep, 5 q8c_prep,
               * 6 perm8_prep, 7 perm4_prep, 8 perm8s_prep */
    uint8_t *buf, *xq, *xr;
    int64_t xrow;
    float *unscale; /* per row, 1 / small_row_scale where ggml's two passes take f16-scaled blocks (else NULL) */
} many_act;

/* "q8x2" with q8_0 / q8_1 activations (the prepared kinds 1-3, and ggml's blocks as they are) stores each block's scales as f16:
 * a row whose largest |x| is under 2 puts its residual's scale (about max|x| / 32258) below f16's
 * normal range (6.1e-5), where it keeps few bits, and the second pass adds little (x ~ 1e-3 came
 * out 30x further from exact than x ~ 1, x ~ 1e-4 as far as one pass). Such a row is quantized
 * times a power of two (its max |x| to [1024, 2048): exact) and its prepared float scales are
 * scaled back (exact), so the products do not change. 1: the row as it is. */
static float small_row_scale(const float *x, int64_t n) {
    uint32_t top = 0; /* max |x| as its bits (an integer max, which vectorizes; NaN ranks above inf) */
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        u &= 0x7fffffffu;
        top = u > top ? u : top;
    }
    float amax;
    memcpy(&amax, &top, 4);
    if (!(amax > 0.0f && amax < 2.0f)) return 1.0f; /* also inf and NaN: left to the non-finite check */
    int e;
    frexpf(amax, &e); /* amax = m 2^e, m in [0.5, 1) */
    return ldexpf(1.0f, 11 - e < 126 ? 11 - e : 126); /* 2^-126 (its inverse) is still a normal float */
}

/* How many floats (the block scales, and q8_1's block sums) follow the int8 values of a prepared
 * row of `kind` that came from f16-scaled blocks (the q8_0 / q8_1 layouts, kinds 1 and 2), else 0: a
 * kind without f16 scales (q8k_prep's are float32) or one this list does not know is never rescaled. */
static int64_t prep_f16_scales(int kind, int64_t cols) {
    const int64_t nb = cols / 32;
    return kind == 1 ? 16 * nb : kind == 2 ? 17 * nb : 0;
}

/* Those floats of one prepared row, each times f. */
static void prep_rescale(int kind, int64_t cols, uint8_t *row, float f) {
    const int64_t n = prep_f16_scales(kind, cols);
    float *d = (float *)(row + cols / 32 * 64);
    for (int64_t i = 0; i < n; i++) d[i] *= f;
}

static int prepare_act(many_act *p, const ext_kernel *k, int twice) {
    const int64_t cols = p->cols, B = p->B, brow = cols / k->qblk * k->qsize;
    const int64_t prow = fused2_prep_bytes(p->prep, cols);
    if (p->prep == 3 || p->prep == 5) { /* 16-bit x or q8c, straight from x: no ggml blocks */
        uint8_t *prep = malloc((size_t)(B * prow) + 64);
        if (!prep) return 0;
        for (int64_t b = 0; b < B; b++) {
            if (p->prep == 3) prep16(cols, p->X + b * cols, prep + b * prow);
            else q8c_prep(cols, p->X + b * cols, prep + b * prow);
        }
        p->buf = p->xq = p->xr = prep;
        p->xrow = prow;
        p->unscale = NULL;
        return 1;
    }
    /* the layouts prep_rescale undoes; ggml's own q8_0 / q8_1 blocks (f16 scales), whose products
     * are scaled back instead (tile_many) */
    const int f16_blocks = p->prep == 0 && (k->qsize == 34 || k->qsize == 36) && k->qblk == 32;
    const int rescale = twice && (prep_f16_scales(p->prep, cols) > 0 || f16_blocks);
    const int q8k = k->qblk == 256 && k->qsize == 292; /* strata_q8k_quantize: ggml's reference, vectorized */
    uint8_t *blocks = malloc((size_t)((twice ? 2 : 1) * B * brow + B * prow + (rescale && f16_blocks ? 4 * B : 0)) + 64);
    float *tmp = twice ? malloc(sizeof(float) * (size_t)(rescale ? 2 * cols + B : cols)) : NULL;
    if (!blocks || (twice && !tmp)) {
        free(blocks);
        free(tmp);
        return 0;
    }
    float *xs = rescale ? tmp + cols : NULL, *fs = rescale ? tmp + 2 * cols : NULL;
    uint8_t *xq = blocks, *xr = twice ? blocks + B * brow : NULL;
    for (int64_t b = 0; b < B; b++) {
        const float *xb = p->X + b * cols;
        if (rescale && (fs[b] = small_row_scale(xb, cols)) != 1.0f) {
            for (int64_t i = 0; i < cols; i++) xs[i] = xb[i] * fs[b];
            xb = xs;
        }
        if (!(q8k && strata_q8k_quantize(xb, xq + b * brow, cols))) k->quant(xb, xq + b * brow, cols);
        if (twice) {
            if (!unquant8(xq + b * brow, k->qblk, k->qsize, tmp, cols)) {
                free(blocks);
                free(tmp);
                return 0;
            }
            for (int64_t i = 0; i < cols; i++) tmp[i] = xb[i] - tmp[i];
            if (!(q8k && strata_q8k_quantize(tmp, xr + b * brow, cols))) k->quant(tmp, xr + b * brow, cols);
        }
    }
    p->buf = blocks;
    p->unscale = NULL;
    if (rescale && f16_blocks) {
        p->unscale = (float *)(blocks + (twice ? 2 : 1) * B * brow + B * prow);
        for (int64_t b = 0; b < B; b++) p->unscale[b] = 1.0f / fs[b];
    }
    if (p->prep) {
        uint8_t *prep = blocks + (twice ? 2 : 1) * B * brow;
        for (int64_t b = 0; b < B; b++) {
            fused2_prep_row(p->prep, cols, xq + b * brow, xr + b * brow, prep + b * prow);
            if (rescale && fs[b] != 1.0f) prep_rescale(p->prep, cols, prep + b * prow, 1.0f / fs[b]);
        }
        p->xq = p->xr = prep;
        p->xrow = prow;
    } else {
        p->xq = xq;
        p->xr = xr;
        p->xrow = brow;
    }
    free(tmp);
    return 1;
}

/* The n <= MANY_MAX products of req in one parallel region, x quantized to 8 bits (twice: plus its
 * 8-bit residual, "q8x2"); 1 when done, 0 (nothing written) when it does not apply: a type without
 * ggml's kernel, a non-finite x (ggml's quantizer would hide it; the other paths keep it), or no
 * memory. */
static int many_run(int n, const many_req *req, int nth, int twice) {
    if (n <= 0 || n > MANY_MAX) return 0;
    strata_pool_mark(1, n); /* the timeline tells preparing x from the products */
    many_item it[MANY_MAX];
    many_act acts[MANY_MAX];
    int n_act = 0, ok = 1;
    int64_t bytes = 0;
    for (int j = 0; j < n && ok; j++) {
        const many_req *q = &req[j];
        const int type = q->type;
        if (type < 0 || type >= MAX_EXT || !EXT[type].dot || q->cols % EXT[type].qblk || q->cols > 0x7FFFFFFF ||
            q->B < 0 || (!q->pick && q->xB != q->B)) {
            ok = 0;
            break;
        }
        const ext_kernel *k = &EXT[type];
        const dot2_fn c1 = act_mode == 4 && fused2_on ? q8c_for(type) : NULL;
        const dot2_fn dot2 = c1 ? c1 : twice && fused2_on ? fused2_for(type, k->qblk, k->qsize) : NULL;
        const int prep = c1 ? 5 : fused2_prep(type, k->qblk, k->qsize, dot2);
        int a = 0;
        while (a < n_act && !(acts[a].X == q->X && acts[a].cols == q->cols && acts[a].B == q->xB &&
                              acts[a].quant == k->quant && acts[a].prep == prep))
            a++;
        if (a == n_act) {
            for (int64_t i = 0; i < q->xB * q->cols; i++)
                if (!(q->X[i] - q->X[i] == 0.0f)) ok = 0;
            if (!ok) break;
            acts[a] = (many_act){q->X, q->cols, q->xB, k->quant, prep, NULL, NULL, NULL, 0, NULL};
            if (!prepare_act(&acts[a], k, twice)) {
                ok = 0;
                break;
            }
            n_act++;
        }
        if (q->silu && (j + 1 >= n || req[j + 1].rows != q->rows || req[j + 1].B != q->B || req[j + 1].pick != q->pick ||
                        req[j + 1].silu)) {
            ok = 0; /* a gate without its up */
            break;
        }
        it[j] = (many_item){q->W, q->rows, q->cols, q->wrow, acts[a].xrow, 0, q->B, q->pick,
                            acts[a].xq, acts[a].xr, q->Y, dot2, fused2m_of(dot2, q->B), k->dot, dot2 == NULL, acts[a].unscale, q->silu};
        bytes += q->rows * q->wrow * q->B;
    }
    if (ok) {
        int64_t tile_rows = ROW_TILE, total;
        for (;;) {
            total = 0;
            for (int j = 0; j < n; j++) {
                it[j].tile0 = total;
                total += j > 0 && it[j - 1].silu ? 0 : (it[j].rows + tile_rows - 1) / tile_rows; /* an up: its gate's */
            }
            if (total <= 0xFFFF) break;
            tile_rows *= 2;
        }
        nth = parallel_threads(bytes, nth); /* waking a helper costs more than it saves */
        const many_args args = {it, n, tile_rows};
        pool_tag = 1;
        pool_info = n | it[0].rows << 16 | it[0].cols << 40;
        pool_bytes = bytes;
        pool_run(tile_many, &args, total, nth < 1 ? 1 : nth);
    }
    for (int a = 0; a < n_act; a++) free(acts[a].buf);
    return ok;
}

/* Y = X W^T through 8-bit x for ggml type `type` (wrow bytes per weight row): "q8x2" in that
 * mode, else one 8-bit pass; 0 if ggml has no kernel for the type, or x is not finite. */
int strata_qmm_ext(int type, const uint8_t *W, int64_t rows, int64_t cols, const float *X, int64_t B, float *Y,
                   int nth, int64_t wrow) {
    const many_req q = {type, W, rows, cols, wrow, X, B, NULL, B, Y, NULL};
    return many_run(1, &q, nth, act_mode >= 3);
}

/* Y_j = X_j W_j^T (X_j: [B, cols_j], Y_j: [B, rows_j], wrows_j bytes per row of W_j) for n products of ggml types types[j] in
 * one parallel region; 1 when done, 0 (nothing written) when it does not apply: not an 8-bit mode,
 * a type without ggml's kernel, a non-finite x, too many products, or no memory. */
int strata_qmm_many(int n, const int *types, const void *const *W, const int64_t *rows, const int64_t *cols,
                    const int64_t *wrows, const float *const *X, int64_t B, float *const *Y, int nth) {
    if (act_mode < 2 || n <= 0 || n > MANY_MAX || B <= 0) return 0;
    many_req req[MANY_MAX];
    for (int j = 0; j < n; j++) req[j] = (many_req){types[j], W[j], rows[j], cols[j], wrows[j], X[j], B, NULL, B, Y[j], NULL};
    return many_run(n, req, nth, act_mode >= 3);
}

/* Prefill: W's rows dequantized by ggml's to_float, as float32 or rounded to bfloat16 (nearest
 * even) for torch's bf16 matmul (oneDNN, AMX where the CPU has it). */
static ggml_to_float_fn TO_FLOAT[MAX_EXT];

void strata_set_to_float(int type, void *fn) {
    if (type >= 0 && type < MAX_EXT) TO_FLOAT[type] = (ggml_to_float_fn)fn;
}

typedef struct {
    const uint8_t *W;
    int64_t rows, cols, wrow, tile_rows;
    void *Y;
    int bf16; /* Y is bfloat16, else float32 */
    ggml_to_float_fn f;
} deq_args;

static inline uint16_t f32_to_bf16(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40); /* nan stays nan */
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static void tile_deq(const void *a_, int64_t tile) {
    const deq_args *a = (const deq_args *)a_;
    const int64_t t0 = tile * a->tile_rows;
    const int64_t t1 = t0 + a->tile_rows < a->rows ? t0 + a->tile_rows : a->rows;
    if (!a->bf16) {
        for (int64_t r = t0; r < t1; r++) a->f(a->W + r * a->wrow, (float *)a->Y + r * a->cols, a->cols);
        return;
    }
    /* a row in pieces of DEQ_PIECE values through a stack buffer: no allocation that could fail
     * (which left rows at zero). A piece is a whole number of blocks (every block holds 1, 32 or
     * 256 values), so its bytes start j * wrow / cols into the row. */
    enum { DEQ_PIECE = 4096 };
    float buf[DEQ_PIECE];
    for (int64_t r = t0; r < t1; r++) {
        uint16_t *y = (uint16_t *)a->Y + r * a->cols;
        for (int64_t j = 0; j < a->cols; j += DEQ_PIECE) {
            const int64_t n = a->cols - j < DEQ_PIECE ? a->cols - j : DEQ_PIECE;
            a->f(a->W + r * a->wrow + j * a->wrow / a->cols, buf, n);
            for (int64_t i = 0; i < n; i++) y[j + i] = f32_to_bf16(buf[i]);
        }
    }
}

/* For prefill.c (built into this library): ggml's to_float of a type (NULL: none). */
void *strata_to_float_fn(int type) { return type >= 0 && type < MAX_EXT ? (void *)TO_FLOAT[type] : NULL; }

/* Y (rows x cols, bfloat16 or float32) = W dequantized; 0 if ggml has no to_float for the type. */
int strata_dequant(int type, const uint8_t *W, int64_t rows, int64_t cols, int64_t wrow, void *Y, int bf16, int nth) {
    if (type < 0 || type >= MAX_EXT || !TO_FLOAT[type]) return 0;
    int64_t tile_rows = ROW_TILE;
    while ((rows + tile_rows - 1) / tile_rows > 0xFFFF) tile_rows *= 2;
    const deq_args a = {W, rows, cols, wrow, tile_rows, Y, bf16, TO_FLOAT[type]};
    pool_run(tile_deq, &a, (rows + tile_rows - 1) / tile_rows, nth < 1 ? 1 : nth);
    return 1;
}

/* Activations: 3 = as 2 plus a second 8-bit pass over x's residual (near-exact, twice the dot
 * products, the same weight traffic), 2 = 8-bit through ggml where it has the type (else as 1),
 * 1 = int16 variants where a type has one, 0 = float32 everywhere (exact; tests compare them). */
void strata_set_activations(int mode) { act_mode = mode; }

#define DEFINE_QMM(NAME, QK, TS, GGML_TYPE)                                                                    \
    DEFINE_ROWS(NAME, QK, TS, 1) DEFINE_ROWS(NAME, QK, TS, 2) DEFINE_ROWS(NAME, QK, TS, 4)            \
    DEFINE_ROWS(NAME, QK, TS, 8)                                                                      \
    static void tile_##NAME(const void *a_, int64_t tile) {                                          \
        const qmm_args *a = (const qmm_args *)a_;                                                    \
        const int64_t t0 = tile * a->tile_rows;                                                      \
        const int64_t t1 = t0 + a->tile_rows < a->rows ? t0 + a->tile_rows : a->rows;                \
        const int64_t nb = a->nblk, c = a->cols, R = a->rows;                                        \
        /* batch rows in groups of 8, then 4, 2, 1: each group decodes the tile once */              \
        for (int64_t b0 = 0; b0 < a->B;) {                                                           \
            const float *x = a->X + b0 * c;                                                          \
            float *y = a->Y + b0 * R;                                                                \
            const int64_t left = a->B - b0;                                                          \
            if (left >= 8) { rows_##NAME##_8(a->W, t0, t1, nb, x, c, y, R); b0 += 8; }               \
            else if (left >= 4) { rows_##NAME##_4(a->W, t0, t1, nb, x, c, y, R); b0 += 4; }          \
            else if (left >= 2) { rows_##NAME##_2(a->W, t0, t1, nb, x, c, y, R); b0 += 2; }          \
            else { rows_##NAME##_1(a->W, t0, t1, nb, x, c, y, R); b0 += 1; }                         \
        }                                                                                            \
    }                                                                                                \
    void strata_qmm_##NAME(const uint8_t *W, int64_t rows, int64_t cols, const float *X, int64_t B,  \
                           float *Y, int nth) {                                                     \
        if (act_mode >= 2 && strata_qmm_ext(GGML_TYPE, W, rows, cols, X, B, Y, nth, cols / (QK) * (TS))) return; \
        if (act_mode >= 1 && qmm16_dispatch_##NAME(W, rows, cols, X, B, Y, nth)) return;             \
        int64_t tile_rows = ROW_TILE;                                                                \
        while ((rows + tile_rows - 1) / tile_rows > 0xFFFF) tile_rows *= 2;                          \
        const qmm_args a = {W, rows, cols, cols / (QK), B, tile_rows, X, Y};                         \
        pool_run(tile_##NAME, &a, (rows + tile_rows - 1) / tile_rows, nth < 1 ? 1 : nth);            \
    }

/* qmm16_dispatch_T: run the int16 variant if T has one (returns 1), else 0. */
#define NO_I16(NAME) \
    static inline int qmm16_dispatch_##NAME(const uint8_t *W, int64_t r, int64_t c, const float *X, int64_t B, \
                                            float *Y, int nth) { (void)W; (void)r; (void)c; (void)X; (void)B; (void)Y; (void)nth; return 0; }
#if defined(HAVE_I16)
#define WITH_I16(NAME) \
    static inline int qmm16_dispatch_##NAME(const uint8_t *W, int64_t r, int64_t c, const float *X, int64_t B, \
                                            float *Y, int nth) { return qmm16_##NAME(W, r, c, X, B, Y, nth); }
#else
#define WITH_I16(NAME) NO_I16(NAME)
#endif
NO_I16(q4_0) NO_I16(q4_1) NO_I16(q5_0) NO_I16(q5_1) WITH_I16(q8_0) NO_I16(q2_k) NO_I16(q3_k)
WITH_I16(q4_k) WITH_I16(q5_k) WITH_I16(q6_k) WITH_I16(iq2_xxs) WITH_I16(iq2_xs) NO_I16(iq3_xxs)
WITH_I16(iq4_nl) WITH_I16(iq4_xs) WITH_I16(mxfp4)

DEFINE_QMM(q4_0, 32, 18, 2)
DEFINE_QMM(q4_1, 32, 20, 3)
DEFINE_QMM(q5_0, 32, 22, 6)
DEFINE_QMM(q5_1, 32, 24, 7)
DEFINE_QMM(q8_0, 32, 34, 8)
DEFINE_QMM(q2_k, 256, 84, 10)
DEFINE_QMM(q3_k, 256, 110, 11)
DEFINE_QMM(q4_k, 256, 144, 12)
DEFINE_QMM(q5_k, 256, 176, 13)
DEFINE_QMM(q6_k, 256, 210, 14)
DEFINE_QMM(iq2_xxs, 256, 66, 16)
DEFINE_QMM(iq2_xs, 256, 74, 17)
DEFINE_QMM(iq3_xxs, 256, 98, 18)
DEFINE_QMM(iq4_nl, 32, 18, 20)
DEFINE_QMM(iq4_xs, 256, 136, 23)
DEFINE_QMM(mxfp4, 32, 17, 39)

/* ------------------------------------------------------------------ routed experts, one token
 *
 * out[h] += sum_j w[j] * down_j(silu(gate_j x) * up_j x) for the k experts of one token, each
 * matrix product by its type's strata_qmm_* (passed as function pointers, so any mix of types
 * works); the same arithmetic as calling them one by one from Python, without k * 3 trips
 * through ctypes and torch. scratch holds 3 * ffn + hidden floats.
 */
typedef void (*qmm_fn)(const uint8_t *, int64_t, int64_t, const float *, int64_t, float *, int);

/* strata_qmm_<type> -> its ggml type and block layout, for the calls that take kernels by pointer. */
static const struct {
    qmm_fn fn;
    int type;
    int64_t qk, ts;
} QMM_TYPES[] = {
    {strata_qmm_q4_0, 2, 32, 18},       {strata_qmm_q4_1, 3, 32, 20},      {strata_qmm_q5_0, 6, 32, 22},
    {strata_qmm_q5_1, 7, 32, 24},       {strata_qmm_q8_0, 8, 32, 34},      {strata_qmm_q2_k, 10, 256, 84},
    {strata_qmm_q3_k, 11, 256, 110},    {strata_qmm_q4_k, 12, 256, 144},   {strata_qmm_q5_k, 13, 256, 176},
    {strata_qmm_q6_k, 14, 256, 210},    {strata_qmm_iq2_xxs, 16, 256, 66}, {strata_qmm_iq2_xs, 17, 256, 74},
    {strata_qmm_iq3_xxs, 18, 256, 98},  {strata_qmm_iq4_nl, 20, 32, 18},   {strata_qmm_iq4_xs, 23, 256, 136},
    {strata_qmm_mxfp4, 39, 32, 17},
};

/* The ggml type of kernel fn and the bytes of a weight row of `cols` values (wrow), or -1. */
static int qmm_type_of(void *fn, int64_t cols, int64_t *wrow) {
    for (size_t i = 0; i < sizeof QMM_TYPES / sizeof QMM_TYPES[0]; i++)
        if ((void *)QMM_TYPES[i].fn == fn) {
            if (cols % QMM_TYPES[i].qk) return -1;
            *wrow = cols / QMM_TYPES[i].qk * QMM_TYPES[i].ts;
            return QMM_TYPES[i].type;
        }
    return -1;
}

/* strata_moe_token in two parallel regions (the 8-bit modes): every expert's gate and up over the
 * one quantized x, then every expert's down; the same arithmetic and order of sums as the loop
 * below. With sh_ffn > 0, a shared expert's gate and up (sh_fns / sh_W [0..1]) join the first
 * region and its down ([2]) the second, and its output (before any gate of its own) goes to
 * sh_out: 2 parallel regions per MoE layer instead of 4, so fewer joins where a thread waits. 0
 * (nothing written) when strata_qmm_many declines the gate/up products. */
static int moe_token_many(const void *const *gate, const void *const *up, const void *const *down, const float *w,
                          int k, void *gate_fn, void *up_fn, void *down_fn, int64_t hidden, int64_t ffn,
                          const float *x, float *out, int nth, void *const *sh_fns, const void *const *sh_W,
                          int64_t sh_ffn, float *sh_out) {
    int64_t gw = 0, uw = 0, dw = 0, sw[3] = {0, 0, 0};
    const int gt = qmm_type_of(gate_fn, hidden, &gw), ut = qmm_type_of(up_fn, hidden, &uw),
              dt = qmm_type_of(down_fn, ffn, &dw);
    const int sh = sh_ffn > 0;
    int st[3] = {0, 0, 0};
    if (sh) {
        st[0] = qmm_type_of(sh_fns[0], hidden, &sw[0]);
        st[1] = qmm_type_of(sh_fns[1], hidden, &sw[1]);
        st[2] = qmm_type_of(sh_fns[2], sh_ffn, &sw[2]);
        if (st[0] < 0 || st[1] < 0 || st[2] < 0) return 0;
    }
    if (act_mode < 2 || k <= 0 || 2 * k + 2 * sh > MANY_MAX || gt < 0 || ut < 0 || dt < 0) return 0;
    float *buf = malloc(sizeof(float) * (size_t)(k * (3 * ffn + hidden) + 3 * sh_ffn) + 64);
    if (!buf) return 0;
    float *g = buf, *u = g + k * ffn, *h = u + k * ffn, *y = h + k * ffn, *sg = y + k * hidden, *su = sg + sh_ffn,
          *shh = su + sh_ffn;
    int types[MANY_MAX];
    const void *Ws[MANY_MAX];
    int64_t rows[MANY_MAX], cols[MANY_MAX], wr[MANY_MAX];
    const float *Xs[MANY_MAX];
    float *Ys[MANY_MAX];
    /* each expert's gate and up as a pair: a tile runs both over the same rows and writes h =
     * silu(gate) * up there (no serial pass over k * ffn values between the two jobs) */
    many_req gu[MANY_MAX];
    for (int j = 0; j < k; j++) {
        gu[2 * j] = (many_req){gt, (const uint8_t *)gate[j], ffn, hidden, gw, x, 1, NULL, 1, g + j * ffn, h + j * ffn};
        gu[2 * j + 1] = (many_req){ut, (const uint8_t *)up[j], ffn, hidden, uw, x, 1, NULL, 1, u + j * ffn, NULL};
    }
    if (sh) {
        gu[2 * k] = (many_req){st[0], (const uint8_t *)sh_W[0], sh_ffn, hidden, sw[0], x, 1, NULL, 1, sg, shh};
        gu[2 * k + 1] = (many_req){st[1], (const uint8_t *)sh_W[1], sh_ffn, hidden, sw[1], x, 1, NULL, 1, su, NULL};
    }
    if (!many_run(2 * k + 2 * sh, gu, nth, act_mode >= 3)) {
        free(buf);
        return 0;
    }
    for (int j = 0; j < k; j++) {
        types[j] = dt;
        Ws[j] = down[j];
        rows[j] = hidden;
        cols[j] = ffn;
        wr[j] = dw;
        Xs[j] = h + j * ffn;
        Ys[j] = y + j * hidden;
    }
    if (sh) {
        types[k] = st[2];
        Ws[k] = sh_W[2];
        rows[k] = hidden;
        cols[k] = sh_ffn;
        wr[k] = sw[2];
        Xs[k] = shh;
        Ys[k] = sh_out;
    }
    if (!strata_qmm_many(k + sh, types, Ws, rows, cols, wr, Xs, 1, Ys, nth)) { /* a non-finite h: each alone */
        for (int j = 0; j < k; j++) ((qmm_fn)down_fn)((const uint8_t *)down[j], hidden, ffn, h + j * ffn, 1, y + j * hidden, nth);
        if (sh) ((qmm_fn)sh_fns[2])((const uint8_t *)sh_W[2], hidden, sh_ffn, shh, 1, sh_out, nth);
    }
    for (int j = 0; j < k; j++)
        for (int64_t i = 0; i < hidden; i++) out[i] += w[j] * y[j * hidden + i];
    free(buf);
    return 1;
}

void strata_moe_token(const void *const *gate, const void *const *up, const void *const *down,
                      const float *w, int k, void *gate_fn, void *up_fn, void *down_fn, int64_t hidden,
                      int64_t ffn, const float *x, float *out, float *scratch, int nth) {
    if (moe_token_many(gate, up, down, w, k, gate_fn, up_fn, down_fn, hidden, ffn, x, out, nth, NULL, NULL, 0, NULL))
        return;
    float *g = scratch, *u = scratch + ffn, *h = scratch + 2 * ffn, *y = scratch + 3 * ffn;
    for (int j = 0; j < k; j++) {
        ((qmm_fn)gate_fn)((const uint8_t *)gate[j], ffn, hidden, x, 1, g, nth);
        ((qmm_fn)up_fn)((const uint8_t *)up[j], ffn, hidden, x, 1, u, nth);
        for (int64_t i = 0; i < ffn; i++) h[i] = silu(g[i]) * u[i];
        ((qmm_fn)down_fn)((const uint8_t *)down[j], hidden, ffn, h, 1, y, nth);
        for (int64_t i = 0; i < hidden; i++) out[i] += w[j] * y[i];
    }
}

/* The routed experts of a few tokens (a verify pass's k+1 positions, a decode batch's rows) in one
 * call: each used expert once over all its tokens (its weights read once), then every token's
 * sum. The pairs come sorted by expert (count[e] consecutive pairs of expert e); order lists the
 * pairs in the order they are added up (each token's experts in its router's order, as a
 * one-token step adds them), with the arithmetic of strata_moe_token (the products are
 * row-independent), so a token's result is what a one-token step computes. 0 (nothing written)
 * when scratch cannot be had. */
int strata_moe_tokens(const void *const *gate, const void *const *up, const void *const *down,
                      const int64_t *count, int n_exp, const int64_t *token, const float *w,
                      const int64_t *order, void *gate_fn,
                      void *up_fn, void *down_fn, int64_t hidden, int64_t ffn, const float *x, float *out, int nth) {
    int64_t n_pairs = 0, most = 0, n_tok = 0;
    for (int e = 0; e < n_exp; e++) {
        n_pairs += count[e];
        if (count[e] > most) most = count[e];
    }
    for (int64_t p = 0; p < n_pairs; p++)
        if (token[p] + 1 > n_tok) n_tok = token[p] + 1;
    float *g = malloc(sizeof(float) * (size_t)(n_pairs * ffn) + 64);
    float *u = malloc(sizeof(float) * (size_t)(n_pairs * ffn) + 64);
    float *ys = malloc(sizeof(float) * (size_t)(n_pairs * hidden) + 64);
    if (!g || !u || !ys) {
        free(g); free(u); free(ys);
        return 0;
    }
    /* the 8-bit modes: all gates and ups over the one quantized x (each expert reading its tokens'
     * rows), then all downs, MANY_MAX products per parallel region */
    int64_t gw = 0, uw = 0, dw = 0;
    const int gt = qmm_type_of(gate_fn, hidden, &gw), ut = qmm_type_of(up_fn, hidden, &uw),
              dt = qmm_type_of(down_fn, ffn, &dw);
    int many = act_mode >= 2 && gt >= 0 && ut >= 0 && dt >= 0;
    many_req req[MANY_MAX];
    const int per = MANY_MAX / 2;
    int64_t first = 0; /* the first pair of expert e0 + j */
    for (int e0 = 0; many && e0 < n_exp; e0 += per) {
        const int ne = n_exp - e0 < per ? n_exp - e0 : per;
        for (int j = 0; j < ne; first += count[e0 + j], j++) {
            const int64_t n = count[e0 + j];
            req[2 * j] = (many_req){gt, gate[e0 + j], ffn, hidden, gw, x, n_tok, token + first, n, g + first * ffn, NULL};
            req[2 * j + 1] = (many_req){ut, up[e0 + j], ffn, hidden, uw, x, n_tok, token + first, n, u + first * ffn, NULL};
        }
        many = many_run(2 * ne, req, nth, act_mode >= 3);
    }
    float *h = g; /* silu(g) * u, in place */
    if (many) {
        for (int64_t i = 0; i < n_pairs * ffn; i++) h[i] = silu(g[i]) * u[i];
        int downs = 1;
        first = 0;
        for (int e0 = 0; downs && e0 < n_exp; e0 += MANY_MAX) {
            const int ne = n_exp - e0 < MANY_MAX ? n_exp - e0 : MANY_MAX;
            for (int j = 0; j < ne; first += count[e0 + j], j++) {
                const int64_t n = count[e0 + j];
                req[j] = (many_req){dt, down[e0 + j], hidden, ffn, dw, h + first * ffn, n, NULL, n, ys + first * hidden, NULL};
            }
            downs = many_run(ne, req, nth, act_mode >= 3);
        }
        if (!downs) /* a non-finite h: each down alone */
            for (int64_t e = 0, p = 0; e < n_exp; p += count[e], e++)
                ((qmm_fn)down_fn)((const uint8_t *)down[e], hidden, ffn, h + p * ffn, count[e], ys + p * hidden, nth);
    } else { /* each expert over its tokens' rows, one product at a time */
        float *xs = malloc(sizeof(float) * (size_t)(most * hidden) + 64);
        if (!xs) {
            free(g); free(u); free(ys);
            return 0;
        }
        for (int64_t e = 0, p = 0; e < n_exp; p += count[e], e++) {
            const int64_t n = count[e];
            for (int64_t i = 0; i < n; i++) memcpy(xs + i * hidden, x + token[p + i] * hidden, sizeof(float) * (size_t)hidden);
            float *ge = g + p * ffn, *ue = u + p * ffn;
            ((qmm_fn)gate_fn)((const uint8_t *)gate[e], ffn, hidden, xs, n, ge, nth);
            ((qmm_fn)up_fn)((const uint8_t *)up[e], ffn, hidden, xs, n, ue, nth);
            for (int64_t i = 0; i < n * ffn; i++) ge[i] = silu(ge[i]) * ue[i];
            ((qmm_fn)down_fn)((const uint8_t *)down[e], hidden, ffn, ge, n, ys + p * hidden, nth);
        }
        free(xs);
    }
    for (int64_t q = 0; q < n_pairs; q++) {
        const int64_t p = order[q];
        float *o = out + token[p] * hidden;
        const float *y = ys + p * hidden;
        for (int64_t i = 0; i < hidden; i++) o[i] += w[p] * y[i];
    }
    free(g); free(u); free(ys);
    return 1;
}

/* ------------------------------------------------------------------ the small ops of a decode step
 *
 * Per decode token a layer's rotary embedding and projection groups were dozens of torch
 * operators (SmolLM2: 5,454 per token, 3-5 us each). Each is one call here instead; the rope's
 * arithmetic is torch's, operation for operation (no fused multiply-adds), so results are equal.
 */

/* Rotary embedding of n_tok tokens x n_heads heads of head_dim values (x, y: [n_tok, n_heads,
 * head_dim]); the first rot values rotate by the token's cos/sin ([n_tok, rot / 2]), the rest are
 * copied. interleaved: pairs (2i, 2i+1) (llama.cpp's NORM mode), else halves (i, i + rot/2). */
__attribute__((optimize("fp-contract=off")))
void strata_rope(const float *x, const float *cs, const float *sn, int64_t n_tok, int64_t n_heads,
                 int64_t head_dim, int64_t rot, int interleaved, float *y) {
    const int64_t half = rot / 2;
    for (int64_t t = 0; t < n_tok; t++) {
        const float *c = cs + t * half, *s = sn + t * half;
        for (int64_t h = 0; h < n_heads; h++) {
            const float *a = x + (t * n_heads + h) * head_dim;
            float *b = y + (t * n_heads + h) * head_dim;
            if (interleaved) {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = a[2 * i], x2 = a[2 * i + 1];
                    b[2 * i] = x1 * c[i] - x2 * s[i];
                    b[2 * i + 1] = x2 * c[i] + x1 * s[i];
                }
            } else {
                for (int64_t i = 0; i < half; i++) {
                    const float x1 = a[i], x2 = a[i + half];
                    b[i] = x1 * c[i] - x2 * s[i];
                    b[i + half] = x2 * c[i] + x1 * s[i];
                }
            }
            for (int64_t i = rot; i < head_dim; i++) b[i] = a[i];
        }
    }
}

/* Several products of the same x (a projection group: q/k/v, gate/up): Y_j = X W_j^T by each
 * weight's strata_qmm_* (fns), into out [B, sum rows] with Y_j at column offset sum_{i<j} rows_i,
 * plus bias_j where given: one call from Python instead of one per weight. */
/* strata_qmm_group's products in one parallel region (strata_qmm_many); 0 (nothing written) when
 * it declines them. */
static int group_many(int n, void *const *fns, const void *const *W, const int64_t *rows, int64_t cols,
                      const float *X, int64_t B, const float *const *bias, float *out, int nth) {
    if (n <= 0 || n > MANY_MAX) return 0;
    int types[MANY_MAX];
    int64_t cs[MANY_MAX], wr[MANY_MAX], total = 0;
    const float *Xs[MANY_MAX];
    float *Ys[MANY_MAX];
    for (int j = 0; j < n; j++) {
        types[j] = qmm_type_of(fns[j], cols, &wr[j]);
        if (types[j] < 0) return 0;
        cs[j] = cols;
        Xs[j] = X;
        total += rows[j];
    }
    float *tmp = B == 1 ? NULL : malloc(sizeof(float) * (size_t)(B * total) + 64);
    if (B != 1 && !tmp) return 0;
    for (int64_t j = 0, off = 0; j < n; off += rows[j], j++) Ys[j] = B == 1 ? out + off : tmp + B * off;
    if (!strata_qmm_many(n, types, W, rows, cs, wr, Xs, B, Ys, nth)) {
        free(tmp);
        return 0;
    }
    for (int64_t j = 0, off = 0; j < n; off += rows[j], j++)
        for (int64_t b = 0; b < B; b++) {
            float *dst = out + b * total + off;
            if (B != 1) memcpy(dst, Ys[j] + b * rows[j], sizeof(float) * (size_t)rows[j]);
            if (bias[j])
                for (int64_t i = 0; i < rows[j]; i++) dst[i] += bias[j][i];
        }
    free(tmp);
    return 1;
}

void strata_qmm_group(int n, void *const *fns, const void *const *W, const int64_t *rows, int64_t cols,
                      const float *X, int64_t B, const float *const *bias, float *out, float *scratch, int nth) {
    if (group_many(n, fns, W, rows, cols, X, B, bias, out, nth)) return;
    int64_t total = 0, off = 0;
    for (int j = 0; j < n; j++) total += rows[j];
    for (int j = 0; j < n; j++) {
        float *y = B == 1 ? out + off : scratch;
        ((qmm_fn)fns[j])((const uint8_t *)W[j], rows[j], cols, X, B, y, nth);
        for (int64_t b = 0; b < B; b++) {
            float *dst = out + b * total + off;
            const float *src = B == 1 ? dst : scratch + b * rows[j];
            if (B != 1) memcpy(dst, src, sizeof(float) * (size_t)rows[j]);
            if (bias[j])
                for (int64_t i = 0; i < rows[j]; i++) dst[i] += bias[j][i];
        }
        off += rows[j];
    }
}

/* ------------------------------------------------------------------ gated delta rule, one step
 *
 * One decode token of Gated DeltaNet (strata/kernels/delta_rule.py), per head h of bh, with the
 * state S (dk x dv, float32) updated in place:
 *     S <- d S;  delta = (v - k^T S) beta;  S <- S + k delta^T;  out = q^T S
 * in two passes over S (the decayed state is recomputed, not stored: the same product), where
 * torch needs five over a state tensor 4x the size of L2. Sums over dk run j = 0, 1, ... */
typedef struct {
    float *S;
    const float *src; /* the state read: S itself (in place), or another (S is then written whole) */
    const float *q, *k, *v, *decay, *beta;
    float *out;
    int64_t dk, dv;
} gdn_args;

static void gdn_head(const void *a_, int64_t h) {
    const gdn_args *a = (const gdn_args *)a_;
    const int64_t dk = a->dk, dv = a->dv;
    float *S = a->S + h * dk * dv;
    const float *src = a->src + h * dk * dv;
    const float *q = a->q + h * dk, *k = a->k + h * dk, *v = a->v + h * dv;
    float *out = a->out + h * dv;
    /* A decay under float32's normal range (g < -87: random or strongly forgetting heads) would
     * make every S * d subnormal, ~20x slower on x86; its products are below 1.2e-38 |S| and
     * vanish beside k delta^T, so they are taken as the zero they round to. */
    const float d = a->decay[h] < 1.17549435e-38f ? 0.0f : a->decay[h], beta = a->beta[h];
    float delta[dv];
    for (int64_t c = 0; c < dv; c++) delta[c] = 0.0f;
    for (int64_t j = 0; j < dk; j++) {
        const float kj = k[j];
        const float *row = src + j * dv;
        for (int64_t c = 0; c < dv; c++) delta[c] += kj * (row[c] * d);
    }
    for (int64_t c = 0; c < dv; c++) {
        delta[c] = (v[c] - delta[c]) * beta;
        out[c] = 0.0f;
    }
    for (int64_t j = 0; j < dk; j++) {
        const float kj = k[j], qj = q[j];
        const float *row = src + j * dv;
        float *dst = S + j * dv;
        if (dst == row) /* in place: its own loop, so the compiler needs no overlap check */
            for (int64_t c = 0; c < dv; c++) {
                const float s = dst[c] * d + kj * delta[c];
                dst[c] = s;
                out[c] += qj * s;
            }
        else
            for (int64_t c = 0; c < dv; c++) {
                const float s = row[c] * d + kj * delta[c];
                dst[c] = s;
                out[c] += qj * s;
            }
    }
}

void strata_gdn_step(float *S, const float *q, const float *k, const float *v, const float *decay,
                     const float *beta, float *out, int64_t bh, int64_t dk, int64_t dv, int nth) {
    const gdn_args a = {S, S, q, k, v, decay, beta, out, dk, dv};
    pool_run(gdn_head, &a, bh, nth < 1 ? 1 : nth);
}

/* The same step from the state `src` into `S` (a verify pass keeps the state after each token:
 * one pass writes the next, no copy first); src == S is the in-place step. */
void strata_gdn_step_from(const float *src, float *S, const float *q, const float *k, const float *v,
                          const float *decay, const float *beta, float *out, int64_t bh, int64_t dk, int64_t dv,
                          int nth) {
    const gdn_args a = {S, src, q, k, v, decay, beta, out, dk, dv};
    pool_run(gdn_head, &a, bh, nth < 1 ? 1 : nth);
}

/* ------------------------------------------------------------------ a decode token's layer halves
 *
 * Between a decode layer's products the Python of a llama-style layer (norms, views, rope, the KV
 * write, attention, residual adds: ~25 torch calls and their wrappers) ran on the calling thread
 * alone: ~0.27 ms per SmolLM2 layer, a third of its step, while the helpers slept. These take one
 * token (B = T = 1, float32) through x + attention(norm(x)) and h + ffn(norm(h)) in one call each,
 * the products through the same kernels (strata_qmm_group / the type's strata_qmm_*). */

/* y = w * (x * 1/sqrt(mean(x^2) + eps)), torch's order of operations (a float sum of squares). */
__attribute__((optimize("fp-contract=off")))
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}
void strata_rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) { rms_norm(x, w, n, eps, y); }

void strata_attend_decode(const float *q, const float *kc, const float *vc, int64_t cap, int64_t S, int64_t n_heads,
                          int64_t n_kv, int64_t D, float *scores, float *att, int nth);

/* out = x + W_o attn(rope(norm_q q), rope(norm_k k), v) of one token, with q/k/v = group(norm(x)),
 * k and v written at cache position pos (kc, vc: [n_kv, cap, head_dim]) and all pos + 1 keys
 * attended (scaled dot products, softmax, GQA: query head h reads kv head h / (n_heads / n_kv)).
 * qn_w / kn_w: per-head RMS norms of q and k (NULL: none). gated (Qwen3-Next): the q rows hold,
 * per head, the query then an output gate, and each head's output is scaled by sigmoid(gate)
 * before W_o. 0 (nothing written) when no memory or hidden < 1. */
__attribute__((optimize("fp-contract=off")))
int strata_attn_decode(const float *x, int64_t hidden, const float *norm_w, float eps, void *const *fns,
                       const void *const *W, const int64_t *rows, const float *const *bias, int64_t n_heads,
                       int64_t n_kv, int64_t head_dim, const float *qn_w, const float *kn_w, float qk_eps,
                       const float *cs, const float *sn, int64_t rot, int interleaved, float *kc, float *vc,
                       int64_t cap, int64_t pos, void *o_fn, const void *o_W, int gated, float *out, int nth) {
    if (hidden < 1) return 0; /* never so from the callers; here it lets GCC see xn written */
    const int64_t D = head_dim, nq = n_heads * D, nk = n_kv * D, S = pos + 1, nqg = gated ? 2 * nq : nq;
    float *buf = malloc(sizeof(float) * (size_t)(hidden + nqg + 2 * nk + nq + n_heads * S + hidden + (gated ? nq : 0))
                        + 64);
    if (!buf) return 0;
    float *xn = buf, *qkv = xn + hidden, *k = qkv + nqg, *v = k + nk, *att = v + nk, *p = att + nq, *o = p + n_heads * S,
          *q = gated ? o + hidden : qkv;
    rms_norm(x, norm_w, hidden, eps, xn);
    strata_qmm_group(3, fns, W, rows, hidden, xn, 1, bias, qkv, NULL, nth);
    if (gated) /* [query | gate] per head: the queries together; the gates stay where they are */
        for (int64_t h = 0; h < n_heads; h++) memcpy(q + h * D, qkv + 2 * h * D, sizeof(float) * (size_t)D);
    if (qn_w)
        for (int64_t h = 0; h < n_heads; h++) rms_norm(q + h * D, qn_w, D, qk_eps, q + h * D);
    if (kn_w)
        for (int64_t h = 0; h < n_kv; h++) rms_norm(k + h * D, kn_w, D, qk_eps, k + h * D);
    strata_rope(q, cs, sn, 1, n_heads, D, rot, interleaved, q);
    strata_rope(k, cs, sn, 1, n_kv, D, rot, interleaved, k);
    for (int64_t h = 0; h < n_kv; h++) {
        memcpy(kc + (h * cap + pos) * D, k + h * D, sizeof(float) * (size_t)D);
        memcpy(vc + (h * cap + pos) * D, v + h * D, sizeof(float) * (size_t)D);
    }
    strata_attend_decode(q, kc, vc, cap, S, n_heads, n_kv, D, p, att, nth); /* decode_attention.c */
    if (gated)
        for (int64_t i = 0; i < nq; i++) att[i] = att[i] * (1.0f / (1.0f + expf(-qkv[(2 * (i / D) + 1) * D + i % D])));
    ((qmm_fn)o_fn)((const uint8_t *)o_W, hidden, nq, att, 1, o, nth);
    for (int64_t i = 0; i < hidden; i++) out[i] = x[i] + o[i];
    free(buf);
    return 1;
}

/* out = h + W_down(silu(W_gate n) * W_up n), n = norm(h), of one token; 0 (nothing written) when
 * no memory. */
int strata_ffn_decode(const float *h, int64_t hidden, const float *norm_w, float eps, void *const *fns,
                      const void *const *W, int64_t ffn, void *down_fn, const void *down_W, float *out, int nth) {
    float *buf = malloc(sizeof(float) * (size_t)(2 * hidden + 2 * ffn) + 64);
    if (!buf) return 0;
    float *n = buf, *gu = n + hidden, *y = gu + 2 * ffn;
    const int64_t rows[2] = {ffn, ffn};
    const float *const bias[2] = {NULL, NULL};
    rms_norm(h, norm_w, hidden, eps, n);
    strata_qmm_group(2, fns, W, rows, hidden, n, 1, bias, gu, NULL, nth);
    for (int64_t i = 0; i < ffn; i++) gu[i] = silu(gu[i]) * gu[ffn + i];
    ((qmm_fn)down_fn)((const uint8_t *)down_W, hidden, ffn, gu, 1, y, nth);
    for (int64_t i = 0; i < hidden; i++) out[i] = h[i] + y[i];
    free(buf);
    return 1;
}

/* a . b over n floats in 32 lanes (the router's logits: a scalar sum ran ~0.3 ms per qwen3 layer on
 * the calling thread alone) */
static float dot_f32(const float *a, const float *b, int64_t n) {
    v8f s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 += ldu(a + i) * ldu(b + i);
        s1 += ldu(a + i + 8) * ldu(b + i + 8);
        s2 += ldu(a + i + 16) * ldu(b + i + 16);
        s3 += ldu(a + i + 24) * ldu(b + i + 24);
    }
    float d = hsum8((s0 + s1) + (s2 + s3));
    for (; i < n; i++) d += a[i] * b[i];
    return d;
}

#define ROUTER_TILE 16
typedef struct {
    const float *R, *x;
    int64_t hidden, n_exp;
    float *y;
} router_args;

static void router_tile(const void *a_, int64_t tile) {
    const router_args *a = (const router_args *)a_;
    for (int64_t e = tile * ROUTER_TILE; e < a->n_exp && e < (tile + 1) * ROUTER_TILE; e++)
        a->y[e] = dot_f32(a->R + e * a->hidden, a->x, a->hidden);
}

/* out = h + sum_j w_j expert_j(n), n = norm(h), of one token: router logits R n (R: [n_exp, hidden]
 * float32), softmax, the k largest (ties to the lower index) in descending order, renormalised to
 * sum 1 when `normalize`, then strata_moe_token's products over the stacked experts (expert e's
 * matrices at gate + e * gs, ...). ids_out / w_out receive the choice. 0 (nothing written) when no
 * memory. */
__attribute__((optimize("fp-contract=off")))
int strata_moe_decode(const float *h, int64_t hidden, const float *norm_w, float eps, const float *router,
                      int64_t n_exp, int k, int normalize, const uint8_t *gate, int64_t gs, const uint8_t *up,
                      int64_t us, const uint8_t *down, int64_t ds, void *gate_fn, void *up_fn, void *down_fn,
                      int64_t ffn, void *const *sh_fns, const void *const *sh_W, int64_t sh_ffn,
                      const float *sh_gate, int64_t *ids_out, float *w_out, float *out, int nth) {
    if (k <= 0 || k > n_exp || 2 * k > MANY_MAX) return 0;
    float *buf = malloc(sizeof(float) * (size_t)(2 * hidden + n_exp) + (size_t)n_exp + 64);
    if (!buf) return 0;
    float *n = buf, *y = n + hidden, *p = y + hidden;
    uint8_t *taken = (uint8_t *)(p + n_exp); /* chosen marks (a scan of the k chosen per expert: 51k steps a qwen3-next layer) */
    memset(taken, 0, (size_t)n_exp);
    rms_norm(h, norm_w, hidden, eps, n);
    const router_args ra = {router, n, hidden, n_exp, p};
    pool_tag = 2;
    pool_info = n_exp;
    pool_bytes = n_exp * hidden * 4;
    pool_run(router_tile, &ra, (n_exp + ROUTER_TILE - 1) / ROUTER_TILE, parallel_threads(n_exp * hidden * 4, nth));
    float m = -INFINITY;
    for (int64_t e = 0; e < n_exp; e++)
        if (p[e] > m) m = p[e];
    float sum = 0.0f;
    for (int64_t e = 0; e < n_exp; e++) {
        p[e] = expf(p[e] - m);
        sum += p[e];
    }
    for (int64_t e = 0; e < n_exp; e++) p[e] = p[e] / sum;
    const void *G[MANY_MAX], *U[MANY_MAX], *Dn[MANY_MAX];
    float wsum = 0.0f;
    for (int j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < n_exp; e++)
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        taken[best] = 1;
        ids_out[j] = best;
        w_out[j] = p[best];
        wsum += p[best];
        G[j] = gate + best * gs;
        U[j] = up + best * us;
        Dn[j] = down + best * ds;
    }
    if (normalize)
        for (int j = 0; j < k; j++) w_out[j] = w_out[j] / wsum;
    float *scratch = malloc(sizeof(float) * (size_t)(3 * ffn + hidden) + 64);
    if (!scratch) {
        free(buf);
        return 0;
    }
    for (int64_t i = 0; i < hidden; i++) y[i] = 0.0f;
    float *sh = sh_ffn > 0 ? malloc(sizeof(float) * (size_t)(2 * sh_ffn + hidden) + 64) : NULL;
    if (sh_ffn > 0 && !sh) {
        free(scratch);
        free(buf);
        return 0;
    }
    float *s = sh ? sh + 2 * sh_ffn : NULL;
    /* the routed experts, and the shared one in the same parallel regions where it can */
    const int together = sh_ffn > 0 && moe_token_many(G, U, Dn, w_out, k, gate_fn, up_fn, down_fn, hidden, ffn, n, y,
                                                      nth, sh_fns, sh_W, sh_ffn, s);
    if (!together) strata_moe_token(G, U, Dn, w_out, k, gate_fn, up_fn, down_fn, hidden, ffn, n, y, scratch, nth);
    if (sh_ffn > 0) { /* the shared expert: y + sigmoid(g . n) * down(silu(gate n) * up n) */
        if (!together) {
            const int64_t rows[2] = {sh_ffn, sh_ffn};
            const float *const bias[2] = {NULL, NULL};
            strata_qmm_group(2, sh_fns, sh_W, rows, hidden, n, 1, bias, sh, NULL, nth);
            for (int64_t i = 0; i < sh_ffn; i++) sh[i] = silu(sh[i]) * sh[sh_ffn + i];
            ((qmm_fn)sh_fns[2])((const uint8_t *)sh_W[2], hidden, sh_ffn, sh, 1, s, nth);
        }
        if (sh_gate) {
            float d = 0.0f;
            for (int64_t i = 0; i < hidden; i++) d += n[i] * sh_gate[i];
            const float sg = 1.0f / (1.0f + expf(-d));
            for (int64_t i = 0; i < hidden; i++) s[i] = sg * s[i];
        }
        for (int64_t i = 0; i < hidden; i++) y[i] = y[i] + s[i];
        free(sh);
    }
    for (int64_t i = 0; i < hidden; i++) out[i] = h[i] + y[i];
    free(scratch);
    free(buf);
    return 1;
}

/* ------------------------------------------------------------------ float16 weights
 *
 * Y (B x rows, float32) = X (B x cols, float32) W^T for a float16 W (strata/kernels/f16.py): each
 * weight widened to float32 as it is read, products and sums in float32, x never rounded to
 * float16. Each (row of W, row of X) dot product is taken alone, so a row's result does not
 * depend on the other rows of the batch (a verify pass's first position equals a decode step). */
/* dots[j] = w . x[j] for nb <= F16_NB rows of x sharing one pass over w (each weight widened
 * once); every x[j] is summed in the same order as it would be alone. */
#define F16_NB 4
/* The weight bytes asked for this far ahead of the ones read (one line per 64 bytes read): a
 * decode step's products (qwen4exp's hyper-connections, 1.2 GB a token) stream each weight once,
 * and the hardware prefetcher alone left one core at 2.5-4 GB/s where 8 KiB ahead gave 4.3-6.1
 * (a scratch A/B on this kind of machine, 320x10240 and 10240x320, loaded). Prefetches past the
 * matrix's end are harmless (never a fault). */
#define F16_AHEAD 8192
static inline void dot_f16_f32(const uint16_t *w, const float *const *x, int nb, int64_t n, float *dots) {
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 a0[F16_NB], a1[F16_NB];
    for (int j = 0; j < nb; j++) a0[j] = a1[j] = _mm512_setzero_ps();
    for (; i + 32 <= n; i += 32) {
        __builtin_prefetch((const char *)(w + i) + F16_AHEAD, 0, 2);
        const __m512 w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i)));
        const __m512 w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i + 16)));
        for (int j = 0; j < nb; j++) {
            a0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[j] + i), a0[j]);
            a1[j] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x[j] + i + 16), a1[j]);
        }
    }
    for (; i + 16 <= n; i += 16) {
        const __m512 w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i)));
        for (int j = 0; j < nb; j++) a0[j] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x[j] + i), a0[j]);
    }
    for (int j = 0; j < nb; j++) dots[j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[j], a1[j]));
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
    __m256 a0[F16_NB], a1[F16_NB];
    for (int j = 0; j < nb; j++) a0[j] = a1[j] = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        if (!(i & 31)) __builtin_prefetch((const char *)(w + i) + F16_AHEAD, 0, 2);
        const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i)));
        const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + i + 8)));
        for (int j = 0; j < nb; j++) {
            a0[j] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[j] + i), a0[j]);
            a1[j] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[j] + i + 8), a1[j]);
        }
    }
    for (int j = 0; j < nb; j++) {
        const __m256 a = _mm256_add_ps(a0[j], a1[j]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        dots[j] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
#else
    for (int j = 0; j < nb; j++) dots[j] = 0.0f;
#endif
    for (int j = 0; j < nb; j++)
        for (int64_t k = i; k < n; k++) dots[j] += f16_to_f32(w[k]) * x[j][k];
}

typedef struct {
    const uint16_t *W;
    int64_t rows, cols, B, tile_rows;
    const float *X;
    float *Y;
} f16_args;

static void tile_f16(const void *a_, int64_t tile) {
    const f16_args *a = (const f16_args *)a_;
    const int64_t t0 = tile * a->tile_rows;
    const int64_t t1 = t0 + a->tile_rows < a->rows ? t0 + a->tile_rows : a->rows;
    for (int64_t b0 = 0; b0 < a->B; b0 += F16_NB) {
        const int nb = a->B - b0 < F16_NB ? (int)(a->B - b0) : F16_NB;
        const float *x[F16_NB];
        float dots[F16_NB];
        for (int j = 0; j < nb; j++) x[j] = a->X + (b0 + j) * a->cols;
        for (int64_t r = t0; r < t1; r++) {
            dot_f16_f32(a->W + r * a->cols, x, nb, a->cols, dots);
            for (int j = 0; j < nb; j++) a->Y[(b0 + j) * a->rows + r] = dots[j];
        }
    }
}

void strata_f16mm(const uint16_t *W, int64_t rows, int64_t cols, const float *X, int64_t B, float *Y, int nth) {
    int64_t tile_rows = ROW_TILE * 4;
    while ((rows + tile_rows - 1) / tile_rows > 0xFFFF) tile_rows *= 2;
    /* few long rows (a hyper-connection's down, 320 x 10240: 5 tiles of 64) split into smaller
     * tiles, so two threads share them evenly */
    while (tile_rows > 4 && (rows + tile_rows - 1) / tile_rows < 8 * (int64_t)(nth < 1 ? 1 : nth)) tile_rows /= 2;
    const f16_args a = {W, rows, cols, B, tile_rows, X, Y};
    pool_run(tile_f16, &a, (rows + tile_rows - 1) / tile_rows, nth < 1 ? 1 : nth);
}

int strata_abi_version(void) { return 10; }
