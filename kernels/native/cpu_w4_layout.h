/* The 4-bit weight layout shared by the CPU's 4-bit matrix products (cpu_w4a16.c: int16 activations, the
 * default; cpu_w4a8.c: int8 activations, opt-in) and by cpu_w4_pack.c, which writes and dequantizes it.
 *
 *   weight   w[n, k] = d[n, g] * q[n, k] + m[n, g]          q in 0..15, g = k / G (G a multiple of 32), d and m fp16
 *
 * dm holds fp16 [N, 2, K / G]: each row's K / G scales d, then its K / G offsets m. A row's codes take K / 2
 * bytes: its K / 32 blocks of 32 codes go in groups of 8 ("super-blocks" of 256 values, 128 bytes of codes),
 * interleaved so that one 32-byte vector holds 4 consecutive values of each of the 8 blocks: its int32 lane i
 * is block i's. A dot-product instruction (VNNI vpdpbusd / vpdpwssd, or vpmaddubsw / vpmaddwd) then
 * accumulates eight blocks' sums side by side, and one fp32 multiply-add per super-block applies their eight
 * scales: the per-block scalar work of a plain block loop was the bottleneck. Byte 32 u + 4 i + j of
 * super-block s holds, in its low nibble, code 8 u + j of block 8 s + i and, in its high nibble, code
 * 8 u + 4 + j (u = 0..3, j = 0..3): unpacked, vector t = 0..7 of a super-block holds value 4 t + j of block i
 * at byte 4 i + j. Inputs are interleaved the same way (value 4 t + j of block 8 s + i at element
 * 256 s + 32 t + 4 i + j). Blocks after the last whole super-block keep the plain order: 16 bytes each, code j
 * in the low nibble of byte j and code 16 + j in its high nibble.
 */
#ifndef LIGHTINFER_CPU_W4_LAYOUT_H
#define LIGHTINFER_CPU_W4_LAYOUT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define W4_AVX2 1
#endif

#include "cpu_convert.h"

#if defined(W4_AVX2) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define W4_AVX512 1 /* the 512-bit paths of the 4-bit products and of the dense weight's unpacking */
#endif

#if defined(__AVX512VL__)
#define W4_TILE 8 /* input rows that share one unpacked super-block (AVX-512's 32 vector registers) */
#else
#define W4_TILE 4 /* of AVX2's 16 vector registers: 8 hold the codes, 4 the sums */
#endif
#define W4_NCHUNK 16 /* output rows a thread takes at a time */
#define W4_NOUT 4    /* output rows one tile may take (a product may take fewer) */
#ifndef W4_AHEAD
#define W4_AHEAD 12 /* output rows the software prefetch runs ahead of the dot products */
#endif

/* fp16 -> fp32 in one instruction where the CPU has F16C (called per block of weights) */
static inline float w4_half(uint16_t h) {
#ifdef W4_AVX2
    return _cvtsh_ss(h);
#else
    return f16_to_f32(h);
#endif
}

/* where value k (0..31) of block b of a row lives: byte offset, and 0 / 4 for the nibble; nsb = K / 256 */
static inline size_t w4_pos(int b, int k, int nsb, int* shift) {
    if (b < 8 * nsb) {
        int t = k / 4, j = k % 4;
        *shift = (t & 1) ? 4 : 0;
        return (size_t)128 * (b / 8) + 32 * (t / 2) + 4 * (b % 8) + j;
    }
    *shift = k < 16 ? 0 : 4;
    return (size_t)16 * b + (k % 16);
}

/* where value k of block b of an input row lives (the same interleave, one element per value) */
static inline size_t w4_xpos(int b, int k, int nsb) {
    if (b < 8 * nsb) return (size_t)256 * (b / 8) + 32 * (k / 4) + 4 * (b % 8) + k % 4;
    return (size_t)32 * b + k;
}

/* dv[b] = a row's scale (or offset) of block b as fp32, from its K / G fp16 values d (repeated when G > 32) */
static inline void w4_block_values(const uint16_t* d, int K, int G, float* dv) {
    int nb = K / 32, b = 0;
#ifdef W4_AVX2
    if (G == 32)
        for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(dv + b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + b))));
#endif
    /* the rest (and G > 32) without an integer division per block: called for every output row of a product,
     * where a division per block cost more than the row's dot products */
    for (int per = G / 32, g = b / per, j = b % per; b < nb; b++) {
        dv[b] = w4_half(d[g]);
        if (++j == per) j = 0, g++;
    }
}

