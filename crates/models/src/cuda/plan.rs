//! A batch turned into the step's device inputs: one `u32` buffer holding tokens, positions, slots,
//! per-row key counts, logit rows, attention tiles and block tables at offsets that depend only on the
//! counts ([`Layout`]), so a graph captured for some counts reads the right addresses at every replay.

use std::ops::Range;

use dflash_runtime::cuda::ops::{
    attn_max_splits, attn_split_keys, tc_prompt_attention_fits, ATTN_KEY_CHUNK, ATTN_MAX_QUERIES, ATTN_SPLIT_MAX_KEYS,
    TC_ATTN_TILE_ROWS,
};

use super::cache::{CudaCacheConfig, GraphKey};
use super::error::{CudaModelError, Result};
use crate::batch::ForwardBatch;
use crate::config::ModelConfig;
use crate::step_padding::StepPadding;

/// Rows per attention tile (prompt tiles, decode / verify tiles) and the prompt kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TileRows {
    pub prompt: usize,
    pub decode: usize,
    /// The model's KV heads (decode tiles keep one split size class, which depends on them).
    pub kv_heads: usize,
    /// Prompt rows on the tensor-core kernel (tiles of [`TC_ATTN_TILE_ROWS`] rows), else the f32 one.
    pub tensor_core_prompt: bool,
}

impl TileRows {
    /// Tiles for `num_heads` query heads over `kv_heads` of `head_dim`: f32 prompt tiles of the most rows whose
    /// query vectors fit one attention block, decode tiles of the most whose [`decode_tile_queries`] do; with
    /// `tensor_core_prompt` (and a head_dim the kernel takes) prompt tiles of [`TC_ATTN_TILE_ROWS`].
    pub fn new(num_heads: usize, kv_heads: usize, head_dim: usize, tensor_core_prompt: bool) -> Self {
        let group = (num_heads / kv_heads.max(1)).max(1);
        let rows = |queries: usize| (queries.min(ATTN_MAX_QUERIES) / group).max(1);
        let tensor_core_prompt = tensor_core_prompt && tc_prompt_attention_fits(head_dim);
        let prompt = if tensor_core_prompt { TC_ATTN_TILE_ROWS } else { rows(ATTN_MAX_QUERIES) };
        TileRows { prompt, decode: rows(decode_tile_queries(num_heads)), kv_heads, tensor_core_prompt }
    }
}

/// Models of at most this many query heads give a decode or verify tile one query vector per warp of the attention
/// block (its 8 warps), so no warp walks the keys twice: verifies of 3-16 rows 4-10% faster on the default model and
/// 7-8% on the Qwen3-0.6B shape. With more heads the narrower tiles' blocks can pass what the GPU holds at once (a
/// 16-row verify of the Qwen3-8B shape: 320 blocks at 144 keys, 2% slower in one run, though 8 and 12 rows ran
/// faster), so they keep 16 until a rule by the step's blocks is measured (PERFORMANCE.md entry 113).
const ONE_QUERY_PER_WARP_MAX_HEADS: usize = 16;

/// Query vectors (rows times the query heads of a KV head) a decode tile of a model of `num_heads` query heads
/// holds: 8 up to [`ONE_QUERY_PER_WARP_MAX_HEADS`], else [`ATTN_MAX_QUERIES`]; `DFLASH_TILE_QUERIES` overrides.
fn decode_tile_queries(num_heads: usize) -> usize {
    let default = if num_heads <= ONE_QUERY_PER_WARP_MAX_HEADS { ATTN_MAX_QUERIES / 2 } else { ATTN_MAX_QUERIES };
    dflash_runtime::switches::switches().decode_tile_queries.unwrap_or(default)
}

/// The most places a sequence's decode tiles are cut besides every `tile_rows` rows: where the split size class
/// changes (at 1,024, 2,048, 4,096 and 8,192 keys; `attn_split_keys`).
const MAX_CLASS_CUTS: usize = (ATTN_SPLIT_MAX_KEYS / ATTN_KEY_CHUNK).ilog2() as usize;

/// Size-class cuts a graph step's sequence may have (`graph_key` refuses batches with more): `rows` consecutive key
/// counts cross at most one size-class boundary per 1,024 (the boundaries are 1,024 or more keys apart).
fn graph_class_cuts(rows: usize) -> usize {
    (1 + rows / 1024).min(MAX_CLASS_CUTS)
}

/// Decode tiles of a graph step (padded with empty tiles to this count, so the layout depends on the key alone):
/// for sequences of at most `rows` rows, `tokens` in all, at most `ceil(rows / tile)` tiles each and
/// `seqs + tokens / tile` together (a sequence's `r` rows take `ceil(r / tile) <= 1 + r / tile` tiles); room for the
/// class cuts only when the key has one, and none with one-row tiles (a cut adds no tile there).
fn graph_decode_tiles(key: GraphKey, tile_rows: usize) -> usize {
    let tile = tile_rows.max(1);
    let cuts = if key.class_cut && tile > 1 { graph_class_cuts(key.rows) } else { 0 };
    let tiles = (key.seqs * key.rows.div_ceil(tile)).min(key.seqs + key.tokens.div_ceil(tile));
    tiles + key.seqs * cuts
}

