//! Which CUDA graph a step replays ([`GraphKey`]): its decode and verify rows padded to a bucket of sequences and
//! rows, and, for a step that also carries a prompt chunk, the chunk's rows padded to a bucket of their own. The
//! key fixes every count the step's layout depends on, so a graph captured for it reads the right inputs at every
//! replay; the padding only ever adds rows and tiles of their own, so a real row is computed by the same kernels,
//! with the same bits, replayed or eager.

use dflash_runtime::cuda::ops::{attn_max_splits, attn_split_keys};

use super::cache::CudaCacheConfig;
use super::plan::{MAX_CLASS_CUTS, ROPE_FOLD_MAX_KEYS};
use crate::batch::{ForwardBatch, SeqRows};

/// Which graph a step replays: its decode / verify sequences (a bucket, padded), the most rows one of them has,
/// their rows in all (padded), whether some sequence's keys pass [`ROPE_FOLD_MAX_KEYS`] (the graphs differ in
/// where RoPE runs), the keys its split attention is launched for, and its prompt chunk's sequences and rows
/// (padded; none for a decode / verify step).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(crate) struct GraphKey {
    pub seqs: usize,
    pub rows: usize,
    /// `seqs · rows` when every decode sequence has `rows` rows; fewer for a step whose sequences verify different
    /// counts of drafts ([`graph_shape`]).
    pub tokens: usize,
    pub long_keys: bool,
    /// Some sequence's rows span two split size classes (their decode tiles are cut there; the graph holds room
    /// for those tiles).
    pub class_cut: bool,
    /// Keys the split attention is launched for (its split blocks per row): at least the step's most
    /// ([`graph_keys`]).
    pub keys: usize,
    /// Sequences whose rows are prompt rows (each wholly: a chunk of its prompt).
    pub prompt_seqs: usize,
    /// Their rows in all, padded ([`graph_prompt_tokens`]; 0 without prompt sequences).
    pub prompt_tokens: usize,
}

impl GraphKey {
    /// Rows of the step, padded rows included.
    pub fn total_rows(&self) -> usize {
        self.tokens + self.prompt_tokens
    }

    /// Rows whose logits the graph computes: every row of a decode / verify step (in row order); with a prompt
    /// chunk, its decode rows and one a prompt sequence, gathered as the step asks (padded with row 0).
    pub fn logit_rows(&self) -> usize {
        match self.prompt_seqs {
            0 => self.tokens,
            n => self.tokens + n,
        }
    }

    /// Whether the graph computes every row's logits in row order (rather than the step's logit rows in order).
    pub fn every_row_logits(&self) -> bool {
        self.prompt_seqs == 0
    }
}

/// The kinds of step a family lets replay graphs besides uniform decode / verify steps.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GraphKinds {
    /// Steps whose sequences verify different counts of drafts (padded sequences then have from none to the key's
    /// rows each).
    pub mixed: bool,
    /// Steps that carry a prompt chunk (the prompt rows take the tensor-core prompt attention, whose launch
    /// depends on the tile count alone).
    pub prompts: bool,
}

/// Size-class cuts a graph step's sequence may have (`graph_key` refuses batches with more): `rows` consecutive key
/// counts cross at most one size-class boundary per 1,024 (the boundaries are 1,024 or more keys apart).
fn graph_class_cuts(rows: usize) -> usize {
    (1 + rows / 1024).min(MAX_CLASS_CUTS)
}

/// Decode tiles of a graph step (padded with empty tiles to this count, so the layout depends on the key alone):
/// for sequences of at most `rows` rows, `tokens` in all, at most `ceil(rows / tile)` tiles each and
/// `seqs + tokens / tile` together (a sequence's `r` rows take `ceil(r / tile) <= 1 + r / tile` tiles); room for the
/// class cuts only when the key has one, and none with one-row tiles (a cut adds no tile there).
pub(crate) fn graph_decode_tiles(key: GraphKey, tile_rows: usize) -> usize {
    let tile = tile_rows.max(1);
    let cuts = if key.class_cut && tile > 1 { graph_class_cuts(key.rows) } else { 0 };
    let tiles = (key.seqs * key.rows.div_ceil(tile)).min(key.seqs + key.tokens.div_ceil(tile));
    tiles + key.seqs * cuts
}

/// Prompt tiles of a graph step: the prompt sequences' `r_i` rows take `ceil(r_i / tile)` tiles each, at most
/// `seqs + tokens / tile` together, and the padded prompt sequence (the rest of the key's rows) at most
/// `ceil(tokens / tile)` more.
pub(crate) fn graph_prompt_tiles(key: GraphKey, tile_rows: usize) -> usize {
    let tile = tile_rows.max(1);
    match key.prompt_seqs {
        0 => 0,
        n => n + key.prompt_tokens / tile + key.prompt_tokens.div_ceil(tile),
    }
}

