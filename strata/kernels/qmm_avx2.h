/* One-pass q8x2 kernels in 256-bit registers, for CPUs without AVX-512 VNNI (qmm.c's own).
 *
 * qmm.c includes this file twice, inside `#pragma GCC target` regions: once for AVX2 + FMA +
 * F16C (V2 names end in _avx2, VNNI 0) and once adding AVX-VNNI (_vnni, VNNI 1), so both exist
 * whatever -march the library is built with, and qmm.c picks one at run time from cpuid.
 *
 * Every kernel unpacks each 32 weights once into magnitudes (u8) and signs, gives both 8-bit
 * activations (x's value and its residual, ggml's q8_K / q8_0 / q8_1 blocks, values in
 * [-127, 127]) the weights' signs (vpsignb), and takes vpmaddubsw (two products per int16 lane,
 * at most 2 * 128 * 127: no saturation) then vpmaddwd by the 16-value scales. With AVX-VNNI,
 * vpdpbusd takes four products per int32 lane and vpdpwssd the scales where a lane's sum stays
 * under 2^15 (|w| <= 63), and unscaled 32-value blocks take vpdpbusd alone. The integer sums are
 * exact, as in ggml's vec_dot; only the order of the float additions differs from its passes.
 * The 32-value block types (Q4_0 to Q8_0, IQ4_NL, MXFP4) take x in 16-bit integers instead, one
 * vpmaddwd pass as close to the exact product as the two 8-bit ones (see their section below).
 */

/* 8 x int32 += (mag . sx) per 4 or 2 values times the 16-value scales sc (SC16 below). */
static inline __attribute__((always_inline)) __m256i V2(dot_sc)(__m256i acc, __m256i mag, __m256i sx, __m256i sc,
                                                               const int big) {
#if VNNI
    if (!big) return _mm256_dpwssd_avx_epi32(acc, _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), mag, sx), sc);
#endif
    (void)big;
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(mag, sx), sc));
}

/* The scales of values 0-15 and 16-31 of a 32-value chunk, as V2(dot_sc) takes them. */
static inline __attribute__((always_inline)) __m256i V2(sc16)(int s0, int s1, const int big) {
#if VNNI
    if (!big) return _mm256_setr_m128i(_mm_set1_epi32(s0 & 0xFFFF), _mm_set1_epi32(s1 & 0xFFFF)); /* high halves 0 */
#endif
    (void)big;
    return _mm256_setr_m128i(_mm_set1_epi16((short)s0), _mm_set1_epi16((short)s1));
}

/* 8 x int32 sums of 4 products mag . sx (unscaled). */
static inline __attribute__((always_inline)) __m256i V2(dot_u)(__m256i mag, __m256i sx) {
#if VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), mag, sx);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(mag, sx), _mm256_set1_epi16(1));
#endif
}

static inline __attribute__((always_inline)) float V2(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 sign bytes (+1 / -1) from 32 sign bits (bit m of byte k: value 8k + m). */
static inline __attribute__((always_inline)) __m256i V2(signs32)(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i s = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), bit);
    return _mm256_or_si256(_mm256_cmpeq_epi8(s, bit), _mm256_set1_epi8(1));
}

/* 32 bytes 0 / 0xFF from 32 bits (bit l: byte l). */
static inline __attribute__((always_inline)) __m256i V2(bits32)(uint32_t bits) {
    return _mm256_cmpeq_epi8(_mm256_or_si256(V2(signs32)(bits), _mm256_set1_epi8(1)), _mm256_set1_epi8(-1));
}

/* 32 nibbles of 16 bytes: values 0-15 the low nibbles, 16-31 the high ones. */
static inline __attribute__((always_inline)) __m256i V2(nibbles32)(const uint8_t *q) {
    const __m128i v = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(15);
    return _mm256_setr_m128i(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
}

/* ------------------------------------------------------------------ 256-value blocks x q8_K */

#ifndef QMM_AVX2_KINDS
#define QMM_AVX2_KINDS
enum { K_Q2, K_Q3, K_Q4, K_Q5, K_Q6, K_IQ2XXS, K_IQ2XS, K_IQ2S, K_IQ3XXS, K_IQ3S, K_IQ4XS, K_IQ1S, K_IQ1M }; /* K_IQ2XS: its own kernel below */
enum { B_Q8_0, B_Q4_0, B_Q5_0, B_IQ4NL, B_MXFP4, B_Q4_1, B_Q5_1 };
#endif

/* The 256-value types' block loops (`kind` is a constant in each caller): per block its scales
 * (V2(k256_scales)), then chunk j (values 32j..32j+31) unpacked to magnitudes and signs
 * (V2(k256_chunk)), both activations' dot products scaled by the chunk's 16-value scales sc[2j],
 * sc[2j+1] (V2(k256_dot)); K-quant mins through the activations' bsums (V2(k256_sum)). The one-row
 * kernel (V2(dot2_k256)) and the multi-row one (V2(dot2m_k256)) share these, so a row's
 * arithmetic is the same in both. */
static const int V2(K256_TS)[] = {84, 110, 144, 176, 210, 66, 74, 82, 98, 110, 136, 50, 56};

/* Block b's d (returned), dmin (K-quants), its scales and K-quant mins per 16 values m16 (int16).
 * The scales: Q4_K / Q5_K in scb, byte j the scale of values 32j..32j+31 (both lanes); Q2_K, Q3_K and
 * Q6_K in scb as int16, the even sub-blocks' in the low lane and the odd ones' in the high lane, so
 * that chunk j's two are one vpshufb of it (V2(k256_scale)), where two GPR moves and broadcasts a
 * chunk cost as much as its products (ns a 256-value block, 1 thread, 3 alternating runs: Q6_K
 * 45.6-46.5 -> 40.3-42.7, Q3_K 50.2-54.3 -> 44.0-45.3); the IQ types, whose scales are computed one
 * by one, in sc[16] (packing those 16 ints into a vector cost more than the broadcasts it saved). */
static inline __attribute__((always_inline)) float V2(k256_scales)(const uint8_t *b, const int kind, float *dmin_,
                                                                  int *sc, __m256i *scb_, __m256i *m16_) {
    float d, dmin = 0.0f;
    __m256i scb = _mm256_setzero_si256();
    __m256i m16 = _mm256_setzero_si256();
    __m128i s8 = _mm_setzero_si128(); /* Q2_K, Q3_K, Q6_K: 16-value sub-block k's scale in byte k (int8) */
    if (kind == K_Q2) {
        d = rd_f16(b + 80);
        dmin = rd_f16(b + 82);
        const __m128i raw = _mm_loadu_si128((const __m128i *)b);
        s8 = _mm_and_si128(raw, _mm_set1_epi8(15));
        m16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15)));
    } else if (kind == K_Q3) {
        d = rd_f16(b + 108);
        uint32_t s4[4];
        q3k_scales_u32(b + 96, s4);
        s8 = _mm_sub_epi8(_mm_setr_epi32((int)s4[0], (int)s4[1], (int)s4[2], (int)s4[3]), _mm_set1_epi8(32));
        m16 = _mm256_cvtepi8_epi16(s8);
        dmin = 4.0f * d;
    } else if (kind == K_Q4 || kind == K_Q5) {
        d = rd_f16(b);
        dmin = rd_f16(b + 2);
        uint64_t s8q, n8;
        k4_scales_mins(b + 4, &s8q, &n8);
        scb = _mm256_broadcastsi128_si256(_mm_cvtsi64_si128((long long)s8q));
        m16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_cvtsi64_si128((long long)n8),
                                                    _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)));
    } else if (kind == K_Q6) {
        d = rd_f16(b + 208);
        s8 = _mm_loadu_si128((const __m128i *)(b + 192));
        m16 = _mm256_cvtepi8_epi16(s8);
        dmin = 32.0f * d;
    } else {
        if (kind == K_IQ2XXS || kind == K_IQ3XXS) {
            d = rd_f16(b);
            const uint8_t *sg = b + (kind == K_IQ2XXS ? 2 + 4 : 66);
            const int stride = kind == K_IQ2XXS ? 8 : 4;
            for (int g = 0; g < 8; g++) sc[2 * g] = sc[2 * g + 1] = 2 * (int)(rd_u32(sg + stride * g) >> 28) + 1;
        } else if (kind == K_IQ2S) {
            d = rd_f16(b);
            const uint8_t *s = b + 74;
            for (int g = 0; g < 8; g++) { sc[2 * g] = 2 * (s[g] & 15) + 1; sc[2 * g + 1] = 2 * (s[g] >> 4) + 1; }
        } else if (kind == K_IQ3S) {
            d = rd_f16(b);
            for (int g = 0; g < 8; g++) sc[2 * g] = sc[2 * g + 1] = 2 * ((b[106 + g / 2] >> (4 * (g % 2))) & 15) + 1;
        } else if (kind == K_IQ4XS) {
            d = rd_f16(b);
            for (int g = 0; g < 8; g++) sc[2 * g] = sc[2 * g + 1] = iq4xs_scale(b, g);
        } else if (kind == K_IQ1S) {
            d = rd_f16(b);
            for (int g = 0; g < 8; g++) sc[2 * g] = sc[2 * g + 1] = 2 * ((rd_u16(b + 34 + 2 * g) >> 12) & 7) + 1;
        } else { /* K_IQ1M: the f16 scale in the top nibbles of the 4 scale words */
            d = iq1m_d(b);
            for (int k = 0; k < 16; k++) sc[k] = 2 * ((rd_u16(b + 48 + 2 * (k / 4)) >> (3 * (k % 4))) & 7) + 1;
        }
    }
    if (kind == K_Q2 || kind == K_Q3 || kind == K_Q6) /* even sub-blocks' scales to the low lane, odd ones' to the high */
        scb = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
    *dmin_ = dmin;
    *scb_ = scb;
    *m16_ = m16;
    return d;
}

