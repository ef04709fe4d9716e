//! Tensor parallelism's split of a dense decoder over `size` ranks (Megatron's layout): each rank holds a slice of
//! every layer and the ranks add their partial outputs with one all-reduce after the attention's output projection
//! and one after the MLP's down projection (`dflash_runtime::comm`).
//!
//! * q / k / v are split by heads (column parallel: whole rows of `[heads * head_dim, hidden]`), so each rank attends
//!   with its own query heads over its own KV heads and keeps only those in its KV cache;
//! * o_proj is split by the same heads along its input (row parallel: columns of `[hidden, heads * head_dim]`), so
//!   each rank's output is a partial sum over its heads;
//! * gate / up are split by MLP columns and down along the same columns, likewise;
//! * the LM head is split by vocabulary rows (vocabulary parallel): each rank computes its slice of the logits and
//!   one all-gather gives every rank the whole row; the vocabulary need not divide evenly;
//! * norms and the embedding are whole on every rank (a lookup reads one row a token; a mapped checkpoint's
//!   embedding is shared, not copied).
//!
//! Quantized matrices split along their input keep whole 32-element blocks: a rank's slice of the intermediate
//! width must be a multiple of the block.

use std::ops::Range;

use dflash_runtime::Tensor;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// What rank `rank` of `size` holds of each layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
    /// Query heads.
    pub heads: Range<usize>,
    /// KV heads (their query groups are this rank's heads, since both split evenly).
    pub kv_heads: Range<usize>,
    /// Columns of the MLP's intermediate width.
    pub intermediate: Range<usize>,
    /// Rows of the LM head: this rank's slice of the logits.
    pub vocab: Range<usize>,
}

impl Shard {
    /// Rank `rank`'s share of a model of `cfg` split over `size` ranks.
    ///
    /// # Errors
    /// `Config` when `rank >= size`, or when the heads, KV heads or intermediate width do not split evenly (named).
    pub fn new(cfg: &ModelConfig, rank: usize, size: usize) -> Result<Self> {
        if size == 0 || rank >= size {
            return Err(ModelError::Config(format!("tensor-parallel rank {rank} of {size}")));
        }
        if cfg.vocab_size < size {
            return Err(ModelError::Config(format!(
                "tensor parallelism over {size} ranks needs a vocabulary of at least {size} tokens"
            )));
        }
        let even = |what: &str, n: usize| -> Result<Range<usize>> {
            if !n.is_multiple_of(size) {
                return Err(ModelError::Config(format!(
                    "tensor parallelism over {size} ranks needs {what} ({n}) divisible by {size}"
                )));
            }
            let per = n / size;
            Ok(rank * per..(rank + 1) * per)
        };
        Ok(Shard {
            rank,
            size,
            heads: even("the attention heads", cfg.num_heads)?,
            kv_heads: even("the KV heads", cfg.num_kv_heads)?,
            intermediate: even("the intermediate size", cfg.intermediate_size)?,
            vocab: Self::vocab_slice(cfg.vocab_size, rank, size),
        })
    }

    /// Rank `rank`'s rows of a vocabulary of `vocab` split over `size` ranks: consecutive, the first
    /// `vocab % size` ranks one row longer.
    pub fn vocab_slice(vocab: usize, rank: usize, size: usize) -> Range<usize> {
        let (per, extra) = (vocab / size, vocab % size);
        let start = rank * per + rank.min(extra);
        start..start + per + usize::from(rank < extra)
    }

    /// The config one rank's layers have: its heads, KV heads and intermediate width (everything else whole).
    pub fn config(&self, cfg: &ModelConfig) -> ModelConfig {
        ModelConfig {
            num_heads: self.heads.len(),
            num_kv_heads: self.kv_heads.len(),
            intermediate_size: self.intermediate.len(),
            ..cfg.clone()
        }
    }

    /// Rows `heads * head_dim` of a q-like matrix `[heads * head_dim, in]` (or of k / v with the KV heads).
    fn head_rows(heads: &Range<usize>, head_dim: usize) -> Range<usize> {
        heads.start * head_dim..heads.end * head_dim
    }

    /// This rank's q, k and v rows.
    ///
    /// # Errors
    /// Matrices smaller than the model's heads.
    pub fn qkv(&self, q: &Tensor, k: &Tensor, v: &Tensor, head_dim: usize) -> Result<[Tensor; 3]> {
        let kv = Self::head_rows(&self.kv_heads, head_dim);
        Ok([take_rows(q, Self::head_rows(&self.heads, head_dim))?, take_rows(k, kv.clone())?, take_rows(v, kv)?])
    }

    /// This rank's input columns of o_proj `[hidden, heads * head_dim]`.
    ///
    /// # Errors
    /// A matrix smaller than the heads; a quantized one whose slice cuts a block.
    pub fn o_proj(&self, o_proj: &Tensor, head_dim: usize) -> Result<Tensor> {
        take_cols(o_proj, Self::head_rows(&self.heads, head_dim))
    }

    /// This rank's rows of the LM head `[vocab, hidden]`.
    ///
    /// # Errors
    /// A matrix smaller than the vocabulary.
    pub fn lm_head(&self, lm_head: &Tensor) -> Result<Tensor> {
        take_rows(lm_head, self.vocab.clone())
    }

