// page_copy.cu: move KV pages between engine caches and memory objects.
//
// Framework-free CUDA C++ (raw addresses, byte strides, sizes; no headers), compiled at first
// use with NVRTC by kvgroups_cuda/nvrtc.py. One launch moves one GroupTransfer (see
// kvgroups_core/transfer/plan.py and docs/DESIGN.md, "The page model"):
//
//   grid  = (min(num_tiles * num_planes * num_runs, CTA cap), 1, 1)
//   block = KVG_THREADS threads
// (the warp kernels, kvg_*_v16_warp, size their grid by segments instead: see kvg_warp_copy)
//
// A work unit moves segment run `run` of plane `plane` for a tile of items_per_cta consecutive
// items. Units come in groups of G = ceil(kept / items_per_cta) tiles (about one chunk's items),
// every plane and run of a group before the next group: w = g * G * planes * runs + tile_in_g
// + size_g * (plane + num_planes * run) (size_g = G but for a shorter last group), so a
// chunk's object is read or written front to back, as a plain copy would, instead of a page
// run of every chunk in turn. CTA b does units b, b + gridDim.x, ...
// (one unit per CTA unless the host capped the CTAs to leave SMs to other work). Item i (counted
// from first_item) is chunk c = i / kept, kept position j = i % kept, block id
// ids[c * bpc + bpc - kept + j]; the ids are read on the device (inline in the parameters, or
// int32 / int64 device memory), so a launch needs no host work per block and can be captured
// in a CUDA graph. Every id is checked against num_blocks: an out-of-range id moves nothing for
// its item and is reported in the device error record (see kvg_report).
//
// Load skips: first_item is the host's static lower bound. With skip_mode != 0 the kernel also
// reads skip_first_n_tokens from device memory (a graph replays whatever the tensor holds) and
// skips the items before first_item_for_skip (kvgroups_core/transfer/plan.py), computed per CTA.
//
// Byte u of piece k of token t of run r (all in bytes):
//   cache : plane_table[p].base + id * block_stride + r.cache_offset + k * r.cache_step
//           + t * r.token_stride + u
//   object: object(c) + region_offset + plane_table[p].obj_offset + j * page_obj_stride
//           + t * row_bytes + r.obj_offset + k * r.obj_step + u
// plane_table[p].obj_offset = object_plane * slots * row_bytes: a plan of a layer subset moves
// some planes of a kernel group into their own rows of the full object, in one launch.
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
#define KVG_ERR_WORDS 8
// Loads in flight: the classic kernel issues KVG_UNROLL 16-byte loads per thread before its
// first store; the warp kernels KVG_WARP_UNROLL per lane (a segment is 32 lanes x that many
// vectors, 8 KiB), at KVG_WARP_MIN_BLOCKS resident CTAs per SM (128 registers, no spill), which
// keeps 128 KiB per SM in flight. The host sizes warp launches with the same count
// (params.WARP_UNROLL). How these were chosen: docs/PERFORMANCE.md, "Where the defaults come
// from".
#define KVG_UNROLL 4
#define KVG_WARP_UNROLL 16
#define KVG_WARP_MIN_BLOCKS 2
#define KVG_MIN_BLOCKS 1  // the classic kernels' __launch_bounds__ minimum (caps registers)

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

// The device error record (KVG_ERR_WORDS int64 words, zero when clean), one per GPU:
//   [0] 1 once a launch met a bad value (claimed with atomicCAS, so [1]-[4] are the first's)
//   [1] the first bad value   [2] its engine group (-1: skip_first_n_tokens)
//   [3] its kernel group      [4] the bound it broke (num_blocks, or the tokens covered)
//   [5] how many bad values were met (ids counted once per item, not per plane)
struct KvgPlane {
    kvg_u64 base;        // cache address of block 0 of the plane
    kvg_i64 obj_offset;  // object_plane * slots * row_bytes
};