/* Chunk j's 16-value scales as V2(dot_sc) takes them (V2(sc16)'s layout). */
static inline __attribute__((always_inline)) __m256i V2(k256_scale)(const int j, const int kind, const int *sc,
                                                                   __m256i scb, const int big) {
    if (kind == K_Q4 || kind == K_Q5) { /* byte j, zero-extended */
#if VNNI
        return _mm256_shuffle_epi8(scb, _mm256_set1_epi32(j | ~0xFF));
#else
        return _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short)(j | ~0xFF)));
#endif
    }
    if (kind == K_Q2 || kind == K_Q3 || kind == K_Q6) { /* int16 j of each lane: sub-blocks 2j (low), 2j + 1 (high) */
#if VNNI
        return _mm256_shuffle_epi8(scb, _mm256_set1_epi32((2 * j) | (2 * j + 1) << 8 | ~0xFFFF));
#else
        return _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short)((2 * j) | (2 * j + 1) << 8)));
#endif
    }
    return V2(sc16)(sc[2 * j], sc[2 * j + 1], big);
}

/* Chunk j of block b: magnitudes (u8) in *mag_ and, where the weights are signed (returns 1), their
 * signs in *sgn_ (returns 0: the weights are unsigned, mag alone). */
static inline __attribute__((always_inline)) int V2(k256_chunk)(const uint8_t *b, const int j, const int kind,
                                                               __m256i *mag_, __m256i *sgn_) {
    const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(15);
    __m256i mag, sgn = _mm256_setzero_si256();
    int signed_w = 1;
    if (kind == K_Q2) {
        mag = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (j / 4))), 2 * (j % 4)), m3);
        signed_w = 0;
    } else if (kind == K_Q3) { /* q + 4 where the hmask bit is set (the 4 off through the mins) */
        const __m256i q = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 32 + 32 * (j / 4))), 2 * (j % 4)), m3);
        const __m256i hbit = _mm256_set1_epi8((char)(1 << j));
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)b), hbit), hbit);
        mag = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(4)));
        signed_w = 0;
    } else if (kind == K_Q4 || kind == K_Q5) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(b + (kind == K_Q5 ? 48 : 16) + 32 * (j / 2)));
        mag = _mm256_and_si256(_mm256_srli_epi16(raw, 4 * (j % 2)), m4);
        if (kind == K_Q5) { /* bit j of each qh byte to bit 4: a 16-bit shift keeps it in its byte */
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
            const __m256i h = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
            mag = _mm256_or_si256(mag, _mm256_and_si256(h, _mm256_set1_epi8(16)));
        }
        signed_w = 0;
    } else if (kind == K_Q6) { /* half h = j / 4, quarter q = j % 4 */
        const int h = j / 4, q = j % 4;
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (q & 1))), 4 * (q >> 1)), m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h)), 2 * q), m3);
        mag = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)); /* 0..63; the 32 off through the mins */
        signed_w = 0;
    } else if (kind == K_IQ2XXS) {
        const uint8_t *g = b + 2 + 8 * j;
        const uint32_t s = rd_u32(g + 4);
        uint64_t e[4];
        for (int k = 0; k < 4; k++) memcpy(&e[k], GRID_IQ2_XXS[g[k]], 8);
        mag = _mm256_setr_epi64x((long long)e[0], (long long)e[1], (long long)e[2], (long long)e[3]);
        sgn = V2(signs32)((uint32_t)KSIGNS8[s & 127] | (uint32_t)KSIGNS8[(s >> 7) & 127] << 8 |
                          (uint32_t)KSIGNS8[(s >> 14) & 127] << 16 | (uint32_t)KSIGNS8[(s >> 21) & 127] << 24);
    } else if (kind == K_IQ2S) {
        uint64_t e[4];
        for (int k = 0; k < 4; k++) memcpy(&e[k], GRID_IQ2_S[b[2 + 4 * j + k] | ((b[66 + j] << (8 - 2 * k)) & 0x300)], 8);
        mag = _mm256_setr_epi64x((long long)e[0], (long long)e[1], (long long)e[2], (long long)e[3]);
        sgn = V2(signs32)(rd_u32(b + 34 + 4 * j));
    } else if (kind == K_IQ3XXS || kind == K_IQ3S) {
        uint32_t e[8];
        for (int k = 0; k < 8; k++) {
            if (kind == K_IQ3XXS) memcpy(&e[k], GRID_IQ3_XXS[b[2 + 8 * j + k]], 4);
            else memcpy(&e[k], GRID_IQ3_S[b[2 + 8 * j + k] | (((b[66 + j] >> k) & 1) << 8)], 4);
        }
        mag = _mm256_setr_epi32((int)e[0], (int)e[1], (int)e[2], (int)e[3], (int)e[4], (int)e[5], (int)e[6], (int)e[7]);
        if (kind == K_IQ3XXS) {
            const uint32_t s = rd_u32(b + 66 + 4 * j);
            sgn = V2(signs32)((uint32_t)KSIGNS8[s & 127] | (uint32_t)KSIGNS8[(s >> 7) & 127] << 8 |
                              (uint32_t)KSIGNS8[(s >> 14) & 127] << 16 | (uint32_t)KSIGNS8[(s >> 21) & 127] << 24);
        } else {
            sgn = V2(signs32)(rd_u32(b + 74 + 4 * j));
        }
    } else if (kind == K_IQ4XS) {
        const __m256i table = _mm256_broadcastsi128_si256((__m128i)IQ4_NL_I8);
        sgn = _mm256_shuffle_epi8(table, V2(nibbles32)(b + 8 + 16 * j));
        mag = _mm256_abs_epi8(sgn);
    } else { /* IQ1_S / IQ1_M: 8 * grid + shift */
        uint64_t e[4];
        __m256i delta;
        if (kind == K_IQ1S) {
            const uint16_t h = rd_u16(b + 34 + 2 * j);
            for (int k = 0; k < 4; k++) memcpy(&e[k], GRID_IQ1_S8[b[2 + 4 * j + k] | (((h >> (3 * k)) & 7) << 8)], 8);
            delta = _mm256_set1_epi8(h & 0x8000 ? -1 : 1);
        } else { /* nibble k of qh's two bytes: index bits 8-10, and bit 3 the shift's sign */
            const uint32_t h = rd_u16(b + 32 + 2 * j);
            for (int k = 0; k < 4; k++) memcpy(&e[k], GRID_IQ1_S8[b[4 * j + k] | (((h >> (4 * k)) & 7) << 8)], 8);
            const uint32_t neg = ((h >> 3) & 1) | ((h >> 7) & 1) << 8 | ((h >> 11) & 1) << 16 | ((h >> 15) & 1) << 24;
            delta = V2(signs32)(neg * 0xFFu); /* byte k all ones: entry k's 8 values -1 */
        }
        sgn = _mm256_add_epi8(_mm256_setr_epi64x((long long)e[0], (long long)e[1], (long long)e[2], (long long)e[3]), delta);
        mag = _mm256_abs_epi8(sgn);
    }
    *mag_ = mag;
    *sgn_ = sgn;
    return signed_w;
}

