/* Writing and reading the 4-bit layout of cpu_w4_layout.h: li_w4_pack (at load) and li_w4_dequant (the dense
 * weight for a prefill's product, where torch's fp32 GEMM beats the block dot products). */
#include <string.h>

#include "cpu_w4_dequant.h"

/* codes [N, K] one byte each (0..15) -> the layout, [N, K / 2] bytes */
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

/* W [N, K] = d * q + m, fp32 or bf16 (odt): the dense weight, for products of many rows (a prefill) where a
 * dense GEMM of the torch build beats the block dot products above; written by rows, parallel over them. */
void li_w4_dequant(const uint8_t* w, const uint16_t* dm, int G, int N, int K, void* out, int odt, int nthreads) {
    (void)nthreads;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1 && (long)N * K >= 65536)
    for (int n = 0; n < N; n++)
        w4_dequant_row(w + (size_t)n * (K / 2), dm + (size_t)n * (K / G) * 2, K, G, odt, out, (size_t)n * K);
}