struct KvgParams {
    kvg_u64 plane_table;       // device address of num_planes KvgPlane entries
    kvg_u64 obj_base;          // obj_mode 0: object of chunk 0
    kvg_i64 obj_chunk_stride;  // obj_mode 0: bytes between chunk objects
    kvg_u64 obj_table;         // obj_mode 1: device address of num_chunks object addresses
    kvg_u64 ids;               // ids_mode 1 / 2: device address of the group's block ids
    kvg_u64 err_record;        // device address of the error record (KVG_ERR_WORDS int64)
    kvg_u64 skip;              // skip_mode 1 / 2: device address of skip_first_n_tokens
    kvg_i64 block_stride;
    kvg_i64 num_blocks;
    kvg_i64 region_offset;
    kvg_i64 row_bytes;
    kvg_i64 page_obj_stride;  // block_size * row_bytes
    kvg_i64 skip_mul;         // device skip: blocks skipped s = skip * skip_mul / skip_div
    kvg_i64 skip_div;
    kvg_i64 skip_max;  // device skip: the tokens the ids cover (larger is an error)
    int blocks_per_chunk;
    int kept_per_chunk;
    int first_item;
    int num_items;
    int items_per_cta;
    int ids_mode;  // 0 inline int32, 1 device int32, 2 device int64
    int obj_mode;  // 0 strided, 1 device table, 2 inline table
    int num_runs;
    int num_planes;
    int num_tiles;         // ceil(num_items / items_per_cta)
    int skip_mode;         // 0 none (first_item is exact), 1 device int32, 2 device int64
    int err_engine_group;  // what the error record names for this launch's ids
    int err_kernel_group;
    int reserved;       // 0 (kept so the parameter layout stays as it was)
    int segs_per_page;  // warp kernels: segments of 32 * KVG_WARP_UNROLL vectors a page
                        // splits into (0 elsewhere)
    int segs_shift;     // warp kernels: log2(segs_per_page), 0xFF if not a power of two
    KvgRun runs[KVG_MAX_RUNS];
    kvg_u64 inline_objs[KVG_INLINE_OBJS];
    int inline_ids[KVG_INLINE_IDS];
};

#ifdef KVG_PARAMS_BYTES
// The host packs this struct with ctypes (natural C alignment, as here); a size mismatch must
// fail the build, not a launch. (NVRTC 13.0 has no offsetof without headers: size only.)
static_assert(sizeof(KvgParams) == KVG_PARAMS_BYTES, "KvgParams size differs from the host");
static_assert(sizeof(KvgRun) == KVG_RUN_BYTES, "KvgRun size differs from the host");
static_assert(sizeof(KvgPlane) == 16, "KvgPlane is two 8-byte words");
#endif

struct alignas(16) kvg_v16 { kvg_u64 a, b; };

template <int V> struct KvgVec;
template <> struct KvgVec<16> { typedef kvg_v16 T; };
template <> struct KvgVec<8> { typedef kvg_u64 T; };
template <> struct KvgVec<4> { typedef kvg_u32 T; };
template <> struct KvgVec<2> { typedef unsigned short T; };
template <> struct KvgVec<1> { typedef unsigned char T; };

