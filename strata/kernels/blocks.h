/* The ggml block fields that qmm.c (decode products) and prefill.c (prompt products) both decode,
 * written once: f16, e8m0 and IQ1_M's block scales, the packed 6-bit scales of Q3_K and of Q4_K / Q5_K, IQ4_XS's
 * sub-block scales, the 16-value tables of IQ4_NL and MXFP4, and the IQ codebooks.
 *
 * The codebooks are filled at load time from gguf-py (strata_init_tables / strata_init_tables_iq in
 * qmm.c, which defines them); they are hidden symbols, shared by the library's files only.
 * Field layouts: strata/quant and gguf-py. Everything here is integer or exact, so every user keeps
 * the arithmetic it had with its own copy.
 */
#ifndef STRATA_BLOCKS_H
#define STRATA_BLOCKS_H

#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------ scalars */

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: renormalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

static inline float rd_f16(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return f16_to_f32(h); }
static inline uint16_t rd_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* IQ1_M's block scale: an f16 in the top nibbles of its 4 scale words (b + 48). */
static inline float iq1m_d(const uint8_t *b) {
    uint16_t s[4];
    memcpy(s, b + 48, 8);
    return f16_to_f32((uint16_t)((s[0] >> 12) | ((s[1] >> 8) & 0x00F0) | ((s[2] >> 4) & 0x0F00) | (s[3] & 0xF000)));
}

/* MXFP4's e8m0 scale 2^(e - 127), halved (the E2M1 table below holds the values doubled). */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ------------------------------------------------------------------ packed scales */

/* Q4_K / Q5_K: the 8 six-bit scales and the 8 six-bit mins of the 12 scale bytes, four at a time
 * in u32 lanes; byte k of *sc (*mn) belongs to 32-value sub-block k. */
static inline void k4_scales_mins(const uint8_t *q, uint64_t *sc, uint64_t *mn) {
    const uint32_t u0 = rd_u32(q), u1 = rd_u32(q + 4), u2 = rd_u32(q + 8);
    const uint32_t s_lo = u0 & 0x3F3F3F3Fu, m_lo = u1 & 0x3F3F3F3Fu;
    const uint32_t s_hi = (u2 & 0x0F0F0F0Fu) | (((u0 >> 6) & 0x03030303u) << 4);
    const uint32_t m_hi = ((u2 >> 4) & 0x0F0F0F0Fu) | (((u1 >> 6) & 0x03030303u) << 4);
    *sc = (uint64_t)s_lo | ((uint64_t)s_hi << 32);
    *mn = (uint64_t)m_lo | ((uint64_t)m_hi << 32);
}

/* The same as bytes: sc[k], mn[k] of sub-block k. */
static inline void scale_min_k4(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    uint64_t a, b;
    k4_scales_mins(s, &a, &b);
    for (int k = 0; k < 8; k++) {
        sc[k] = (uint8_t)(a >> (8 * k));
        mn[k] = (uint8_t)(b >> (8 * k));
    }
}

/* Q3_K: the 16 six-bit scales of the 12 scale bytes, unsigned (the stored value; the scale is
 * that minus 32), four at a time in u32 lanes: byte j of s4[k / 4] belongs to 16-value sub-block k
 * = 4 (k / 4) + j. Low 4 bits from byte k (k < 8) or k - 8's high nibble, high 2 bits from byte
 * 8 + k % 4 at bit 2 (k / 4). */
static inline void q3k_scales_u32(const uint8_t *s, uint32_t s4[4]) {
    const uint32_t a0 = rd_u32(s), a1 = rd_u32(s + 4), t = rd_u32(s + 8);
    const uint32_t k4 = 0x0F0F0F0Fu, k2 = 0x03030303u;
    s4[0] = (a0 & k4) | ((t & k2) << 4);
    s4[1] = (a1 & k4) | (((t >> 2) & k2) << 4);
    s4[2] = ((a0 >> 4) & k4) | (((t >> 4) & k2) << 4);
    s4[3] = ((a1 >> 4) & k4) | (((t >> 6) & k2) << 4);
}

/* Q3_K's signed scale of 16-value sub-block k from q3k_scales_u32's lanes. */
static inline int q3k_scale(const uint32_t s4[4], int k) { return (int)((s4[k / 4] >> (8 * (k % 4))) & 0xFF) - 32; }

/* Q3_K {hmask[32]; qs[64]; scales[12]; f16 d} at b: d times each 16-value sub-block's scale. */
static inline void q3k_sub_scales(const uint8_t *b, float dl[16]) {
    const float d = rd_f16(b + 108);
    uint32_t s4[4];
    q3k_scales_u32(b + 96, s4);
    for (int k = 0; k < 16; k++) dl[k] = d * (float)q3k_scale(s4, k);
}

/* IQ4_XS {f16 d; u16 scales_h; u8 scales_l[4]; ...}: the signed scale of 32-value sub-block j,
 * (4 low bits | 2 high bits << 4) - 32. */
static inline int iq4xs_scale(const uint8_t *b, int j) {
    return (int)(((b[4 + j / 2] >> (4 * (j & 1))) & 0xF) | (((rd_u16(b + 2) >> (2 * j)) & 3) << 4)) - 32;
}

/* ------------------------------------------------------------------ 16-value tables */

typedef int8_t v16i8 __attribute__((vector_size(16)));

/* IQ4_NL's (and IQ4_XS's) 16 signed values, and MXFP4's E2M1 values doubled to integers. */
static const v16i8 IQ4_NL_I8 = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const v16i8 E2M1_I8 = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ------------------------------------------------------------------ codebooks (defined in qmm.c) */

#define STRATA_SHARED extern __attribute__((visibility("hidden")))
STRATA_SHARED uint8_t GRID_IQ2_XXS[256][8];
STRATA_SHARED uint8_t GRID_IQ2_XS[512][8];
STRATA_SHARED uint8_t GRID_IQ3_XXS[256][4];
/* ksigns_iq2xs as 8 floats / 8 int16 of +-1 per 7-bit index, and as 7 sign bits + their parity */
STRATA_SHARED float KSIGNS[128][8] __attribute__((aligned(32)));
STRATA_SHARED int16_t KSIGNS16[128][8] __attribute__((aligned(16)));
STRATA_SHARED uint8_t KSIGNS8[128];
/* IQ1_S / IQ1_M (values in {-1, 0, 1} kept times 8, so that 8 * grid + delta is one int8), IQ2_S, IQ3_S */
STRATA_SHARED int8_t GRID_IQ1_S8[2048][8] __attribute__((aligned(64)));
STRATA_SHARED uint8_t GRID_IQ2_S[1024][8] __attribute__((aligned(64)));
STRATA_SHARED uint8_t GRID_IQ3_S[512][4] __attribute__((aligned(64)));
#undef STRATA_SHARED

#endif
