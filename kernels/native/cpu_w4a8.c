/* The CPU's 4-bit matrix product with int8 activations (opt-in: LIGHTINFER_CPU_W4=int8): y = x W^T with W in
 * the 4-bit layout of cpu_w4_layout.h and x quantized to int8 per block of 32.
 *
 * Built with the other sources of kernels/native into one library by kernels/cpu_native.py, which calls it
 * (w4_linear with int8_activations). The scheme is llama.cpp's Q4_1 x Q8_1 dot product
 * (ggml-quants.c), with a group of G >= 32 weights sharing one (scale, offset):
 *
 *   input    x[r, k] ~ dx[r, b] * xq[r, k]                   xq in -127..127, one dx per block b of 32 along k
 *   product  y[r, n] = sum_b d[n,b] dx[r,b] sum_{k in b} q[n,k] xq[r,k]  +  sum_b m[n,b] sx[r,b]
 *
 * where sx[r, b] is the exact fp32 sum of x over block b (so the offset term carries no activation rounding),
 * and d, m a block's group's.
 * The input is interleaved as the weight is (w4_quantize_row), one byte per value.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_w4_layout.h"

#ifdef W4_AVX2
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
 * the NR accumulators in registers. w: row n's codes; dv and mv: its scale and offset per block (fp32, K / 32);
 * xq, dx, sx: the rows' quantized values, block scales and block sums. */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t* w, const float* dv, const float* mv,
                                                           int K, const int8_t* xq, const float* dx,
                                                           const float* sx, const int NR, float* acc) {
    int nb = K / 32, nsb = nb / 8;
#ifdef W4_AVX2
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 total[W4_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) total[r] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t* ws = w + (size_t)128 * sb;
        __m256i q[8];
        _Pragma("GCC unroll 8") for (int u = 0; u < 4; u++) {
            __m256i v = _mm256_loadu_si256((const __m256i*)(ws + 32 * u));
            q[2 * u] = _mm256_and_si256(v, low);
            q[2 * u + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        __m256 d8 = _mm256_loadu_ps(dv + 8 * sb), m8 = _mm256_loadu_ps(mv + 8 * sb);
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
            const int8_t* a = xq + (size_t)r * K + 256 * (size_t)sb;
            total[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sx + (size_t)r * nb + 8 * sb), total[r]);
            __m256i s32 = dot32(_mm256_setzero_si256(), q[0], _mm256_loadu_si256((const __m256i*)a));
            _Pragma("GCC unroll 8") for (int t = 1; t < 8; t++)
                s32 = dot32(s32, q[t], _mm256_loadu_si256((const __m256i*)(a + 32 * t)));
            __m256 scale = _mm256_mul_ps(d8, _mm256_loadu_ps(dx + (size_t)r * nb + 8 * sb));
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s32), scale, total[r]);
        }
    }
    for (int b = 8 * nsb; b < nb; b++) { /* the blocks after the last super-block, in plain order */
        __m128i raw = _mm_loadu_si128((const __m128i*)(w + 16 * (size_t)b));
        __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
            __m256i a = _mm256_loadu_si256((const __m256i*)(xq + (size_t)r * K + 32 * (size_t)b));
            __m256 scale = _mm256_set1_ps(dv[b] * dx[(size_t)r * nb + b]);
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(_mm256_setzero_si256(), q, a)), scale, total[r]);
            total[r] = _mm256_add_ps(total[r], _mm256_setr_ps(mv[b] * sx[(size_t)r * nb + b], 0, 0, 0, 0, 0, 0, 0));
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) acc[r] = w4_hsum8(total[r]);
#else
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    for (int b = 0; b < nb; b++) {
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
            const int8_t* a = xq + (size_t)r * K;
            int s = 0, shift;
            for (int k = 0; k < 32; k++) {
                size_t at = w4_pos(b, k, nsb, &shift);
                s += ((w[at] >> shift) & 15) * a[w4_xpos(b, k, nsb)];
            }
            acc[r] += (float)s * (dv[b] * dx[(size_t)r * nb + b]) + mv[b] * sx[(size_t)r * nb + b];
        }
    }
#endif
}

/* the w4_tile_fn of this product: in is the struct w4_qinput of the whole input (int8 values) */
static void dot_tile(const uint8_t* w, const float* dv, const float* mv, int K, const void* in, int r0, int nr,
                     int no, float* acc) {
    const struct w4_qinput* p = (const struct w4_qinput*)in;
    const int8_t* xq = (const int8_t*)p->xq + (size_t)r0 * K;
    const float* dx = p->dx + (size_t)r0 * (K / 32);
    const float* sx = p->sx + (size_t)r0 * (K / 32);
#define DOT(NR) dot_rows(w, dv, mv, K, xq, dx, sx, NR, acc)
    for (int o = 0; o < no; o++, w += K / 2, dv += K / 32, mv += K / 32, acc += W4_TILE) W4_BY_ROWS(nr, DOT)
#undef DOT
}

/* y [M, N] (fp32 or bf16) = x [M, K] (fp32 or bf16) W^T (+ bias fp32 [N] or NULL).
 * work: at least M * (K + 8 * (K / 32)) + 4 bytes, 4-byte aligned (the quantized input). */
void li_w4a8_linear(const void* x, int xdt, int M, int K, const uint8_t* w, const uint16_t* dm, int G, int N,
                    const float* bias, void* y, int ydt, void* work, int nthreads) {
    w4_quantized_product(x, xdt, M, K, w, dm, G, N, bias, y, ydt, work, nthreads, 1, dot_tile);
}
