/* The CPU's 4-bit matrix product: y = x W^T with W in 4-bit codes and x quantized to int8 per block of 32.
 *
 * Built with cpu_decode_ops.c into one library by kernels/cpu_native.py; called through ctypes from
 * kernels/cpu_lowbit.py (w4a8_linear). The scheme is llama.cpp's Q4_1 x Q8_1 dot product (ggml-quants.c),
 * with a group of G >= 32 weights sharing one (scale, offset):
 *
 *   weight   w[n, k] = d[n, g] * q[n, k] + m[n, g]          q in 0..15, g = k / G, d and m fp16
 *   input    x[r, k] ~ dx[r, b] * xq[r, k]                   xq in -127..127, one dx per block b of 32 along k
 *   product  y[r, n] = sum_g d[n,g] * sum_{b in g} dx[r,b] * sum_{k in b} q[n,k] xq[r,k]  +  sum_g m[n,g] sx[r,g]
 *
 * where sx[r, g] is the exact fp32 sum of x over group g (so the offset term carries no activation rounding).
 *
 * Layout (li_w4_pack writes the weight from one byte per code; quantize_row_q8 the input likewise): a row's
 * K / 32 blocks go in groups of 8 ("super-blocks" of 256 values, 128 bytes of codes), interleaved so that
 * one 32-byte vector holds 4 consecutive values of each of the 8 blocks: its int32 lane i is block i's.
 * A dot-product instruction (VNNI vpdpbusd, or vpmaddubsw + vpmaddwd) then accumulates eight blocks' sums
 * at once, and one fp32 multiply-add per super-block applies their eight scales; the per-block fp32 work of
 * a plain Q4 x Q8 loop was the kernel's bottleneck. Byte 32 u + 4 i + j of super-block s holds, in its low
 * nibble, code 8 u + j of block 8 s + i and, in its high nibble, code 8 u + 4 + j (u = 0..3, j = 0..3);
 * the input's byte 32 t + 4 i + j is value 4 t + j of block 8 s + i (t = 0..7). Blocks after the last whole
 * super-block keep the plain order: 16 bytes each, code j in the low nibble of byte j and 16 + j in its high.
 * dm holds fp16 [N, 2, K / G]: each row's K / G scales d, then its K / G offsets m.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define W4_AVX2 1
#endif

#include "cpu_convert.h"

#if defined(__AVX512VL__)
#define W4_TILE 8 /* input rows that share one unpacked super-block: 8 + 8 + 8 vector registers of 32 */
#else
#define W4_TILE 4 /* of AVX2's 16 vector registers: 8 hold the codes, 4 the sums */
#endif
#define W4_NCHUNK 16 /* output rows a thread takes at a time */
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

/* where value k (0..31) of block b of a row lives in the layout above: byte offset, and 0 / 4 for the nibble */
static inline size_t w4_pos(int b, int k, int nsb, int* shift) {
    if (b < 8 * nsb) {
        int t = k / 4, j = k % 4;
        *shift = (t & 1) ? 4 : 0;
        return (size_t)128 * (b / 8) + 32 * (t / 2) + 4 * (b % 8) + j;
    }
    *shift = k < 16 ? 0 : 4;
    return (size_t)16 * b + (k % 16);
}

/* where value k of block b of an input row lives (the same interleave, one byte per value) */
static inline size_t w4_xpos(int b, int k, int nsb) {
    if (b < 8 * nsb) return (size_t)256 * (b / 8) + 32 * (k / 4) + 4 * (b % 8) + k % 4;
    return (size_t)32 * b + k;
}

/* codes [N, K] one byte each (0..15) -> the layout above, [N, K / 2] bytes */
void li_w4_pack(const uint8_t* codes, uint8_t* packed, long n_rows, int K) {
    int nb = K / 32, nsb = nb / 8, shift;
    for (long n = 0; n < n_rows; n++) {
        const uint8_t* c = codes + n * (long)K;
        uint8_t* p = packed + n * (long)(K / 2);
        memset(p, 0, (size_t)K / 2);
        for (int b = 0; b < nb; b++)
            for (int k = 0; k < 32; k++) {
                size_t at = w4_pos(b, k, nsb, &shift);
                p[at] |= (uint8_t)((c[32 * b + k] & 15) << shift);
            }
    }
}