/* Chunk j's products with both activations of a row (yq, yr: its q8_K blocks of this block), scaled
 * by s (V2(sc16)), added to sq and sr. */
static inline __attribute__((always_inline)) void V2(k256_dot)(__m256i *sq, __m256i *sr, __m256i mag, __m256i sgn,
                                                              const int signed_w, __m256i s, const uint8_t *yq,
                                                              const uint8_t *yr, const int j, const int big) {
    __m256i xqv = _mm256_loadu_si256((const __m256i *)(yq + 4 + 32 * j));
    __m256i xrv = _mm256_loadu_si256((const __m256i *)(yr + 4 + 32 * j));
    if (signed_w) {
        xqv = _mm256_sign_epi8(xqv, sgn);
        xrv = _mm256_sign_epi8(xrv, sgn);
    }
    *sq = V2(dot_sc)(*sq, mag, xqv, s, big);
    *sr = V2(dot_sc)(*sr, mag, xrv, s, big);
    __asm__("" : "+x"(*sq), "+x"(*sr)); /* one chain each: GCC's reassociated sums spilled */
}

/* A row's block sums sq, sr into its accumulators, and the mins through the bsums: Q2_K, Q4_K,
 * Q5_K's own, and Q3_K's / Q6_K's offsets (4 and 32 times the sub-block scale), so that their
 * weights stay unsigned (no vpsignb). */
static inline __attribute__((always_inline)) void V2(k256_sum)(__m256 *acc, __m256 *accm, __m256i sq, __m256i sr,
                                                              float d, float dmin, __m256i m16, const uint8_t *yq,
                                                              const uint8_t *yr, const int has_mins) {
    float dq, dr;
    memcpy(&dq, yq, 4);
    memcpy(&dr, yr, 4);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sq), _mm256_set1_ps(d * dq), *acc);
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sr), _mm256_set1_ps(d * dr), *acc);
    if (has_mins) {
        const __m256i bq = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(yq + 260)), m16);
        const __m256i br = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(yr + 260)), m16);
        *accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bq), _mm256_set1_ps(dmin * dq), *accm);
        *accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(br), _mm256_set1_ps(dmin * dr), *accm);
    }
}

/* A row's result from its accumulators. */
static inline __attribute__((always_inline)) float V2(k256_result)(__m256 acc, __m256 accm, const int kind) {
    const int has_mins = kind <= K_Q6;
    const float f = kind == K_IQ2XXS || kind == K_IQ2S || kind == K_IQ1S || kind == K_IQ1M ? 0.125f
                    : kind == K_IQ3XXS ? 0.25f : 1.0f;
    return f * V2(hsum)(acc) - (has_mins ? V2(hsum)(accm) : 0.0f);
}

/* One weight row against one row of activations (xq, xr: its q8_K blocks). */
static inline __attribute__((always_inline)) float V2(dot2_k256)(int64_t n, const uint8_t *w, const uint8_t *xq,
                                                                const uint8_t *xr, const int kind) {
    const int big = kind == K_IQ4XS, has_mins = kind <= K_Q6;
    const int ts = V2(K256_TS)[kind];
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *b = w + i * ts, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, ts);
        float dmin;
        int sc[16];
        __m256i scb, m16;
        const float d = V2(k256_scales)(b, kind, &dmin, sc, &scb, &m16);
        __m256i sq = _mm256_setzero_si256(), sr = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i mag, sgn;
            const int signed_w = V2(k256_chunk)(b, j, kind, &mag, &sgn);
            V2(k256_dot)(&sq, &sr, mag, sgn, signed_w, V2(k256_scale)(j, kind, sc, scb, big), yq, yr, j, big);
        }
        V2(k256_sum)(&acc, &accm, sq, sr, d, dmin, m16, yq, yr, has_mins);
    }
    return V2(k256_result)(acc, accm, kind);
}

/* nr <= DOT2M_ROWS rows of activations (row r at xq + xoff[r], xr + xoff[r]) against one weight row
 * into y[0..nr): each block's scales and chunks unpacked once for all rows, then every row's
 * products, each row's arithmetic that of V2(dot2_k256) (so each result equals its one-row one). */
static inline __attribute__((always_inline)) void V2(dot2m_k256)(int64_t n, const uint8_t *w, const uint8_t *xq,
                                                                const uint8_t *xr, const int64_t *xoff, int nr,
                                                                float *y, const int kind) {
    const int big = kind == K_IQ4XS, has_mins = kind <= K_Q6;
    const int ts = V2(K256_TS)[kind];
    __m256 acc[DOT2M_ROWS], accm[DOT2M_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *b = w + i * ts;
        stream_prefetch(b, ts);
        float dmin;
        int sc[16];
        __m256i scb, m16, mag[8], sgn[8], s[8];
        const float d = V2(k256_scales)(b, kind, &dmin, sc, &scb, &m16);
        int signed_w = 0;
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            signed_w = V2(k256_chunk)(b, j, kind, &mag[j], &sgn[j]);
            s[j] = V2(k256_scale)(j, kind, sc, scb, big);
        }
        for (int r = 0; r < nr; r++) {
            const uint8_t *yq = xq + xoff[r] + i * 292, *yr = xr + xoff[r] + i * 292;
            __m256i sq = _mm256_setzero_si256(), sr = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) V2(k256_dot)(&sq, &sr, mag[j], sgn[j], signed_w, s[j], yq, yr, j, big);
            V2(k256_sum)(&acc[r], &accm[r], sq, sr, d, dmin, m16, yq, yr, has_mins);
        }
    }
    for (int r = 0; r < nr; r++) y[r] = V2(k256_result)(acc[r], accm[r], kind);
}

