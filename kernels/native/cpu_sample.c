/* The sampler's greedy pick on the CPU: the index of each row's largest logit.
 * Called by kernels/cpu_native.py (argmax_rows) for layers/sampler.py.
 *
 *   li_argmax_rows  x fp32 [rows, n] -> out int64 [rows]: the first index of the row's maximum, or of its first
 *                   NaN where it has one (torch.argmax's answer); torch's CPU argmax took ~88 us for one row of a
 *                   49,152-token vocabulary, this a few.
 *
 * Two passes per row, both over a row that stays in cache: the maximum (and whether any value is NaN), then the
 * first position holding it.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

/* the row's maximum; *nan set when any value is NaN */
static float row_max(const float* restrict x, long n, int* nan) {
    long j = 0;
    float best = -INFINITY;
    int any_nan = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
    }
    best = _mm512_reduce_max_ps(m);
    any_nan = unordered != 0;
#elif defined(__AVX2__)
    __m256 m = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, m);
    for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best; /* a NaN lane only matters via any_nan */
    any_nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; j < n; j++) {
        if (x[j] != x[j]) any_nan = 1;
        else if (x[j] > best) best = x[j];
    }
    *nan = any_nan;
    return best;
}

/* the first index holding `target` (the first NaN when nan) */
static long first_index(const float* restrict x, long n, float target, int nan) {
    long j = 0;
#if defined(__AVX512F__)
    const __m512 t = _mm512_set1_ps(target);
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, t, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
#elif defined(__AVX2__)
    const __m256 t = _mm256_set1_ps(target);
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, t, _CMP_EQ_OQ));
        if (hit) return j + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; j < n; j++) {
        if (nan ? x[j] != x[j] : x[j] == target) return j;
    }
    return 0; /* n == 0 only */
}

void li_argmax_rows(const float* x, int rows, long n, int64_t* out, int nthreads) {
    int threads = rows < 4 || nthreads < 1 ? 1 : nthreads;
    (void)threads; /* only the OpenMP pragma reads it */
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++) {
        const float* row = x + (size_t)r * n;
        int nan = 0;
        float best = row_max(row, n, &nan);
        out[r] = first_index(row, n, best, nan);
    }
}
