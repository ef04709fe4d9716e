// Keyed token draws where the logits are: one block per requested row turns a logit row into the token that
// draw_rows (src/ops/sample.rs, with the filters of src/ops/filter.rs) picks for it, plus its logprobs, so a
// step reads back token ids instead of logits. CPU twin: ops::sample::draw_row; tests/cuda_sample.rs holds
// them against each other.
//
// A block reads its raw logit row where it is; only a row with adjustments is first copied into the block's
// scratch row (global memory: a 152K vocabulary does not fit in shared memory) and adjusted there. Greedy rows
// take the argmax; others write the row divided by the temperature into scratch, filter it (top-k, top-p, min-p,
// as filter_ids) and take the Gumbel-max of the survivors under the host's keyed noise. Logprobs come from the
// raw logits, each computed where a pass reads it (SampleLogprobs) rather than written out and read back.
//
// The filters never sort the vocabulary. Each keeps a prefix of the order (value desc, id asc) of the valid
// values (> -inf, not NaN), so what survives is "sort key <= cut" plus min-p's threshold. One pass counts (for
// top-p also weighs) the values within a few widths of the maximum; the narrowest window that holds what the
// filter needs is compacted into shared memory and bitonic-sorted when it has at most SAMPLE_SORT_CAP values
// (the common case), and the cut is read off the sorted list as the host reads it: top-p's mass accumulated
// one value at a time in f64 in the host's order. A wider window takes the fallback: bisections over the
// values' ordered bits with block reductions, then the tie at the cut resolved by id.
//
// Exactness. Key mixing, comparisons and argmaxes are exact, and every f32 operation that reaches a result is
// spelled __f*_rn: NVRTC contracts a * b + c into an FMA by default, which rounds differently from Rust (which
// never does). The logprob normaliser and (when sorted in shared memory) the top-p total of a top-k set are
// summed in f64 in the host's order (chunks of 256 values, eight lanes each), so they are the host's bits. The
// other f64 sums are not: top-p's total over the whole vocabulary (the host sums it in eight lanes of vocab / 8
// values, a chain too long for one thread) and, in the fallback, a top-k set's total and the bisection's
// masses (block trees). They differ from the host's by a few ulps of the sum, so the kept set differs only if
// the mass before some id lies within that of the target: a tie of measure zero. (When a window's smallest
// weight is at least its mass / 2^29 no partial sum rounds at all, so the fallback's masses are then exact.)
// Gumbel noise and the normaliser's log use CUDA's double log, within an ulp of the host's libm: a winner
// changes only if two scores agree to ~1e-16, and the normaliser, rounded to f32, almost never moves.
//
// Determinism and batch invariance: no floating-point atomics (compaction takes slots from an integer counter
// and what it writes is sorted by a total order before use), fixed reduction trees over a fixed thread layout,
// and a block touches only its own row, scratch row and output. Nothing waits on the host: graph-capturable.

#define SAMPLE_THREADS 512
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Most values a window may hold to be sorted in shared memory (u64 keys: 32 KiB).
#define SAMPLE_SORT_CAP 4096
#define SAMPLE_MAX_TOP 20
// Words per row of the input (pack_draws) and of the output (unpack_drawn): DRAW_WORDS / DRAWN_WORDS.
#define SAMPLE_DRAW_WORDS 16
#define SAMPLE_DRAWN_WORDS (2 + 2 * SAMPLE_MAX_TOP)
#define SAMPLE_NO_ID 0xffffffffu
// A cut that keeps every valid value.
#define SAMPLE_ALL 0xffffffffffffffffull
// Window widths below the maximum (the host's top-p windows 1..32, two narrower ones for top-k and logprobs).
#define SAMPLE_WINDOWS 8
// ops::sample::STREAM_TARGET.
#define SAMPLE_STREAM_TARGET 0x9E3779B97F4A7C15ull

// Row words (pack_draws).
#define DW_LOGIT_ROW 0
#define DW_ADJUST_BEGIN 1
#define DW_ADJUST_END 2
#define DW_TOP_N 3  // SAMPLE_NO_ID: no logprobs
#define DW_TEMPERATURE 4
#define DW_TOP_K 5
#define DW_TOP_P 6
#define DW_MIN_P 7
#define DW_LN_MIN_P 8  // min_p.ln() as the host rounds it
#define DW_SEED 9       // low word, then high
#define DW_POSITION 11  // low word, then high

struct SampleShared {
    u64 keys[SAMPLE_SORT_CAP];    // sort keys of a window, or of adjustments
    double part[SAMPLE_THREADS];  // chunk sums of the host-order f64 sums
    double red_d[SAMPLE_WARPS * (SAMPLE_WINDOWS + 1)];
    u32 red_u[SAMPLE_WARPS * (SAMPLE_WINDOWS + 1)];
    u64 red_k[SAMPLE_WARPS];
    float red_f[SAMPLE_WARPS];
    u32 red_i[SAMPLE_WARPS];
    u32 count;
    u32 found;
};

// ---- Scalar twins of the host's arithmetic ----