#define V2_K256(name, kind) \
    static float V2(dot2_##name)(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) { \
        return V2(dot2_k256)(n, w, xq, xr, kind); \
    } \
    static void V2(dot2m_##name)(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr, \
                                 const int64_t *xoff, int nr, float *y) { \
        V2(dot2m_k256)(n, w, xq, xr, xoff, nr, y, kind); \
    }
V2_K256(q2_k, K_Q2)
V2_K256(q3_k, K_Q3)
V2_K256(q4_k, K_Q4)
V2_K256(q5_k, K_Q5)
V2_K256(q6_k, K_Q6)
V2_K256(iq2_xxs, K_IQ2XXS)
V2_K256(iq2_s, K_IQ2S)
V2_K256(iq3_xxs, K_IQ3XXS)
V2_K256(iq3_s, K_IQ3S)
V2_K256(iq4_xs, K_IQ4XS)
V2_K256(iq1_s, K_IQ1S)
V2_K256(iq1_m, K_IQ1M)
#undef V2_K256

/* ------------------------------------------------------------------ 256-value blocks x q8c, one pass
 *
 * "q8c" (qmm.c's q8c_prep) gives x one 8-bit integer pass, as llama.cpp's q8_K does, but each 32
 * values their own step d m_j (m_j in 1..32, the smallest that keeps their largest |x| within 127
 * steps), where q8_K steps by the block's largest |x| / 127: rounding noise falls with the chunk's
 * largest value instead of the block's. The integer m_j joins the weights' 16-value scales (Q6_K:
 * |128 * 32| per scale, so a block's int32 lane sums stay under 2^30), and the block's d stays one
 * float: the inner loop is q8_K's single pass, ggml's cost, not q8x2's two. */

/* Chunk j's scales from cs (16-value scales times m_j: int16 j of the low lane the chunk's first
 * 16 values', of the high lane its last 16's), as V2(dot_sc) takes them. */
static inline __attribute__((always_inline)) __m256i V2(cs_chunk)(__m256i cs, const int j) {
#if VNNI
    return _mm256_shuffle_epi8(cs, _mm256_set1_epi32((2 * j) | (2 * j + 1) << 8 | ~0xFFFF));
#else
    return _mm256_shuffle_epi8(cs, _mm256_set1_epi16((short)((2 * j) | (2 * j + 1) << 8)));
#endif
}

/* The K-quants' block scales of V2(k256_scales) times x's m_j (y: the block's q8c activations): scb
 * in cs's layout (Q4_K / Q5_K's bytes widened), and the mins per 16 values (the IQ types' scales
 * take m_j chunk by chunk). */
static inline __attribute__((always_inline)) void V2(k256_cscales)(const int kind, const uint8_t *y, __m256i *scb,
                                                                  __m256i *m16) {
    const __m128i m8 = _mm_loadu_si128((const __m128i *)(y + 292));
    if (kind == K_Q4 || kind == K_Q5)
        *scb = _mm256_broadcastsi128_si256(_mm_mullo_epi16(_mm_cvtepu8_epi16(_mm256_castsi256_si128(*scb)), m8));
    else if (kind == K_Q2 || kind == K_Q3 || kind == K_Q6)
        *scb = _mm256_mullo_epi16(*scb, _mm256_broadcastsi128_si256(m8));
    if (kind <= K_Q6)
        *m16 = _mm256_mullo_epi16(*m16, _mm256_setr_m128i(_mm_unpacklo_epi16(m8, m8), _mm_unpackhi_epi16(m8, m8)));
}

/* One weight row against one row of q8c activations. */
static inline __attribute__((always_inline)) float V2(dot1c_k256)(int64_t n, const uint8_t *w, const uint8_t *xc,
                                                                 const int kind) {
    const int big = kind == K_IQ4XS, has_mins = kind <= K_Q6;
    const int ts = V2(K256_TS)[kind];
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *b = w + i * ts, *y = xc + i * Q8C_BLOCK;
        stream_prefetch(b, ts);
        float dmin, dy;
        int sc[16];
        __m256i scb, m16;
        const float d = V2(k256_scales)(b, kind, &dmin, sc, &scb, &m16);
        V2(k256_cscales)(kind, y, &scb, &m16);
        const int16_t *mj = (const int16_t *)(y + 292);
        memcpy(&dy, y, 4);
        __m256i sq = _mm256_setzero_si256();
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m256i mag, sgn;
            const int signed_w = V2(k256_chunk)(b, j, kind, &mag, &sgn);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(y + 4 + 32 * j));
            if (signed_w) xv = _mm256_sign_epi8(xv, sgn);
            const __m256i s = kind <= K_Q6 ? V2(cs_chunk)(scb, j) : V2(sc16)(sc[2 * j] * mj[j], sc[2 * j + 1] * mj[j], big);
            sq = V2(dot_sc)(sq, mag, xv, s, big);
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sq), _mm256_set1_ps(d * dy), acc);
        if (has_mins) {
            const __m256i bq = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(y + 260)), m16);
            accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bq), _mm256_set1_ps(dmin * dy), accm);
        }
    }
    return V2(k256_result)(acc, accm, kind);
}

/* nr <= DOT2M_ROWS rows of q8c activations (row r at xc + xoff[r]) against one weight row: each
 * block's chunks unpacked once for all rows, each row's arithmetic that of V2(dot1c_k256). */
static inline __attribute__((always_inline)) void V2(dot1cm_k256)(int64_t n, const uint8_t *w, const uint8_t *xc,
                                                                 const int64_t *xoff, int nr, float *y, const int kind) {
    const int big = kind == K_IQ4XS, has_mins = kind <= K_Q6;
    const int ts = V2(K256_TS)[kind];
    __m256 acc[DOT2M_ROWS], accm[DOT2M_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *b = w + i * ts;
        stream_prefetch(b, ts);
        float dmin;
        int sc[16];
        __m256i scb0, m160, mag[8], sgn[8];
        const float d = V2(k256_scales)(b, kind, &dmin, sc, &scb0, &m160);
        int signed_w = 0;
        #pragma GCC unroll 8
        for (int j = 0; j < 8; j++) signed_w = V2(k256_chunk)(b, j, kind, &mag[j], &sgn[j]);
        for (int r = 0; r < nr; r++) {
            const uint8_t *yb = xc + xoff[r] + i * Q8C_BLOCK;
            __m256i scb = scb0, m16 = m160;
            V2(k256_cscales)(kind, yb, &scb, &m16);
            const int16_t *mj = (const int16_t *)(yb + 292);
            float dy;
            memcpy(&dy, yb, 4);
            __m256i sq = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(yb + 4 + 32 * j));
                if (signed_w) xv = _mm256_sign_epi8(xv, sgn[j]);
                const __m256i s = kind <= K_Q6 ? V2(cs_chunk)(scb, j) : V2(sc16)(sc[2 * j] * mj[j], sc[2 * j + 1] * mj[j], big);
                sq = V2(dot_sc)(sq, mag[j], xv, s, big);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sq), _mm256_set1_ps(d * dy), acc[r]);
            if (has_mins) {
                const __m256i bq = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(yb + 260)), m16);
                accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(bq), _mm256_set1_ps(dmin * dy), accm[r]);
            }
        }
    }
    for (int r = 0; r < nr; r++) y[r] = V2(k256_result)(acc[r], accm[r], kind);
}

#define V2_K256C(name, kind) \
    static float V2(dot1c_##name)(int64_t n, const uint8_t *w, const uint8_t *xc, const uint8_t *unused) { \
        (void)unused; \
        return V2(dot1c_k256)(n, w, xc, kind); \
    } \
    static void V2(dot1cm_##name)(int64_t n, const uint8_t *w, const uint8_t *xc, const uint8_t *unused, \
                                  const int64_t *xoff, int nr, float *y) { \
        (void)unused; \
        V2(dot1cm_k256)(n, w, xc, xoff, nr, y, kind); \
    }