template <int V> __device__ __forceinline__ typename KvgVec<V>::T kvg_ld(kvg_u64 a) {
    return *reinterpret_cast<const typename KvgVec<V>::T*>(a);
}
template <int V> __device__ __forceinline__ void kvg_st(kvg_u64 a, typename KvgVec<V>::T v) {
    *reinterpret_cast<typename KvgVec<V>::T*>(a) = v;
}
// 16-byte accesses that name the global space: the warp kernels' page addresses come out of
// memory (plane and object tables), so plain dereferences compile to generic LD / ST. Pinned
// host objects are global addresses too (mapped through UVA).
__device__ __forceinline__ kvg_v16 kvg_ldg16(kvg_u64 a) {
    kvg_v16 v;
    asm volatile("ld.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.a), "=l"(v.b) : "l"(a));
    return v;
}
__device__ __forceinline__ void kvg_stg16(kvg_u64 a, kvg_v16 v) {
    asm volatile("st.global.v2.u64 [%0], {%1, %2};" ::"l"(a), "l"(v.a), "l"(v.b) : "memory");
}

// Every entry point calls this before its first memory access. The host launches these
// kernels with programmatic stream serialization (driver.py), so one may be set up and
// started while the kernel before it on the stream still drains (ids, skips and pages may
// still be written by that kernel); this wait returns once that kernel has finished and its
// writes are visible. The one thing done before it is the warp kernels' L2 prefetch
// (kvg_warp_prefetch_store_source), which reads only past L1 and writes nothing.
// Without the launch attribute it returns at once; before sm_90 there is nothing to wait for.
__device__ __forceinline__ void kvg_wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The warp kernels' next step: let the kernel after this one be launched while this one still
// copies, so a chain of launches (32 one-layer stores in an engine's graph) does not pay a
// launch ramp at every boundary. Its CTAs take SM slots as this kernel's retire and sit in
// their own wait. That cannot expose this kernel's writes early: a kernel launched after it
// programmatically passes griddepcontrol.wait, which waits for this whole grid and its memory,
// before reading anything (the launch attribute's contract, trigger or not); and triggering
// only after the wait keeps at most one kernel of a chain waiting.
// Only the warp kernels do it: at 128 registers two of their CTAs fill an SM, so a waiting CTA
// only takes a slot a finished one left. A kernel with room for more CTAs per SM is slowed by
// it (the next grid's CTAs crowd onto the SMs that freed first), so the classic kernels (up to
// four per SM) keep the implicit trigger at exit (docs/PERFORMANCE.md has the measurements).
__device__ __forceinline__ void kvg_let_next_grid_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ kvg_i64 kvg_load_id(const KvgParams& p, kvg_i64 where) {
    if (p.ids_mode == 0) return p.inline_ids[where];
    if (p.ids_mode == 1) return reinterpret_cast<const int*>(p.ids)[where];
    return reinterpret_cast<const kvg_i64*>(p.ids)[where];
}

// Record a bad value: the first launch to claim word 0 writes the details; only CTAs of work
// units of plane 0, run 0 count ids, so every bad item counts once.
__device__ __noinline__ void kvg_report(const KvgParams& p, kvg_i64 value, int engine_group,
                                        kvg_i64 bound, bool count) {
    kvg_i64* rec = reinterpret_cast<kvg_i64*>(p.err_record);
    if (atomicCAS(reinterpret_cast<unsigned long long*>(rec), 0ull, 1ull) == 0ull) {
        rec[1] = value;
        rec[2] = engine_group;
        rec[3] = p.err_kernel_group;
        rec[4] = bound;
    }
    if (count) atomicAdd(reinterpret_cast<unsigned long long*>(rec + 5), 1ull);
}

// First item to move: the host's bound, or first_item_for_skip of the device skip (clamped to
// [0, skip_max] after reporting a value outside it).
__device__ __forceinline__ int kvg_first_item(const KvgParams& p, bool report) {
    if (p.skip_mode == 0) return p.first_item;
    kvg_i64 skip = p.skip_mode == 1 ? (kvg_i64) * reinterpret_cast<const int*>(p.skip)
                                    : *reinterpret_cast<const kvg_i64*>(p.skip);
    if (skip < 0 || skip > p.skip_max) {
        if (report) kvg_report(p, skip, -1, p.skip_max, true);
        skip = skip < 0 ? 0 : p.skip_max;
    }
    const kvg_i64 s = skip * p.skip_mul / p.skip_div;
    const kvg_i64 bpc = p.blocks_per_chunk, kept = p.kept_per_chunk;
    const kvg_i64 tail = s % bpc - (bpc - kept);
    kvg_i64 first = (s / bpc) * kept + (tail > 0 ? tail : 0);
    if (first < p.first_item) first = p.first_item;
    const kvg_i64 total = (kvg_i64)p.first_item + p.num_items;
    return (int)(first < total ? first : total);
}

__device__ __forceinline__ kvg_u64 kvg_object(const KvgParams& p, int chunk) {
    if (p.obj_mode == 0) return p.obj_base + (kvg_u64)((kvg_i64)chunk * p.obj_chunk_stride);
    if (p.obj_mode == 1) return reinterpret_cast<const kvg_u64*>(p.obj_table)[chunk];
    return p.inline_objs[chunk];
}

template <bool STORE, int V, bool CONTIG>
__device__ __forceinline__ void kvg_page_copy(const KvgParams& p) {
    typedef typename KvgVec<V>::T T;
    // Page start addresses of the tile's items; 0 marks an item not moved (bad id, skipped).
    __shared__ kvg_u64 s_cache[KVG_MAX_TILE];
    __shared__ kvg_u64 s_obj[KVG_MAX_TILE];

    // Units go by groups of about one chunk's tiles: every plane and run of a group's tiles
    // before the next group, so the objects are walked chunk by chunk (as in kvg_warp_copy).
    const int planes_x_runs = p.num_planes * p.num_runs;
    const int group_tiles =
        min((p.kept_per_chunk + p.items_per_cta - 1) / p.items_per_cta, p.num_tiles);
    const int full_groups = p.num_tiles / group_tiles;
    const int full_work = full_groups * group_tiles * planes_x_runs;
    const int num_work = p.num_tiles * planes_x_runs;
    for (int w = blockIdx.x; w < num_work; w += gridDim.x) {
        // unit w = tile_in_group + group_size * (plane + num_planes * run), group by group;
        // the last group may hold fewer tiles.
        const int group = w < full_work ? w / (group_tiles * planes_x_runs) : full_groups;
        const int size = w < full_work ? group_tiles : p.num_tiles - full_groups * group_tiles;
        const int in_group = w - group * group_tiles * planes_x_runs;
        const int tile = group * group_tiles + in_group % size;
        const int rest = in_group / size;
        const int plane = rest % p.num_planes;
        const int run_idx = rest / p.num_planes;
        const KvgRun& run = p.runs[run_idx];
        const bool counts = plane == 0 && run_idx == 0;
        const int tile0 = tile * p.items_per_cta;
        const int n_tile = min(p.items_per_cta, p.num_items - tile0);
        const int first = kvg_first_item(p, counts && tile == 0 && threadIdx.x == 0);

        if ((int)threadIdx.x < n_tile) {
            const int item = p.first_item + tile0 + threadIdx.x;
            kvg_u64 cache_page = 0, obj_page = 0;
            if (item >= first) {
                const int chunk = item / p.kept_per_chunk;
                const int pos = item - chunk * p.kept_per_chunk;
                const kvg_i64 where = (kvg_i64)chunk * p.blocks_per_chunk
                                      + (p.blocks_per_chunk - p.kept_per_chunk) + pos;
                // The plane entry is read alongside the id (see kvg_warp_copy).
                const KvgPlane pl = reinterpret_cast<const KvgPlane*>(p.plane_table)[plane];
                const kvg_i64 id = kvg_load_id(p, where);
                if (id >= 0 && id < p.num_blocks) {
                    cache_page = pl.base + (kvg_u64)(id * p.block_stride + run.cache_offset);
                    obj_page = kvg_object(p, chunk)
                               + (kvg_u64)(p.region_offset + pl.obj_offset + pos * p.page_obj_stride
                                           + run.obj_offset);
                } else if (counts) {
                    kvg_report(p, id, p.err_engine_group, p.num_blocks, true);
                }
            }
            s_cache[threadIdx.x] = cache_page;
            s_obj[threadIdx.x] = obj_page;
        }
        __syncthreads();

        const kvg_u32 page_units = run.page_units;
        const kvg_u32 page_shift = run.shifts & 0xFFu;
        const kvg_u32 token_shift = (run.shifts >> 8) & 0xFFu;
        const kvg_u32 piece_shift = (run.shifts >> 16) & 0xFFu;
        const kvg_u32 total = n_tile > 0 ? (kvg_u32)n_tile * page_units : 0u;
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
                            const kvg_u32 t =
                                token_shift != 0xFFu ? r >> token_shift : r / run.units_per_token;
                            const kvg_u32 r2 = r - t * run.units_per_token;
                            const kvg_u32 piece =
                                piece_shift != 0xFFu ? r2 >> piece_shift : r2 / run.units_per_piece;
                            const kvg_u32 wu = r2 - piece * run.units_per_piece;
                            c_off = t * run.token_stride + piece * run.cache_step + (kvg_i64)wu * V;
                            o_off = t * p.row_bytes + piece * run.obj_step + (kvg_i64)wu * V;
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
        __syncthreads();  // the next work unit rewrites the tile's page addresses
    }
}

// Contiguous pages of 16-byte vectors, one warp per segment. The kernel above stages a tile's
// page addresses in shared memory behind a barrier and gives each CTA whole pages, so a CTA's
// loads start only after its id and table lookups, and a launch of a few hundred pages keeps
// few bytes in flight. Here a work unit is one segment (32 lanes x KVG_WARP_UNROLL vectors,
// 8 KiB by default) of one page: each warp looks up its own id (one broadcast load), needs no
// barrier, and a launch has as many independent warps as segments (one unit per warp unless
// the host capped the CTAs; then warps loop over units).
//
// Units run chunk by chunk, and inside a chunk plane by plane:
//   u = seg + segs_per_page * (pos + kept * (plane + num_planes * row)),
// for kept position pos of chunk first_item / kept + row (kept = kept_per_chunk). Consecutive
// warps cover one plane's pages of a chunk, then the next plane of the same chunk, so a
// chunk's object ([plane][page] in its region) is read or written front to back, as a plain
// copy would, while the cache side follows the engine's block order. Positions of the first
// chunk before first_item, and past the last item, are skipped. Bad ids and skips behave as
// in kvg_page_copy; ids are reported by segment 0 of plane 0 only, so every bad item counts
// once.

// A warp launch's shape, and where its unit u lies (the order above).
struct KvgWarpShape {
    kvg_u32 segs;        // segments per page
    kvg_u32 segs_shift;  // log2(segs), 0xFF if not a power of two
    kvg_u32 kept;
    kvg_u32 planes_x_kept;
    kvg_u32 rows;   // chunks the launch touches
    kvg_u32 total;  // units
    int row0_item;  // first item of the first chunk touched
    int end_item;
};
struct KvgWarpUnit {
    int chunk;
    int item;
    kvg_u32 pos;
    kvg_u32 plane;
    kvg_u32 seg;
};

__device__ __forceinline__ KvgWarpShape kvg_warp_shape(const KvgParams& p) {
    KvgWarpShape g;
    // The host keeps total below 2**31 (larger launches take kvg_page_copy), so unit indices
    // are 32-bit; segs_per_page is almost always a power of two.
    g.segs = (kvg_u32)p.segs_per_page;
    g.segs_shift = (kvg_u32)p.segs_shift;
    g.kept = (kvg_u32)p.kept_per_chunk;
    g.planes_x_kept = g.kept * (kvg_u32)p.num_planes;
    g.row0_item = p.first_item - p.first_item % p.kept_per_chunk;
    g.end_item = p.first_item + p.num_items;
    g.rows = (kvg_u32)((g.end_item - g.row0_item + p.kept_per_chunk - 1) / p.kept_per_chunk);
    g.total = g.segs * g.planes_x_kept * g.rows;
    return g;
}

__device__ __forceinline__ KvgWarpUnit kvg_warp_unit(const KvgParams& p, const KvgWarpShape& g,
                                                     kvg_u32 u) {
    KvgWarpUnit w;
    const kvg_u32 rest = g.segs_shift != 0xFFu ? u >> g.segs_shift : u / g.segs;
    w.seg = u - rest * g.segs;
    const kvg_u32 row = rest / g.planes_x_kept;
    const kvg_u32 in_row = rest - row * g.planes_x_kept;
    w.plane = in_row / g.kept;
    w.pos = in_row - w.plane * g.kept;
    w.chunk = g.row0_item / p.kept_per_chunk + (int)row;
    w.item = w.chunk * p.kept_per_chunk + (int)w.pos;
    return w;
}

__device__ __forceinline__ kvg_i64 kvg_id_slot(const KvgParams& p, const KvgWarpUnit& w) {
    return (kvg_i64)w.chunk * p.blocks_per_chunk + (p.blocks_per_chunk - p.kept_per_chunk) + w.pos;
}

// Loads that bypass L1, for the look-ups made before griddepcontrol.wait: L1 is not coherent,
// so a line read there before the prior kernel's writes became visible could be served again
// after the wait. L2 is the GPU's point of coherence, which is what makes the prefetch safe.
__device__ __forceinline__ kvg_i64 kvg_load_id_l2(const KvgParams& p, kvg_i64 where) {
    if (p.ids_mode == 0) return p.inline_ids[where];
    if (p.ids_mode == 1) {
        int v;
        asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p.ids + (kvg_u64)where * 4u));
        return v;
    }
    kvg_i64 v;
    asm volatile("ld.global.cg.s64 %0, [%1];" : "=l"(v) : "l"(p.ids + (kvg_u64)where * 8u));
    return v;
}

