/* The CPU's 8-bit matrix product for a weight with one scale per output row (an 8-bit LM head, e.g. SmolLM2's
 * tied Q8_0 table as kernels/cpu_lowbit.py requantizes it): y = x W^T, W[n, k] = s[n] * q[n, k] with q int8 and
 * s bf16, and x quantized to int16 with one scale per row:
 *
 *   input    x[r, k] ~ dx[r] * xq[r, k]          xq in -32767..32767, dx = max |x[r, :]| / 32767
 *   product  y[r, n] = s[n] dx[r] sum_k q[n, k] xq[r, k]
 *
 * The integer sums are exact per lane (int32, converted to fp32 every 2,048 values so that no K overflows them); a bf16
 * activation is held exactly unless it is more than 2^7 times smaller than its row's largest, so the product is
 * within ~1e-5 of the exact one with the same weight, where torch's _weight_int8pack_mm rounds x to bf16 (~2^-9).
 *
 * Built with the other sources of kernels/native into one library by kernels/cpu_native.py (w8_linear). The
 * weight keeps its plain [N, K] order (a tied embedding reads its rows): 32 codes widen to 32 int16 (vpmovsxbw)
 * and one VNNI vpdpwssd (else vpmaddwd + vpaddd) per input row multiplies them; AVX2 does it 16 at a time.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_w4_layout.h"

#define W8_SPAN 2048 /* values summed per int32 lane before a conversion: at most 2048 / 16 * 127 * 32767 < 2^31 */

/* xq[r, :] and dx[r] for one row of x (fp32 or bf16, K values) */
static void w8_quantize_row(const void* x, int dt, int K, int16_t* xq, float* dx) {
    float amax = 0.0f;
    for (int k = 0; k < K; k++) {
        float v = dt == DT_BF16 ? bf16_to_f32(((const uint16_t*)x)[k]) : ((const float*)x)[k];
        float a = fabsf(v);
        amax = a > amax ? a : amax;
    }
    float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int k = 0; k < K; k++) {
        float v = dt == DT_BF16 ? bf16_to_f32(((const uint16_t*)x)[k]) : ((const float*)x)[k];
        xq[k] = (int16_t)lrintf(v * id);
    }
    *dx = d;
}

#if defined(W4_AVX2) && defined(__AVX512BW__)
#define W8_AVX512 1
#endif

/* acc[r] = sum_k q[k] xq[r, k] (as fp32) for NR (a compile-time constant once inlined) input rows */
static inline __attribute__((always_inline)) void w8_rows(const int8_t* q, int K, const int16_t* xq, const int NR,
                                                          float* acc) {
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += W8_SPAN) {
        int k1 = k0 + W8_SPAN < K ? k0 + W8_SPAN : K, k = k0;
#if defined(W8_AVX512)
        const int CH = NR == 1 ? 4 : NR == 2 ? 2 : 1;
        __m512i s[W4_TILE][4];
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) s[r][0] = s[r][1] = s[r][2] = s[r][3] = _mm512_setzero_si512();
        for (; k + 32 * CH <= k1; k += 32 * CH)
            _Pragma("GCC unroll 4") for (int c = 0; c < CH; c++) {
                __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + k + 32 * c)));
                _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)
                    s[r][c] = w4_dot16(s[r][c], w, _mm512_loadu_si512(xq + (size_t)r * K + k + 32 * c));
            }
        for (; k + 32 <= k1; k += 32) {
            __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(q + k)));
            _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)
                s[r][0] = w4_dot16(s[r][0], w, _mm512_loadu_si512(xq + (size_t)r * K + k));
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
            __m512i t = _mm512_add_epi32(_mm512_add_epi32(s[r][0], s[r][1]), _mm512_add_epi32(s[r][2], s[r][3]));
            acc[r] += _mm512_reduce_add_ps(_mm512_cvtepi32_ps(t)); /* lanes <= 2^29: the sum of 16 may not be */
        }
