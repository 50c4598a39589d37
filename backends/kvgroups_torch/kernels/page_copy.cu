// page_copy.cu: move KV pages between engine caches and memory objects.
//
// Framework-free CUDA C++ (raw addresses, byte strides, sizes; no headers), compiled at first
// use with NVRTC by kvgroups_torch/nvrtc.py. One launch moves one GroupTransfer (see
// kvgroups_core/plan.py and docs/DESIGN.md, "The page model"):
//
//   grid  = (ceil(num_items / items_per_cta), num_planes, num_runs)
//   block = KVG_THREADS threads
//
// CTA (x, p, r) moves segment run r of plane p for a tile of items_per_cta consecutive items.
// Item i (counted from first_item) is chunk c = i / kept, kept position j = i % kept, block id
// ids[c * bpc + bpc - kept + j]; the ids are read on the device (inline in the parameters, or
// int32 / int64 device memory), so a launch needs no host work per block and can be captured
// in a CUDA graph. Every id is checked against num_blocks: an out-of-range id moves nothing for
// its item and sets *err_flag = 1.
//
// Byte u of piece k of token t of run r (all in bytes):
//   cache : plane_base[p] + id * block_stride + r.cache_offset + k * r.cache_step
//           + t * r.token_stride + u
//   object: object(c) + region_offset + p * plane_obj_stride + j * page_obj_stride
//           + t * row_bytes + r.obj_offset + k * r.obj_step + u
// object(c) = obj_base + c * obj_chunk_stride (one [num_chunks, nbytes] buffer), or
// obj_table[c] (device table) / inline_objs[c] (separate per-chunk buffers). Object addresses
// may point to pinned host memory (read and written directly through UVA).
//
// Template parameters: STORE (cache -> object) or load; V, the vector width in bytes (the
// host picks the widest dividing every size, offset, stride and base address); CONTIG, when
// one run covers a page as a single byte range in both cache and object (NHD rows), so no
// (token, piece) decomposition is needed.

typedef unsigned long long kvg_u64;
typedef long long kvg_i64;
typedef unsigned int kvg_u32;

#define KVG_MAX_RUNS 2
#define KVG_MAX_TILE 64
#define KVG_INLINE_IDS 512
#define KVG_INLINE_OBJS 64
#define KVG_THREADS 256
// Tuning knobs (the host may override them with -D; they are part of the cubin cache key).
// Defaults from the H200 sweeps of benchmarks/bench_torch_transfer.py --sweep, timed over
// batches of back-to-back calls (torch_sweep_h200.jsonl): 4 loads in flight per thread beat
// 8; the L2 256-byte prefetch hint, the read-only load path and a forced 8 CTAs per SM (which
// spills) measured equal or slower, so they stay off.
#ifndef KVG_UNROLL
#define KVG_UNROLL 4        // 16-byte loads in flight per thread before the first store
#endif
#ifndef KVG_LOAD_HINT
#define KVG_LOAD_HINT 0     // 1: ld.global.L2::256B (ask L2 to fetch whole 256-byte sectors)
#endif
#ifndef KVG_STORE_HINT
#define KVG_STORE_HINT 0    // 1: st.global.cs (streaming: written once, never re-read here)
#endif
#ifndef KVG_LOAD_NC
#define KVG_LOAD_NC 0       // 1: ld.global.nc.L1::no_allocate (read-only path, no L1 fill)
#endif
#ifndef KVG_MIN_BLOCKS
#define KVG_MIN_BLOCKS 1    // __launch_bounds__ minimum resident CTAs per SM (caps registers)
#endif

struct KvgRun {
    kvg_i64 cache_offset;
    kvg_i64 cache_step;
    kvg_i64 token_stride;
    kvg_i64 obj_offset;
    kvg_i64 obj_step;
    kvg_u32 units_per_piece;  // nbytes / V
    kvg_u32 units_per_token;  // count * units_per_piece
    kvg_u32 page_units;       // block_size * units_per_token
    // log2 of page_units (bits 0-7), units_per_token (8-15), units_per_piece (16-23); 0xFF
    // where the size is not a power of two. Real pages almost always are, and a shift instead
    // of a 32-bit division per 16-byte vector keeps the copy loop memory-bound.
    kvg_u32 shifts;
};