/// The most prompt sequences a graph step carries.
const GRAPH_MAX_PROMPT_SEQS: usize = 2;

/// The most prompt rows (padded) a graph step carries: past them a chunk's own work dwarfs the launches a graph
/// saves, and padding to a bucket would cost more than it.
const GRAPH_MAX_PROMPT_TOKENS: usize = 256;

/// Prompt rows a graph step of `n` prompt rows is padded to: a multiple of 32, or of a quarter of `n`'s power of two
/// past 128 (32, 64, 96, 128, 192, 256): few buckets, so few graphs, and at most a quarter of the rows padding.
pub(crate) fn graph_prompt_tokens(n: usize) -> usize {
    let step = (n.next_power_of_two() / 4).max(32);
    n.div_ceil(step) * step
}

/// Whether some sequence of `batch` attends more than [`ROPE_FOLD_MAX_KEYS`] keys.
pub(crate) fn long_keys(batch: &ForwardBatch) -> bool {
    batch.seqs.iter().any(|s| s.context_len + s.num_rows > ROPE_FOLD_MAX_KEYS)
}

/// The graph a batch can replay, within the cache's capacities: a step whose sequences are all past their prompts,
/// padded as [`graph_shape`] says (with `kinds.mixed`, also when they verify different counts of drafts); with
/// `kinds.prompts`, also a step that carries a chunk of at most [`GRAPH_MAX_PROMPT_SEQS`] prompts, each sequence's
/// rows either all prompt or all decode.
pub(crate) fn graph_key(
    batch: &ForwardBatch,
    cfg: &CudaCacheConfig,
    kv_heads: usize,
    kinds: GraphKinds,
) -> Option<GraphKey> {
    if !cfg.graphs || batch.seqs.is_empty() || batch.seqs.iter().any(|s| s.num_rows == 0) {
        return None;
    }
    let in_prompt = |s: &SeqRows| s.context_len < s.prompt_len;
    let decode: Vec<SeqRows> = batch.seqs.iter().filter(|s| !in_prompt(s)).copied().collect();
    let prompt: Vec<&SeqRows> = batch.seqs.iter().filter(|s| in_prompt(s)).collect();
    if prompt.is_empty() {
        return decode_key(&decode, cfg, kv_heads, kinds.mixed, long_keys(batch));
    }
    let whole = prompt.iter().all(|s| s.context_len + s.num_rows <= s.prompt_len);
    if !kinds.prompts || !whole || prompt.len() > GRAPH_MAX_PROMPT_SEQS {
        return None;
    }
    let prompt_tokens = graph_prompt_tokens(prompt.iter().map(|s| s.num_rows).sum());
    let decode_part = match decode.is_empty() {
        true => GraphKey { keys: GRAPH_MIN_KEYS.min(cfg.max_seq_len), ..no_prompt() },
        false => decode_key(&decode, cfg, kv_heads, kinds.mixed, false)?,
    };
    let key = GraphKey { long_keys: long_keys(batch), prompt_seqs: prompt.len(), prompt_tokens, ..decode_part };
    let fits = prompt_tokens <= GRAPH_MAX_PROMPT_TOKENS
        && key.total_rows() <= cfg.max_tokens
        && key.logit_rows() <= cfg.max_logit_rows
        && batch.logit_rows.len() <= key.logit_rows()
        && key.seqs + key.prompt_seqs < graph_seq_limit(cfg);
    fits.then_some(key)
}

/// A key's prompt part when it has none.
fn no_prompt() -> GraphKey {
    GraphKey {
        seqs: 0,
        rows: 0,
        tokens: 0,
        long_keys: false,
        class_cut: false,
        keys: 0,
        prompt_seqs: 0,
        prompt_tokens: 0,
    }
}