// filter::exp_nonpositive bit for bit: e^x for x <= 0, 0 below -87 (and for NaN). Constants by their bits.
__device__ __forceinline__ float sample_exp_nonpositive(float x) {
    const float rounder = __uint_as_float(0x4b400000u);  // 1.5 * 2^23
    const float clamped = x > -87.0f ? x : -87.0f;
    const float shifted = __fadd_rn(__fmul_rn(clamped, __uint_as_float(0x3fb8aa3bu)), rounder);
    const float n = __fsub_rn(shifted, rounder);
    const float r = __fsub_rn(__fsub_rn(clamped, __fmul_rn(n, __uint_as_float(0x3f318000u))),
                              __fmul_rn(n, __uint_as_float(0xb95e8083u)));
    float poly = __fadd_rn(__fmul_rn(__uint_as_float(0x39506967u), r), __uint_as_float(0x3ab743cfu));
    poly = __fadd_rn(__fmul_rn(poly, r), __uint_as_float(0x3c088908u));
    poly = __fadd_rn(__fmul_rn(poly, r), __uint_as_float(0x3d2aa9c1u));
    poly = __fadd_rn(__fmul_rn(poly, r), __uint_as_float(0x3e2aaaaau));
    poly = __fadd_rn(__fmul_rn(poly, r), 0.5f);
    const float mantissa = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(poly, r), r), r), 1.0f);
    const int n_int = (int)(__float_as_uint(shifted) - __float_as_uint(rounder));
    const float scale = __uint_as_float((u32)(n_int + 127) << 23);
    return x >= -87.0f ? __fmul_rn(mantissa, scale) : 0.0f;
}

// e^(v - max) as the host weighs a value for top-p and the normaliser.
__device__ __forceinline__ float sample_weight(float v, float vmax) {
    return sample_exp_nonpositive(__fsub_rn(v, vmax));
}

// filter::ordered_bits: unsigned order = f32::total_cmp order. Inverse: sample_from_okey.
__device__ __forceinline__ u32 sample_okey(float v) {
    const u32 b = __float_as_uint(v);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float sample_from_okey(u32 k) { return __uint_as_float((k >> 31) ? (k & 0x7fffffffu) : ~k); }

// Sort key whose ascending order is (value desc, id asc): filter::by_value_desc.
__device__ __forceinline__ u64 sample_skey(float v, u32 id) { return ((u64)(~sample_okey(v)) << 32) | id; }
__device__ __forceinline__ u32 sample_key_id(u64 key) { return (u32)key; }
__device__ __forceinline__ float sample_key_value(u64 key) { return sample_from_okey(~(u32)(key >> 32)); }

// A token the filters may keep: neither -inf nor NaN.
__device__ __forceinline__ bool sample_valid(float v) { return v > DF_NEG_INF; }

// keyed_bits(seed, pos, token, STREAM_TARGET); mix64 is misc.cu's, the host's splitmix64 finaliser.
__device__ __forceinline__ u64 sample_keyed_bits(u64 seed, u64 pos, u32 token) {
    return mix64(seed ^ mix64(pos ^ mix64((u64)token ^ SAMPLE_STREAM_TARGET))) >> 11;
}

// gumbel(uniform_from_bits(bits)) = -ln(-ln((bits + 0.5) * 2^-53)).
__device__ __forceinline__ double sample_gumbel(u64 bits) {
    const double u = __dmul_rn(__dadd_rn(__ull2double_rn(bits), 0.5), __longlong_as_double(0x3ca0000000000000ll));
    return -log(-log(u));
}

// A survivor's Gumbel-max score: scaled value plus its keyed noise, in f64 as gumbel_argmax's offer.
__device__ __forceinline__ double sample_score(float s, u32 id, u64 seed, u64 pos) {
    return __dadd_rn((double)s, sample_gumbel(sample_keyed_bits(seed, pos, id)));
}

// Adjustment::apply: kind 0 adds, else HF's repetition penalty.
__device__ __forceinline__ float sample_apply(float l, u32 kind, float value) {
    if (kind == 0u) return __fadd_rn(l, value);
    return l > 0.0f ? __fdiv_rn(l, value) : __fmul_rn(l, value);
}

// Is (s, i) a better Gumbel-max pick than (bs, bi)? Higher score, then lower id; SAMPLE_NO_ID is no pick.
__device__ __forceinline__ bool sample_better(double s, u32 i, double bs, u32 bi) {
    if (i == SAMPLE_NO_ID) return false;
    return bi == SAMPLE_NO_ID || s > bs || (s == bs && i < bi);
}

// ---- Block reductions: a warp butterfly, then every thread folds the warps in order (same result in each) ----

template <typename T, typename Op>
__device__ __forceinline__ T sample_reduce(T v, Op op, T* slots) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(DF_FULL_MASK, v, offset));
    __syncthreads();  // the slots may still be read by the previous reduction
    if ((threadIdx.x & 31u) == 0) slots[threadIdx.x >> 5] = v;
    __syncthreads();
    v = slots[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) v = op(v, slots[w]);
    return v;
}

__device__ __forceinline__ u32 sample_sum_u32(u32 v, SampleShared& sh) {
    return sample_reduce(v, [](u32 a, u32 b) { return a + b; }, sh.red_u);
}
__device__ __forceinline__ double sample_sum_f64(double v, SampleShared& sh) {
    return sample_reduce(v, [](double a, double b) { return __dadd_rn(a, b); }, sh.red_d);
}
__device__ __forceinline__ float sample_max_f32(float v, SampleShared& sh) {
    return sample_reduce(v, [](float a, float b) { return fmaxf(a, b); }, sh.red_f);
}
__device__ __forceinline__ u64 sample_min_u64(u64 v, SampleShared& sh) {
    return sample_reduce(v, [](u64 a, u64 b) { return a < b ? a : b; }, sh.red_k);
}

// The block's best (score, id) pick, returned to every thread.
__device__ __forceinline__ void sample_reduce_best(double& s, u32& id, SampleShared& sh) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const double os = __shfl_xor_sync(DF_FULL_MASK, s, offset);
        const u32 oi = __shfl_xor_sync(DF_FULL_MASK, id, offset);
        if (sample_better(os, oi, s, id)) s = os, id = oi;
    }
    __syncthreads();
    if ((threadIdx.x & 31u) == 0) sh.red_d[threadIdx.x >> 5] = s, sh.red_i[threadIdx.x >> 5] = id;
    __syncthreads();
    s = sh.red_d[0], id = sh.red_i[0];
    for (int w = 1; w < SAMPLE_WARPS; ++w) {
        if (sample_better(sh.red_d[w], sh.red_i[w], s, id)) s = sh.red_d[w], id = sh.red_i[w];
    }
}

