/* The CPU engine's per-layer small ops in C: one call where torch needs five to forty.
 *
 * Built at first use by kernels/cpu_native.py (cc -O3 -march=native -ffp-contract=off, see FLAGS in cpu_native.py) and called
 * through ctypes; every function takes raw pointers to contiguous tensors and plain ints. The results are the
 * torch_cpu backend's (kernels/cpu_fused.py, kernels/torch_cpu.py) up to fp32 summation order:
 *
 *   li_add_rms_norm   residual = x + residual (rounded to the activation dtype), out = RMSNorm(residual) * w
 *   li_qk_norm        the per-head q and k RMSNorms of a fused qkv projection's output, in place
 *   li_silu_mul       out = silu(gate) * up, computed in fp32, rounded once
 *   li_rope_store     rotate-half RoPE of q and k (each product and sum rounded as torch rounds them: no
 *                     fused multiply-add), k and v written at their cache slots (INT8: per token and head,
 *                     asymmetric, exactly reference.quantize_kv_int8)
 *   li_attend_decode  one query per sequence against its paged context, GQA without repeating K/V
 *
 * Activation and cache dtypes: DT_F32, DT_BF16 (and DT_I8 for a cache). fp16 activations are not handled
 * here (the torch path takes them).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_convert.h"
#include "cpu_kv_cache.h"

static inline void to_f32(const void* p, int dt, size_t off, int n, float* restrict out) {
    if (dt == DT_BF16) {
        const uint16_t* restrict src = (const uint16_t*)p + off;
        uint32_t* restrict bits = (uint32_t*)out;
        for (int i = 0; i < n; i++) bits[i] = (uint32_t)src[i] << 16;
    } else {
        memcpy(out, (const float*)p + off, sizeof(float) * (size_t)n);
    }
}

static inline void from_f32(void* p, int dt, size_t off, int n, const float* restrict in) {
    if (dt == DT_BF16) {
        uint16_t* restrict dst = (uint16_t*)p + off;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(in[i]);
    } else {
        memcpy((float*)p + off, in, sizeof(float) * (size_t)n);
    }
}

/* rounds n values in place as a dtype-dt array would hold them */
static inline void round_to(int dt, int n, float* restrict v) {
    if (dt != DT_BF16) return;
    uint32_t* restrict bits = (uint32_t*)v;
    for (int i = 0; i < n; i++) bits[i] = (uint32_t)f32_to_bf16(v[i]) << 16;
}

/* loop over rows in parallel only when there is enough work to pay for waking the threads */
#define PARALLEL_MIN 32768

/* exp(x), ~1 ulp, branch-free so that loops over it vectorise: 2^n * p(r), r = x - n ln2, |r| <= ln2 / 2.
 * x is clamped to [-87.3, 88.7] (the normal fp32 range): below, 1.2e-38 stands for 0. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    /* round to nearest even by adding and taking away 1.5 * 2^23: unlike nearbyintf this vectorises */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

/* out[i] = v[i] / rms(v) * w[i] over h values, fp32 (out may be v): one row of each RMSNorm here */
static inline void rms_scale(const float* v, const float* w, int h, float eps, float* out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < h; i++) ss += v[i] * v[i];
    float rstd = 1.0f / sqrtf(ss / (float)h + eps);
    for (int i = 0; i < h; i++) out[i] = v[i] * rstd * w[i];
}

/* x, residual, out, residual_out: [rows, h] of dtype dt (x may be NULL: no add, residual_out unused);
 * weight [h] of dtype wdt. */
void li_add_rms_norm(const void* x, const void* residual, void* residual_out, const void* weight, int wdt,
                     void* out, int rows, int h, float eps, int dt, int nthreads) {
    float w[h];
    to_f32(weight, wdt, 0, h, w);
    int threads = (long)rows * h < PARALLEL_MIN ? 1 : nthreads;
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++) {
        size_t base = (size_t)r * h;
        float v[h], a[h];
        to_f32(residual, dt, base, h, v);
        if (x) {
            to_f32(x, dt, base, h, a);
            for (int i = 0; i < h; i++) v[i] += a[i];
            round_to(dt, h, v);
            from_f32(residual_out, dt, base, h, v);
        }
        rms_scale(v, w, h, eps, a);
        from_f32(out, dt, base, h, a);
    }
}

/* qkv [T, row_stride] of dtype dt, per token q (H heads of D) | k (Hkv heads) | v: each q head normalized in place
 * with q_weight, each k head with k_weight (dtype wdt), as li_add_rms_norm without x normalizes a row (fp32 inside,
 * rounded once): the per-head q/k norms of Qwen3 and Gemma 3, before li_rope_store reads the same buffer. */
