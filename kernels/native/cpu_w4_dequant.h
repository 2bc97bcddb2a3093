/* The dense weight W = d * q + m of the 4-bit layout (cpu_w4_layout.h), a row at a time, fp32 or bf16: for
 * li_w4_dequant (cpu_w4_pack.c: the whole weight, for torch's GEMM) and li_w4_amx_linear (cpu_w4_amx.c: 32 rows
 * at a time, into the tiles' buffer). */
#ifndef LIGHTINFER_CPU_W4_DEQUANT_H
#define LIGHTINFER_CPU_W4_DEQUANT_H

#include "cpu_w4_layout.h"

/* one value of the dense weight, d * q + m, stored as fp32 or bf16 */
static inline void w4_store(void* out, int odt, size_t at, float v) {
    if (odt == DT_BF16)
        ((uint16_t*)out)[at] = f32_to_bf16(v);
    else
        ((float*)out)[at] = v;
}

#if defined(W4_AVX512)
/* 16 fp32 values rounded to bf16, to nearest even (finite values: a weight is never NaN) */
static inline __m256i w4_to_bf16(__m512 v) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(v);
#else /* by integer arithmetic */
    __m512i u = _mm512_castps_si512(v);
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                             _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
#endif
}

/* block i of one super-block (its 16 bytes: lo codes 0..15, hi codes 16..31, one lane of lo / hi as below) */
static inline void w4_dequant_half(__m128i codes, float d, float m, int odt, void* out, size_t at) {
    __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), _mm512_set1_ps(d), _mm512_set1_ps(m));
    if (odt == DT_BF16)
        _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), w4_to_bf16(v));
    else
        _mm512_storeu_ps((float*)out + at, v);
}

/* one block's 32 values in bf16 from its codes (c0: codes 0..15, c1: 16..31, a byte each) by table lookup: the 16
 * values d * q + m a block can hold, each computed and rounded as w4_dequant_half does, then one vpermw picks
 * 32 of them (about half the instructions of converting each code) */
static inline void w4_dequant_block_bf16(__m128i c0, __m128i c1, float d, float m, uint16_t* out) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i table = _mm512_broadcast_i64x4(w4_to_bf16(_mm512_fmadd_ps(q, _mm512_set1_ps(d), _mm512_set1_ps(m))));
    __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(c1, c0)); /* words 0..15 of table: codes 0..15 */
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(idx, table));
}

#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
#define W4_VBMI 1
/* byte 2 c of this vector: where code c of the block in 128-bit lane 0 lives in (lo | hi), the codes' low and
 * high nibbles of a super-block's 4 blocks as w4_dequant_superblock lays them out (dword u of a lane: codes
 * 8 u .. 8 u + 3 in lo, 8 u + 4 .. 8 u + 7 in hi; hi's bytes numbered from 64); odd bytes unused (zeroed) */
static const uint8_t w4_code_bytes[64] __attribute__((aligned(64))) = {
    0, 0, 1, 0, 2, 0, 3, 0, 64, 0, 65, 0, 66, 0, 67, 0, 4, 0, 5, 0, 6, 0, 7, 0, 68, 0, 69, 0, 70, 0, 71, 0,
    8, 0, 9, 0, 10, 0, 11, 0, 72, 0, 73, 0, 74, 0, 75, 0, 12, 0, 13, 0, 14, 0, 15, 0, 76, 0, 77, 0, 78, 0, 79, 0};

/* the 256 bf16 values of super-block `p` as w4_dequant_superblock writes them (bit for bit), with fewer
 * shuffles: one vpermt2b per block takes its 32 codes as words straight from the nibbles, and one vcvtne2ps2bf16
 * makes the lookup tables of two blocks (words 0..15 the first's, 16..31 the second's: its codes + 16) */