/// Counts that fix where each input lies in the input buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    /// Rows (padded rows included).
    pub t: usize,
    /// Logit rows.
    pub l: usize,
    pub prompt_tiles: usize,
    pub decode_tiles: usize,
    /// Rows attended with split keys (their partial states are merged); not stored, it sizes the scratch.
    pub decode_rows: usize,
    pub seqs: usize,
    /// Block-table entries per sequence.
    pub stride: usize,
}

impl Layout {
    fn spans(&self) -> [usize; 8] {
        let t = self.t;
        [t, t, t, t, self.l, 4 * self.prompt_tiles, 4 * self.decode_tiles, self.seqs * self.stride]
    }

    /// Range of input `i` in the order tokens, positions, slots, row_keys, logit_rows, prompt tiles,
    /// decode tiles, tables.
    fn range(&self, i: usize) -> Range<usize> {
        let spans = self.spans();
        let start: usize = spans[..i].iter().sum();
        start..start + spans[i]
    }

    pub fn tokens(&self) -> Range<usize> {
        self.range(0)
    }
    pub fn positions(&self) -> Range<usize> {
        self.range(1)
    }
    pub fn slots(&self) -> Range<usize> {
        self.range(2)
    }
    pub fn row_keys(&self) -> Range<usize> {
        self.range(3)
    }
    pub fn logit_rows(&self) -> Range<usize> {
        self.range(4)
    }
    pub fn prompt_tiles(&self) -> Range<usize> {
        self.range(5)
    }
    pub fn decode_tiles(&self) -> Range<usize> {
        self.range(6)
    }
    pub fn tables(&self) -> Range<usize> {
        self.range(7)
    }

    /// Total `u32`s.
    pub fn len(&self) -> usize {
        self.spans().iter().sum()
    }

    /// The largest input buffer any step within `cfg` needs.
    pub fn capacity(cfg: &CudaCacheConfig, tile_rows: TileRows) -> usize {
        let (t, s) = (cfg.max_tokens.max(cfg.max_decode_rows), graph_seq_limit(cfg));
        let tiles = s * (1 + MAX_CLASS_CUTS) + t.div_ceil(tile_rows.prompt.min(tile_rows.decode).max(1));
        Layout {
            t,
            l: cfg.max_logit_rows.max(t),
            prompt_tiles: tiles,
            decode_tiles: tiles,
            decode_rows: cfg.max_decode_rows,
            seqs: s,
            stride: cfg.table_stride(),
        }
        .len()
    }
}

/// What the forward needs to know about a planned step besides the inputs themselves.
#[derive(Clone, Debug)]
pub(crate) struct StepPlan {
    pub layout: Layout,
    pub max_prompt_tile_rows: usize,
    pub max_decode_tile_rows: usize,
    /// Split blocks per decode tile (the attention grid's z).
    pub decode_splits: usize,
    /// Prompt tiles go to the tensor-core kernel.
    pub tensor_core_prompt: bool,
    /// The most decode rows one sequence has (sizes the new keys' shared memory when the RoPE and K/V write are
    /// folded into the attention).
    pub max_decode_seq_rows: usize,
    /// Some sequence attends more than [`ROPE_FOLD_MAX_KEYS`] keys (a graph's: as its key says).
    pub long_keys: bool,
}

