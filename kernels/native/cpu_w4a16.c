/* The CPU's 4-bit matrix product with 16-bit activations (the default where this library builds):
 * y = x W^T with W in the interleaved 4-bit layout of cpu_w4_layout.h and x quantized to int16 per block of 32.
 *
 * Built with the other sources of kernels/native into one library by kernels/cpu_native.py, which calls it
 * (w4_linear). The structure is cpu_w4a8.c's with 16-bit integers:
 *
 *   input    x[r, k] ~ dx[r, b] * xq[r, k]                   xq in -32767..32767, one dx per block b of 32
 *   product  y[r, n] = sum_b d[n,b] dx[r,b] sum_{k in b} q[n,k] xq[r,k]  +  sum_b m[n,b] sx[r,b]
 *
 * with sx[r, b] the exact fp32 sum of x over block b (and d, m a block's group's). 15 bits per block of 32 hold
 * a bf16 activation (8 significant bits) exactly unless it is more than 2^7 times smaller than its block's
 * largest, and round it by at most 2^-16 of that largest otherwise: the product is the exact one within ~1e-5 of
 * its norm (fp32 activations are rounded likewise), where int8 activations (cpu_w4a8.c) move it by ~1e-2. The
 * integer sums are exact.
 *
 * AVX-512 (VNNI vpdpwssd, else vpmaddwd + vpaddd): a super-block's 256 codes widen to 8 vectors of 32 words,
 * word 4 i + j holding a value of block i, and 8 dot-product instructions per input row sum its 256 products
 * into 16 int32 lanes, two per block; one conversion and one FMA then apply the 8 blocks' scales. AVX2: the
 * same in 16-word halves. Else plain loops.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_w4_layout.h"

#if defined(W4_AVX512)
static const int32_t W16_PAIRS[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
#endif

/* acc[r] = sum_k W[n, k] x[r, k] for NR (a compile-time constant once inlined) input rows: w, row n's codes; dv
 * and mv, its scale and offset per block (fp32, K / 32); xq, dx, sx: the rows' quantized values, block scales
 * and block sums. Few rows get two partial sums each, so that the dependent chain of dot products does not
 * bound the loop. */
static inline __attribute__((always_inline)) void dot_rows(const uint8_t* w, const float* dv, const float* mv,
                                                           int K, const int16_t* xq, const float* dx,
                                                           const float* sx, const int NR, float* acc) {
    int nb = K / 32, nsb = nb / 8;
#if defined(W4_AVX512)
    const int CH = NR <= 2 ? 2 : 1;
    const __m512i low = _mm512_set1_epi16(0x0f), pairs = _mm512_loadu_si512(W16_PAIRS);
    __m512 total[W4_TILE];
    __m256 offs[W4_TILE]; /* the offset terms m * sx of the super-blocks' 8 blocks */
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) total[r] = _mm512_setzero_ps(), offs[r] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t* ws = w + (size_t)128 * sb;
        const __m256 m8 = _mm256_loadu_ps(mv + 8 * sb);
        __m512i q[8];
        _Pragma("GCC unroll 8") for (int u = 0; u < 4; u++) {
            __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(ws + 32 * u)));
            q[2 * u] = _mm512_and_si512(v, low);
            q[2 * u + 1] = _mm512_srli_epi16(v, 4);
        }
        __m512 d16 = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(dv + 8 * sb)));
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
            const int16_t* a = xq + (size_t)r * K + 256 * (size_t)sb;
            __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) s[t % CH] = w4_dot16(s[t % CH], q[t], _mm512_loadu_si512(a + 32 * t));
            if (CH == 2) s[0] = _mm512_add_epi32(s[0], s[1]);
            __m512 dx16 = _mm512_permutexvar_ps(
                pairs, _mm512_castps256_ps512(_mm256_loadu_ps(dx + (size_t)r * nb + 8 * sb)));
            total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[0]), _mm512_mul_ps(d16, dx16), total[r]);
            offs[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sx + (size_t)r * nb + 8 * sb), offs[r]);
        }
    }
    for (int b = 8 * nsb; b < nb; b++) { /* the blocks after the last super-block, in plain order */
        __m128i raw = _mm_loadu_si128((const __m128i*)(w + 16 * (size_t)b));
        __m512i q = _mm512_and_si512(_mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw)), low);
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
            __m512i s = w4_dot16(_mm512_setzero_si512(), q, _mm512_loadu_si512(xq + (size_t)r * K + 32 * (size_t)b));
            total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(dv[b] * dx[(size_t)r * nb + b]), total[r]);
            offs[r] = _mm256_add_ps(offs[r], _mm256_setr_ps(mv[b] * sx[(size_t)r * nb + b], 0, 0, 0, 0, 0, 0, 0));
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)
        acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(total[r], _mm512_zextps256_ps512(offs[r])));