// `value` computed by thread 0 (after the caller's writes), returned to every thread.
__device__ __forceinline__ u32 sample_broadcast(u32 value, SampleShared& sh) {
    __syncthreads();
    if (threadIdx.x == 0) sh.found = value;
    __syncthreads();
    const u32 v = sh.found;
    __syncthreads();
    return v;
}

// ---- Passes over a row ----

// Loads a thread keeps in flight in a pass over a row: one block works a whole row, so a pass waits out the
// memory latency once per SAMPLE_UNROLL * SAMPLE_THREADS values, not once per SAMPLE_THREADS.
#define SAMPLE_UNROLL 4

// How a pass reads a row: a row of values (raw or scratch), or the log_softmax of a raw row, each value computed
// as it is read (as the host rounds it) instead of written to scratch and read back.
struct SampleLogprobs { const float* raw; float log_norm; };
__device__ __forceinline__ float sample_read(const float* row, u32 i) { return row[i]; }
__device__ __forceinline__ float sample_read(const SampleLogprobs& r, u32 i) { return __fsub_rn(r.raw[i], r.log_norm); }

// visit(i, value i) for this thread's ids i = threadIdx.x + t * SAMPLE_THREADS < n in increasing order (the
// plain loop's, so a thread's sums keep their bits and its argmax its ties), SAMPLE_UNROLL loads issued before
// any is used.
template <typename Row, typename Visit>
__device__ __forceinline__ void sample_each(const Row& row, u32 n, Visit visit) {
    for (u32 i0 = threadIdx.x; i0 < n; i0 += SAMPLE_UNROLL * SAMPLE_THREADS) {
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (u32 u = 0, i = i0; u < SAMPLE_UNROLL; ++u, i += SAMPLE_THREADS) v[u] = i < n ? sample_read(row, i) : 0.0f;
#pragma unroll
        for (u32 u = 0, i = i0; u < SAMPLE_UNROLL; ++u, i += SAMPLE_THREADS) if (i < n) visit(i, v[u]);
    }
}

// filter::argmax of a row: the largest non-NaN value, ties to the lowest id, 0 when all are NaN (block_argmax
// is reduce.cu's). With `fold` it also sets row_max to the row's fmaxf maximum (every thread): the raw maximum of
// the logprobs, when this pass reads the raw row anyway.
__device__ u32 sample_argmax(const float* row, u32 n, bool fold, float& row_max, SampleShared& sh) {
    float best = DF_NEG_INF, vmax = DF_NEG_INF;
    u32 idx = DF_NO_INDEX;
    sample_each(row, n, [&](u32 i, float v) {
        if (v > best || (idx == DF_NO_INDEX && v == v)) best = v, idx = i;
        vmax = fmaxf(vmax, v);
    });
    if (fold) row_max = sample_max_f32(vmax, sh);
    __syncthreads();  // block_argmax writes its slots unguarded: a previous call may still read them
    block_argmax(best, idx);
    return sample_broadcast(idx == DF_NO_INDEX ? 0u : idx, sh);
}

// ---- Sorting and compaction in shared memory ----

// Stages k0..k1 (powers of two) of sample_sort's network on keys[0..n), each from sub-stage j = min(k / 2, 16)
// down. These pair keys within 32-key blocks, so a warp runs them on registers (key e in lane e % 32) with
// shuffles: the pair's lower index keeps the smaller key in an ascending block ((e & k) == 0), else the larger.
__device__ void sample_sort_lanes(u64* keys, u32 n, u32 k0, u32 k1) {
    for (u32 e = threadIdx.x; e < n; e += SAMPLE_THREADS) {  // whole warps: n is a multiple of 32
        u64 a = keys[e];
        for (u32 k = k0; k <= k1; k <<= 1) {
            for (u32 j = min(k >> 1, 16u); j > 0; j >>= 1) {
                const u64 b = __shfl_xor_sync(DF_FULL_MASK, a, j);
                a = ((e & j) == 0) == ((e & k) == 0) ? min(a, b) : max(a, b);
            }
        }
        keys[e] = a;
    }
    __syncthreads();
}

// Sorts keys[0..n) ascending (n a power of two, at least 32; the caller synchronised after writing them): a
// bitonic network. Sub-stages j >= 32 take whole compare-exchange pairs in shared memory, the rest of each stage
// runs in registers (sample_sort_lanes, which takes stages 2..32 at once): one barrier for them, not five.
__device__ void sample_sort(u64* keys, u32 n) {
    for (u32 k = 32; k <= n; k <<= 1) {
        for (u32 j = k >> 1; j >= 32; j >>= 1) {
            for (u32 q = threadIdx.x; q < n / 2; q += SAMPLE_THREADS) {
                const u32 i = ((q & ~(j - 1)) << 1) | (q & (j - 1));  // the pair (i, i + j)
                const u64 a = keys[i], b = keys[i + j];
                if ((a > b) == ((i & k) == 0)) keys[i] = b, keys[i + j] = a;
            }
            __syncthreads();
        }
        sample_sort_lanes(keys, n, k == 32 ? 2 : k, k);
    }
}

// Pads keys[n..n2) with the largest key and sorts; returns n2, the power of two >= max(n, 32). The padding sorts
// last, so keys[0..n) come out as any sort of them would.
__device__ u32 sample_pad_sort(u64* keys, u32 n) {
    u32 n2 = 32;
    while (n2 < n) n2 <<= 1;
    for (u32 i = n + threadIdx.x; i < n2; i += SAMPLE_THREADS) keys[i] = SAMPLE_ALL;
    __syncthreads();
    sample_sort(keys, n2);
    return n2;
}