void li_qk_norm(void* qkv, int dt, int T, long row_stride, int H, int Hkv, int D, const void* q_weight,
                const void* k_weight, int wdt, float eps, int nthreads) {
    float qw[D], kw[D];
    to_f32(q_weight, wdt, 0, D, qw);
    to_f32(k_weight, wdt, 0, D, kw);
    const int heads = H + Hkv;
    int threads = (long)T * heads * D < PARALLEL_MIN ? 1 : nthreads;
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (long item = 0; item < (long)T * heads; item++) {
        int h = (int)(item % heads);
        size_t base = (size_t)(item / heads) * (size_t)row_stride + (size_t)h * D;
        const float* w = h < H ? qw : kw;
        float v[D];
        to_f32(qkv, dt, base, D, v);
        rms_scale(v, w, D, eps, v);
        from_f32(qkv, dt, base, D, v);
    }
}

/* x [rows, 2 * inter] (gate | up), out [rows, inter], both dtype dt */
void li_silu_mul(const void* x, void* out, int rows, int inter, int dt, int nthreads) {
    int threads = (long)rows * inter < PARALLEL_MIN ? 1 : nthreads;
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int r = 0; r < rows; r++) {
        float g[inter], u[inter];
        to_f32(x, dt, (size_t)r * 2 * inter, inter, g);
        to_f32(x, dt, (size_t)r * 2 * inter + inter, inter, u);
#pragma omp simd
        for (int i = 0; i < inter; i++) g[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
        from_f32(out, dt, (size_t)r * inter, inter, g);
    }
}

/* Per-row asymmetric INT8 of x [d] (reference.quantize_kv_int8): codes, fp16 scale and zero. */
static void quantize_row(const float* x, int d, int8_t* q, uint16_t* scale_out, uint16_t* zero_out) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < d; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    float scale = (hi - lo) / 255.0f;
    if (!(scale > 0.0f)) scale = 1.0f;
    uint16_t s16 = f32_to_f16(scale);
    scale = f16_to_f32(s16);
    uint16_t z16 = f32_to_f16(lo + 128.0f * scale);
    float zero = f16_to_f32(z16);
    for (int i = 0; i < d; i++) {
        float v = nearbyintf((x[i] - zero) / scale);
        v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
        q[i] = (int8_t)v;
    }
    *scale_out = s16;
    *zero_out = z16;
}

/* qkv [T, row_stride] (q | k | v heads, dtype dt), positions int64 [T], cos/sin fp32 [max_pos, R / 2], with
 * Hkv = kv->num_kv_heads and D = kv->head_dim; the first R (even, <= D) dims of each q and k head rotate, the
 * others pass unchanged (partial rotation: Phi-3's partial_rotary_factor). Writes q_out [T, H, D] (dtype dt),
 * and k (rounded to dt) and v at slots int64 [T] (-1: skipped) of the cache kv (an INT8 one also gets its fp16
 * scales / zeros). */
void li_rope_store(const void* qkv, int dt, int T, int row_stride, int H, int R, const int64_t* positions,
                   const float* cos_cache, const float* sin_cache, const int64_t* slots, const li_kv_cache* kv,
                   void* q_out, int nthreads) {
    const int Hkv = kv->num_kv_heads, D = kv->head_dim, cdt = kv->dtype;
    void *k_cache = kv->k, *v_cache = kv->v;
    uint16_t *k_scale = kv->k_scale, *k_zero = kv->k_zero, *v_scale = kv->v_scale, *v_zero = kv->v_zero;
    const int half = R / 2;
    /* tokens in parallel for a prefill (each writes its own q rows and cache slots); one decode token alone */
    int threads = (long)T * (H + 2 * Hkv) * D < PARALLEL_MIN || nthreads < 1 ? 1 : nthreads;
    (void)threads; /* only the OpenMP pragma reads it */
#pragma omp parallel for num_threads(threads) if (threads > 1)
    for (int t = 0; t < T; t++) {
        const float* c = cos_cache + (size_t)positions[t] * half;
        const float* s = sin_cache + (size_t)positions[t] * half;
        size_t row = (size_t)t * row_stride;
        int64_t slot = slots ? slots[t] : -1;
        for (int hh = 0; hh < H + 2 * Hkv; hh++) {
            float x[D], y[D];
            to_f32(qkv, dt, row + (size_t)hh * D, D, x);
            if (hh < H + Hkv) { /* q or k: x * [cos, cos] + roll(x, R/2) * [-sin, sin] on R dims, rounded to dt */
                for (int i = 0; i < half; i++) {
                    float a = x[i] * c[i], b = x[i + half] * -s[i];
                    y[i] = a + b;
                    float a2 = x[i + half] * c[i], b2 = x[i] * s[i];
                    y[i + half] = a2 + b2;
                }
                memcpy(y + R, x + R, sizeof(float) * (D - R)); /* the dims that do not rotate */
                round_to(dt, D, y);
            } else {
                memcpy(y, x, sizeof(float) * D);
            }
            if (hh < H) {
                from_f32(q_out, dt, ((size_t)t * H + hh) * D, D, y);
                continue;
            }
            if (slot < 0) continue;
            int kvh = hh < H + Hkv ? hh - H : hh - H - Hkv;
            void* cache = hh < H + Hkv ? k_cache : v_cache;
            size_t at = ((size_t)slot * Hkv + kvh);
            if (cdt == DT_I8) {
                uint16_t* sc = hh < H + Hkv ? k_scale : v_scale;
                uint16_t* zr = hh < H + Hkv ? k_zero : v_zero;
                quantize_row(y, D, (int8_t*)cache + at * D, sc + at, zr + at);
            } else {
                from_f32(cache, cdt, at * D, D, y);
            }
        }
    }
}