#elif defined(W4_AVX2)
    /* a super-block's vector t holds blocks 0-3 in its first 16 words and 4-7 in its last: two sums per row */
    const __m256i low = _mm256_set1_epi16(0x0f);
    __m256 total[W4_TILE];
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) total[r] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const __m256 m8 = _mm256_loadu_ps(mv + 8 * sb);
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) total[r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sx + (size_t)r * nb + 8 * sb), total[r]);
        const uint8_t* ws = w + (size_t)128 * sb;
        __m256i s[W4_TILE][2];
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {
            _Pragma("GCC unroll 8") for (int h = 0; h < 2; h++) {
                __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(ws + 32 * (t / 2) + 16 * h)));
                __m256i q = t & 1 ? _mm256_srli_epi16(v, 4) : _mm256_and_si256(v, low);
                _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++)
                    s[r][h] = w4_dot16(s[r][h], q, _mm256_loadu_si256(
                                                    (const __m256i*)(xq + (size_t)r * K + 256 * (size_t)sb + 32 * t + 16 * h)));
            }
        }
        _Pragma("GCC unroll 8") for (int h = 0; h < 2; h++) { /* lanes 2 i, 2 i + 1: block 4 h + i */
            const __m256i idx = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
            __m256 d8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(dv + 8 * sb + 4 * h)), idx);
            _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
                __m256 dx8 = _mm256_permutevar8x32_ps(
                    _mm256_castps128_ps256(_mm_loadu_ps(dx + (size_t)r * nb + 8 * sb + 4 * h)), idx);
                total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), _mm256_mul_ps(d8, dx8), total[r]);
            }
        }
    }
    for (int b = 8 * nsb; b < nb; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i*)(w + 16 * (size_t)b)), l4 = _mm_set1_epi8(0x0f);
        __m256i q0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, l4));
        __m256i q1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), l4));
        _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
            const int16_t* a = xq + (size_t)r * K + 32 * (size_t)b;
            __m256i s = w4_dot16(w4_dot16(_mm256_setzero_si256(), q0, _mm256_loadu_si256((const __m256i*)a)), q1,
                              _mm256_loadu_si256((const __m256i*)(a + 16)));
            total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dv[b] * dx[(size_t)r * nb + b]), total[r]);
            total[r] = _mm256_add_ps(total[r], _mm256_setr_ps(mv[b] * sx[(size_t)r * nb + b], 0, 0, 0, 0, 0, 0, 0));
        }
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) acc[r] = w4_hsum8(total[r]);
#else
    _Pragma("GCC unroll 8") for (int r = 0; r < NR; r++) {
        const int16_t* a = xq + (size_t)r * K;
        float sum = 0.0f;
        int shift;
        for (int b = 0; b < nb; b++) {
            int32_t s = 0;
            for (int k = 0; k < 32; k++) {
                size_t at = w4_pos(b, k, nsb, &shift);
                s += ((w[at] >> shift) & 15) * a[w4_xpos(b, k, nsb)];
            }
            sum += (float)s * (dv[b] * dx[(size_t)r * nb + b]) + mv[b] * sx[(size_t)r * nb + b];
        }
        acc[r] = sum;
    }
#endif
}

#if defined(W4_AVX512)
/* acc[o * W4_TILE + r] = sum_k W[n + o, k] x[r, k] for W4_NOUT output rows (codes K / 2 bytes apart, dv and mv
 * K / 32 apart) and NR <= 2 input rows at once, as dot_rows computes each: a decode step's shape. Each input
 * vector and block scale is loaded once for the W4_NOUT rows, and their 2 * W4_NOUT * NR sums are independent
 * chains of dot products (one row's own two chains waited on the dot product's latency). */