// Stores of the warp kernels, before their wait: one lane per warp asks L2 to fetch the cache
// segment of the warp's first unit (cp.async.bulk.prefetch.L2), so a kernel whose CTAs take
// SM slots while the kernel before it drains (the early trigger) has its first reads under way
// by the time the wait returns. The ids may still be written by that kernel, and the cache
// pages too (an engine's attention writes the layer it then saves), so no byte the copy moves
// is read here and nothing is written: a stale id costs a wasted fetch, never a wrong byte (the
// copy looks everything up again after the wait), and an id is bounds-checked before it forms
// an address, so no prefetch leaves the cache tensor. Only CTAs of the first wave (the ones
// that can be resident while a prior kernel runs) prefetch; later ones start with the wait
// already satisfied and would only double their first reads' L2 requests. Device skips are
// not read here (the pages before them are fetched for nothing). Only stores prefetch: a
// load's source may be pinned host memory. A one-chunk store replayed alone in a graph, with
// no kernel before it to overlap, pays for the look-ups twice; docs/PERFORMANCE.md has the
// trade measured.
__device__ __forceinline__ void kvg_warp_prefetch_store_source(const KvgParams& p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if ((threadIdx.x & 31) != 0) return;
    kvg_u32 sms;
    asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
    if (blockIdx.x >= sms * KVG_WARP_MIN_BLOCKS) return;
    const KvgWarpShape g = kvg_warp_shape(p);
    const kvg_u32 u = blockIdx.x * (KVG_THREADS / 32) + (threadIdx.x >> 5);
    if (u >= g.total) return;
    const KvgWarpUnit w = kvg_warp_unit(p, g, u);
    if (w.item < p.first_item || w.item >= g.end_item) return;
    const kvg_i64 id = kvg_load_id_l2(p, kvg_id_slot(p, w));
    if (id < 0 || id >= p.num_blocks) return;
    kvg_u64 base;
    asm volatile("ld.global.cg.u64 %0, [%1];"
                 : "=l"(base)
                 : "l"(p.plane_table + (kvg_u64)w.plane * sizeof(KvgPlane)));
    const KvgRun& run = p.runs[0];
    const kvg_u64 page = base + (kvg_u64)(id * p.block_stride + run.cache_offset);
    const kvg_u32 seg_bytes = 32u * KVG_WARP_UNROLL * 16u;
    const kvg_u32 begin = w.seg * seg_bytes;
    const kvg_u32 bytes = min(seg_bytes, run.page_units * 16u - begin);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(page + begin), "r"(bytes)
                 : "memory");