/* Cache row `at` (slot * Hkv + KV head) of a K or V cache of dtype cdt as D fp32 values (INT8 dequantized). */
static inline void kv_row(const void* cache, int cdt, const uint16_t* scale, const uint16_t* zero, size_t at, int D,
                          float* restrict row) {
    if (cdt == DT_I8) {
        const int8_t* codes = (const int8_t*)cache + at * D;
        float sc = f16_to_f32(scale[at]), zr = f16_to_f32(zero[at]);
        for (int i = 0; i < D; i++) row[i] = (float)codes[i] * sc + zr;
    } else {
        to_f32(cache, cdt, at * D, D, row);
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* sum_i a[i] b[i] over n values: fp32 products and sums, in fused multiply-adds of 16 (AVX-512) or 8 (AVX2 + FMA)
 * lanes. The plain loop is a reduction that -ffp-contract=off without -ffast-math keeps scalar, a fifth of a
 * batched step's time on an AVX2 CPU (docs/cpu_performance.md, "Measurements behind the C ops' choices"). */
static inline float dot_f32(const float* restrict a, const float* restrict b, int n) {
    int i = 0;
    float dot = 0.0f;
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b)), s1 = _mm512_setzero_ps();
        for (i = 16; i + 32 <= n; i += 32) {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        }
        for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        dot = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (n >= 8) {
        __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b)), s1 = _mm256_setzero_ps();
        for (i = 8; i + 16 <= n; i += 16) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        }
        for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        __m256 s = _mm256_add_ps(s0, s1);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        dot = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
#endif
    for (; i < n; i++) dot += a[i] * b[i];
    return dot;
}

/* y[i] += p x[i] over n values */
static inline void axpy_f32(float* restrict y, float p, const float* restrict x, int n) {
    int i = 0;
#if defined(__AVX512F__)
    const __m512 pv = _mm512_set1_ps(p);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__FMA__)
    const __m256 pv = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += p * x[i];
}

#define KV_AHEAD 16 /* tokens the K rows are prefetched ahead of the scores */

/* ask for cache row `at` (row_bytes from byte at * row_bytes) and its INT8 scale and zero */
static inline void kv_prefetch(const void* cache, const uint16_t* scale, const uint16_t* zero, size_t at,
                               size_t row_bytes) {
    const char* p = (const char*)cache + at * row_bytes;
    for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off);
    if (scale) __builtin_prefetch(scale + at), __builtin_prefetch(zero + at);
}

/* a position in a sequence's paged context: its block-table entry and the token within that block */
struct kv_pos {
    int block, j;
};

/* the cache row (slot * Hkv + kvh) of the token at `pos`, and `pos` moved on to the next token */
static inline size_t kv_next(struct kv_pos* pos, const int32_t* blocks, int block_size, int Hkv, int kvh) {
    size_t at = ((size_t)blocks[pos->block] * block_size + pos->j) * Hkv + kvh;
    if (++pos->j == block_size) pos->j = 0, pos->block++;
    return at;
}