/// Checks a batch against itself, the model and the cache's capacities (the device cannot report bad
/// indices, so they are refused here).
pub(crate) fn validate(batch: &ForwardBatch, cfg: &CudaCacheConfig, model: &ModelConfig) -> Result<()> {
    let bad = |m: String| Err(CudaModelError::Batch(m));
    let t = batch.tokens.len();
    if t == 0 || batch.positions.len() != t || batch.slots.len() != t {
        return bad(format!("{t} tokens, {} positions, {} slots", batch.positions.len(), batch.slots.len()));
    }
    let rows: usize = batch.seqs.iter().map(|s| s.num_rows).sum();
    if rows != t {
        return bad(format!("sequences cover {rows} rows, batch has {t}"));
    }
    if t > cfg.max_tokens || batch.seqs.len() > cfg.max_seqs || batch.logit_rows.len() > cfg.max_logit_rows {
        return bad(format!(
            "{t} rows / {} sequences / {} logit rows exceed the cache's {} / {} / {}",
            batch.seqs.len(),
            batch.logit_rows.len(),
            cfg.max_tokens,
            cfg.max_seqs,
            cfg.max_logit_rows
        ));
    }
    if let Some(r) = batch.logit_rows.iter().find(|&&r| r as usize >= t) {
        return bad(format!("logit row {r} out of {t}"));
    }
    if let Some(id) = batch.tokens.iter().find(|&&id| id as usize >= model.vocab_size) {
        return bad(format!("token {id} past the vocabulary of {}", model.vocab_size));
    }
    if let Some(p) = batch.positions.iter().find(|&&p| p as usize >= model.max_position_embeddings.max(1)) {
        return bad(format!("position {p} past the RoPE table of {}", model.max_position_embeddings));
    }
    let capacity = cfg.num_pages * cfg.page_size;
    if let Some(s) = batch.slots.iter().find(|&&s| s as usize >= capacity) {
        return bad(format!("slot {s} beyond the cache's {capacity}"));
    }
    let mut decode_rows = 0;
    for s in batch.seqs {
        let end = s.context_len + s.num_rows;
        let need = end.div_ceil(cfg.page_size);
        if end > cfg.max_seq_len
            || s.block_table.len() < need
            || s.block_table[..need].iter().any(|&p| p as usize >= cfg.num_pages)
        {
            return bad(format!("block table {:?} for {end} tokens (at most {})", s.block_table, cfg.max_seq_len));
        }
        decode_rows += s.num_rows - prompt_rows(s.prompt_len, s.context_len, s.num_rows);
    }
    if decode_rows > cfg.max_decode_rows {
        return bad(format!("{decode_rows} decode rows exceed the cache's {}", cfg.max_decode_rows));
    }
    Ok(())
}

/// Rows of a sequence that are prompt (attended whole); the rest are decode rows (split keys).
fn prompt_rows(prompt_len: usize, context_len: usize, num_rows: usize) -> usize {
    prompt_len.saturating_sub(context_len).min(num_rows)
}

/// The most keys a step's sequences may attend for its decode and verify attention to do the RoPE and K/V write
/// itself (`paged_attention_rope`): past it every split block's own rotation of q costs more than the launch it
/// saves (PERFORMANCE.md entry 37: the fold is 7.5% faster per Qwen3-0.6B-shape step at 128-384 keys, 1.7% slower
/// at 7,900-8,156).
pub(crate) const ROPE_FOLD_MAX_KEYS: usize = 4096;

/// Contexts past which a decode or verify step replays other graphs: a graph's key says whether some sequence
/// attends more than [`ROPE_FOLD_MAX_KEYS`] keys.
pub const GRAPH_CONTEXTS: [usize; 1] = [ROPE_FOLD_MAX_KEYS];

/// Whether some sequence of `batch` attends more than [`ROPE_FOLD_MAX_KEYS`] keys.
fn long_keys(batch: &ForwardBatch) -> bool {
    batch.seqs.iter().any(|s| s.context_len + s.num_rows > ROPE_FOLD_MAX_KEYS)
}

/// The graph a batch can replay: every sequence past its prompt, padded as [`graph_shape`] says within the cache's
/// capacities; with `mixed`, also batches whose sequences have different row counts.
pub(crate) fn graph_key(batch: &ForwardBatch, cfg: &CudaCacheConfig, kv_heads: usize, mixed: bool) -> Option<GraphKey> {
    let past_prompts = batch.seqs.iter().all(|s| s.num_rows > 0 && s.context_len >= s.prompt_len);
    if !cfg.graphs || batch.seqs.is_empty() || !past_prompts {
        return None;
    }
    let (seqs, rows, tokens) = graph_shape(batch, cfg, mixed)?;
    // Size-class changes within a sequence whose `rows` rows attend keys first ..= first + rows - 1 (the padded
    // sequences': 1 ..= rows at most): the split size only grows with the keys, by doubling.
    let class = |keys: usize| attn_split_keys(keys, kv_heads);
    let cuts = |first: usize, rows: usize| (class(first + rows - 1) / class(first)).ilog2() as usize;
    let real = batch.seqs.iter().map(|s| cuts(s.context_len + 1, s.num_rows));
    let most = real.chain([cuts(1, rows)]).max().unwrap_or(0);
    if most > graph_class_cuts(rows) {
        return None;
    }
    let class_cut = most > 0;
    let max_keys = batch.seqs.iter().map(|s| s.context_len + s.num_rows).max().unwrap_or(rows);
    let keys = graph_keys(max_keys, cfg.max_seq_len, kv_heads);
    Some(GraphKey { seqs, rows, tokens, long_keys: long_keys(batch), class_cut, keys })
}

/// Sequences, rows per sequence and rows in all of the graph step `batch` replays ([`StepPadding::shape`] within
/// the cache's capacities); with `mixed`, also for batches whose sequences have different row counts.
fn graph_shape(batch: &ForwardBatch, cfg: &CudaCacheConfig, mixed: bool) -> Option<(usize, usize, usize)> {
    let widest = batch.seqs.iter().map(|s| s.num_rows).max()?;
    let total = batch.seqs.iter().map(|s| s.num_rows).sum();
    step_padding(cfg, mixed).shape(batch.seqs.len(), widest, total)
}