#endif
}

template <bool STORE> __device__ __forceinline__ void kvg_warp_copy(const KvgParams& p) {
    const int lane = threadIdx.x & 31;
    const KvgRun& run = p.runs[0];
    const kvg_u32 page_units = run.page_units;
    const KvgWarpShape g = kvg_warp_shape(p);
    const kvg_u32 warps = gridDim.x * (KVG_THREADS / 32);
    const KvgPlane* planes = reinterpret_cast<const KvgPlane*>(p.plane_table);
    kvg_u32 u = blockIdx.x * (KVG_THREADS / 32) + (threadIdx.x >> 5);
    const int first = kvg_first_item(p, u == 0 && lane == 0);
    for (; u < g.total; u += warps) {
        // Every lane has the same u, so each branch below is uniform across the warp.
        const KvgWarpUnit w = kvg_warp_unit(p, g, u);
        const int chunk = w.chunk;
        const kvg_u32 pos = w.pos, plane = w.plane, seg = w.seg;
        if (w.item < first || w.item >= g.end_item) continue;
        const kvg_i64 where = kvg_id_slot(p, w);
        // The plane entry is read before the id is checked (plane < num_planes always), so
        // the two loads overlap instead of the data loads waiting on both in turn.
        const KvgPlane pl = planes[plane];
        const kvg_i64 id = kvg_load_id(p, where);
        if (id < 0 || id >= p.num_blocks) {
            if (plane == 0 && seg == 0 && lane == 0)
                kvg_report(p, id, p.err_engine_group, p.num_blocks, true);
            continue;
        }
        const kvg_u64 cache_page = pl.base + (kvg_u64)(id * p.block_stride + run.cache_offset);
        const kvg_u64 obj_page = kvg_object(p, chunk)
                                 + (kvg_u64)(p.region_offset + pl.obj_offset
                                             + (kvg_i64)pos * p.page_obj_stride + run.obj_offset);
        const kvg_u64 src = STORE ? cache_page : obj_page;
        const kvg_u64 dst = STORE ? obj_page : cache_page;
        const kvg_u32 k0 = seg * (32u * KVG_WARP_UNROLL) + (kvg_u32)lane;
        kvg_v16 v[KVG_WARP_UNROLL];
#pragma unroll
        for (int s = 0; s < KVG_WARP_UNROLL; ++s) {
            const kvg_u32 k = k0 + 32u * s;
            if (k < page_units) v[s] = kvg_ldg16(src + (kvg_u64)k * 16u);
        }
#pragma unroll
        for (int s = 0; s < KVG_WARP_UNROLL; ++s) {
            const kvg_u32 k = k0 + 32u * s;
            if (k < page_units) kvg_stg16(dst + (kvg_u64)k * 16u, v[s]);
        }
    }
}