/* One sequence and KV head: the G = H / Hkv query heads sharing it, over L cached tokens. */
static void attend_one(const float* q, int G, int D, float scale, const int32_t* blocks, int L, int block_size,
                       int Hkv, int kvh, const void* k_cache, const void* v_cache, int cdt, const uint16_t* k_scale,
                       const uint16_t* k_zero, const uint16_t* v_scale, const uint16_t* v_zero, float* scores,
                       float* acc) {
    float row[D];
    /* A step reads each layer's cache cold (the weights streamed since evicted it), and a token's row is a short
     * strided piece of a scattered block: without prefetching the loops wait on memory latency (~4x the time
     * of a hot cache at 200 tokens). K rows are asked for KV_AHEAD tokens ahead, V rows as their K row is read,
     * so the second pass finds them in cache. */
    const size_t row_bytes = (size_t)D * (cdt == DT_I8 ? 1 : cdt == DT_BF16 ? 2 : 4);
    /* token t's cache row is (blocks[t / block_size] * block_size + t % block_size) * Hkv + kvh: stepped
     * through with counters, not two integer divisions per token */
    struct kv_pos ahead = {0, 0}, at_k = {0, 0};
    for (int t = 0; t < L && t < KV_AHEAD; t++) kv_prefetch(k_cache, k_scale, k_zero, kv_next(&ahead, blocks, block_size, Hkv, kvh), row_bytes);
    for (int t = 0; t < L; t++) {
        size_t at = kv_next(&at_k, blocks, block_size, Hkv, kvh);
        if (t + KV_AHEAD < L) kv_prefetch(k_cache, k_scale, k_zero, kv_next(&ahead, blocks, block_size, Hkv, kvh), row_bytes);
        kv_prefetch(v_cache, v_scale, v_zero, at, row_bytes);
        kv_row(k_cache, cdt, k_scale, k_zero, at, D, row);
        for (int g = 0; g < G; g++) scores[(size_t)g * L + t] = dot_f32(q + (size_t)g * D, row, D) * scale;
    }
    for (int g = 0; g < G; g++) {
        float* sg = scores + (size_t)g * L;
        float m = sg[0];
#pragma omp simd reduction(max : m)
        for (int t = 1; t < L; t++) m = sg[t] > m ? sg[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < L; t++) {
            sg[t] = exp_approx(sg[t] - m);
            sum += sg[t];
        }
        float inv = 1.0f / sum;
        for (int t = 0; t < L; t++) sg[t] *= inv;
        memset(acc + (size_t)g * D, 0, sizeof(float) * D);
    }
    struct kv_pos at_v = {0, 0};
    for (int t = 0; t < L; t++) {
        size_t at = kv_next(&at_v, blocks, block_size, Hkv, kvh);
        kv_row(v_cache, cdt, v_scale, v_zero, at, D, row);
        for (int g = 0; g < G; g++) axpy_f32(acc + (size_t)g * D, scores[(size_t)g * L + t], row, D);
    }
}

/* q [B, H, D] (dtype dt, D = kv->head_dim) -> out [B, H, D] (dtype dt); block_tables int32 [B, bt_stride],
 * context_lens int32 [B] (the new token included); the cache kv as li_rope_store's. scratch: fp32, at least
 * nthreads * (G * max_len + 2 * G * D) values. Parallel over (sequence, KV head) when worth it. */
void li_attend_decode(const void* q, int dt, int B, int H, float scale, const int32_t* block_tables, int bt_stride,
                      const int32_t* context_lens, const li_kv_cache* kv, void* out, float* scratch, int max_len,
                      int nthreads) {
    const int Hkv = kv->num_kv_heads, D = kv->head_dim, block_size = kv->block_size, cdt = kv->dtype;
    const void *k_cache = kv->k, *v_cache = kv->v;
    const uint16_t *k_scale = kv->k_scale, *k_zero = kv->k_zero, *v_scale = kv->v_scale, *v_zero = kv->v_zero;
    const int G = H / Hkv;
    const size_t per_thread = (size_t)G * max_len + 2 * (size_t)G * D;
    long work = 0;
    for (int b = 0; b < B; b++) work += context_lens[b];
    int threads = (work * H * D < 2 * PARALLEL_MIN || nthreads < 1) ? 1 : nthreads;
    /* Few (sequence, KV head) pairs for the threads (one sequence of a 3-KV-head model: 3 for 2 threads) are
     * split by query head, each part reading the shared K and V rows itself (from cache after the first). */
    const int split = threads > 1 && B * Hkv < 4 * threads ? G : 1, Gi = G / split;
    (void)threads; /* only the OpenMP pragma reads it: unused in a build without OpenMP */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1)
    for (int item = 0; item < B * Hkv * split; item++) {
        int b = item / (Hkv * split), kvh = item / split % Hkv, part = item % split;
#ifdef _OPENMP
        float* mine = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float* mine = scratch;
#endif
        float* qf = mine + (size_t)Gi * max_len;
        float* acc = qf + (size_t)Gi * D;
        size_t at = ((size_t)b * H + kvh * G + part * Gi) * D;
        to_f32(q, dt, at, Gi * D, qf);
        attend_one(qf, Gi, D, scale, block_tables + (size_t)b * bt_stride, context_lens[b], block_size, Hkv, kvh,
                   k_cache, v_cache, cdt, k_scale, k_zero, v_scale, v_zero, mine, acc);
        from_f32(out, dt, at, Gi * D, acc);
    }
}