// Writes the sort keys of the ids whose value passes `keep` into sh.keys and sorts them; returns how many there
// are. Slots come from an integer counter, so their order varies from run to run, but the sort's order is total:
// the result does not. Callers compact only sets they counted first (at most SAMPLE_SORT_CAP): a count above the
// cap would be a bug (the keys past it are dropped, not written out of bounds).
template <typename Row, typename Keep>
__device__ u32 sample_compact_sorted(const Row& row, u32 n, Keep keep, SampleShared& sh) {
    if (threadIdx.x == 0) sh.count = 0;
    __syncthreads();
    const u32 lane = threadIdx.x & 31u;
    for (u32 base = 0; base < n; base += SAMPLE_UNROLL * SAMPLE_THREADS) {  // tiles of the block: warps vote
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (u32 u = 0, i = base + threadIdx.x; u < SAMPLE_UNROLL; ++u, i += SAMPLE_THREADS) {
            v[u] = i < n ? sample_read(row, i) : 0.0f;
        }
#pragma unroll
        for (u32 u = 0, i = base + threadIdx.x; u < SAMPLE_UNROLL; ++u, i += SAMPLE_THREADS) {
            const bool p = i < n && keep(v[u], i);
            const u32 ballot = __ballot_sync(DF_FULL_MASK, p);
            if (ballot == 0u) continue;
            const u32 leader = __ffs(ballot) - 1;
            u32 first = 0;
            if (lane == leader) first = atomicAdd(&sh.count, __popc(ballot));
            first = __shfl_sync(DF_FULL_MASK, first, leader);
            const u32 slot = first + __popc(ballot & ((1u << lane) - 1u));
            if (p && slot < SAMPLE_SORT_CAP) sh.keys[slot] = sample_skey(v[u], i);
        }
    }
    __syncthreads();
    const u32 count = sh.count;
    __syncthreads();  // the next compaction resets sh.count
    if (count > 0) sample_pad_sort(sh.keys, min(count, (u32)SAMPLE_SORT_CAP));
    return count;
}

// ---- Adjustments ----

// Applies adj[begin..end) (3 words each: id, kind, value bits) to row in list order. Entries of different ids
// commute, so a tile of up to SAMPLE_SORT_CAP entries is sorted by (id, position) and the first entry of each id
// applies that id's entries in order; tiles run one after another. Ids >= n are skipped.
__device__ void sample_adjust(float* row, u32 n, const u32* adj, u32 begin, u32 end, SampleShared& sh) {
    for (u32 t0 = begin; t0 < end; t0 += SAMPLE_SORT_CAP) {
        const u32 m = min(end - t0, (u32)SAMPLE_SORT_CAP);
        for (u32 i = threadIdx.x; i < m; i += SAMPLE_THREADS) {
            const u32 id = adj[3 * (u64)(t0 + i)];
            sh.keys[i] = id < n ? ((u64)id << 32) | i : SAMPLE_ALL;
        }
        sample_pad_sort(sh.keys, m);
        for (u32 i = threadIdx.x; i < m; i += SAMPLE_THREADS) {
            const u64 key = sh.keys[i];
            const u32 id = (u32)(key >> 32);
            if (key == SAMPLE_ALL || (i > 0 && (u32)(sh.keys[i - 1] >> 32) == id)) continue;
            float l = row[id];
            for (u32 j = i; j < m && (u32)(sh.keys[j] >> 32) == id; ++j) {
                const u32* a = adj + 3 * (u64)(t0 + (u32)sh.keys[j]);
                l = sample_apply(l, a[1], __uint_as_float(a[2]));
            }
            row[id] = l;
        }
        __syncthreads();
    }
}

// ---- Sums in the host's order ----