// One extern "C" entry point per variant, so the host finds them by plain name:
// kvg_{store,load}_v{16,8,4,2,1}_{contig,runs} and kvg_{store,load}_v16_warp.
#ifndef KVG_BUILD_XLA
#define KVG_BUILD_XLA 0  // 1: only the XLA entry points below
#endif
#if !KVG_BUILD_XLA
#define KVG_KERNEL(DIR, STORE, V, KIND, CONTIG)                               \
    extern "C" __global__ void __launch_bounds__(KVG_THREADS, KVG_MIN_BLOCKS) \
        kvg_##DIR##_v##V##_##KIND(const __grid_constant__ KvgParams p) {      \
        kvg_wait_for_prior_grid();                                            \
        kvg_page_copy<STORE, V, CONTIG>(p);                                   \
    }

#define KVG_KERNELS_V(V)                     \
    KVG_KERNEL(store, true, V, contig, true) \
    KVG_KERNEL(store, true, V, runs, false)  \
    KVG_KERNEL(load, false, V, contig, true) \
    KVG_KERNEL(load, false, V, runs, false)

KVG_KERNELS_V(16)
extern "C" __global__ void __launch_bounds__(KVG_THREADS, KVG_WARP_MIN_BLOCKS)
    kvg_store_v16_warp(const __grid_constant__ KvgParams p) {
    kvg_warp_prefetch_store_source(p);
    kvg_wait_for_prior_grid();
    kvg_let_next_grid_start();
    kvg_warp_copy<true>(p);
}
extern "C" __global__ void __launch_bounds__(KVG_THREADS, KVG_WARP_MIN_BLOCKS)
    kvg_load_v16_warp(const __grid_constant__ KvgParams p) {
    kvg_wait_for_prior_grid();
    kvg_let_next_grid_start();
    kvg_warp_copy<false>(p);
}
KVG_KERNELS_V(8)
KVG_KERNELS_V(4)
KVG_KERNELS_V(2)
KVG_KERNELS_V(1)
#endif  // !KVG_BUILD_XLA