V2_K256C(q2_k, K_Q2)
V2_K256C(q3_k, K_Q3)
V2_K256C(q4_k, K_Q4)
V2_K256C(q5_k, K_Q5)
V2_K256C(q6_k, K_Q6)
V2_K256C(iq2_xxs, K_IQ2XXS)
V2_K256C(iq2_s, K_IQ2S)
V2_K256C(iq3_xxs, K_IQ3XXS)
V2_K256C(iq3_s, K_IQ3S)
V2_K256C(iq4_xs, K_IQ4XS)
V2_K256C(iq1_s, K_IQ1S)
V2_K256C(iq1_m, K_IQ1M)
#undef V2_K256C

/* IQ2_XS {f16 d; u16 qs[32]; u8 scales[8]} x q8_K in its own loop: dot2_k256's way (scalar sign
 * lookups, one u16 at a time) took ~114 cycles a block on Zen 3 (llvm-mca), 4-5x Q4_K's per byte.
 * Here the 32 sign bytes of a block come from two vectors (each u16's 7 bits >> 9 and their parity
 * by one vpshufb of bits 0-3 ^ 4-6, as ggml's AVX2 kernel does) and spread per 32 values by vpshufb
 * + vpand + vpaddb 0x7F (bit set: 0x80..0xFF, negative; clear: 0x7F); the 4 grid rows of 32 values
 * are 4 loads merged by vmovhpd / vinserti128, their indices bextr'd from one u64; the 16-value
 * scales (2s + 1) one vpshufb each from one vector. ~44 cycles a block (llvm-mca, znver3). */
static inline __attribute__((always_inline)) __m128i V2(ld2q)(const uint8_t *a, const uint8_t *b) {
    return _mm_castpd_si128(_mm_loadh_pd(_mm_castsi128_pd(_mm_loadl_epi64((const __m128i *)a)), (const double *)b));
}

static inline __attribute__((always_inline)) uint64_t V2(bits9)(uint64_t u, const int at) {
#if defined(__BMI__)
    return _bextr_u64(u, at, 9);
#else
    return (u >> at) & 511;
#endif
}

/* Chunk j's scales (sub-blocks 2j, 2j + 1) from scb (each sub-block's 2s + 1, both lanes), as
 * V2(dot_sc) takes them: in each int16 (AVX2) or each int32's low half (VNNI, V2(sc16)). */
static inline __attribute__((always_inline)) __m256i V2(iq2xs_scales)(__m256i scb, const int j) {
#if VNNI
    const __m256i sp = _mm256_setr_epi8(2 * j, -1, -1, -1, 2 * j, -1, -1, -1, 2 * j, -1, -1, -1, 2 * j, -1, -1, -1,
                                        2 * j + 1, -1, -1, -1, 2 * j + 1, -1, -1, -1, 2 * j + 1, -1, -1, -1, 2 * j + 1, -1, -1, -1);
#else
    const __m256i sp = _mm256_setr_epi8(2 * j, -1, 2 * j, -1, 2 * j, -1, 2 * j, -1, 2 * j, -1, 2 * j, -1, 2 * j, -1, 2 * j, -1,
                                        2 * j + 1, -1, 2 * j + 1, -1, 2 * j + 1, -1, 2 * j + 1, -1, 2 * j + 1, -1, 2 * j + 1, -1, 2 * j + 1, -1, 2 * j + 1, -1);
#endif
    return _mm256_shuffle_epi8(scb, sp);
}

/* Block b's 16-value scales 2s + 1 (byte k: sub-block k), and its 8 chunks' grid magnitudes and
 * sign bytes as V2(dot2_iq2_xs) unpacks them: the multi-row kernels' shared unpacking. */
static inline __attribute__((always_inline)) __m128i V2(iq2xs_scale_bytes)(const uint8_t *b) {
    const __m128i m15 = _mm_set1_epi8(15);
    const __m128i sb = _mm_loadl_epi64((const __m128i *)(b + 66));
    const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(sb, m15), _mm_and_si128(_mm_srli_epi16(sb, 4), m15));
    return _mm_add_epi8(_mm_add_epi8(nib, nib), _mm_set1_epi8(1));
}

/* Half h (u16 16h..16h+15) of block b: its sign words' 7 bits and parity, in both lanes' order as
 * V2(iq2xs_chunk) takes them. */
static inline __attribute__((always_inline)) void V2(iq2xs_half)(const uint8_t *b, const int h, __m256i dup[2]) {
    const __m256i odd = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0));
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 2 + 32 * h));
    const __m256i p = _mm256_srli_epi16(q, 9);
    const __m256i f = _mm256_or_si256(p, _mm256_shuffle_epi8(odd, _mm256_xor_si256(p, _mm256_srli_epi16(q, 13))));
    dup[0] = _mm256_permute2x128_si256(f, f, 0x00);
    dup[1] = _mm256_permute2x128_si256(f, f, 0x11);
}

/* Chunk j (values 32j..32j+31: u16 4j..4j+3) of block b, dup its half's (V2(iq2xs_half)): the grid
 * magnitudes and the sign bytes. */
static inline __attribute__((always_inline)) void V2(iq2xs_chunk)(const uint8_t *b, const int j, const __m256i dup[2],
                                                                 __m256i *mag, __m256i *sgn) {
    /* value m of u16 k (of 4) takes sign byte k: bytes 2k of 4 u16, then of the next 4 */
    const __m256i spread0 = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2,
                                             4, 4, 4, 4, 4, 4, 4, 4, 6, 6, 6, 6, 6, 6, 6, 6);
    const __m256i spread1 = _mm256_add_epi8(spread0, _mm256_set1_epi8(8));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull), pos = _mm256_set1_epi8(0x7F);
    const int c = j % 4;
    uint64_t u;
    memcpy(&u, b + 2 + 8 * j, 8);
    __asm__("" : "+r"(u)); /* one load; GCC would fold it into each bextr */
    const __m128i lo = V2(ld2q)(GRID_IQ2_XS[V2(bits9)(u, 0)], GRID_IQ2_XS[V2(bits9)(u, 16)]);
    const __m128i hi = V2(ld2q)(GRID_IQ2_XS[V2(bits9)(u, 32)], GRID_IQ2_XS[V2(bits9)(u, 48)]);
    *mag = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
    *sgn = _mm256_add_epi8(_mm256_and_si256(_mm256_shuffle_epi8(dup[c >> 1], c & 1 ? spread1 : spread0), bit), pos);
}

static inline __attribute__((always_inline)) void V2(iq2xs_chunks)(const uint8_t *b, __m256i *mag, __m256i *sgn) {
    #pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m256i dup[2];
        V2(iq2xs_half)(b, h, dup);
        #pragma GCC unroll 4
        for (int c = 0; c < 4; c++) V2(iq2xs_chunk)(b, 4 * h + c, dup, &mag[4 * h + c], &sgn[4 * h + c]);
    }
}