static inline void w4_dequant_superblock_vbmi(const uint8_t* p, const float* dv, const float* mv, uint16_t* out) {
    const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64), low = _mm512_set1_epi8(0x0f);
    const __m512i base = _mm512_load_si512(w4_code_bytes), second = _mm512_set1_epi16(16);
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __mmask64 words = 0x5555555555555555ull;
    for (int half = 0; half < 2; half++) {
        const int o = 4 * half;
        const __m512i idx = _mm512_setr_epi32(o, o + 8, o + 16, o + 24, o + 1, o + 9, o + 17, o + 25, o + 2, o + 10,
                                              o + 18, o + 26, o + 3, o + 11, o + 19, o + 27);
        __m512i blocks = _mm512_permutex2var_epi32(a, idx, b); /* 128-bit lane i: block o + i, dword u */
        __m512i lo = _mm512_and_si512(blocks, low), hi = _mm512_and_si512(_mm512_srli_epi16(blocks, 4), low);
        for (int i = 0; i < 4; i += 2) {
            const int blk = o + i;
            __m512i table = (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_fmadd_ps(q, _mm512_set1_ps(dv[blk + 1]), _mm512_set1_ps(mv[blk + 1])),
                _mm512_fmadd_ps(q, _mm512_set1_ps(dv[blk]), _mm512_set1_ps(mv[blk])));
            __m512i c0 = _mm512_maskz_permutex2var_epi8(words, lo, _mm512_add_epi16(base, _mm512_set1_epi16(16 * i)), hi);
            __m512i c1 = _mm512_maskz_permutex2var_epi8(words, lo, _mm512_add_epi16(base, _mm512_set1_epi16(16 * i + 16)), hi);
            _mm512_storeu_si512(out + 32 * (size_t)blk, _mm512_permutexvar_epi16(c0, table));
            _mm512_storeu_si512(out + 32 * (size_t)(blk + 1), _mm512_permutexvar_epi16(_mm512_or_si512(c1, second), table));
        }
    }
}
#endif

/* the 256 values of super-block `p` (128 bytes), blocks b0..b0+7, to out + at (row-major, plain order) */
static inline void w4_dequant_superblock(const uint8_t* p, const float* dv, const float* mv, int odt, void* out,
                                         size_t at) {
#if defined(W4_VBMI)
    if (odt == DT_BF16) {
        w4_dequant_superblock_vbmi(p, dv, mv, (uint16_t*)out + at);
        return;
    }
#endif
    const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64), low = _mm512_set1_epi8(0x0f);
    for (int half = 0; half < 2; half++) { /* blocks 4 half + i, i = 0..3: the dwords i, 8 + i, 16 + i, 24 + i */
        const int o = 4 * half;
        const __m512i idx = _mm512_setr_epi32(o, o + 8, o + 16, o + 24, o + 1, o + 9, o + 17, o + 25, o + 2, o + 10,
                                              o + 18, o + 26, o + 3, o + 11, o + 19, o + 27);
        __m512i blocks = _mm512_permutex2var_epi32(a, idx, b); /* 128-bit lane i: block 4 half + i, dword u */
        __m512i lo = _mm512_and_si512(blocks, low), hi = _mm512_and_si512(_mm512_srli_epi16(blocks, 4), low);
        /* dword u of lo holds codes 8 u .. 8 u + 3, of hi 8 u + 4 .. 8 u + 7: interleaved, codes in order */
        __m512i first = _mm512_unpacklo_epi32(lo, hi), second = _mm512_unpackhi_epi32(lo, hi);
        __m128i f[4] = {_mm512_castsi512_si128(first), _mm512_extracti32x4_epi32(first, 1),
                        _mm512_extracti32x4_epi32(first, 2), _mm512_extracti32x4_epi32(first, 3)};
        __m128i s[4] = {_mm512_castsi512_si128(second), _mm512_extracti32x4_epi32(second, 1),
                        _mm512_extracti32x4_epi32(second, 2), _mm512_extracti32x4_epi32(second, 3)};
        for (int i = 0; i < 4; i++) {
            int blk = o + i;
            if (odt == DT_BF16) {
                w4_dequant_block_bf16(f[i], s[i], dv[blk], mv[blk], (uint16_t*)out + at + 32 * (size_t)blk);
                continue;
            }
            w4_dequant_half(f[i], dv[blk], mv[blk], odt, out, at + 32 * (size_t)blk);
            w4_dequant_half(s[i], dv[blk], mv[blk], odt, out, at + 32 * (size_t)blk + 16);
        }
    }
}
#endif

#if defined(W4_AVX2) && !defined(W4_AVX512)
/* AVX2: 16 codes (a byte each, in order) -> 16 fp32 values d * q + m at out (one rounding, as the AVX-512 path) */
static inline void w4_dequant16_f32(__m128i codes, float d, float m, float* out) {
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), dv, mv));
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8))), dv, mv));
}

/* AVX2: the 256 fp32 values of super-block p (128 bytes), blocks b0..b0+7, at out. Vector u of the super-block
 * holds dword u of each of its 8 blocks (block b's codes 8 u..8 u + 3 in the low nibbles of that dword's bytes,
 * 8 u + 4..8 u + 7 in the high ones); interleaving the nibbles, then the vectors' 64-bit halves, puts each block's
 * 32 codes in order. Without it the fp32 weight of a prefill was unpacked one code at a time, several times the
 * AVX-512 path's time (docs/cpu_performance.md, "Measurements behind the C ops' choices"). */