// Σ weight(i) for i < m in filter::sum_exp's order: chunks of 256, each summed in eight f64 lanes (i % 8) then
// its tail, the chunk sums added in order. One thread per chunk, then thread 0 adds them up.
template <typename Weight>
__device__ double sample_sum_host_order(Weight weight, u32 m, SampleShared& sh) {
    const u32 chunks = (m + 255) / 256;
    double total = 0.0;
    for (u32 c0 = 0; c0 < chunks; c0 += SAMPLE_THREADS) {
        const u32 c = c0 + threadIdx.x;
        if (c < chunks) {
            const u32 begin = c * 256, len = min(256u, m - begin), full = len & ~7u;
            double lanes[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
            for (u32 i = 0; i < full; i += 8) {
#pragma unroll
                for (int j = 0; j < 8; ++j) lanes[j] = __dadd_rn(lanes[j], (double)weight(begin + i + j));
            }
            double tail = 0.0, sum = 0.0;
            for (u32 i = full; i < len; ++i) tail = __dadd_rn(tail, (double)weight(begin + i));
#pragma unroll
            for (int j = 0; j < 8; ++j) sum = __dadd_rn(sum, lanes[j]);
            sh.part[threadIdx.x] = __dadd_rn(sum, tail);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (u32 k = 0; k < min((u32)SAMPLE_THREADS, chunks - c0); ++k) total = __dadd_rn(total, sh.part[k]);
            sh.red_d[0] = total;
        }
        __syncthreads();
        total = sh.red_d[0];
        __syncthreads();
    }
    return total;
}

// filter::keep_top_p over the sorted keys[0..m): how many lead while the mass before them is below `target`
// (at least one). The mass is accumulated one value at a time in f64, in the host's order; warp 0 computes 32
// weights at once and every lane runs the same sequential sum over them.
__device__ u32 sample_keep_top_p(const u64* keys, u32 m, float vmax, double target, SampleShared& sh) {
    u32 kept = 0;
    if (threadIdx.x < 32) {
        double mass = 0.0;
        bool open = true;
        for (u32 base = 0; base < m && open; base += 32) {
            const u32 i = base + threadIdx.x;
            const float w = i < m ? sample_weight(sample_key_value(keys[i]), vmax) : 0.0f;
            for (u32 j = 0; j < 32 && base + j < m; ++j) {
                const float wj = __shfl_sync(DF_FULL_MASK, w, j);
                if (!(mass < target)) {
                    open = false;
                    break;
                }
                mass = __dadd_rn(mass, (double)wj);
                ++kept;
            }
        }
    }
    return sample_broadcast(max(kept, 1u), sh);
}

// ---- Windows ----

// Widths 1/16, 1/4, 1, 2, 4, ..., 32.
__device__ __forceinline__ float sample_window_width(int j) {
    return j == 0 ? 0.0625f : j == 1 ? 0.25f : (float)(1u << (j - 2));
}

// For each window j (values >= max - width j) and, at [SAMPLE_WINDOWS], all valid values: how many valid
// values it holds and, when `weigh`, their mass Σ e^(v - max) (a block tree). Returned to every thread.
template <typename Row>
__device__ void sample_windows(const Row& row, u32 n, float vmax, bool weigh, u32 (&count)[SAMPLE_WINDOWS + 1],
                               double (&mass)[SAMPLE_WINDOWS + 1], SampleShared& sh) {
    float floors[SAMPLE_WINDOWS];
#pragma unroll
    for (int j = 0; j < SAMPLE_WINDOWS; ++j) floors[j] = __fsub_rn(vmax, sample_window_width(j));
#pragma unroll
    for (int j = 0; j <= SAMPLE_WINDOWS; ++j) count[j] = 0, mass[j] = 0.0;
    sample_each(row, n, [&](u32, float v) {
        if (!sample_valid(v)) return;
        const double w = weigh ? (double)sample_weight(v, vmax) : 0.0;
        count[SAMPLE_WINDOWS] += 1;
        mass[SAMPLE_WINDOWS] = __dadd_rn(mass[SAMPLE_WINDOWS], w);
        if (!(v >= floors[SAMPLE_WINDOWS - 1])) return;
#pragma unroll
        for (int j = 0; j < SAMPLE_WINDOWS; ++j) {
            if (v >= floors[j]) count[j] += 1, mass[j] = __dadd_rn(mass[j], w);
        }
    });
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j <= SAMPLE_WINDOWS; ++j) {
        for (int offset = 16; offset > 0; offset >>= 1) {
            count[j] += __shfl_xor_sync(DF_FULL_MASK, count[j], offset);
            mass[j] = __dadd_rn(mass[j], __shfl_xor_sync(DF_FULL_MASK, mass[j], offset));
        }
    }
    __syncthreads();
    if (lane == 0) {
#pragma unroll
        for (int j = 0; j <= SAMPLE_WINDOWS; ++j) {
            sh.red_u[warp * (SAMPLE_WINDOWS + 1) + j] = count[j];
            sh.red_d[warp * (SAMPLE_WINDOWS + 1) + j] = mass[j];
        }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j <= SAMPLE_WINDOWS; ++j) {
        count[j] = sh.red_u[j];
        mass[j] = sh.red_d[j];
        for (int w = 1; w < SAMPLE_WARPS; ++w) {
            count[j] += sh.red_u[w * (SAMPLE_WINDOWS + 1) + j];
            mass[j] = __dadd_rn(mass[j], sh.red_d[w * (SAMPLE_WINDOWS + 1) + j]);
        }
    }
    __syncthreads();
}

// The floor of window j (every valid value for j == SAMPLE_WINDOWS).
__device__ __forceinline__ float sample_window_floor(float vmax, int j) {
    return j < SAMPLE_WINDOWS ? __fsub_rn(vmax, sample_window_width(j)) : DF_NEG_INF;
}

// ---- Fallback: cuts by bisection over the whole row ----

// The id of the r-th (1-based) id, in id order, whose value passes `pick`: tiles of the block in turn, counted
// with __syncthreads_count, then ranked by ballots within the tile that reaches r. SAMPLE_NO_ID if none.
template <typename Row, typename Pick>
__device__ u32 sample_nth(const Row& row, u32 n, u32 r, Pick pick, SampleShared& sh) {
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    u32 seen = 0, found = SAMPLE_NO_ID;
    for (u32 base = 0; base < n; base += SAMPLE_THREADS) {
        const u32 i = base + threadIdx.x;
        const bool p = i < n && pick(sample_read(row, i), i);
        const u32 in_tile = __syncthreads_count(p);
        if (seen + in_tile >= r) {
            const u32 ballot = __ballot_sync(DF_FULL_MASK, p);
            if (lane == 0) sh.red_u[warp] = __popc(ballot);
            __syncthreads();
            u32 rank = seen + __popc(ballot & ((1u << lane) - 1u));
            for (u32 w = 0; w < warp; ++w) rank += sh.red_u[w];
            if (p && rank + 1 == r) sh.found = i;
            __syncthreads();
            found = sh.found;
            break;
        }
        seen += in_tile;
    }
    return sample_broadcast(found, sh);
}

// The cut keeping the first k valid values (value desc, id asc): SAMPLE_ALL when there are at most k. The k-th
// value's ordered bits by bisection (32 counting passes), then the tie at it resolved by id.
template <typename Row>
__device__ u64 sample_cut_count(const Row& row, u32 n, u32 k, u32 valid, SampleShared& sh) {
    if (valid <= k) return SAMPLE_ALL;
    u32 t = 0;  // the largest t with count(okey >= t) >= k
    for (int bit = 31; bit >= 0; --bit) {
        const u32 cand = t | (1u << bit);
        u32 c = 0;
        sample_each(row, n, [&](u32, float v) { c += sample_valid(v) && sample_okey(v) >= cand; });
        if (sample_sum_u32(c, sh) >= k) t = cand;
    }
    u32 above = 0;
    sample_each(row, n, [&](u32, float v) { above += sample_valid(v) && sample_okey(v) > t; });
    above = sample_sum_u32(above, sh);
    auto at_t = [=](float v, u32) { return sample_valid(v) && sample_okey(v) == t; };
    const u32 id = sample_nth(row, n, k - above, at_t, sh);
    return ((u64)(~t) << 32) | id;
}