static float V2(dot2_iq2_xs)(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *b = w + i * 74, *yq = xq + i * 292, *yr = xr + i * 292;
        stream_prefetch(b, 74);
        float dq, dr;
        memcpy(&dq, yq, 4);
        memcpy(&dr, yr, 4);
        const float d = rd_f16(b);
        const __m256i scb = _mm256_broadcastsi128_si256(V2(iq2xs_scale_bytes)(b)); /* in both 128-bit lanes */
        __m256i sq = _mm256_setzero_si256(), sr = _mm256_setzero_si256();
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) { /* u16 16h..16h+15: 128 values */
            __m256i dup[2];
            V2(iq2xs_half)(b, h, dup);
            #pragma GCC unroll 4
            for (int c = 0; c < 4; c++) { /* sub-blocks 2j, 2j+1 */
                const int j = 4 * h + c;
                __m256i mag, sgn;
                V2(iq2xs_chunk)(b, j, dup, &mag, &sgn);
                const __m256i s = V2(iq2xs_scales)(scb, j);
                sq = V2(dot_sc)(sq, mag, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(yq + 4 + 32 * j)), sgn), s, 0);
                sr = V2(dot_sc)(sr, mag, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(yr + 4 + 32 * j)), sgn), s, 0);
                __asm__("" : "+x"(sq), "+x"(sr)); /* one chain each: GCC's reassociated sums spilled */
            }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sq), _mm256_set1_ps(d * dq), acc);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sr), _mm256_set1_ps(d * dr), acc);
    }
    return 0.125f * V2(hsum)(acc);
}

/* nr <= DOT2M_ROWS rows of activations against one IQ2_XS weight row (V2(dot2m_k256)'s contract):
 * each block's 8 chunks (grid magnitudes, sign bytes, 16-value scales) unpacked once, as
 * V2(dot2_iq2_xs) unpacks them, then every row's products in V2(dot2_iq2_xs)'s order, so each
 * result is its one-row kernel's bit for bit. The grid lookups and sign spreading are most of a
 * block's cost (~44 cycles), so a prompt's or a verify pass's rows share them. */
static void V2(dot2m_iq2_xs)(int64_t n, const uint8_t *w, const uint8_t *xq, const uint8_t *xr, const int64_t *xoff,
                             int nr, float *y) {
    __m256 acc[DOT2M_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *b = w + i * 74;
        stream_prefetch(b, 74);
        const float d = rd_f16(b);
        const __m256i scb = _mm256_broadcastsi128_si256(V2(iq2xs_scale_bytes)(b));
        __m256i mag[8], sgn[8], s[8];
        V2(iq2xs_chunks)(b, mag, sgn);
        for (int j = 0; j < 8; j++) s[j] = V2(iq2xs_scales)(scb, j);
        for (int r = 0; r < nr; r++) {
            const uint8_t *yq = xq + xoff[r] + i * 292, *yr = xr + xoff[r] + i * 292;
            float dq, dr;
            memcpy(&dq, yq, 4);
            memcpy(&dr, yr, 4);
            __m256i sq = _mm256_setzero_si256(), sr = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                sq = V2(dot_sc)(sq, mag[j], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(yq + 4 + 32 * j)), sgn[j]), s[j], 0);
                sr = V2(dot_sc)(sr, mag[j], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(yr + 4 + 32 * j)), sgn[j]), s[j], 0);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sq), _mm256_set1_ps(d * dq), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sr), _mm256_set1_ps(d * dr), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) y[r] = 0.125f * V2(hsum)(acc[r]);
}

/* IQ2_XS against one row of q8c activations: V2(dot2_iq2_xs)'s unpacking, one integer pass, the
 * 16-value scales (2s + 1) times m_j in cs's layout (even sub-blocks in the low lane). */
static float V2(dot1c_iq2_xs)(int64_t n, const uint8_t *w, const uint8_t *xc, const uint8_t *unused) {
    (void)unused;
    const __m128i evens = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *b = w + i * 74, *y = xc + i * Q8C_BLOCK;
        stream_prefetch(b, 74);
        float dy;
        memcpy(&dy, y, 4);
        const float d = rd_f16(b);
        const __m256i s16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(V2(iq2xs_scale_bytes)(b), evens));
        const __m256i cs = _mm256_mullo_epi16(s16, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(y + 292))));
        __m256i sq = _mm256_setzero_si256();
        #pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            __m256i dup[2];
            V2(iq2xs_half)(b, h, dup);
            #pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                const int j = 4 * h + c;
                __m256i mag, sgn;
                V2(iq2xs_chunk)(b, j, dup, &mag, &sgn);
                sq = V2(dot_sc)(sq, mag, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(y + 4 + 32 * j)), sgn), V2(cs_chunk)(cs, j), 0);
            }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sq), _mm256_set1_ps(d * dy), acc);
    }
    return 0.125f * V2(hsum)(acc);
}

/* nr rows of q8c activations against one IQ2_XS weight row: V2(dot2m_iq2_xs)'s unpacking once for
 * all rows, each row's arithmetic that of V2(dot1c_iq2_xs). */
static void V2(dot1cm_iq2_xs)(int64_t n, const uint8_t *w, const uint8_t *xc, const uint8_t *unused, const int64_t *xoff,
                              int nr, float *y) {
    (void)unused;
    const __m128i evens = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256 acc[DOT2M_ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *b = w + i * 74;
        stream_prefetch(b, 74);
        const float d = rd_f16(b);
        const __m256i s16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(V2(iq2xs_scale_bytes)(b), evens));
        __m256i mag[8], sgn[8];
        V2(iq2xs_chunks)(b, mag, sgn);
        for (int r = 0; r < nr; r++) {
            const uint8_t *yb = xc + xoff[r] + i * Q8C_BLOCK;
            float dy;
            memcpy(&dy, yb, 4);
            const __m256i cs = _mm256_mullo_epi16(s16, _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(yb + 292))));
            __m256i sq = _mm256_setzero_si256();
            #pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                sq = V2(dot_sc)(sq, mag[j], _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(yb + 4 + 32 * j)), sgn[j]), V2(cs_chunk)(cs, j), 0);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sq), _mm256_set1_ps(d * dy), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) y[r] = 0.125f * V2(hsum)(acc[r]);
}

/* The q8c kernel for a ggml type (256-value blocks), or NULL (qmm.c's q8c_for). */
static dot2_fn V2(q8c_for)(int type) {
    switch (type) {
    case 10: return V2(dot1c_q2_k);
    case 11: return V2(dot1c_q3_k);
    case 12: return V2(dot1c_q4_k);
    case 13: return V2(dot1c_q5_k);
    case 14: return V2(dot1c_q6_k);
    case 16: return V2(dot1c_iq2_xxs);
    case 17: return V2(dot1c_iq2_xs);
    case 18: return V2(dot1c_iq3_xxs);
    case 19: return V2(dot1c_iq1_s);
    case 21: return V2(dot1c_iq3_s);
    case 22: return V2(dot1c_iq2_s);
    case 23: return V2(dot1c_iq4_xs);
    case 29: return V2(dot1c_iq1_m);
    default: return NULL;
    }
}

/* ------------------------------------------------------------------ 32-value blocks x 16-bit x */

/* Q8_0 {f16 d; i8 qs[32]}, Q4_0 / IQ4_NL {f16 d; u8 qs[16]}, Q5_0 {f16 d; u32 qh; u8 qs[16]},
 * MXFP4 {u8 e8m0; u8 qs[16]}, Q4_1 {f16 d, m; u8 qs[16]} and Q5_1 {f16 d, m; u32 qh; u8 qs[16]}
 * against x in 16-bit integers (qmm.c's prep16: int16 values, a float scale per 32, and that scale
 * times each block's integer sum). Each block's 32 weights become two vectors of 16-bit integers,
 * and vpmaddwd takes both halves against x in one pass (the 8-bit x and residual of the other
 * kernels took two): |w| <= 128 and |x| <= 32767, so a lane's two products stay far inside int32.
 * Q4_1's and Q5_1's mins go through x's block sums. */
static const int V2(B32_TS)[] = {34, 18, 22, 18, 17, 20, 24};