/* One row of x (fp32 or bf16, K values) -> xq (int8, K), dx (one per 32), sx (exact sum per group of G). */
static void quantize_row_q8(const void* x, int dt, int K, int G, int8_t* xq, float* dx, float* sx) {
    float v[32];
    int nsb = K / 256;
    for (int g = 0; g < K / G; g++) sx[g] = 0.0f;
    for (int b = 0; b < K / 32; b++) {
        size_t off = (size_t)32 * b;
        if (dt == DT_BF16) {
            const uint16_t* h = (const uint16_t*)x + off;
            for (int j = 0; j < 32; j++) v[j] = bf16_to_f32(h[j]);
        } else {
            memcpy(v, (const float*)x + off, sizeof v);
        }
        float amax = 0.0f, sum = 0.0f;
        for (int j = 0; j < 32; j++) {
            amax = fmaxf(amax, fabsf(v[j]));
            sum += v[j];
        }
        float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int8_t q[32];
        for (int j = 0; j < 32; j++) q[j] = (int8_t)lrintf(v[j] * id);
        if (b < 8 * nsb) { /* value 4 t + j of block 8 s + i at byte 256 s + 32 t + 4 i + j */
            int8_t* o = xq + (size_t)256 * (b / 8) + 4 * (b % 8);
            for (int t = 0; t < 8; t++) memcpy(o + 32 * t, q + 4 * t, 4);
        } else {
            memcpy(xq + off, q, 32);
        }
        dx[b] = d;
        sx[(32 * b) / G] += sum;
    }
}

#ifdef W4_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* acc + the 8 int32 lane sums of q (unsigned 0..15) x a (signed), 4 bytes a lane: VNNI where the CPU has it */
static inline __m256i dot32(__m256i acc, __m256i q, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, q, a);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, q, a);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1)));
#endif
}
#endif

/* acc[r] = sum_k W[n, k] x[r, k] for NR (a compile-time constant once inlined) input rows: the compiler keeps
 * the NR accumulators in registers. w: row n's codes; dv: row n's scale per block (fp32, K / 32); m: its
 * offsets per group (fp16, K / G). */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t* w, const float* dv, const uint16_t* m,
                                                           int K, int G, const int8_t* xq, const float* dx,
                                                           const float* sx, const int NR, float* acc) {
    int nb = K / 32, nsb = nb / 8, ng = K / G;
#ifdef W4_AVX2
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 total[W4_TILE];
    for (int r = 0; r < NR; r++) total[r] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t* ws = w + (size_t)128 * sb;
        __m256i q[8];
        for (int u = 0; u < 4; u++) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(ws + 32 * u));
            q[2 * u] = _mm256_and_si256(v, low);
            q[2 * u + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        __m256 d8 = _mm256_loadu_ps(dv + 8 * sb);
        for (int r = 0; r < NR; r++) {
            const int8_t* a = xq + (size_t)r * K + 256 * (size_t)sb;
            __m256i s32 = dot32(_mm256_setzero_si256(), q[0], _mm256_loadu_si256((const __m256i*)a));
            for (int t = 1; t < 8; t++)
                s32 = dot32(s32, q[t], _mm256_loadu_si256((const __m256i*)(a + 32 * t)));
            __m256 scale = _mm256_mul_ps(d8, _mm256_loadu_ps(dx + (size_t)r * nb + 8 * sb));
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, total[r]);
        }
    }
    for (int b = 8 * nsb; b < nb; b++) { /* the blocks after the last super-block, in plain order */
        __m128i raw = _mm_loadu_si128((const __m128i*)(w + 16 * (size_t)b));
        __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
        for (int r = 0; r < NR; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i*)(xq + (size_t)r * K + 32 * (size_t)b));
            __m256 scale = _mm256_set1_ps(dv[b] * dx[(size_t)r * nb + b]);
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(_mm256_setzero_si256(), q, a)), scale, total[r]);
        }
    }
    for (int r = 0; r < NR; r++) acc[r] = hsum8(total[r]);
#else
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    for (int b = 0; b < nb; b++) {
        for (int r = 0; r < NR; r++) {
            const int8_t* a = xq + (size_t)r * K;
            int s = 0, shift;
            for (int k = 0; k < 32; k++) {
                size_t at = w4_pos(b, k, nsb, &shift);
                s += ((w[at] >> shift) & 15) * a[w4_xpos(b, k, nsb)];
            }
            acc[r] += (float)s * (dv[b] * dx[(size_t)r * nb + b]);
        }
    }
#endif
    for (int g = 0; g < ng; g++) { /* the offsets against the exact sums of x */
        float mg = w4_half(m[g]);
        for (int r = 0; r < NR; r++) acc[r] += mg * sx[(size_t)r * ng + g];
    }
}

static void dot_tile(const uint8_t* w, const float* dv, const uint16_t* m, int K, int G, const int8_t* xq,
                     const float* dx, const float* sx, int nr, float* acc) {
    switch (nr) { /* constant row counts: one unrolled body each */
    case 1: dot_rows(w, dv, m, K, G, xq, dx, sx, 1, acc); break;
    case 2: dot_rows(w, dv, m, K, G, xq, dx, sx, 2, acc); break;
    case 3: dot_rows(w, dv, m, K, G, xq, dx, sx, 3, acc); break;
#if W4_TILE == 8
    case 4: dot_rows(w, dv, m, K, G, xq, dx, sx, 4, acc); break;
    case 5: dot_rows(w, dv, m, K, G, xq, dx, sx, 5, acc); break;
    case 6: dot_rows(w, dv, m, K, G, xq, dx, sx, 6, acc); break;
    case 7: dot_rows(w, dv, m, K, G, xq, dx, sx, 7, acc); break;
#endif
    default: dot_rows(w, dv, m, K, G, xq, dx, sx, W4_TILE, acc); break;
    }
}