/* One row of x (fp32 or bf16, K values) -> xq (integers of `bytes` bytes, int8 or int16, K of them, in the
 * interleaved input order above), dx (one scale per block of 32: max |x| / 127 or / 32767, x ~ dx * xq,
 * rounded to nearest even) and sx (the exact fp32 sum of x over each block of 32). */
static inline void w4_quantize_row(const void* x, int dt, int K, int bytes, void* xq, float* dx, float* sx) {
    float v[32];
    int nsb = K / 256;
    float qmax = bytes == 1 ? 127.0f : 32767.0f;
    for (int b = 0; b < K / 32; b++) {
        size_t off = (size_t)32 * b;
        if (dt == DT_BF16) {
            const uint16_t* h = (const uint16_t*)x + off;
            for (int j = 0; j < 32; j++) v[j] = bf16_to_f32(h[j]);
        } else {
            memcpy(v, (const float*)x + off, sizeof v);
        }
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < 32; j++) { /* a compare, not fmaxf: vectorised, no libm call per value */
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
            sum += v[j];
        }
        float d = amax / qmax, id = d > 0.0f ? 1.0f / d : 0.0f;
        union { int8_t b8[32]; int16_t b16[32]; } q;
        if (bytes == 1)
            for (int j = 0; j < 32; j++) q.b8[j] = (int8_t)lrintf(v[j] * id);
        else
            for (int j = 0; j < 32; j++) q.b16[j] = (int16_t)lrintf(v[j] * id);
        char* o = (char*)xq;
        if (b < 8 * nsb) { /* value 4 t + j of block 8 s + i at element 256 s + 32 t + 4 i + j */
            o += (size_t)bytes * (256 * (size_t)(b / 8) + 4 * (b % 8));
            for (int t = 0; t < 8; t++) memcpy(o + (size_t)bytes * 32 * t, (char*)&q + (size_t)bytes * 4 * t, 4 * bytes);
        } else {
            memcpy(o + (size_t)bytes * off, &q, 32 * (size_t)bytes);
        }
        dx[b] = d;
        sx[b] = sum;
    }
}

#ifdef W4_AVX2
static inline float w4_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* The tiles of one product: acc[o * W4_TILE + r] = sum_k W[n + o, k] x[r0 + r, k] for nr <= W4_TILE input
 * rows and no <= W4_NOUT output rows, from the first output row's codes w (K / 2 bytes a row) and its scales
 * and offsets per block dv and mv (fp32, K / 32 a row); in: the prepared input. */
typedef void (*w4_tile_fn)(const uint8_t* w, const float* dv, const float* mv, int K, const void* in, int r0,
                           int nr, int no, float* acc);

/* y [M, N] (fp32 or bf16) = the tiles of `tile` over every output row (+ bias fp32 [N] or NULL), parallel over
 * chunks of W4_NCHUNK output rows: a chunk's weights (a few KB) stay in L1 while every tile of input rows
 * passes over them, so each weight byte is read from memory once per call. Inlined with a constant `tile`. */