/// The key of decode / verify sequences `seqs` (none of them in its prompt).
fn decode_key(
    seqs: &[SeqRows],
    cfg: &CudaCacheConfig,
    kv_heads: usize,
    mixed: bool,
    long_keys: bool,
) -> Option<GraphKey> {
    let (padded_seqs, rows, tokens) = graph_shape(seqs, cfg, mixed)?;
    // Size-class changes within a sequence whose `rows` rows attend keys first ..= first + rows - 1 (the padded
    // sequences': 1 ..= rows at most): the split size only grows with the keys, by doubling.
    let class = |keys: usize| attn_split_keys(keys, kv_heads);
    let cuts = |first: usize, rows: usize| (class(first + rows - 1) / class(first)).ilog2() as usize;
    let real = seqs.iter().map(|s| cuts(s.context_len + 1, s.num_rows));
    let most = real.chain([cuts(1, rows)]).max().unwrap_or(0);
    if most > graph_class_cuts(rows) {
        return None;
    }
    let max_keys = seqs.iter().map(|s| s.context_len + s.num_rows).max().unwrap_or(rows);
    let keys = graph_keys(max_keys, cfg.max_seq_len, kv_heads);
    Some(GraphKey { seqs: padded_seqs, rows, tokens, long_keys, class_cut: most > 0, keys, ..no_prompt() })
}

/// Sequences, rows per sequence and rows in all of the graph step decode / verify sequences `seqs` replay.
/// Sequences with the same rows pad the sequences to a bucket ([`graph_seqs`]), each padded one with those rows. A
/// step whose sequences verify different counts of drafts (with `mixed`) pads its rows in all to a bucket too, and
/// its most rows per sequence to a power of two; the padded rows go to padded sequences, at most that many each
/// (so a graph's attention keeps its tiles' shape), and some padded sequences may have none.
fn graph_shape(seqs: &[SeqRows], cfg: &CudaCacheConfig, mixed: bool) -> Option<(usize, usize, usize)> {
    let limit = cfg.max_tokens.min(cfg.max_decode_rows).min(cfg.max_logit_rows);
    let fits = |&(seqs, _, tokens): &(usize, usize, usize)| seqs <= graph_seq_limit(cfg) && tokens <= limit;
    let n = seqs.len();
    let first = seqs.first()?.num_rows;
    if seqs.iter().all(|s| s.num_rows == first) {
        return [graph_seqs(n), n].into_iter().map(|s| (s, first, s * first)).find(fits);
    }
    if !mixed {
        return None;
    }
    let rows = seqs.iter().map(|s| s.num_rows).max()?.next_power_of_two();
    let total: usize = seqs.iter().map(|s| s.num_rows).sum();
    let tokens = graph_seqs(total);
    let padded = (graph_seqs(n + (tokens - total).div_ceil(rows)), rows, tokens);
    [padded, (n, rows, total)].into_iter().find(fits)
}

/// The most sequences a graph step may be padded to: past the cache's, room for the padded sequences that hold a
/// mixed step's padded rows. (Only the inputs' block tables grow with it; a uniform step's bucket stays within
/// the cache's sequences rounded up to a power of two.)
pub(crate) fn graph_seq_limit(cfg: &CudaCacheConfig) -> usize {
    2 * cfg.max_seqs
}

/// Sequences a graph step of `n` sequences is padded to: a power of two up to 16, past it the next multiple of an
/// eighth of `n`'s power of two (20, 24, 28, 32, 40, 48, ...), so a step pads less than a quarter of its sequences
/// where powers of two padded up to half (20 sequences ran as 32: entry 98). `DFLASH_GRAPH_BUCKETS=pow2` pads to
/// powers of two.
pub(crate) fn graph_seqs(n: usize) -> usize {
    if n <= 16 || dflash_runtime::switches::switches().graph_pow2_buckets {
        return n.next_power_of_two();
    }
    let step = n.next_power_of_two() / 8;
    n.div_ceil(step) * step
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_chunks_pad_to_few_buckets() {
        let buckets: Vec<usize> =
            [1, 32, 33, 64, 65, 96, 97, 128, 129, 192, 193, 256].iter().map(|&n| graph_prompt_tokens(n)).collect();
        assert_eq!(buckets, [32, 32, 64, 64, 96, 96, 128, 128, 192, 192, 256, 256]);
        for n in 65..=GRAPH_MAX_PROMPT_TOKENS {
            let b = graph_prompt_tokens(n);
            assert!(b >= n && 2 * (b - n) < n, "{n} prompt rows pad to {b}");
        }
    }

    #[test]
    fn graph_steps_pad_to_fine_buckets() {
        let buckets: Vec<usize> = [1, 3, 5, 9, 16, 17, 20, 24, 33, 63, 64, 65, 100, 128, 129, 200, 256]
            .iter()
            .map(|&n| graph_seqs(n))
            .collect();
        assert_eq!(buckets, [1, 4, 8, 16, 16, 20, 20, 24, 40, 64, 64, 80, 112, 128, 160, 224, 256]);
        for n in 17..=1024 {
            let b = graph_seqs(n);
            assert!(b >= n && 4 * (b - n) < n, "{n} sequences pad to {b}");
        }
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
}