#elif defined(W4_AVX2)
        __m256i s[W4_TILE][2];
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        for (; k + 32 <= k1; k += 32)
            _Pragma("GCC unroll 2") for (int c = 0; c < 2; c++) {
                __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + k + 16 * c)));
                _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++)
                    s[r][c] = w4_dot16(s[r][c], w, _mm256_loadu_si256((const __m256i*)(xq + (size_t)r * K + k + 16 * c)));
            }
        _Pragma("GCC unroll 4") for (int r = 0; r < NR; r++) {
            acc[r] += w4_hsum8(_mm256_cvtepi32_ps(_mm256_add_epi32(s[r][0], s[r][1])));
        }
#endif
        /* what the vectors left (and everything without AVX2): exact int64 sums, one conversion per span, as the
         * vector lanes do (a float sum per product drifted by ~K * 2^-24 of the result) */
        int64_t rest[W4_TILE] = {0};
        for (; k < k1; k++)
            for (int r = 0; r < NR; r++) rest[r] += (int32_t)q[k] * xq[(size_t)r * K + k];
        for (int r = 0; r < NR; r++) acc[r] += (float)rest[r];
    }
}

static void w8_tile(const int8_t* q, int K, const int16_t* xq, int nr, float* acc) {
#define DOT(NR) w8_rows(q, K, xq, NR, acc)
    W4_BY_ROWS(nr, DOT)
#undef DOT
}

/* y [M, N] (fp32 or bf16) = x [M, K] (fp32 or bf16) W^T (+ bias fp32 [N] or NULL), W = s * q: q int8 [N, K],
 * s bf16 [N]. work: at least M * (2 * K + 4) + 4 bytes, 4-byte aligned (the quantized input). */
void li_w8_linear(const void* x, int xdt, int M, int K, const int8_t* q, const uint16_t* s, int N, const float* bias,
                  void* y, int ydt, void* work, int nthreads) {
    int16_t* xq = (int16_t*)work;
    float* dx = (float*)(xq + (size_t)M * K + ((size_t)M * K) % 2);
    size_t xstride = (size_t)K * (xdt == DT_BF16 ? 2 : 4);
    (void)nthreads;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M >= 8 && nthreads > 1)
    for (int r = 0; r < M; r++) w8_quantize_row((const char*)x + r * xstride, xdt, K, xq + (size_t)r * K, dx + r);
    int chunks = (N + W4_NCHUNK - 1) / W4_NCHUNK;
    long work_units = (long)N * ((M + W4_TILE - 1) / W4_TILE) * K;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (work_units >= 65536 && nthreads > 1)
    for (int c = 0; c < chunks; c++) {
        int n0 = c * W4_NCHUNK, n1 = n0 + W4_NCHUNK < N ? n0 + W4_NCHUNK : N;
        for (int r0 = 0; r0 < M; r0 += W4_TILE) {
            int nr = M - r0 < W4_TILE ? M - r0 : W4_TILE;
            for (int n = n0; n < n1; n++) {
                float acc[W4_TILE], sn = bf16_to_f32(s[n]), b = bias ? bias[n] : 0.0f;
#ifdef W4_AVX2
                if (r0 == 0 && n + W4_AHEAD < N) { /* cold weights: ask for the row W4_AHEAD ahead now */
                    const char* ahead = (const char*)(q + (size_t)(n + W4_AHEAD) * K);
                    for (int i = 0; i < K; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
                }
#endif
                w8_tile(q + (size_t)n * K, K, xq + (size_t)r0 * K, nr, acc);
                for (int r = 0; r < nr; r++) {
                    size_t at = (size_t)(r0 + r) * N + n;
                    float v = acc[r] * (sn * dx[r0 + r]) + b;
                    if (ydt == DT_BF16)
                        ((uint16_t*)y)[at] = f32_to_bf16(v);
                    else
                        ((float*)y)[at] = v;
                }
            }
        }
    }
}