// Σ e^(v - max) over the values of C (valid, sort key <= cut0) whose ordered bits lie in (lo, hi].
__device__ double sample_mass_between(const float* row, u32 n, u64 cut0, float vmax, u32 lo, u32 hi,
                                      SampleShared& sh) {
    double m = 0.0;
    sample_each(row, n, [&](u32 i, float v) {
        const u32 k = sample_okey(v);
        if (sample_valid(v) && k > lo && k <= hi && sample_skey(v, i) <= cut0) {
            m = __dadd_rn(m, (double)sample_weight(v, vmax));
        }
    });
    return sample_sum_f64(m, sh);
}

// keep_top_p's cut over C (valid values with sort key <= cut0) without a sort. With A(x) the mass of C above
// ordered bits x, the last id kept lies in the group of equal values at b, the smallest b with A(b) < target
// (found by bisection, each step weighing only the values inside the interval it halves); within the group
// the host keeps, in id order, the members whose mass before them, A(b) + j * w, is below the target.
__device__ u64 sample_cut_mass(const float* row, u32 n, u64 cut0, float vmax, double target, SampleShared& sh) {
    auto in_c = [=](float v, u32 i) { return sample_valid(v) && sample_skey(v, i) <= cut0; };
    if (!(target > 0.0)) {  // nothing is below the target: only the first is kept
        u64 first = SAMPLE_ALL;
        sample_each(row, n, [&](u32 i, float v) {
            if (in_c(v, i)) first = min(first, sample_skey(v, i));
        });
        return sample_min_u64(first, sh);
    }
    if (!(sample_mass_between(row, n, cut0, vmax, 0u, 0xffffffffu, sh) >= target)) return cut0;  // C is kept whole
    // Invariant: A(lo) >= target > A(hi) = a_hi.
    u32 lo = 0, hi = 0xffffffffu;
    double a_hi = 0.0;
    while (hi - lo > 1) {
        const u32 mid = lo + (hi - lo) / 2;
        const double a = __dadd_rn(a_hi, sample_mass_between(row, n, cut0, vmax, mid, hi, sh));
        if (a >= target) {
            lo = mid;
        } else {
            hi = mid;
            a_hi = a;
        }
    }
    const u32 b = hi;
    const float value = sample_from_okey(b);
    auto in_group = [=](float v, u32 i) { return in_c(v, i) && sample_okey(v) == b; };
    u32 c = 0;
    sample_each(row, n, [&](u32 i, float v) { c += in_group(v, i); });
    c = sample_sum_u32(c, sh);
    // Members j = 0.. of the group are kept while a_hi + j * w < target (j * w is exact in f64).
    const double w = (double)sample_weight(value, vmax);
    u32 j0 = c;
    if (w > 0.0) {
        const double guess = ceil((target - a_hi) / w);
        j0 = guess < 1.0 ? 1u : (guess > (double)c ? c : (u32)guess);
        while (j0 > 1 && !(__dadd_rn(a_hi, (double)(j0 - 1) * w) < target)) --j0;
        while (j0 < c && __dadd_rn(a_hi, (double)j0 * w) < target) ++j0;
    }
    const u32 id = sample_nth(row, n, max(j0, 1u), in_group, sh);
    return ((u64)(~b) << 32) | id;
}

// ---- The draw ----

struct SampleFilter {
    u64 cut;       // survivors: valid, sort key <= cut,
    bool min_p;    // and, when set, v - max >= ln_min_p
    float max;
    float ln_min_p;
};

__device__ __forceinline__ bool sample_survives(float s, u32 id, const SampleFilter& f) {
    if (!sample_valid(s)) return false;
    if (f.cut != SAMPLE_ALL && sample_skey(s, id) > f.cut) return false;
    return !f.min_p || __fsub_rn(s, f.max) >= f.ln_min_p;
}

// Gumbel-max over the listed candidates sh.keys[0..m) that survive min-p; SAMPLE_NO_ID if none.
__device__ u32 sample_gumbel_listed(u32 m, const SampleFilter& f, u64 seed, u64 pos, SampleShared& sh) {
    double bs = 0.0;
    u32 bi = SAMPLE_NO_ID;
    for (u32 i = threadIdx.x; i < m; i += SAMPLE_THREADS) {
        const u64 key = sh.keys[i];
        const float s = sample_key_value(key);
        const u32 id = sample_key_id(key);
        if (!sample_survives(s, id, f)) continue;
        const double score = sample_score(s, id, seed, pos);
        if (sample_better(score, id, bs, bi)) bs = score, bi = id;
    }
    sample_reduce_best(bs, bi, sh);
    return bi;
}