static inline __attribute__((always_inline)) void w4_product(int M, int K, const uint8_t* w, const uint16_t* dm,
                                                             int G, int N, const float* bias, void* y, int ydt,
                                                             int nthreads, w4_tile_fn tile, const void* in) {
    int nb = K / 32, ng = K / G;
    int chunks = (N + W4_NCHUNK - 1) / W4_NCHUNK;
    long work_units = (long)N * ((M + W4_TILE - 1) / W4_TILE) * K;
    (void)nthreads;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (work_units >= 65536 && nthreads > 1)
    for (int c = 0; c < chunks; c++) {
        int n0 = c * W4_NCHUNK, n1 = n0 + W4_NCHUNK < N ? n0 + W4_NCHUNK : N;
        /* the chunk's scales and offsets per block, converted once for every tile of rows */
        float dv[W4_NCHUNK * nb], mv[W4_NCHUNK * nb];
        for (int n = n0; n < n1; n++) {
            w4_block_values(dm + (size_t)n * ng * 2, K, G, dv + (size_t)(n - n0) * nb);
            w4_block_values(dm + (size_t)n * ng * 2 + ng, K, G, mv + (size_t)(n - n0) * nb);
        }
        for (int r0 = 0; r0 < M; r0 += W4_TILE) {
            int nr = M - r0 < W4_TILE ? M - r0 : W4_TILE;
            for (int n = n0; n < n1; n += W4_NOUT) {
                int no = n1 - n < W4_NOUT ? n1 - n : W4_NOUT;
                float acc[W4_NOUT * W4_TILE];
#ifdef W4_AVX2
                if (r0 == 0 && n + W4_AHEAD < N) { /* cold weights: ask for the codes W4_AHEAD rows ahead now */
                    int ahead_rows = N - n - W4_AHEAD < no ? N - n - W4_AHEAD : no;
                    const char* ahead = (const char*)(w + (size_t)(n + W4_AHEAD) * (K / 2));
                    for (int i = 0; i < ahead_rows * (K / 2); i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
                }
                if (r0 == 0 && n + W4_NCHUNK < N) { /* and the scales the next chunk converts first thing */
                    int ahead_rows = N - n - W4_NCHUNK < no ? N - n - W4_NCHUNK : no;
                    const char* ahead = (const char*)(dm + (size_t)(n + W4_NCHUNK) * ng * 2);
                    for (int i = 0; i < ahead_rows * ng * 4; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
                }
#endif
                tile(w + (size_t)n * (K / 2), dv + (size_t)(n - n0) * nb, mv + (size_t)(n - n0) * nb, K, in, r0, nr,
                     no, acc);
                for (int o = 0; o < no; o++) {
                    float b = bias ? bias[n + o] : 0.0f;
                    for (int r = 0; r < nr; r++) {
                        size_t at = (size_t)(r0 + r) * N + n + o;
                        if (ydt == DT_BF16)
                            ((uint16_t*)y)[at] = f32_to_bf16(acc[o * W4_TILE + r] + b);
                        else
                            ((float*)y)[at] = acc[o * W4_TILE + r] + b;
                    }
                }
            }
        }
    }
}

/* acc + the int32 pair sums of a x b (int16 each): VNNI vpdpwssd, else vpmaddwd + vpaddd (cpu_w4a16.c, cpu_w8.c) */
#if defined(W4_AVX2) && defined(__AVX512BW__)
static inline __m512i w4_dot16(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
#elif defined(W4_AVX2)
static inline __m256i w4_dot16(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

/* CALL(NR) for nr = 1..W4_TILE input rows, NR a compile-time constant: one unrolled body per row count */
#if W4_TILE == 8
#define W4_BY_ROWS(nr, CALL)                                                                                   \
    switch (nr) {                                                                                              \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    case 4: CALL(4); break;                                                                                    \
    case 5: CALL(5); break;                                                                                    \
    case 6: CALL(6); break;                                                                                    \
    case 7: CALL(7); break;                                                                                    \
    default: CALL(8); break;                                                                                   \
    }
#else
#define W4_BY_ROWS(nr, CALL)                                                                                   \
    switch (nr) {                                                                                              \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    default: CALL(4); break;                                                                                   \
    }
#endif

/* The input of a product quantized per block of 32 (w4_quantize_row): values (int8 or int16, interleaved), and
 * per block a scale and the exact sum of x; rows K values (K / 32 blocks) apart. */
struct w4_qinput {
    const void* xq;
    const float* dx;
    const float* sx;
};

/* y [M, N] (fp32 or bf16) = x [M, K] (fp32 or bf16) W^T (+ bias fp32 [N] or NULL) for a product whose tiles read
 * a w4_qinput of `bytes`-byte values: the rows quantized into work (at least M * (bytes * K + 8 * (K / 32)) + 4
 * bytes, 4-byte aligned), then w4_product. */
static inline __attribute__((always_inline)) void w4_quantized_product(
    const void* x, int xdt, int M, int K, const uint8_t* w, const uint16_t* dm, int G, int N, const float* bias,
    void* y, int ydt, void* work, int nthreads, int bytes, w4_tile_fn tile) {
    int nb = K / 32;
    size_t values = (size_t)M * K * bytes, xstride = (size_t)K * (xdt == DT_BF16 ? 2 : 4);
    float* dx = (float*)((char*)work + values + (4 - values % 4) % 4);
    float* sx = dx + (size_t)M * nb;
    (void)nthreads;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 8 && nthreads > 1)
    for (int r = 0; r < M; r++)
        w4_quantize_row((const char*)x + r * xstride, xdt, K, bytes, (char*)work + (size_t)r * K * bytes,
                        dx + (size_t)r * nb, sx + (size_t)r * nb);
    struct w4_qinput in = {work, dx, sx};
    w4_product(M, K, w, dm, G, N, bias, y, ydt, nthreads, tile, &in);
}

#endif