#if KVG_BUILD_XLA
// Launches from XLA (kvgroups_jax, lowering "cuda"). jaxlib's kernel-call custom call hands a
// kernel every operand and result buffer as one pointer parameter, in order, then two pointers
// of its own; it cannot pass a parameter struct, and the buffers' addresses are known only when
// the program runs. So an XLA entry point takes the buffers as plain 64-bit words a0..a{M-1}
// (kvgroups_jax/lowerings/cuda.py generates one per padded count M, the unused words are zeros)
// after a blob that XLA holds as a constant:
//   KvgXlaHead, then a KvgParams with every address left 0, then num_planes KvgXlaPlane.
// Each CTA copies the parameters into shared memory, fills in the addresses from the words
// (a plane's cache base is the word of its buffer plus its byte offset), reads first_item /
// num_items from the call's device meta (traced values: skips, item counts below the compiled
// bucket), clamps them to the call's items, and then runs the very copy of the torch entry
// points on that copy. No PDL here: XLA launches without the attribute, so there is neither a
// prior grid to wait for nor a prefetch to overlap it with.
#ifndef KVG_XLA_MAX_PLANES
#define KVG_XLA_MAX_PLANES 512
#endif
struct KvgXlaHead {
    int meta;         // word of the int32 [first_item, num_items] meta
    int ids;          // word of the int32 block ids
    int obj;          // word of the object the copy writes (store) or reads (load)
    int err;          // word of the error record (an output of the call)
    int num_planes;   // <= KVG_XLA_MAX_PLANES (the host checks)
    int first_lo;     // the plan's static first item: meta[0] is clamped to [first_lo, total]
    int total_items;  // num_chunks * kept_per_chunk: no item at or past it is moved
    int pad;
};
struct KvgXlaPlane {
    kvg_i64 word;        // which a_i holds the plane's buffer
    kvg_i64 offset;      // byte offset of the plane's block 0 in that buffer
    kvg_i64 obj_offset;  // as KvgPlane.obj_offset
};
// The parameters up to the inline id and object tables, which XLA calls never use.
#define KVG_XLA_PARAM_WORDS                                                                      \
    ((int)(sizeof(KvgParams) - KVG_INLINE_OBJS * sizeof(kvg_u64) - KVG_INLINE_IDS * sizeof(int)) \
     / 4)