/* Block b's weights as two vectors of 16-bit integers (values 0-15, 16-31), and in *dm the block
 * scale (lane 0) and Q4_1's / Q5_1's min (lane 1; the other kinds' lane 1 is not used). */
static inline __attribute__((always_inline)) void V2(b32_unpack)(const uint8_t *b, const int kind, __m256i *lo_,
                                                                __m256i *hi_, __m128 *dm) {
    __m256i lo, hi;
    if (kind == B_Q8_0) {
        lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 2)));
        hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 18)));
    } else if (kind == B_MXFP4 || kind == B_IQ4NL) {
        const v16i8 t = kind == B_MXFP4 ? E2M1_I8 : IQ4_NL_I8;
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + (kind == B_MXFP4 ? 1 : 2))), m4 = _mm_set1_epi8(15);
        lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8((__m128i)t, _mm_and_si128(q, m4)));
        hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8((__m128i)t, _mm_and_si128(_mm_srli_epi16(q, 4), m4)));
    } else { /* nibbles, and the fifth bits of Q5_0 / Q5_1 */
        const int at = kind == B_Q4_0 ? 2 : kind == B_Q5_0 ? 6 : kind == B_Q4_1 ? 4 : 8;
        const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + at))), m4 = _mm256_set1_epi16(15);
        lo = _mm256_and_si256(q, m4);
        hi = _mm256_srli_epi16(q, 4);
        if (kind == B_Q5_0 || kind == B_Q5_1) { /* bit l of qh into lane l's bit 4: times 2^(15-l), bit 15 down to 4 */
            const uint32_t qh = rd_u32(b + (kind == B_Q5_0 ? 2 : 4));
            const __m256i up = _mm256_setr_epi16((short)0x8000, 0x4000, 0x2000, 0x1000, 0x800, 0x400, 0x200, 0x100,
                                                 0x80, 0x40, 0x20, 0x10, 8, 4, 2, 1), m16 = _mm256_set1_epi16(16);
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_srli_epi16(_mm256_mullo_epi16(_mm256_set1_epi16((short)qh), up), 11), m16));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(_mm256_mullo_epi16(_mm256_set1_epi16((short)(qh >> 16)), up), 11), m16));
        }
        if (kind == B_Q4_0 || kind == B_Q5_0) { /* signed here: a large block's offset through the sums cancels in float */
            const __m256i off = _mm256_set1_epi16(kind == B_Q4_0 ? 8 : 16);
            lo = _mm256_sub_epi16(lo, off);
            hi = _mm256_sub_epi16(hi, off);
        }
    }
    /* d (and Q4_1's / Q5_1's m right after it) as one 4-byte load */
    *dm = kind == B_MXFP4 ? _mm_set_ss(e8m0_half(b[0])) : _mm_cvtph_ps(_mm_cvtsi32_si128((int)rd_u32(b)));
    *lo_ = lo;
    *hi_ = hi;
}

/* Block i of one row of prepared activations (prep16's layout, nb blocks) times the unpacked
 * weights, added to acc (and, lane 1, the min times x's block sum to mins). */
static inline __attribute__((always_inline)) void V2(b32_dot)(__m256 *acc, __m128 *mins, __m256i lo, __m256i hi,
                                                             __m128 dm, const uint8_t *prep, int64_t nb, int64_t i,
                                                             const int kind) {
    const int16_t *x = (const int16_t *)prep + 32 * i;
    const __m128 f = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd((const double *)(prep + nb * 64) + i))); /* d dx, m cs */
    const __m256i xa = _mm256_loadu_si256((const __m256i *)x), xb = _mm256_loadu_si256((const __m256i *)(x + 16));
#if VNNI
    const __m256i s = _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(lo, xa), hi, xb);
#else
    const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(lo, xa), _mm256_madd_epi16(hi, xb));
#endif
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcastss_ps(f), *acc);
    if (kind == B_Q4_1 || kind == B_Q5_1) *mins = _mm_add_ps(*mins, f);
}

static inline __attribute__((always_inline)) float V2(dot2_b32)(int64_t n, const uint8_t *w, const uint8_t *prep,
                                                               const int kind) {
    const int64_t nb = n / 32;
    const int ts = V2(B32_TS)[kind];
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(); /* even and odd blocks: two FMA chains */
    __m128 mins0 = _mm_setzero_ps(), mins1 = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const uint8_t *b = w + i * ts;
        stream_prefetch(b, ts);
        __m256i lo, hi;
        __m128 dm;
        V2(b32_unpack)(b, kind, &lo, &hi, &dm);
        if (i & 1) V2(b32_dot)(&acc1, &mins1, lo, hi, dm, prep, nb, i, kind);
        else V2(b32_dot)(&acc0, &mins0, lo, hi, dm, prep, nb, i, kind);
    }
    const __m128 m = _mm_add_ps(mins0, mins1);
    return V2(hsum)(_mm256_add_ps(acc0, acc1)) + _mm_cvtss_f32(_mm_movehdup_ps(m));
}

/* nr <= DOT2M_ROWS rows of prepared activations (row r at prep + xoff[r]) against one weight row into
 * y[0..nr): up to B32_SPAN blocks unpacked at a time, then every row's products over them (the
 * row's accumulators in registers through the span), each row's arithmetic that of V2(dot2_b32)
 * (so each result equals its one-row one). */
#define B32_SPAN 32
static inline __attribute__((always_inline)) void V2(dot2m_b32)(int64_t n, const uint8_t *w, const uint8_t *prep,
                                                               const int64_t *xoff, int nr, float *y, const int kind) {
    const int64_t nb = n / 32;
    const int ts = V2(B32_TS)[kind];
    __m256 acc[DOT2M_ROWS][2];
    __m128 mins[DOT2M_ROWS][2];
    for (int r = 0; r < nr; r++) {
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        mins[r][0] = mins[r][1] = _mm_setzero_ps();
    }
    for (int64_t i0 = 0; i0 < nb; i0 += B32_SPAN) { /* B32_SPAN is even: block i0 + g's parity is g's */
        const int ns = nb - i0 < B32_SPAN ? (int)(nb - i0) : B32_SPAN;
        __m256i lo[B32_SPAN], hi[B32_SPAN];
        __m128 dm[B32_SPAN];
        for (int g = 0; g < ns; g++) {
            stream_prefetch(w + (i0 + g) * ts, ts);
            V2(b32_unpack)(w + (i0 + g) * ts, kind, &lo[g], &hi[g], &dm[g]);
        }
        for (int r = 0; r < nr; r++) {
            __m256 a0 = acc[r][0], a1 = acc[r][1];
            __m128 m0 = mins[r][0], m1 = mins[r][1];
            const uint8_t *x = prep + xoff[r];
            int g = 0;
            for (; g + 1 < ns; g += 2) {
                V2(b32_dot)(&a0, &m0, lo[g], hi[g], dm[g], x, nb, i0 + g, kind);
                V2(b32_dot)(&a1, &m1, lo[g + 1], hi[g + 1], dm[g + 1], x, nb, i0 + g + 1, kind);
            }
            if (g < ns) V2(b32_dot)(&a0, &m0, lo[g], hi[g], dm[g], x, nb, i0 + g, kind);
            acc[r][0] = a0;
            acc[r][1] = a1;
            mins[r][0] = m0;
            mins[r][1] = m1;
        }
    }
    for (int r = 0; r < nr; r++) {
        const __m128 m = _mm_add_ps(mins[r][0], mins[r][1]);
        y[r] = V2(hsum)(_mm256_add_ps(acc[r][0], acc[r][1])) + _mm_cvtss_f32(_mm_movehdup_ps(m));
    }
}
#undef B32_SPAN