static inline __attribute__((always_inline)) void dot_outs(const uint8_t* w, const float* dv, const float* mv,
                                                           int K, const int16_t* xq, const float* dx,
                                                           const float* sx, const int NR, float* acc) {
    int nb = K / 32, nsb = nb / 8;
    const __m512i low = _mm512_set1_epi16(0x0f), pairs = _mm512_loadu_si512(W16_PAIRS);
    __m512 total[W4_NOUT][2];
    __m256 offs[W4_NOUT][2];
    _Pragma("GCC unroll 8") for (int o = 0; o < W4_NOUT; o++)
        _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) total[o][r] = _mm512_setzero_ps(), offs[o][r] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        __m512i s[W4_NOUT][2][2]; /* output row, input row, even / odd u */
        _Pragma("GCC unroll 8") for (int o = 0; o < W4_NOUT; o++)
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) s[o][r][0] = s[o][r][1] = _mm512_setzero_si512();
        _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
            __m512i xa[2][2];
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) {
                const int16_t* a = xq + (size_t)r * K + 256 * (size_t)sb + 64 * u;
                xa[r][0] = _mm512_loadu_si512(a), xa[r][1] = _mm512_loadu_si512(a + 32);
            }
            _Pragma("GCC unroll 8") for (int o = 0; o < W4_NOUT; o++) {
                __m512i v = _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256((const __m256i*)(w + (size_t)o * (K / 2) + 128 * (size_t)sb + 32 * u)));
                __m512i q0 = _mm512_and_si512(v, low), q1 = _mm512_srli_epi16(v, 4);
                _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
                    s[o][r][u & 1] = w4_dot16(w4_dot16(s[o][r][u & 1], q0, xa[r][0]), q1, xa[r][1]);
            }
        }
        __m512 dx16[2];
        _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
            dx16[r] = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(dx + (size_t)r * nb + 8 * sb)));
        _Pragma("GCC unroll 8") for (int o = 0; o < W4_NOUT; o++) {
            const float* dvo = dv + (size_t)o * nb + 8 * sb;
            __m512 d16 = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(dvo)));
            __m256 m8 = _mm256_loadu_ps(mv + (size_t)o * nb + 8 * sb);
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) {
                __m512i sum = _mm512_add_epi32(s[o][r][0], s[o][r][1]);
                total[o][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d16, dx16[r]), total[o][r]);
                offs[o][r] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(sx + (size_t)r * nb + 8 * sb), offs[o][r]);
            }
        }
    }
    for (int b = 8 * nsb; b < nb; b++) /* the blocks after the last super-block, in plain order */
        _Pragma("GCC unroll 8") for (int o = 0; o < W4_NOUT; o++) {
            __m128i raw = _mm_loadu_si128((const __m128i*)(w + (size_t)o * (K / 2) + 16 * (size_t)b));
            __m512i q = _mm512_and_si512(_mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw)), low);
            float d = dv[(size_t)o * nb + b], m = mv[(size_t)o * nb + b];
            _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++) {
                __m512i sum = w4_dot16(_mm512_setzero_si512(), q, _mm512_loadu_si512(xq + (size_t)r * K + 32 * (size_t)b));
                total[o][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(d * dx[(size_t)r * nb + b]), total[o][r]);
                offs[o][r] = _mm256_add_ps(offs[o][r], _mm256_setr_ps(m * sx[(size_t)r * nb + b], 0, 0, 0, 0, 0, 0, 0));
            }
        }
    _Pragma("GCC unroll 8") for (int o = 0; o < W4_NOUT; o++)
        _Pragma("GCC unroll 2") for (int r = 0; r < NR; r++)
            acc[o * W4_TILE + r] = _mm512_reduce_add_ps(_mm512_add_ps(total[o][r], _mm512_zextps256_ps512(offs[o][r])));
}
#endif

/* the w4_tile_fn of this product: in is the struct w4_qinput of the whole input (int16 values) */
static void dot_tile(const uint8_t* w, const float* dv, const float* mv, int K, const void* in, int r0, int nr,
                     int no, float* acc) {
    const struct w4_qinput* p = (const struct w4_qinput*)in;
    const int16_t* xq = (const int16_t*)p->xq + (size_t)r0 * K;
    const float* dx = p->dx + (size_t)r0 * (K / 32);
    const float* sx = p->sx + (size_t)r0 * (K / 32);
#if defined(W4_AVX512)
    if (no == W4_NOUT && nr <= 2) {
        if (nr == 1)
            dot_outs(w, dv, mv, K, xq, dx, sx, 1, acc);
        else
            dot_outs(w, dv, mv, K, xq, dx, sx, 2, acc);
        return;
    }
#endif
#define DOT(NR) dot_rows(w, dv, mv, K, xq, dx, sx, NR, acc)
    for (int o = 0; o < no; o++, w += K / 2, dv += K / 32, mv += K / 32, acc += W4_TILE) W4_BY_ROWS(nr, DOT)
#undef DOT
}

/* y [M, N] (fp32 or bf16) = x [M, K] (fp32 or bf16) W^T (+ bias fp32 [N] or NULL).
 * work: at least M * (2 * K + 8 * (K / 32)) + 4 bytes, 4-byte aligned (the quantized input). */
void li_w4a16_linear(const void* x, int xdt, int M, int K, const uint8_t* w, const uint16_t* dm, int G, int N,
                     const float* bias, void* y, int ydt, void* work, int nthreads) {
    w4_quantized_product(x, xdt, M, K, w, dm, G, N, bias, y, ydt, work, nthreads, 2, dot_tile);
}