/// Whether a family whose steps of different row counts can replay graphs (`family_mixed`) has them replay now:
/// `DFLASH_MIXED_GRAPHS=0` runs such steps eagerly.
pub(crate) fn mixed_graphs(family_mixed: bool) -> bool {
    family_mixed && !dflash_runtime::switches::switches().no_mixed_graphs
}

/// The graph buckets of steps within `cfg` (`mixed`: steps of different row counts replay graphs too).
pub(crate) fn step_padding(cfg: &CudaCacheConfig, mixed: bool) -> StepPadding {
    let max_rows = cfg.max_tokens.min(cfg.max_decode_rows).min(cfg.max_logit_rows);
    StepPadding { max_rows, max_seqs: graph_seq_limit(cfg), mixed }
}

/// The most sequences a graph step may be padded to: past the cache's, room for the padded sequences that hold a
/// mixed step's padded rows. (Only the inputs' block tables grow with it; a uniform step's bucket stays within
/// the cache's sequences rounded up to a power of two.)
fn graph_seq_limit(cfg: &CudaCacheConfig) -> usize {
    2 * cfg.max_seqs
}

/// Fewest keys a graph step's attention is launched for.
const GRAPH_MIN_KEYS: usize = 128;

/// Keys a graph step whose sequences attend at most `max_keys` keys launches its attention for: `max_keys` rounded
/// up to a power of two (at least [`GRAPH_MIN_KEYS`]), or the cache's longest sequence `max_seq_len` once that
/// many keys already give a row the most splits it can have. A launch for the longest sequence alone would give
/// a step of short sequences mostly empty split blocks: at 8,192 keys and 3 KV heads, 128 per row and head where
/// 200 keys use 7 (entry 94). Rows' bits do not depend on it: a row's splits follow its own keys.
pub(crate) fn graph_keys(max_keys: usize, max_seq_len: usize, kv_heads: usize) -> usize {
    let bucket = max_keys.next_power_of_two().max(GRAPH_MIN_KEYS).min(max_seq_len);
    let whole = dflash_runtime::switches::switches().no_graph_keys
        || attn_max_splits(bucket, kv_heads) >= attn_max_splits(max_seq_len, kv_heads);
    if whole {
        max_seq_len
    } else {
        bucket
    }
}

/// Writes the inputs of `batch` into `host` and returns the plan. With `graph`, sequences are padded to
/// `graph.seqs` and rows to `graph.tokens` (rows that write the cache's spare page and attend only it), every row's
/// logits are computed, and the split count covers the key's keys, so the counts depend on the key alone.
pub(crate) fn plan(
    batch: &ForwardBatch,
    graph: Option<GraphKey>,
    cfg: &CudaCacheConfig,
    tile_rows: TileRows,
    host: &mut Vec<u32>,
) -> StepPlan {
    let stride = cfg.table_stride();
    let trash = cfg.trash_page() as u32;
    let ps = cfg.page_size as u32;
    let mut b = Builder { kv_heads: tile_rows.kv_heads, ..Builder::default() };
    for (i, s) in batch.seqs.iter().enumerate() {
        let first = b.row_keys.len();
        b.row_keys.extend((0..s.num_rows).map(|j| (s.context_len + j + 1) as u32));
        let prompt = prompt_rows(s.prompt_len, s.context_len, s.num_rows);
        b.tiles(i, first, prompt, tile_rows.prompt, false);
        b.tiles(i, first + prompt, s.num_rows - prompt, tile_rows.decode, true);
        let used = s.block_table.len().min(stride);
        b.tables.extend_from_slice(&s.block_table[..used]);
        b.tables.extend(std::iter::repeat_n(trash, stride - used));
    }
    let (mut tokens, mut positions, mut slots) =
        (batch.tokens.to_vec(), batch.positions.to_vec(), batch.slots.to_vec());
    if let Some(key) = graph {
        let mut left = key.tokens - batch.tokens.len();
        for i in batch.seqs.len()..key.seqs {
            let rows = left.min(key.rows);
            left -= rows;
            let first = b.row_keys.len();
            b.row_keys.extend((1..=rows).map(|j| j as u32));
            b.tiles(i, first, rows, tile_rows.decode, true);
            b.tables.extend(std::iter::repeat_n(trash, stride));
            tokens.extend(std::iter::repeat_n(0, rows));
            positions.extend(std::iter::repeat_n(0, rows));
            slots.extend((0..rows as u32).map(|j| trash * ps + j % ps));
        }
        debug_assert_eq!(left, 0, "a graph key's padded sequences hold its padded rows");
        // Empty tiles (no rows: the kernels skip them) up to the key's count; full tiles' shared memory. (Padding
        // costs: a graph's empty tiles still launch their blocks, so keys without a class cut have none.)
        let tiles = graph_decode_tiles(key, tile_rows.decode);
        debug_assert!(b.decode_tiles.len() / 4 <= tiles, "a graph step's tiles exceed its key's count");
        b.decode_tiles.resize(4 * tiles, 0);
        b.max_decode_tile_rows = key.rows.min(tile_rows.decode);
        b.max_decode_seq_rows = key.rows;
    }
    let t = tokens.len();
    let logit_rows: Vec<u32> = if graph.is_some() { (0..t as u32).collect() } else { batch.logit_rows.to_vec() };
    let decode_splits = match graph {
        Some(key) => attn_max_splits(key.keys, tile_rows.kv_heads),
        None => attn_max_splits(b.max_decode_keys, tile_rows.kv_heads),
    };
    let layout = Layout {
        t,
        l: logit_rows.len(),
        prompt_tiles: b.prompt_tiles.len() / 4,
        decode_tiles: b.decode_tiles.len() / 4,
        decode_rows: b.decode_rows,
        seqs: b.tables.len() / stride,
        stride,
    };
    host.clear();
    for part in [&tokens, &positions, &slots, &b.row_keys, &logit_rows, &b.prompt_tiles, &b.decode_tiles, &b.tables] {
        host.extend_from_slice(part);
    }
    StepPlan {
        layout,
        max_prompt_tile_rows: b.max_prompt_tile_rows,
        max_decode_tile_rows: b.max_decode_tile_rows,
        decode_splits,
        tensor_core_prompt: tile_rows.tensor_core_prompt,
        max_decode_seq_rows: b.max_decode_seq_rows,
        long_keys: graph.map_or_else(|| long_keys(batch), |key| key.long_keys),
    }
}