struct KvgParams {
    kvg_u64 plane_table;       // device address of num_planes plane base addresses
    kvg_u64 obj_base;          // obj_mode 0: object of chunk 0
    kvg_i64 obj_chunk_stride;  // obj_mode 0: bytes between chunk objects
    kvg_u64 obj_table;         // obj_mode 1: device address of num_chunks object addresses
    kvg_u64 ids;               // ids_mode 1 / 2: device address of the group's block ids
    kvg_u64 err_flag;          // device address of an int, set to 1 on an out-of-range id
    kvg_i64 block_stride;
    kvg_i64 num_blocks;
    kvg_i64 region_offset;
    kvg_i64 row_bytes;
    kvg_i64 plane_obj_stride;  // slots * row_bytes
    kvg_i64 page_obj_stride;   // block_size * row_bytes
    int blocks_per_chunk;
    int kept_per_chunk;
    int first_item;
    int num_items;
    int items_per_cta;
    int ids_mode;              // 0 inline int32, 1 device int32, 2 device int64
    int obj_mode;              // 0 strided, 1 device table, 2 inline table
    int num_runs;
    KvgRun runs[KVG_MAX_RUNS];
    kvg_u64 inline_objs[KVG_INLINE_OBJS];
    int inline_ids[KVG_INLINE_IDS];
};

#ifdef KVG_PARAMS_BYTES
// The host packs this struct with ctypes (natural C alignment, as here); a size mismatch must
// fail the build, not a launch. (NVRTC 13.0 has no offsetof without headers: size only.)
static_assert(sizeof(KvgParams) == KVG_PARAMS_BYTES, "KvgParams size differs from the host");
static_assert(sizeof(KvgRun) == KVG_RUN_BYTES, "KvgRun size differs from the host");
#endif

struct alignas(16) kvg_v16 { kvg_u64 a, b; };

template <int V> struct KvgVec;
template <> struct KvgVec<16> { typedef kvg_v16 T; };
template <> struct KvgVec<8> { typedef kvg_u64 T; };
template <> struct KvgVec<4> { typedef kvg_u32 T; };
template <> struct KvgVec<2> { typedef unsigned short T; };
template <> struct KvgVec<1> { typedef unsigned char T; };

template <int V>
__device__ __forceinline__ typename KvgVec<V>::T kvg_ld(kvg_u64 a) {
    return *reinterpret_cast<const typename KvgVec<V>::T*>(a);
}
template <int V>
__device__ __forceinline__ void kvg_st(kvg_u64 a, typename KvgVec<V>::T v) {
    *reinterpret_cast<typename KvgVec<V>::T*>(a) = v;
}
// The source of a copy is never written during the launch, so the read-only (non-coherent)
// path may serve it (KVG_LOAD_NC), without allocating in L1 (every byte is read once).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && (KVG_LOAD_HINT == 1 || KVG_LOAD_NC == 1)
template <>
__device__ __forceinline__ kvg_v16 kvg_ld<16>(kvg_u64 a) {
    kvg_v16 v;
#if KVG_LOAD_NC == 1 && KVG_LOAD_HINT == 1
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v2.u64 {%0, %1}, [%2];"
                 : "=l"(v.a), "=l"(v.b) : "l"(a));
#elif KVG_LOAD_NC == 1
    asm volatile("ld.global.nc.L1::no_allocate.v2.u64 {%0, %1}, [%2];"
                 : "=l"(v.a), "=l"(v.b) : "l"(a));
#else
    asm volatile("ld.global.L2::256B.v2.u64 {%0, %1}, [%2];" : "=l"(v.a), "=l"(v.b) : "l"(a));
#endif
    return v;
}
#endif
#if KVG_STORE_HINT == 1
template <>
__device__ __forceinline__ void kvg_st<16>(kvg_u64 a, kvg_v16 v) {
    asm volatile("st.global.cs.v2.u64 [%0], {%1, %2};" :: "l"(a), "l"(v.a), "l"(v.b) : "memory");
}
#endif

__device__ __forceinline__ kvg_i64 kvg_load_id(const KvgParams& p, kvg_i64 where) {
    if (p.ids_mode == 0) return p.inline_ids[where];
    if (p.ids_mode == 1) return reinterpret_cast<const int*>(p.ids)[where];
    return reinterpret_cast<const kvg_i64*>(p.ids)[where];
}

__device__ __forceinline__ kvg_u64 kvg_object(const KvgParams& p, int chunk) {
    if (p.obj_mode == 0) return p.obj_base + (kvg_u64)((kvg_i64)chunk * p.obj_chunk_stride);
    if (p.obj_mode == 1) return reinterpret_cast<const kvg_u64*>(p.obj_table)[chunk];
    return p.inline_objs[chunk];
}