// Gumbel-max over the row's survivors; SAMPLE_NO_ID if none. Scoring every survivor would take two double logs
// each, so (as gumbel_argmax) the ids within 8 of the maximum are scored first; any other id can only win if
// its noise reaches best - cutoff, a bound on its key bits (lowered by generous margins: this only decides what
// is scored, never the result). No noise reaches 40 (u <= 1 - 2^-54 gives 37.4).
__device__ u32 sample_gumbel_row(const float* row, u32 n, const SampleFilter& f, u64 seed, u64 pos,
                                 SampleShared& sh) {
    const float cutoff = __fsub_rn(f.max, 8.0f);
    double bs = 0.0;
    u32 bi = SAMPLE_NO_ID;
    sample_each(row, n, [&](u32 i, float s) {
        if (!(s >= cutoff) || !sample_survives(s, i, f)) return;
        const double score = sample_score(s, i, seed, pos);
        if (sample_better(score, i, bs, bi)) bs = score, bi = i;
    });
    sample_reduce_best(bs, bi, sh);
    u64 min_bits = 0;
    double reach = -__longlong_as_double(0x7ff0000000000000ll);
    if (bi != SAMPLE_NO_ID) {
        const double needed = bs - (double)cutoff - 1e-5;
        const double u_bound = exp(-exp(-needed)) - 64.0 * 2.220446049250313e-16;
        const double floor_bits = floor(u_bound * 9007199254740992.0 - 0.5);
        min_bits = floor_bits > 0.0 ? (u64)floor_bits : 0ull;  // NaN (an infinite best) scores them all
        reach = bs - 40.0;
    }
    sample_each(row, n, [&](u32 i, float s) {
        if (s >= cutoff || !((double)s > reach) || !sample_survives(s, i, f)) return;
        const u64 bits = sample_keyed_bits(seed, pos, i);
        if (bits < min_bits) return;
        const double score = __dadd_rn((double)s, sample_gumbel(bits));
        if (sample_better(score, i, bs, bi)) bs = score, bi = i;
    });
    sample_reduce_best(bs, bi, sh);
    return bi;
}

// draw_token over the adjusted row `src` (raw, or the adjusted copy in `row`), scaled into the scratch row `row`.
// With `fold` (src is raw, logprobs asked) its first pass also sets raw_max to raw's fmaxf maximum.
__device__ u32 sample_draw(const float* src, float* row, u32 n, const u32* words, bool fold, float& raw_max,
                           SampleShared& sh) {
    const float temperature = __uint_as_float(words[DW_TEMPERATURE]);
    if (!(temperature >= __uint_as_float(0x3727c5acu))) {  // GREEDY_TEMPERATURE
        return sample_argmax(src, n, fold, raw_max, sh);
    }
    float vmax = DF_NEG_INF, src_max = DF_NEG_INF;
    sample_each(src, n, [&](u32 i, float l) {
        const float s = l != l ? DF_NEG_INF : __fdiv_rn(l, temperature);
        row[i] = s;
        vmax = fmaxf(vmax, s);
        src_max = fmaxf(src_max, l);
    });
    if (fold) raw_max = sample_max_f32(src_max, sh);
    vmax = sample_max_f32(vmax, sh);  // its barriers also publish the scaled row
    if (!(vmax > DF_NEG_INF)) return sample_argmax(row, n, false, vmax, sh);  // nothing survives: the host's fallback

    const u32 top_k = words[DW_TOP_K];
    const float top_p = __uint_as_float(words[DW_TOP_P]), min_p = __uint_as_float(words[DW_MIN_P]);
    const bool top_k_on = top_k > 0 && top_k < n, top_p_on = top_p < 1.0f;
    const bool filters = top_k > 0 || top_p_on || min_p > 0.0f;
    SampleFilter f = {SAMPLE_ALL, filters && ((!top_k_on && !top_p_on) || min_p > 0.0f), vmax,
                      __uint_as_float(words[DW_LN_MIN_P])};
    u32 listed = 0;  // > 0: the candidates are sh.keys[0..listed)
    if (top_k_on || top_p_on) {
        u32 count[SAMPLE_WINDOWS + 1];
        double mass[SAMPLE_WINDOWS + 1];
        sample_windows(row, n, vmax, !top_k_on, count, mass, sh);
        double target = __dmul_rn((double)top_p, mass[SAMPLE_WINDOWS]);  // top-p alone: over every value
        const double needed = target * (1.0 + 1e-4);  // filter::TOP_P_WINDOW_SLACK
        int j = 0;
        while (j < SAMPLE_WINDOWS && !(top_k_on ? count[j] >= top_k : mass[j] >= needed)) ++j;
        if (count[j] <= SAMPLE_SORT_CAP) {
            // m == count[j] <= SAMPLE_SORT_CAP: the same values as sample_windows counted, against the same floor.
            const float floor = sample_window_floor(vmax, j);
            auto in_window = [=](float v, u32) { return sample_valid(v) && v >= floor; };
            u32 m = sample_compact_sorted(row, n, in_window, sh);
            if (top_k_on) m = min(m, top_k);
            if (top_k_on && top_p_on) {
                // The top-k set's total in the host's order: ascending ids. Re-key by id, sum, key back.
                for (u32 i = threadIdx.x; i < m; i += SAMPLE_THREADS) {
                    const u64 key = sh.keys[i];
                    sh.keys[i] = ((u64)sample_key_id(key) << 32) | sample_okey(sample_key_value(key));
                }
                sample_pad_sort(sh.keys, m);
                const double total = sample_sum_host_order(
                    [&](u32 i) { return sample_weight(sample_from_okey((u32)sh.keys[i]), vmax); }, m, sh);
                target = __dmul_rn((double)top_p, total);
                for (u32 i = threadIdx.x; i < m; i += SAMPLE_THREADS) {
                    const u64 key = sh.keys[i];
                    sh.keys[i] = sample_skey(sample_from_okey((u32)key), (u32)(key >> 32));
                }
                sample_pad_sort(sh.keys, m);
            }
            if (top_p_on && m > 0) m = sample_keep_top_p(sh.keys, m, vmax, target, sh);
            listed = m;
            if (m == 0) f.cut = 0;  // (no valid value; unreachable with vmax > -inf)
        } else {
            const u64 cut0 = top_k_on ? sample_cut_count(row, n, top_k, count[SAMPLE_WINDOWS], sh) : SAMPLE_ALL;
            if (top_p_on && top_k_on) {
                target = __dmul_rn((double)top_p, sample_mass_between(row, n, cut0, vmax, 0u, 0xffffffffu, sh));
            }
            f.cut = top_p_on ? sample_cut_mass(row, n, cut0, vmax, target, sh) : cut0;
        }
    }
    const u64 seed = ((u64)words[DW_SEED + 1] << 32) | words[DW_SEED];
    const u64 pos = ((u64)words[DW_POSITION + 1] << 32) | words[DW_POSITION];
    const u32 id =
        listed > 0 ? sample_gumbel_listed(listed, f, seed, pos, sh) : sample_gumbel_row(row, n, f, seed, pos, sh);
    return id != SAMPLE_NO_ID ? id : sample_argmax(row, n, false, vmax, sh);
}