/// The per-row and per-tile inputs as they are built.
#[derive(Default)]
struct Builder {
    /// The model's KV heads (the split size classes).
    kv_heads: usize,
    row_keys: Vec<u32>,
    prompt_tiles: Vec<u32>,
    decode_tiles: Vec<u32>,
    /// Decode rows so far: the next decode tile's first partial row.
    decode_rows: usize,
    tables: Vec<u32>,
    max_prompt_tile_rows: usize,
    max_decode_tile_rows: usize,
    max_decode_keys: usize,
    max_decode_seq_rows: usize,
}

impl Builder {
    /// Tiles of at most `tile_rows` rows over rows `first .. first + rows` of sequence `seq` (prompt rows come first in
    /// a sequence: its first prompt tile starts at key 0).
    fn tiles(&mut self, seq: usize, first: usize, rows: usize, tile_rows: usize, decode: bool) {
        if decode {
            self.max_decode_seq_rows = self.max_decode_seq_rows.max(rows);
        }
        let mut start = first;
        while start < first + rows {
            let mut n = tile_rows.min(first + rows - start);
            if decode {
                // A decode tile's rows share one split size class (the kernels cut a tile's keys as its first row's).
                let class = |row: usize| attn_split_keys(self.row_keys[row] as usize, self.kv_heads);
                n = (1..n).find(|&i| class(start + i) != class(start)).unwrap_or(n);
                self.decode_tiles.extend([seq as u32, start as u32, n as u32, self.decode_rows as u32]);
                self.decode_rows += n;
                self.max_decode_tile_rows = self.max_decode_tile_rows.max(n);
                self.max_decode_keys = self.max_decode_keys.max(self.row_keys[start + n - 1] as usize);
            } else {
                // The first key the tile copies to bf16 for the tensor-core attention: where the tile before
                // it ends (its rows attend the keys before too, copied by the tiles before).
                let key_lo = if start == first { 0 } else { self.row_keys[start - 1] };
                self.prompt_tiles.extend([seq as u32, start as u32, n as u32, key_lo]);
                self.max_prompt_tile_rows = self.max_prompt_tile_rows.max(n);
            }
            start += n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SeqRows;

    fn cfg() -> CudaCacheConfig {
        CudaCacheConfig::new(8, 4, 32, 4, 16)
    }

    #[test]
    fn decode_tiles_give_each_warp_one_query_vector_on_models_of_few_heads() {
        if dflash_runtime::switches::switches().decode_tile_queries.is_some() {
            return; // DFLASH_TILE_QUERIES set for this process
        }
        // The default model (9 query heads over 3): 2 rows a decode tile (6 vectors), 5 a prompt tile.
        assert_eq!(
            TileRows::new(9, 3, 64, false),
            TileRows { prompt: 5, decode: 2, kv_heads: 3, tensor_core_prompt: false }
        );
        // Qwen3-0.6B (16 over 8): 4 rows; Qwen3-8B (32 over 8) keeps 16 vectors, 4 rows.
        assert_eq!(TileRows::new(16, 8, 128, true).decode, 4);
        assert_eq!(TileRows::new(32, 8, 128, true).decode, 4);
        assert_eq!(TileRows::new(32, 8, 128, false).prompt, 4);
        // Qwen3-Next's attention (16 over 2): one row of 8 vectors a decode tile.
        assert_eq!(
            TileRows::new(16, 2, 256, false),
            TileRows { prompt: 2, decode: 1, kv_heads: 2, tensor_core_prompt: false }
        );
    }

    #[test]
    fn plan_tiles_prompt_and_decode_rows_apart() {
        let table_a = [3u32, 1, 2];
        let table_b = [0u32];
        // Sequence a: 2 prompt rows then 2 decode rows from context 5 (prompt 7); b: one decode row.
        let seqs = [
            SeqRows { num_rows: 4, context_len: 5, block_table: &table_a, prompt_len: 7 },
            SeqRows { num_rows: 1, context_len: 2, block_table: &table_b, prompt_len: 2 },
        ];
        let tokens = [1u32, 2, 3, 4, 5];
        let positions = [5u32, 6, 7, 8, 2];
        let slots = [5u32, 6, 7, 8, 2];
        let batch =
            ForwardBatch { tokens: &tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &[3, 4] };
        validate(&batch, &cfg(), &tiny_model()).expect("valid");
        let mut host = Vec::new();
        let p = plan(
            &batch,
            None,
            &cfg(),
            TileRows { prompt: 2, decode: 2, kv_heads: 8, tensor_core_prompt: false },
            &mut host,
        );
        let l = p.layout;
        assert_eq!((l.t, l.l, l.prompt_tiles, l.decode_tiles, l.decode_rows, l.seqs, l.stride), (5, 2, 1, 2, 3, 2, 4));
        assert_eq!(&host[l.row_keys()], &[6, 7, 8, 9, 3]);
        assert_eq!(&host[l.prompt_tiles()], &[0, 0, 2, 0]);
        assert_eq!(&host[l.decode_tiles()], &[0, 2, 2, 0, 1, 4, 1, 2]);
        assert_eq!(&host[l.tables()], &[3, 1, 2, 8, 0, 8, 8, 8]);
        assert_eq!(p.decode_splits, 1);
        assert_eq!(host.len(), l.len());
        assert_eq!(p.max_decode_seq_rows, 2, "sequence a's decode rows");
        // A 5-row prompt chunk after 5 keys in tiles of 2: each tile copies the keys from where the one before
        // ended, the first from key 0.
        let seqs = [SeqRows { num_rows: 5, context_len: 5, block_table: &table_a, prompt_len: 10 }];
        let batch =
            ForwardBatch { tokens: &tokens, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &[4] };
        let p = plan(
            &batch,
            None,
            &cfg(),
            TileRows { prompt: 2, decode: 2, kv_heads: 8, tensor_core_prompt: true },
            &mut host,
        );
        assert_eq!(&host[p.layout.prompt_tiles()], &[0, 0, 2, 0, 0, 2, 2, 7, 0, 4, 1, 9]);
    }

    #[test]
    fn decode_tiles_keep_one_split_size_class_and_graphs_a_fixed_count() {
        // A verify of 6 rows over keys 1,022..=1,027 in tiles of 4: cut where the split grows past 1,024 keys.
        let table: Vec<u32> = (0..70).collect();
        let seqs = [SeqRows { num_rows: 6, context_len: 1021, block_table: &table, prompt_len: 10 }];
        let positions: Vec<u32> = (1021..1027).collect();
        let tokens = [1u32; 6];
        let batch =
            ForwardBatch { tokens: &tokens, positions: &positions, seqs: &seqs, slots: &positions, logit_rows: &[] };
        let mut cfg = CudaCacheConfig::new(80, 16, 64, 4, 1200);
        let rows = TileRows { prompt: 16, decode: 4, kv_heads: 8, tensor_core_prompt: false };
        let mut host = Vec::new();
        let p = plan(&batch, None, &cfg, rows, &mut host);
        assert_eq!(&host[p.layout.decode_tiles()], &[0, 0, 3, 0, 0, 3, 3, 3]);
        assert_eq!(p.decode_splits, 32, "1,024 keys in 32-key splits");
        // As a graph step: padded with empty tiles to the key's count, full tiles' shared memory.
        let key = graph_key(&batch, &cfg, 8, true).expect("uniform");
        assert!(key.class_cut, "keys 1,022..=1,027 span two size classes");
        let p = plan(&batch, Some(key), &cfg, rows, &mut host);
        assert_eq!(p.layout.decode_tiles, graph_decode_tiles(key, 4));
        assert_eq!(p.layout.decode_tiles, 3, "two tiles and one of room for the cut");
        assert_eq!(&host[p.layout.decode_tiles()][..8], &[0, 0, 3, 0, 0, 3, 3, 3]);
        assert!(host[p.layout.decode_tiles()][8..].chunks(4).all(|t| t[2] == 0), "the rest are empty");
        assert_eq!(p.max_decode_tile_rows, 4);
        // The capacity holds a graph step of the most sequences, each cut at a class boundary.
        cfg.max_decode_rows = 64;
        assert!(Layout::capacity(&cfg, rows) >= p.layout.len());
    }

    #[test]
    fn graph_plans_pad_to_the_bucket_and_keep_their_layout() {
        let table = [1u32, 2];
        let mk = |ctx: usize| SeqRows { num_rows: 2, context_len: ctx, block_table: &table, prompt_len: 3 };
        let seqs = [mk(3), mk(5), mk(4)];
        let tokens = [7u32; 6];
        let positions = [3u32, 4, 5, 6, 4, 5];
        let batch =
            ForwardBatch { tokens: &tokens, positions: &positions, seqs: &seqs, slots: &positions, logit_rows: &[1] };
        let key = graph_key(&batch, &cfg(), 8, true).expect("uniform decode batch");
        assert_eq!(key, GraphKey { seqs: 4, rows: 2, tokens: 8, long_keys: false, class_cut: false, keys: 16 });
        // A sequence past the RoPE fold's key count replays another graph (the RoPE kernel of its own).
        let long = [mk(3), mk(ROPE_FOLD_MAX_KEYS - 1), mk(4)];
        let long_key = graph_key(&ForwardBatch { seqs: &long, ..batch }, &cfg(), 8, true).expect("uniform");
        // (Its rows' keys, 4,096 and 4,097, also span two split size classes.)
        assert_eq!(long_key, GraphKey { long_keys: true, class_cut: true, keys: 16, ..key });
        let mut host = Vec::new();
        let p = plan(
            &batch,
            Some(key),
            &cfg(),
            TileRows { prompt: 16, decode: 4, kv_heads: 8, tensor_core_prompt: false },
            &mut host,
        );
        assert_eq!((p.layout.t, p.layout.l, p.layout.seqs), (8, 8, 4));
        assert_eq!(p.decode_splits, attn_max_splits(16, 8));
        assert_eq!(&host[p.layout.slots()][6..], &[32, 33], "padded rows write the spare page");
        assert_eq!(&host[p.layout.row_keys()][6..], &[1, 2]);
        assert_eq!(p.max_decode_seq_rows, 2, "padded sequences have the bucket's rows too");
        // A later step with other contexts has the same layout (the graph's addresses stay valid).
        let seqs2 = [mk(9), mk(5), mk(4)];
        let batch2 = ForwardBatch { seqs: &seqs2, ..batch };
        let p2 = plan(
            &batch2,
            graph_key(&batch2, &cfg(), 8, true),
            &cfg(),
            TileRows { prompt: 16, decode: 4, kv_heads: 8, tensor_core_prompt: false },
            &mut host,
        );
        assert_eq!(p2.layout, p.layout);
        // A prompt row anywhere takes the eager path.
        let seqs3 = [mk(3), SeqRows { context_len: 1, ..mk(1) }, mk(4)];
        assert!(graph_key(&ForwardBatch { seqs: &seqs3, ..batch }, &cfg(), 8, true).is_none());
    }

    #[test]
    fn steps_verifying_different_draft_counts_replay_padded_graphs() {
        let table = [1u32, 2, 3, 4];
        let mk = |rows: usize| SeqRows { num_rows: rows, context_len: 3, block_table: &table, prompt_len: 3 };
        let tokens = [7u32; 6];
        let positions = [3u32, 3, 4, 5, 3, 4];
        let seqs = [mk(1), mk(3), mk(2)];
        let batch =
            ForwardBatch { tokens: &tokens, positions: &positions, seqs: &seqs, slots: &positions, logit_rows: &[0] };
        assert!(graph_key(&batch, &cfg(), 8, false).is_none(), "a family without mixed graphs runs it eagerly");
        // 6 rows pad to 8, the most rows (3) to 4: one padded sequence of 2 rows.
        let key = graph_key(&batch, &cfg(), 8, true).expect("mixed decode and verify rows");
        assert_eq!((key.seqs, key.rows, key.tokens), (4, 4, 8));
        let tile_rows = TileRows { prompt: 16, decode: 4, kv_heads: 8, tensor_core_prompt: false };
        let mut host = Vec::new();
        let p = plan(&batch, Some(key), &cfg(), tile_rows, &mut host);
        assert_eq!((p.layout.t, p.layout.l, p.layout.seqs, p.layout.decode_tiles), (8, 8, 4, 4));
        assert_eq!(&host[p.layout.row_keys()][6..], &[1, 2], "the padded sequence's rows attend the spare page");
        assert_eq!(p.max_decode_seq_rows, 4, "the key's rows, whatever the batch's most");
        // Four sequences of 6 rows: the padded rows need a fifth sequence, so the sequences pad to 8 (past the
        // cache's 4: padded sequences only take block-table room), three of them with no rows.
        let four = [mk(1), mk(1), mk(1), mk(3)];
        let key4 = graph_key(&ForwardBatch { seqs: &four, ..batch }, &cfg(), 8, true).expect("mixed");
        assert_eq!((key4.seqs, key4.rows, key4.tokens), (8, 4, 8));
        let p4 = plan(&ForwardBatch { seqs: &four, ..batch }, Some(key4), &cfg(), tile_rows, &mut host);
        assert_eq!(p4.layout.seqs, 8);
        assert!(Layout::capacity(&cfg(), tile_rows) >= p4.layout.len());
    }

    #[test]
    fn a_graph_keys_layout_is_the_same_for_every_batch_it_takes() {
        let table = [1u32, 2, 3, 4];
        let tile_rows = TileRows { prompt: 16, decode: 3, kv_heads: 8, tensor_core_prompt: false };
        let (mut layouts, mut host) = (std::collections::HashMap::new(), Vec::new());
        // Every batch of 1-4 sequences of 1-5 rows each, at two contexts.
        for code in 0..5usize.pow(4) {
            for n in 1..=4 {
                let rows: Vec<usize> = (0..n).map(|i| 1 + code / 5usize.pow(i as u32) % 5).collect();
                let ctx = 3 + code % 2;
                let seqs: Vec<SeqRows> = rows
                    .iter()
                    .map(|&r| SeqRows { num_rows: r, context_len: ctx, block_table: &table, prompt_len: 3 })
                    .collect();
                let t: usize = rows.iter().sum();
                let (tokens, positions) = (vec![1u32; t], vec![4u32; t]);
                let batch = ForwardBatch {
                    tokens: &tokens,
                    positions: &positions,
                    seqs: &seqs,
                    slots: &positions,
                    logit_rows: &[0],
                };
                let Some(key) = graph_key(&batch, &cfg(), 8, true) else { continue };
                let p = plan(&batch, Some(key), &cfg(), tile_rows, &mut host);
                assert!(p.layout.t == key.tokens && p.layout.seqs == key.seqs && host.len() == p.layout.len());
                let (lay, tile, seq_rows) = (p.layout, p.max_decode_tile_rows, p.max_decode_seq_rows);
                let first = *layouts.entry(key).or_insert((lay, tile, seq_rows));
                assert_eq!(first, (lay, tile, seq_rows), "rows {rows:?} under {key:?}");
            }
        }
        assert!(layouts.keys().any(|k| k.tokens < k.seqs * k.rows), "some keys are mixed");
    }

    #[test]
    fn graph_steps_launch_attention_for_their_keys_not_the_longest_sequence() {
        // The default model: 3 KV heads, 32-key splits up to 4,096 keys, 128 splits a row from there.
        assert_eq!(graph_keys(1, 8192, 3), GRAPH_MIN_KEYS);
        assert_eq!(graph_keys(200, 8192, 3), 256);
        assert_eq!(attn_max_splits(graph_keys(200, 8192, 3), 3), 8, "where the longest sequence's launch has 128");
        assert_eq!(graph_keys(1500, 8192, 3), 2048);
        assert_eq!(graph_keys(2049, 8192, 3), 8192, "4,096 keys already have a row's most splits");
        // 8 KV heads reach their most splits at 1,024 keys: past that, one graph for every context.
        assert_eq!(graph_keys(600, 8192, 8), 8192);
        assert_eq!(graph_keys(100, 8192, 8), 128);
        assert_eq!(graph_keys(100, 64, 8), 64, "never past the longest sequence");
    }

    #[test]
    fn validate_refuses_what_the_device_cannot_check() {
        let table = [1u32];
        let seqs = [SeqRows { num_rows: 1, context_len: 0, block_table: &table, prompt_len: 1 }];
        let ok = ForwardBatch { tokens: &[1], positions: &[0], seqs: &seqs, slots: &[4], logit_rows: &[0] };
        validate(&ok, &cfg(), &tiny_model()).expect("valid");
        assert!(validate(&ForwardBatch { tokens: &[999], ..ok }, &cfg(), &tiny_model()).is_err(), "token id");
        assert!(validate(&ForwardBatch { slots: &[32], ..ok }, &cfg(), &tiny_model()).is_err(), "slot");
        assert!(validate(&ForwardBatch { positions: &[64], ..ok }, &cfg(), &tiny_model()).is_err(), "position");
        let bad_page = [8u32];
        let seqs = [SeqRows { block_table: &bad_page, ..seqs[0] }];
        assert!(validate(&ForwardBatch { seqs: &seqs, ..ok }, &cfg(), &tiny_model()).is_err(), "page");
    }

    fn tiny_model() -> ModelConfig {
        let v = serde_json::json!({
            "model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "vocab_size": 100, "max_position_embeddings": 64,
        });
        ModelConfig::from_hf(&v).expect("config")
    }
}