template <bool STORE, int V, bool CONTIG>
__device__ __forceinline__ void kvg_page_copy(const KvgParams& p) {
    typedef typename KvgVec<V>::T T;
    // Page start addresses of the tile's items; 0 marks an item whose block id was rejected.
    __shared__ kvg_u64 s_cache[KVG_MAX_TILE];
    __shared__ kvg_u64 s_obj[KVG_MAX_TILE];

    const int plane = blockIdx.y;
    const KvgRun& run = p.runs[blockIdx.z];
    const int tile0 = blockIdx.x * p.items_per_cta;
    const int n_tile = min(p.items_per_cta, p.num_items - tile0);

    if ((int)threadIdx.x < n_tile) {
        const int item = p.first_item + tile0 + threadIdx.x;
        const int chunk = item / p.kept_per_chunk;
        const int pos = item - chunk * p.kept_per_chunk;
        const kvg_i64 where = (kvg_i64)chunk * p.blocks_per_chunk
                              + (p.blocks_per_chunk - p.kept_per_chunk) + pos;
        const kvg_i64 id = kvg_load_id(p, where);
        kvg_u64 cache_page = 0, obj_page = 0;
        if (id >= 0 && id < p.num_blocks) {
            const kvg_u64 base = reinterpret_cast<const kvg_u64*>(p.plane_table)[plane];
            cache_page = base + (kvg_u64)(id * p.block_stride + run.cache_offset);
            obj_page = kvg_object(p, chunk) + (kvg_u64)(p.region_offset
                       + plane * p.plane_obj_stride + pos * p.page_obj_stride + run.obj_offset);
        } else {
            *reinterpret_cast<volatile int*>(p.err_flag) = 1;
        }
        s_cache[threadIdx.x] = cache_page;
        s_obj[threadIdx.x] = obj_page;
    }
    __syncthreads();
    if (n_tile <= 0) return;

    const kvg_u32 page_units = run.page_units;
    const kvg_u32 page_shift = run.shifts & 0xFFu;
    const kvg_u32 token_shift = (run.shifts >> 8) & 0xFFu;
    const kvg_u32 piece_shift = (run.shifts >> 16) & 0xFFu;
    const kvg_u32 total = (kvg_u32)n_tile * page_units;
    for (kvg_u32 k0 = threadIdx.x; k0 < total; k0 += KVG_THREADS * KVG_UNROLL) {
        // Issue every load of the unrolled step before the first store: bytes in flight.
        T v[KVG_UNROLL];
        kvg_u64 dst[KVG_UNROLL];
#pragma unroll
        for (int s = 0; s < KVG_UNROLL; ++s) {
            const kvg_u32 k = k0 + s * KVG_THREADS;
            dst[s] = 0;
            if (k < total) {
                const kvg_u32 it = page_shift != 0xFFu ? k >> page_shift : k / page_units;
                const kvg_u32 r = k - it * page_units;
                const kvg_u64 cache_page = s_cache[it];
                if (cache_page != 0) {
                    kvg_i64 c_off, o_off;
                    if (CONTIG) {
                        c_off = (kvg_i64)r * V;
                        o_off = c_off;
                    } else {
                        const kvg_u32 t = token_shift != 0xFFu ? r >> token_shift
                                                               : r / run.units_per_token;
                        const kvg_u32 r2 = r - t * run.units_per_token;
                        const kvg_u32 piece = piece_shift != 0xFFu ? r2 >> piece_shift
                                                                   : r2 / run.units_per_piece;
                        const kvg_u32 w = r2 - piece * run.units_per_piece;
                        c_off = t * run.token_stride + piece * run.cache_step + (kvg_i64)w * V;
                        o_off = t * p.row_bytes + piece * run.obj_step + (kvg_i64)w * V;
                    }
                    const kvg_u64 c_addr = cache_page + (kvg_u64)c_off;
                    const kvg_u64 o_addr = s_obj[it] + (kvg_u64)o_off;
                    const kvg_u64 src = STORE ? c_addr : o_addr;
                    dst[s] = STORE ? o_addr : c_addr;
                    v[s] = kvg_ld<V>(src);
                }
            }
        }
#pragma unroll
        for (int s = 0; s < KVG_UNROLL; ++s) {
            if (dst[s] != 0) kvg_st<V>(dst[s], v[s]);
        }
    }
}

// One extern "C" entry point per variant, so the host finds them by plain name:
// kvg_{store,load}_v{16,8,4,2,1}_{contig,runs}.
#define KVG_KERNEL(DIR, STORE, V, KIND, CONTIG)                                         \
    extern "C" __global__ void __launch_bounds__(KVG_THREADS, KVG_MIN_BLOCKS)          \
    kvg_##DIR##_v##V##_##KIND(const __grid_constant__ KvgParams p) {                   \
        kvg_page_copy<STORE, V, CONTIG>(p);                                            \
    }

#define KVG_KERNELS_V(V)                          \
    KVG_KERNEL(store, true, V, contig, true)      \
    KVG_KERNEL(store, true, V, runs, false)       \
    KVG_KERNEL(load, false, V, contig, true)      \
    KVG_KERNEL(load, false, V, runs, false)

KVG_KERNELS_V(16)
KVG_KERNELS_V(8)
KVG_KERNELS_V(4)
KVG_KERNELS_V(2)
KVG_KERNELS_V(1)