    /// This rank's gate and up rows `[intermediate, hidden]` and down's input columns `[hidden, intermediate]`.
    ///
    /// # Errors
    /// Matrices smaller than the intermediate width; a quantized down projection whose slice cuts a block.
    pub fn mlp(&self, gate: &Tensor, up: &Tensor, down: &Tensor) -> Result<[Tensor; 3]> {
        let cols = self.intermediate.clone();
        Ok([take_rows(gate, cols.clone())?, take_rows(up, cols.clone())?, take_cols(down, cols)?])
    }
}

/// Rows `rows` of a matrix `[n, k]` of any dtype (a quantized row is a whole number of blocks).
///
/// # Errors
/// `rows` past `n`.
pub fn take_rows(t: &Tensor, rows: Range<usize>) -> Result<Tensor> {
    if rows.end > t.rows() || rows.start > rows.end {
        return Err(ModelError::Config(format!("rows {rows:?} of a [{}, {}] matrix", t.rows(), t.row_len())));
    }
    let rb = t.row_bytes();
    let bytes = &t.bytes()?[rows.start * rb..rows.end * rb];
    Ok(Tensor::from_bytes(t.dtype(), &[rows.len(), t.row_len()], bytes)?)
}

/// Columns `cols` of every row of a matrix `[n, k]`; for a quantized dtype `cols` must start and end on a block.
///
/// # Errors
/// `cols` past `k`, or cutting a quantized block.
pub fn take_cols(t: &Tensor, cols: Range<usize>) -> Result<Tensor> {
    let (dtype, k) = (t.dtype(), t.row_len());
    let cut = |at: usize| dtype.bytes_for(at);
    let (Some(from), Some(to)) = (cut(cols.start), cut(cols.end)) else {
        return Err(ModelError::Config(format!(
            "columns {cols:?} of a {dtype} matrix cut its {}-element blocks",
            dtype.block_len()
        )));
    };
    if cols.end > k || cols.start > cols.end {
        return Err(ModelError::Config(format!("columns {cols:?} of a [{}, {k}] matrix", t.rows())));
    }
    let rb = t.row_bytes();
    let src = t.bytes()?;
    let mut bytes = Vec::with_capacity(t.rows() * (to - from));
    for row in src.chunks_exact(rb) {
        bytes.extend_from_slice(&row[from..to]);
    }
    Ok(Tensor::from_bytes(dtype, &[t.rows(), cols.len()], &bytes)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_runtime::DType;

    fn config(heads: usize, kv_heads: usize, intermediate: usize) -> ModelConfig {
        let json = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
            "intermediate_size": intermediate,
            "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": 16, "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 256
        });
        ModelConfig::from_hf(&json).expect("config")
    }

    #[test]
    fn ranks_take_consecutive_equal_shares_and_name_what_does_not_split() {
        let cfg = config(8, 4, 256);
        let shards: Vec<Shard> = (0..4).map(|r| Shard::new(&cfg, r, 4).expect("shard")).collect();
        assert_eq!(shards[1].heads, 2..4);
        assert_eq!(shards[3].kv_heads, 3..4);
        assert_eq!(shards[2].intermediate, 128..192);
        assert_eq!(shards.iter().map(|s| s.vocab.clone()).collect::<Vec<_>>(), [0..25, 25..50, 50..75, 75..100]);
        // A vocabulary that does not divide: the first ranks take one row more, and the slices tile it.
        let uneven: Vec<_> = (0..3).map(|r| Shard::vocab_slice(100, r, 3)).collect();
        assert_eq!(uneven, [0..34, 34..67, 67..100]);
        let one = shards[0].config(&cfg);
        assert_eq!((one.num_heads, one.num_kv_heads, one.intermediate_size, one.hidden_size), (2, 1, 64, 64));
        let err = Shard::new(&config(8, 2, 256), 0, 4).expect_err("2 KV heads over 4 ranks");
        assert!(err.to_string().contains("KV heads (2)"), "{err}");
        assert!(Shard::new(&cfg, 4, 4).is_err(), "rank past the group");
    }

    #[test]
    fn slices_keep_whole_rows_and_quantized_blocks() {
        // A [3, 64] Q8_0 matrix: two 34-byte blocks a row, bytes numbered so a slice shows where it came from.
        let bytes: Vec<u8> = (0..3 * 68).map(|i| i as u8).collect();
        let q = Tensor::from_bytes(DType::Q8_0, &[3, 64], &bytes).expect("q8");
        let rows = take_rows(&q, 1..3).expect("rows");
        assert_eq!((rows.rows(), rows.bytes().expect("b")[0]), (2, 68));
        let cols = take_cols(&q, 32..64).expect("second block of every row");
        assert_eq!(cols.shape(), &[3, 32]);
        assert_eq!(cols.bytes().expect("b")[..2], [34, 35]);
        assert_eq!(cols.bytes().expect("b")[34], 68 + 34);
        let err = take_cols(&q, 16..48).expect_err("cuts blocks");
        assert!(err.to_string().contains("32-element blocks"), "{err}");
        let f = Tensor::from_f32(&(0..12).map(|v| v as f32).collect::<Vec<_>>(), &[3, 4]).expect("f32");
        assert_eq!(take_cols(&f, 1..3).expect("cols").as_f32().expect("f32"), &[1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
    }
}