#define V2_B32(name, kind) \
    static float V2(dot2_##name)(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused) { \
        (void)unused; \
        return V2(dot2_b32)(n, w, prep, kind); \
    }
#define V2_B32M(name, kind) \
    V2_B32(name, kind) \
    static void V2(dot2m_##name)(int64_t n, const uint8_t *w, const uint8_t *prep, const uint8_t *unused, \
                                 const int64_t *xoff, int nr, float *y) { \
        (void)unused; \
        V2(dot2m_b32)(n, w, prep, xoff, nr, y, kind); \
    }
V2_B32(q8_0, B_Q8_0)
V2_B32M(q4_0, B_Q4_0)
V2_B32M(q5_0, B_Q5_0)
V2_B32M(iq4_nl, B_IQ4NL)
V2_B32M(mxfp4, B_MXFP4)
V2_B32M(q4_1, B_Q4_1)
V2_B32M(q5_1, B_Q5_1)
#undef V2_B32M
#undef V2_B32

/* The kernel for a ggml type and its activation layout, or NULL (qmm.c's fused2_for). */
static dot2_fn V2(fused2_for)(int type, int64_t qblk, int64_t qsize) {
    if (qblk == 256 && qsize == 292) {
        switch (type) {
        case 10: return V2(dot2_q2_k);
        case 11: return V2(dot2_q3_k);
        case 12: return V2(dot2_q4_k);
        case 13: return V2(dot2_q5_k);
        case 14: return V2(dot2_q6_k);
        case 16: return V2(dot2_iq2_xxs);
        case 17: return V2(dot2_iq2_xs);
        case 18: return V2(dot2_iq3_xxs);
        case 19: return V2(dot2_iq1_s);
        case 21: return V2(dot2_iq3_s);
        case 22: return V2(dot2_iq2_s);
        case 23: return V2(dot2_iq4_xs);
        case 29: return V2(dot2_iq1_m);
        default: return NULL;
        }
    }
    if (qblk == 32 && qsize == 34) {
        switch (type) {
        case 2: return V2(dot2_q4_0);
        case 6: return V2(dot2_q5_0);
        case 8: return V2(dot2_q8_0);
        case 20: return V2(dot2_iq4_nl);
        case 39: return V2(dot2_mxfp4);
        default: return NULL;
        }
    }
    if (qblk == 32 && qsize == 36 && (type == 3 || type == 7)) return type == 3 ? V2(dot2_q4_1) : V2(dot2_q5_1);
    return NULL;
}

/* The multi-row kernel of this set's one-row kernel f, or NULL (qmm.c's fused2m_of), and in
 * *min_rows the fewest rows it takes: below them its stores and reloads of the unpacked blocks cost
 * more than the unpacking it saves (AVX2 on a Zen 3, CPU time of 768x2048 products, B = 2-4: Q4_K
 * 1.10 / 1.02 / 0.85x the one-row kernels at B = 2 / 3 / 4, Q6_K 0.97 / 0.93 / 0.75x, Q4_0 1.09 /
 * 0.88 / 0.87x). Q8_0 has none: its unpacking is one load, which the stores and reloads cost as
 * much as (0.96-1.33x at B = 2-17). IQ2_XS's own multi-row loop: 1.06-1.15 / 0.90-0.92 / 0.79-0.83 /
 * 0.75-0.78x its one-row loop per row at B = 2 / 4 / 8 / 17 (bench_kernels --multirow-ab, 1 thread). */
static dot2m_fn V2(fused2m_of)(dot2_fn f, int *min_rows) {
    /* q8c, the same row counts (CPU time multi / one-row, 2048x2048, B = 2 / 3 / 4 / 8, Zen 3: Q4_K 0.98 / 1.00 /
     * 0.92 / 0.85, Q6_K 0.93 / 0.75 / 0.67 / 0.65, Q5_K 1.02 / 0.83 / 0.76 / 0.71, IQ2_XS 0.95 / 1.07 / 0.68 / 0.55) */
    if (f == V2(dot1c_q2_k)) return *min_rows = 3, V2(dot1cm_q2_k);
    if (f == V2(dot1c_q3_k)) return *min_rows = 3, V2(dot1cm_q3_k);
    if (f == V2(dot1c_q4_k)) return *min_rows = 4, V2(dot1cm_q4_k);
    if (f == V2(dot1c_q5_k)) return *min_rows = 3, V2(dot1cm_q5_k);
    if (f == V2(dot1c_q6_k)) return *min_rows = 3, V2(dot1cm_q6_k);
    if (f == V2(dot1c_iq2_xs)) return *min_rows = 4, V2(dot1cm_iq2_xs);
    if (f == V2(dot1c_iq2_xxs)) return *min_rows = 2, V2(dot1cm_iq2_xxs);
    if (f == V2(dot1c_iq2_s)) return *min_rows = 2, V2(dot1cm_iq2_s);
    if (f == V2(dot1c_iq3_xxs)) return *min_rows = 2, V2(dot1cm_iq3_xxs);
    if (f == V2(dot1c_iq3_s)) return *min_rows = 2, V2(dot1cm_iq3_s);
    if (f == V2(dot1c_iq4_xs)) return *min_rows = 3, V2(dot1cm_iq4_xs);
    if (f == V2(dot1c_iq1_s)) return *min_rows = 2, V2(dot1cm_iq1_s);
    if (f == V2(dot1c_iq1_m)) return *min_rows = 2, V2(dot1cm_iq1_m);
    if (f == V2(dot2_q2_k)) return *min_rows = 3, V2(dot2m_q2_k);
    if (f == V2(dot2_q3_k)) return *min_rows = 3, V2(dot2m_q3_k);
    if (f == V2(dot2_q4_k)) return *min_rows = 4, V2(dot2m_q4_k);
    if (f == V2(dot2_q5_k)) return *min_rows = 3, V2(dot2m_q5_k);
    if (f == V2(dot2_q6_k)) return *min_rows = 3, V2(dot2m_q6_k);
    if (f == V2(dot2_iq2_xs)) return *min_rows = 4, V2(dot2m_iq2_xs);
    if (f == V2(dot2_iq2_xxs)) return *min_rows = 2, V2(dot2m_iq2_xxs);
    if (f == V2(dot2_iq2_s)) return *min_rows = 2, V2(dot2m_iq2_s);
    if (f == V2(dot2_iq3_xxs)) return *min_rows = 2, V2(dot2m_iq3_xxs);
    if (f == V2(dot2_iq3_s)) return *min_rows = 2, V2(dot2m_iq3_s);
    if (f == V2(dot2_iq4_xs)) return *min_rows = 3, V2(dot2m_iq4_xs);
    if (f == V2(dot2_iq1_s)) return *min_rows = 2, V2(dot2m_iq1_s);
    if (f == V2(dot2_iq1_m)) return *min_rows = 2, V2(dot2m_iq1_m);
    if (f == V2(dot2_q4_0)) return *min_rows = 3, V2(dot2m_q4_0);
    if (f == V2(dot2_q5_0)) return *min_rows = 3, V2(dot2m_q5_0);
    if (f == V2(dot2_iq4_nl)) return *min_rows = 3, V2(dot2m_iq4_nl);
    if (f == V2(dot2_mxfp4)) return *min_rows = 3, V2(dot2m_mxfp4);
    if (f == V2(dot2_q4_1)) return *min_rows = 3, V2(dot2m_q4_1);
    if (f == V2(dot2_q5_1)) return *min_rows = 3, V2(dot2m_q5_1);
    return NULL;
}
