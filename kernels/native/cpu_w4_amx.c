/* The 4-bit product of many rows (a prefill) on Intel AMX: y [M, N] = x [M, K] W^T, x bf16, W = d * q + m in
 * the layout of cpu_w4_layout.h, fp32 sums.
 *
 * Without it a prefill dequantizes the whole weight to bf16 in memory (212 MB for SmolLM2-135M) for torch's
 * GEMM, which copies it once more into its own blocked layout. Here each thread dequantizes 32 rows of W at
 * a time into a buffer that stays in its L1/L2 cache and multiplies them at once with every row of x:
 *
 *   C^T [n, m] = sum_k W [n, k] x [m, k]     tiles: A = 16 rows of W x 32 k (row-major, as dequantized),
 *                                                   B = x in VNNI pairs (16 k pairs x 16 m x 2), C = 16 n x 16 m
 *
 * W is the tiles' A operand because a row of W dequantizes to 32 consecutive k, the A tile's row as it is; x,
 * much smaller than W for the shapes of a prefill, is the one rearranged (once per call, into VNNI tiles), and
 * each 16 x 16 C tile is transposed on its way out. x's rows are padded with zeros to a multiple of 16, W's
 * to a multiple of 32 in the buffer; the padding is computed and not written.
 *
 * The products are bf16 x bf16 with fp32 sums, as torch's bf16 GEMM on the dequantized weight (the weight
 * rounded to bf16 alike); only the order of the fp32 additions differs. AMX needs the kernel's permission to
 * use its tile registers (Linux 5.16+, arch_prctl): li_w4_amx_init asks for it and says whether the kernel
 * may run. */
#include "cpu_w4_dequant.h"

#if defined(W4_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define W4_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#endif

#define AMX_ROWS 32 /* rows of W (and of x) per block: 2 x 2 tiles of 16 */

#if defined(W4_AMX)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = -1; /* -1: not asked yet; 0: refused; 1: granted */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* every tile 16 rows x 64 bytes: 0..3 the sums, 4..5 W, 6..7 x */
static void amx_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* 16 x 16 32-bit values transposed in registers: r[i] holds row i, then column i */
static inline void amx_transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* 128-bit lane L of u[i + j]: column 4 L + j of rows i .. i + 3 */
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; j++) { /* lanes 0..3 of t[j]: columns j, 8 + j of rows 0..3, then of rows 4..7 */
        t[j] = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xdd);
        t[8 + j] = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
    }
}

/* x [M, K] bf16 -> xv: tile (kc, mt) at (kc * MT + mt) * 512 values holds row r = k pair kc * 16 + r, as 16 m
 * (mt * 16 ..) x 2 values; rows m >= M are zeros */
static void amx_pack_x(const uint16_t* x, int M, int K, int MT, uint16_t* xv, int kc, int mt) {
    const uint32_t* x32 = (const uint32_t*)x;
    __m512 r[16];
    for (int i = 0; i < 16; i++) {
        int m = mt * 16 + i;
        r[i] = m < M ? _mm512_loadu_ps((const float*)(x32 + (size_t)m * (K / 2) + (size_t)kc * 16)) : _mm512_setzero_ps();
    }
    amx_transpose16(r);
    float* out = (float*)(xv + ((size_t)kc * MT + mt) * 512);
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(out + 16 * i, r[i]);
}

/* the 16 x 16 sums of C tile `c` (rows n0 + .., columns m0 + ..) written transposed into y, bias added */
static inline void amx_store(const float* c, int m0, int n0, int M, int N, const float* bias, void* y, int ydt) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(c + 16 * i);
    amx_transpose16(r);
    int nn = N - n0 < 16 ? N - n0 : 16;
    __mmask16 mask = (__mmask16)((1u << nn) - 1);
    __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < 16 && m0 + i < M; i++) {
        __m512 v = _mm512_add_ps(r[i], b);
        size_t at = (size_t)(m0 + i) * N + n0;
        if (ydt == DT_BF16)
            _mm256_mask_storeu_epi16((uint16_t*)y + at, mask, w4_to_bf16(v));
        else
            _mm512_mask_storeu_ps((float*)y + at, mask, v);
    }
}

/* C tiles 0..3 (W rows n0 + 16 (t / 2) .., x rows 16 (mt + t % 2) ..) stored and written into y; `pairs`: 2
 * tiles of x rows (tiles 0..3), or 1 (tiles 0 and 2) */
static inline void amx_flush(float c[4][256], int pairs, int mt, int M, int n0, int N, const float* bias, void* y,
                             int ydt) {
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    if (pairs == 2) {
        _tile_stored(1, c[1], 64);
        _tile_stored(3, c[3], 64);
    }
    for (int t = 0; t < 4; t++) {
        int n = n0 + 16 * (t / 2), m = 16 * (mt + t % 2);
        if ((t % 2 == 0 || pairs == 2) && n < N && m < M) amx_store(c[t], m, n, M, N, bias, y, ydt);
    }
}