/* dv[b] = row n's scale d of block b as fp32 (its group's, repeated when G > 32) */
static inline void block_scales(const uint16_t* d, int K, int G, float* dv) {
    int nb = K / 32, b = 0;
#ifdef W4_AVX2
    if (G == 32)
        for (; b + 8 <= nb; b += 8) _mm256_storeu_ps(dv + b, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(d + b))));
#endif
    for (; b < nb; b++) dv[b] = w4_half(d[(32 * b) / G]);
}

/* y [M, N] (fp32 or bf16) = x [M, K] (fp32 or bf16) W^T (+ bias fp32 [N] or NULL).
 * work: at least M * (K + 4 * (K / 32) + 4 * (K / G)) bytes (the quantized input). */
void li_w4a8_linear(const void* x, int xdt, int M, int K, const uint8_t* w, const uint16_t* dm, int G, int N,
                    const float* bias, void* y, int ydt, void* work, int nthreads) {
    int nb = K / 32, ng = K / G;
    int8_t* xq = (int8_t*)work;
    float* dx = (float*)(xq + (size_t)M * K + ((4 - ((size_t)M * K) % 4) % 4));
    float* sx = dx + (size_t)M * nb;
    size_t xstride = (size_t)K * (xdt == DT_BF16 ? 2 : 4);
    (void)nthreads;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 8 && nthreads > 1)
    for (int r = 0; r < M; r++)
        quantize_row_q8((const char*)x + r * xstride, xdt, K, G, xq + (size_t)r * K, dx + (size_t)r * nb,
                        sx + (size_t)r * ng);
    /* A thread owns chunks of W4_NCHUNK output rows: their weights (a few KB) stay in L1 while every tile of
     * input rows passes over them, so each weight byte is read from memory once per call. */
    int chunks = (N + W4_NCHUNK - 1) / W4_NCHUNK;
    long work_units = (long)N * ((M + W4_TILE - 1) / W4_TILE) * K;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (work_units >= 65536 && nthreads > 1)
    for (int c = 0; c < chunks; c++) {
        int n0 = c * W4_NCHUNK, n1 = n0 + W4_NCHUNK < N ? n0 + W4_NCHUNK : N;
        float dv[W4_NCHUNK * nb]; /* the chunk's scales per block, converted once for every tile of rows */
        for (int n = n0; n < n1; n++) block_scales(dm + (size_t)n * ng * 2, K, G, dv + (size_t)(n - n0) * nb);
        for (int r0 = 0; r0 < M; r0 += W4_TILE) {
            int nr = M - r0 < W4_TILE ? M - r0 : W4_TILE;
            for (int n = n0; n < n1; n++) {
                float acc[W4_TILE], b = bias ? bias[n] : 0.0f;
#ifdef W4_AVX2
                if (r0 == 0 && n + W4_AHEAD < N) { /* cold weights: ask for the row W4_AHEAD ahead now */
                    const char* ahead = (const char*)(w + (size_t)(n + W4_AHEAD) * (K / 2));
                    for (int i = 0; i < K / 2; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
                    _mm_prefetch((const char*)(dm + (size_t)(n + W4_AHEAD) * ng * 2), _MM_HINT_T0);
                }
#endif
                dot_tile(w + (size_t)n * (K / 2), dv + (size_t)(n - n0) * nb, dm + (size_t)n * ng * 2 + ng, K, G,
                         xq + (size_t)r0 * K, dx + (size_t)r0 * nb, sx + (size_t)r0 * ng, nr, acc);
                for (int r = 0; r < nr; r++) {
                    size_t at = (size_t)(r0 + r) * N + n;
                    if (ydt == DT_BF16)
                        ((uint16_t*)y)[at] = f32_to_bf16(acc[r] + b);
                    else
                        ((float*)y)[at] = acc[r] + b;
                }
            }
        }
    }
}

/* W [N, K] fp32 = d * q + m: the dense weight, for products of many rows (a prefill) where a dense GEMM of
 * the torch build beats the block dot products above; written by rows, parallel over them. */
void li_w4_dequant(const uint8_t* w, const uint16_t* dm, int G, int N, int K, float* out, int nthreads) {
    int ng = K / G;
    (void)nthreads;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (long)N * K >= 65536)
    for (int n = 0; n < N; n++) {
        const uint8_t* p = w + (size_t)n * (K / 2);
        float* o = out + (size_t)n * K;
        int nb = K / 32, nsb = nb / 8, shift;
        for (int b = 0; b < nb; b++) {
            int g = (32 * b) / G;
            float d = w4_half(dm[(size_t)n * ng * 2 + g]), m = w4_half(dm[(size_t)n * ng * 2 + ng + g]);
            for (int k = 0; k < 32; k++) {
                size_t at = w4_pos(b, k, nsb, &shift);
                o[32 * b + k] = d * (float)((p[at] >> shift) & 15) + m;
            }
        }
    }
}