static inline void w4_dequant_superblock_f32_avx2(const uint8_t* p, const float* dv, const float* mv, float* out) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i lo[4], hi[4];
    for (int u = 0; u < 4; u++) {
        __m256i v = _mm256_loadu_si256((const __m256i*)(p + 32 * u));
        lo[u] = _mm256_and_si256(v, low);
        hi[u] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    for (int part = 0; part < 2; part++) { /* 128-bit lane l: blocks 4 l + 2 part and 4 l + 2 part + 1 */
        __m256i q[4];
        for (int u = 0; u < 4; u++) /* 64-bit half h of a lane: block 4 l + 2 part + h, codes 8 u..8 u + 7 */
            q[u] = part ? _mm256_unpackhi_epi32(lo[u], hi[u]) : _mm256_unpacklo_epi32(lo[u], hi[u]);
        __m256i first0 = _mm256_unpacklo_epi64(q[0], q[1]), first1 = _mm256_unpacklo_epi64(q[2], q[3]);
        __m256i second0 = _mm256_unpackhi_epi64(q[0], q[1]), second1 = _mm256_unpackhi_epi64(q[2], q[3]);
        for (int l = 0; l < 2; l++) {
            int b = 4 * l + 2 * part;
            __m128i f0 = l ? _mm256_extracti128_si256(first0, 1) : _mm256_castsi256_si128(first0);
            __m128i f1 = l ? _mm256_extracti128_si256(first1, 1) : _mm256_castsi256_si128(first1);
            __m128i s0 = l ? _mm256_extracti128_si256(second0, 1) : _mm256_castsi256_si128(second0);
            __m128i s1 = l ? _mm256_extracti128_si256(second1, 1) : _mm256_castsi256_si128(second1);
            w4_dequant16_f32(f0, dv[b], mv[b], out + 32 * b);
            w4_dequant16_f32(f1, dv[b], mv[b], out + 32 * b + 16);
            w4_dequant16_f32(s0, dv[b + 1], mv[b + 1], out + 32 * (b + 1));
            w4_dequant16_f32(s1, dv[b + 1], mv[b + 1], out + 32 * (b + 1) + 16);
        }
    }
}
#endif

/* row n of W = d * q + m (its K / 2 bytes of codes p, its K / G scales then offsets dmr) as K values of odt at
 * out + at: the dense weight of a prefill's product */
static inline void w4_dequant_row(const uint8_t* p, const uint16_t* dmr, int K, int G, int odt, void* out, size_t at) {
    int ng = K / G, nb = K / 32, nsb = nb / 8, shift, b = 0;
    float dv[nb], mv[nb];
    w4_block_values(dmr, K, G, dv);
    w4_block_values(dmr + ng, K, G, mv);
#if defined(W4_AVX512)
    for (; b < 8 * nsb; b += 8) w4_dequant_superblock(p + 16 * (size_t)b, dv + b, mv + b, odt, out, at + 32 * (size_t)b);
    for (; b < nb; b++) { /* plain order: code j in the low nibble of byte j, 16 + j in its high nibble */
        __m128i raw = _mm_loadu_si128((const __m128i*)(p + 16 * (size_t)b)), low = _mm_set1_epi8(0x0f);
        w4_dequant_half(_mm_and_si128(raw, low), dv[b], mv[b], odt, out, at + 32 * (size_t)b);
        w4_dequant_half(_mm_and_si128(_mm_srli_epi16(raw, 4), low), dv[b], mv[b], odt, out, at + 32 * (size_t)b + 16);
    }
#elif defined(W4_AVX2)
    if (odt == DT_F32) { /* a CPU without AVX-512 multiplies a prefill in fp32 (cpu_native.dense_gemm_dtype) */
        float* o = (float*)out + at;
        for (; b < 8 * nsb; b += 8) w4_dequant_superblock_f32_avx2(p + 16 * (size_t)b, dv + b, mv + b, o + 32 * (size_t)b);
        for (; b < nb; b++) { /* plain order: code j in the low nibble of byte j, 16 + j in its high nibble */
            __m128i raw = _mm_loadu_si128((const __m128i*)(p + 16 * (size_t)b)), low = _mm_set1_epi8(0x0f);
            w4_dequant16_f32(_mm_and_si128(raw, low), dv[b], mv[b], o + 32 * (size_t)b);
            w4_dequant16_f32(_mm_and_si128(_mm_srli_epi16(raw, 4), low), dv[b], mv[b], o + 32 * (size_t)b + 16);
        }
    }
#endif
    for (; b < nb; b++)
        for (int k = 0; k < 32; k++) {
            size_t pos = w4_pos(b, k, nsb, &shift);
            w4_store(out, odt, at + 32 * (size_t)b + k, dv[b] * (float)((p[pos] >> shift) & 15) + mv[b]);
        }
}

#endif