/* the sums of rows n0 .. n0 + 31 of W (dequantized in wb, row stride K) with every row of x (MT tiles of 16
 * rows): two tiles of x at a time (2 x 2 sums per step), the last one alone when MT is odd */
static void amx_block(const uint16_t* wb, const uint16_t* xv, int M, int K, int MT, int n0, int N, const float* bias,
                      void* y, int ydt) {
    float c[4][256];
    int mt = 0;
    for (; mt + 1 < MT; mt += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kc = 0; kc < K / 32; kc++) {
            const uint16_t* b = xv + ((size_t)kc * MT + mt) * 512;
            _tile_loadd(4, wb + 32 * kc, 2 * K);
            _tile_loadd(5, wb + 16 * (size_t)K + 32 * kc, 2 * K);
            _tile_loadd(6, b, 64);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        amx_flush(c, 2, mt, M, n0, N, bias, y, ydt);
    }
    if (mt < MT) { /* a decode batch of up to 16 rows has only this */
        _tile_zero(0);
        _tile_zero(2);
        for (int kc = 0; kc < K / 32; kc++) {
            _tile_loadd(4, wb + 32 * kc, 2 * K);
            _tile_loadd(5, wb + 16 * (size_t)K + 32 * kc, 2 * K);
            _tile_loadd(6, xv + ((size_t)kc * MT + mt) * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(2, 5, 6);
        }
        amx_flush(c, 1, mt, M, n0, N, bias, y, ydt);
    }
}
#endif

/* *ok = 1 where li_w4_amx_linear may run: built for AMX (-march=native on such a CPU) and the tile registers
 * granted to this process */
void li_w4_amx_init(int32_t* ok) {
#if defined(W4_AMX)
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    *ok = amx_state;
#else
    *ok = 0;
#endif
}

/* y [M, N] (fp32 or bf16, ydt) = x [M, K] (bf16) W^T (+ bias, fp32 [N] or NULL); K a multiple of 32, G of K's
 * blocks (a multiple of 32 dividing K). work: (M rounded up to 16 + 32 nthreads) K values of 16 bits (x in
 * tiles, then 32 rows of W per thread). Only after li_w4_amx_init said yes (called before, it asks itself, and
 * leaves y as it is where AMX is refused). */
void li_w4_amx_linear(const uint16_t* x, int M, int K, const uint8_t* w, const uint16_t* dm, int G, int N,
                      const float* bias, void* y, int ydt, uint16_t* work, int nthreads) {
#if defined(W4_AMX)
    if (amx_state != 1) { /* a call before li_w4_amx_init (it would fault without the grant): ask now */
        int32_t ok;
        li_w4_amx_init(&ok);
        if (!ok) return;
    }
    const int MT = (M + 15) / 16, KC = K / 32, NB = (N + AMX_ROWS - 1) / AMX_ROWS;
    uint16_t* xv = work;
    uint16_t* wbufs = work + (size_t)MT * 16 * K;
    (void)nthreads;
    #pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int me = 0;
#ifdef _OPENMP
        me = omp_get_thread_num();
#endif
        uint16_t* wb = wbufs + (size_t)me * AMX_ROWS * K;
        #pragma omp for schedule(static)
        for (int t = 0; t < KC * MT; t++) amx_pack_x(x, M, K, MT, xv, t / MT, t % MT);
        amx_configure();
        #pragma omp for schedule(static)
        for (int nb = 0; nb < NB; nb++) {
            int n0 = nb * AMX_ROWS;
            for (int r = 0; r < AMX_ROWS; r++) {
                if (n0 + r + AMX_ROWS < N) { /* the next block's row (this thread's, schedule static): from memory */
                    const char* next = (const char*)(w + (size_t)(n0 + r + AMX_ROWS) * (K / 2));
                    for (int at = 0; at < K / 2; at += 64) _mm_prefetch(next + at, _MM_HINT_T0);
                    _mm_prefetch((const char*)(dm + (size_t)(n0 + r + AMX_ROWS) * (K / G) * 2), _MM_HINT_T0);
                }
                if (n0 + r < N)
                    w4_dequant_row(w + (size_t)(n0 + r) * (K / 2), dm + (size_t)(n0 + r) * (K / G) * 2, K, G, DT_BF16,
                                   wb, (size_t)r * K);
                else
                    memset(wb + (size_t)r * K, 0, 2 * (size_t)K);
            }
            amx_block(wb, xv, M, K, MT, n0, N, bias, y, ydt);
        }
        _tile_release();
    }
#else
    (void)x, (void)M, (void)K, (void)w, (void)dm, (void)G, (void)N, (void)bias, (void)y, (void)ydt, (void)work,
        (void)nthreads;
#endif
}