// The `top` most likely ids of the logprobs (value desc, id asc; -inf and NaN never listed) into
// sh.keys[0..returned). `vmax` is their largest valid value.
__device__ u32 sample_top_listed(const SampleLogprobs& row, u32 n, u32 top, float vmax, SampleShared& sh) {
    u32 count[SAMPLE_WINDOWS + 1];
    double mass[SAMPLE_WINDOWS + 1];
    sample_windows(row, n, vmax, false, count, mass, sh);
    int j = 0;
    while (j < SAMPLE_WINDOWS && count[j] < top) ++j;
    u32 m;  // <= SAMPLE_SORT_CAP: count[j] when a window is compacted, else at most top values
    if (count[j] <= SAMPLE_SORT_CAP) {
        const float floor = sample_window_floor(vmax, j);
        m = sample_compact_sorted(row, n, [=](float v, u32) { return sample_valid(v) && v >= floor; }, sh);
    } else {
        const u64 cut = sample_cut_count(row, n, top, count[SAMPLE_WINDOWS], sh);
        auto kept = [=](float v, u32 i) { return sample_valid(v) && (cut == SAMPLE_ALL || sample_skey(v, i) <= cut); };
        m = sample_compact_sorted(row, n, kept, sh);
    }
    return min(m, top);
}

// One block per row j of `packed` (num_rows rows of SAMPLE_DRAW_WORDS words, then num_adjust adjustments of 3
// words): reads logits row words[DW_LOGIT_ROW] of `logits` ([logit_rows, vocab]), works in scratch row j
// ([num_rows, vocab] or more) and writes out[j] (SAMPLE_DRAWN_WORDS words: id, logprob bits, top ids, top
// logprob bits; unused top slots SAMPLE_NO_ID). A logit row past the logits draws from an empty row, as
// draw_rows does: id 0, logprob -inf, no top ids.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 1)
    sample_rows(const float* __restrict__ logits, u32 logit_rows, u32 vocab, const u32* __restrict__ packed,
                u32 num_rows, u32 num_adjust, u32* __restrict__ out, float* scratch) {
    DF_GRID_DEPENDENCY();
    __shared__ SampleShared sh;
    const u32* words = packed + (u64)blockIdx.x * SAMPLE_DRAW_WORDS;
    const u32* adj = packed + (u64)num_rows * SAMPLE_DRAW_WORDS;
    u32* o = out + (u64)blockIdx.x * SAMPLE_DRAWN_WORDS;
    const u32 top_words = words[DW_TOP_N];
    const u32 top = top_words == SAMPLE_NO_ID ? 0u : min(top_words, (u32)SAMPLE_MAX_TOP);
    const u32 logit_row = words[DW_LOGIT_ROW];
    u32 id = 0, listed = 0;
    float logprob = DF_NEG_INF;
    if (logit_row < logit_rows) {
        const float* raw = logits + (u64)logit_row * vocab;
        float* row = scratch + (u64)blockIdx.x * vocab;
        const bool logprobs = top_words != SAMPLE_NO_ID;
        const u32 begin = words[DW_ADJUST_BEGIN], end = words[DW_ADJUST_END];
        const bool adjusted = begin < end && end <= num_adjust;
        // The raw maximum (logprobs only), found by the first pass over the raw row: the copy or the draw's.
        float raw_max = DF_NEG_INF;
        if (adjusted) {
            float copy_max = DF_NEG_INF;
            sample_each(raw, vocab, [&](u32 i, float l) { row[i] = l, copy_max = fmaxf(copy_max, l); });
            if (logprobs) raw_max = sample_max_f32(copy_max, sh);
            __syncthreads();  // publishes the copy
            sample_adjust(row, vocab, adj, begin, end, sh);
        }
        id = sample_draw(adjusted ? row : raw, row, vocab, words, logprobs && !adjusted, raw_max, sh);
        if (logprobs && raw_max > DF_NEG_INF) {
            // log_softmax: log_norm = max + ln Σ e^(l - max), the sum in the host's order.
            const double sum = sample_sum_host_order([=](u32 i) { return sample_weight(raw[i], raw_max); }, vocab, sh);
            const float log_norm = __fadd_rn(raw_max, __double2float_rn(log(sum)));
            logprob = __fsub_rn(raw[id], log_norm);
            const float top_max = __fsub_rn(raw_max, log_norm);
            if (top > 0 && sample_valid(top_max)) {
                listed = sample_top_listed(SampleLogprobs{raw, log_norm}, vocab, top, top_max, sh);
            }
        }
    }
    for (u32 i = threadIdx.x; i < SAMPLE_DRAWN_WORDS; i += SAMPLE_THREADS) {
        u32 w = 0;
        if (i == 0) {
            w = id;
        } else if (i == 1) {
            w = __float_as_uint(logprob);
        } else if (i < 2 + SAMPLE_MAX_TOP) {
            w = i - 2 < listed ? sample_key_id(sh.keys[i - 2]) : SAMPLE_NO_ID;
        } else {
            const u32 t = i - 2 - SAMPLE_MAX_TOP;
            w = t < listed ? __float_as_uint(sample_key_value(sh.keys[t])) : 0u;
        }
        o[i] = w;
    }
}