template <bool STORE>
__device__ __forceinline__ void kvg_xla_warp_copy(const char* blob, const kvg_u64* words) {
    __shared__ KvgParams p;
    __shared__ KvgPlane planes[KVG_XLA_MAX_PLANES];
    const KvgXlaHead* head = reinterpret_cast<const KvgXlaHead*>(blob);
    const kvg_u32* src = reinterpret_cast<const kvg_u32*>(blob + sizeof(KvgXlaHead));
    kvg_u32* dst = reinterpret_cast<kvg_u32*>(&p);
    for (int i = threadIdx.x; i < KVG_XLA_PARAM_WORDS; i += KVG_THREADS) dst[i] = src[i];
    __syncthreads();  // the entry point's words, and p, are complete
    const KvgXlaPlane* xp =
        reinterpret_cast<const KvgXlaPlane*>(blob + sizeof(KvgXlaHead) + sizeof(KvgParams));
    const int num_planes = head->num_planes;
    for (int i = threadIdx.x; i < num_planes; i += KVG_THREADS) {
        planes[i].base = words[xp[i].word] + (kvg_u64)xp[i].offset;
        planes[i].obj_offset = xp[i].obj_offset;
    }
    if (threadIdx.x == 0) {
        const int* meta = reinterpret_cast<const int*>(words[head->meta]);
        const int total = head->total_items;
        int first = meta[0], count = meta[1];
        first = first < head->first_lo ? head->first_lo : (first > total ? total : first);
        count = count < 0 ? 0 : (count > total - first ? total - first : count);
        p.first_item = first;
        p.num_items = count;
        p.plane_table = (kvg_u64)planes;  // a generic address: kvg_warp_copy reads it as such
        p.obj_base = words[head->obj];
        p.ids = words[head->ids];
        p.err_record = words[head->err];
    }
    __syncthreads();
    kvg_warp_copy<STORE>(p);
}
#endif  // KVG_BUILD_XLA
