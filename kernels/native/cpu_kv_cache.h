/* One layer's paged KV cache as the C ops read it: the caller fills one per cache object and passes its address
 * (kernels/native_abi.py, LiKvCache: the same fields in the same order), instead of eight positional arguments.
 * A recorded decode step keeps the struct alive with the graph (engine/cpu_graph.py). */
#ifndef LI_CPU_KV_CACHE_H
#define LI_CPU_KV_CACHE_H

#include <stdint.h>

typedef struct {
    void* k;             /* [num_blocks * block_size, num_kv_heads, head_dim], dtype */
    void* v;             /* as k */
    uint16_t* k_scale;   /* fp16 [slots, num_kv_heads]: DT_I8 caches only, else NULL */
    uint16_t* k_zero;
    uint16_t* v_scale;
    uint16_t* v_zero;
    int32_t dtype;       /* DT_F32, DT_BF16 or DT_I8 */
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t block_size;  /* tokens per block */
} li_kv_cache;

#endif
