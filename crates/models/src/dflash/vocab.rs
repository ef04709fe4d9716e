//! Draft vocabularies: the drafter scores only the target tokens it is likely to propose (the "draft vocab" of
//! FR-Spec and EAGLE-3).
//!
//! A draft vocabulary keeps the `N` LM-head rows of the tokens the target emits most often, gathered once into a
//! contiguous tensor of the head's own dtype: draft logits have `N` columns, column `j` being target token
//! `ids[j]`. Lossless by construction: verification compares drafts with the target's own tokens over the full
//! vocabulary. The ids are kept ascending, so "ties go to the lower id" means the same in draft and target ids.
//!
//! The ranking ships with the drafter as [`DRAFT_VOCAB_FILE`]: a safetensors file holding `token_ids` (i32, u32
//! or i64, target ids, most useful first) and, in its metadata, `default_size`, the `N` measured best.
//!
//! Design notes: docs/MODELS.md, "Draft vocabulary".

use std::path::Path;
use std::sync::Arc;

use dflash_runtime::Tensor;
use safetensors::{Dtype as StDtype, SafeTensors};

use crate::error::{ModelError, Result};

/// The ranking's file name in a drafter directory.
pub const DRAFT_VOCAB_FILE: &str = "draft_vocab.safetensors";
/// The ranking tensor's name.
const TOKEN_IDS: &str = "token_ids";
/// The metadata key holding the recommended size.
const DEFAULT_SIZE: &str = "default_size";

/// Target token ids ranked by how useful they are to draft.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VocabRanking {
    /// Most useful first.
    pub token_ids: Vec<u32>,
    /// The draft vocabulary size recorded with the ranking (`default_size` in the file's metadata).
    pub default_size: Option<usize>,
}

impl VocabRanking {
    /// Reads a ranking file.
    ///
    /// # Errors
    /// An unreadable file, a malformed header, no `token_ids` tensor, a tensor that is not 1-D integers, a
    /// negative id, or a `default_size` that is not a positive integer.
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| ModelError::io(path, e))?;
        let (_, meta) = SafeTensors::read_metadata(&bytes).map_err(|e| ModelError::format(path, e.to_string()))?;
        let default_size = match meta.metadata().as_ref().and_then(|m| m.get(DEFAULT_SIZE)) {
            None => None,
            Some(s) => match s.parse::<usize>() {
                Ok(n) if n > 0 => Some(n),
                _ => return Err(ModelError::format(path, format!("{DEFAULT_SIZE} `{s}` is not a positive integer"))),
            },
        };
        let st = SafeTensors::deserialize(&bytes).map_err(|e| ModelError::format(path, e.to_string()))?;
        let view = st.tensor(TOKEN_IDS).map_err(|e| ModelError::format(path, e.to_string()))?;
        if view.shape().len() != 1 {
            return Err(ModelError::format(path, format!("{TOKEN_IDS} has shape {:?}, expected 1-D", view.shape())));
        }
        let token_ids = integer_ids(view.dtype(), view.data()).map_err(|msg| ModelError::format(path, msg))?;
        Ok(VocabRanking { token_ids, default_size })
    }

    /// Reads `dir/draft_vocab.safetensors`; `None` when the drafter ships no ranking.
    ///
    /// # Errors
    /// As [`VocabRanking::read`] for a file that exists.
    pub fn read_dir(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join(DRAFT_VOCAB_FILE);
        if path.exists() {
            Self::read(&path).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The draft vocabulary of size `n`: the first `n` ranked ids plus every id of `always` (the tokenizer's
    /// end-of-sequence ids, so a drafter can always propose the end), deduplicated and ascending. Asking for more
    /// than the ranking holds takes all of it.
    pub fn select(&self, n: usize, always: &[u32]) -> Vec<u32> {
        let mut ids: Vec<u32> = self.token_ids.iter().take(n).chain(always).copied().collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Little-endian integer ids of a safetensors tensor.
fn integer_ids(dtype: StDtype, data: &[u8]) -> std::result::Result<Vec<u32>, String> {
    let negative = |v: i64| format!("{TOKEN_IDS} holds a negative id {v}");
    match dtype {
        StDtype::U32 => Ok(data.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()),
        StDtype::I32 => data
            .chunks_exact(4)
            .map(|b| {
                let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                u32::try_from(v).map_err(|_| negative(v.into()))
            })
            .collect(),
        StDtype::I64 => data
            .chunks_exact(8)
            .map(|b| {
                let v = i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
                u32::try_from(v).map_err(|_| negative(v))
            })
            .collect(),
        other => Err(format!("{TOKEN_IDS} has dtype {other:?}, expected I32, U32 or I64")),
    }
}

/// A draft vocabulary: the target ids the drafter scores and the LM head rows of those ids.
#[derive(Debug)]
pub struct DraftVocab {
    /// Draft id `j` is target id `ids[j]`; strictly ascending.
    ids: Arc<[u32]>,
    /// The head's rows `ids`, in that order, in the head's dtype.
    head: Tensor, // [N, Ht]
    /// Rows of the head the rows were gathered from.
    target_vocab: usize,
}

impl DraftVocab {
    /// Gathers the rows `ids` (any order, duplicates dropped) of the target's LM head into a contiguous tensor
    /// of the same dtype (block-quantized rows are whole blocks, so they copy as bytes).
    ///
    /// # Errors
    /// No ids, an id outside the head, a head that is not 2-D or whose bytes are not host-readable.
    pub fn gather(lm_head: &Tensor, ids: &[u32]) -> Result<Self> {
        let &[v, ht] = lm_head.shape() else {
            return Err(ModelError::Batch(format!("LM head of shape {:?}, expected [V, H]", lm_head.shape())));
        };
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        match ids.last() {
            None => return Err(ModelError::Config("an empty draft vocabulary".into())),
            Some(&last) if last as usize >= v => {
                return Err(ModelError::Config(format!("draft vocabulary id {last} outside the {v}-token LM head")))
            }
            Some(_) => {}
        }
        let rb = lm_head.row_bytes();
        let src = lm_head.bytes()?;
        let mut bytes = Vec::with_capacity(ids.len() * rb);
        for &id in &ids {
            let at = id as usize * rb;
            bytes.extend_from_slice(&src[at..at + rb]);
        }
        let head = Tensor::from_bytes(lm_head.dtype(), &[ids.len(), ht], &bytes)?;
        Ok(DraftVocab { ids: ids.into(), head, target_vocab: v })
    }

    /// Tokens in the draft vocabulary (`N`).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Target id of every draft id, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// The gathered rows.
    pub fn head(&self) -> &Tensor {
        &self.head // [N, Ht]
    }

    /// Size of the target vocabulary the rows come from.
    pub fn target_vocab(&self) -> usize {
        self.target_vocab
    }

    /// The draft id of a target token, if it is in the draft vocabulary.
    pub fn draft_id(&self, target_id: u32) -> Option<usize> {
        self.ids.binary_search(&target_id).ok()
    }
}

/// The LM head a block pass scores its draft rows with.
#[derive(Clone, Copy, Debug)]
pub enum DraftHead<'a> {
    /// The target's whole head `[V, Ht]`: logit column `j` is token `j`.
    Full(&'a Tensor),
    /// A draft vocabulary: logit column `j` is token `vocab.ids()[j]`.
    Vocab(&'a DraftVocab),
}

impl<'a> DraftHead<'a> {
    /// The matrix the draft rows are multiplied with.
    pub fn matrix(&self) -> &'a Tensor {
        match self {
            DraftHead::Full(t) => t,
            DraftHead::Vocab(v) => &v.head,
        }
    }

    /// The target id of every logit column (`None` for the full head).
    pub fn token_ids(&self) -> Option<Arc<[u32]>> {
        match self {
            DraftHead::Full(_) => None,
            DraftHead::Vocab(v) => Some(Arc::clone(&v.ids)),
        }
    }
}

impl<'a> From<&'a Tensor> for DraftHead<'a> {
    fn from(t: &'a Tensor) -> Self {
        DraftHead::Full(t)
    }
}

impl<'a> From<&'a DraftVocab> for DraftHead<'a> {
    fn from(v: &'a DraftVocab) -> Self {
        DraftHead::Vocab(v)
    }
}

/// The target id of logit column `column` under an optional column map.
pub fn target_id(token_ids: Option<&[u32]>, column: u32) -> u32 {
    token_ids.map_or(column, |ids| ids[column as usize])
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_runtime::{ops, DType};
    use std::collections::HashMap;

    /// A `[v, h]` f32 head whose row `i` is `i + 0.01 · c` in column `c`.
    fn head(v: usize, h: usize) -> Tensor {
        let data: Vec<f32> = (0..v * h).map(|x| (x / h) as f32 + 0.01 * (x % h) as f32).collect();
        Tensor::from_f32(&data, &[v, h]).expect("head")
    }

    #[test]
    fn gather_copies_the_rows_in_ascending_id_order() {
        let full = head(10, 4);
        let vocab = DraftVocab::gather(&full, &[7, 2, 9, 2]).expect("gather");
        assert_eq!(vocab.ids(), &[2, 7, 9]);
        assert_eq!(vocab.head().shape(), &[3, 4]);
        assert_eq!(vocab.target_vocab(), 10);
        let rows = vocab.head().as_f32().expect("f32");
        let src = full.as_f32().expect("f32");
        for (j, &id) in vocab.ids().iter().enumerate() {
            assert_eq!(&rows[j * 4..(j + 1) * 4], &src[id as usize * 4..(id as usize + 1) * 4]);
        }
        assert_eq!(vocab.draft_id(7), Some(1));
        assert_eq!(vocab.draft_id(3), None);
        assert!(DraftVocab::gather(&full, &[]).is_err());
        assert!(DraftVocab::gather(&full, &[3, 10]).is_err(), "id past the head");
    }

    #[test]
    fn gathered_logits_are_the_full_logits_columns_for_dense_and_quantized_heads() {
        let (v, h) = (48, 64);
        let x: Vec<f32> = (0..3 * h).map(|i| ((i * 29 % 17) as f32 - 8.0) / 7.0).collect();
        let x = Tensor::from_f32(&x, &[3, h]).expect("x");
        let dense: Vec<f32> = (0..v * h).map(|i| ((i * 37 % 23) as f32 - 11.0) / 13.0).collect();
        let dense = Tensor::from_f32(&dense, &[v, h]).expect("dense");
        let mut q8 = Tensor::zeros(DType::Q8_0, &[v, h]).expect("q8_0");
        dflash_runtime::quant::quantize_row(DType::Q8_0, dense.as_f32().expect("f32"), q8.bytes_mut().expect("bytes"));
        for full in [&dense, &q8] {
            let vocab = DraftVocab::gather(full, &[40, 1, 17, 5, 33]).expect("gather");
            assert_eq!(vocab.head().dtype(), full.dtype());
            let mut all = Tensor::zeros(DType::F32, &[3, v]).expect("y");
            ops::matmul(&x, full, &mut all).expect("full");
            let mut some = Tensor::zeros(DType::F32, &[3, vocab.len()]).expect("y");
            ops::matmul(&x, DraftHead::from(&vocab).matrix(), &mut some).expect("draft");
            let (all, some) = (all.as_f32().expect("f32"), some.as_f32().expect("f32"));
            for r in 0..3 {
                for (j, &id) in vocab.ids().iter().enumerate() {
                    assert_eq!(
                        some[r * vocab.len() + j],
                        all[r * v + id as usize],
                        "{:?} row {r} id {id}",
                        full.dtype()
                    );
                }
            }
        }
    }

    #[test]
    fn columns_map_back_to_target_ids() {
        let full = head(10, 2);
        let vocab = DraftVocab::gather(&full, &[8, 3, 5]).expect("gather");
        let map = DraftHead::Vocab(&vocab).token_ids().expect("map");
        assert_eq!(target_id(Some(&map), 0), 3);
        assert_eq!(target_id(Some(&map), 2), 8);
        assert_eq!(target_id(None, 6), 6);
        assert!(DraftHead::Full(&full).token_ids().is_none());
        assert_eq!(DraftHead::Full(&full).matrix().shape(), &[10, 2]);
    }

    #[test]
    fn select_takes_the_ranked_prefix_plus_the_always_ids() {
        let ranking = VocabRanking { token_ids: vec![0, 2, 40, 7, 13, 9], default_size: Some(4) };
        assert_eq!(ranking.select(4, &[2, 50]), vec![0, 2, 7, 40, 50]);
        assert_eq!(ranking.select(100, &[]), vec![0, 2, 7, 9, 13, 40]);
        assert_eq!(ranking.select(0, &[5]), vec![5]);
    }

    fn write_ranking(path: &Path, dtype: StDtype, data: Vec<u8>, n: usize, meta: Option<&str>) {
        let view = safetensors::tensor::TensorView::new(dtype, vec![n], &data).expect("view");
        let meta = meta.map(|s| HashMap::from([(DEFAULT_SIZE.to_string(), s.to_string())]));
        safetensors::serialize_to_file([(TOKEN_IDS, view)], meta, path).expect("write");
    }

    #[test]
    fn rankings_read_from_safetensors() {
        let dir = tempfile::tempdir().expect("tmp");
        assert_eq!(VocabRanking::read_dir(dir.path()).expect("absent"), None);
        let path = dir.path().join(DRAFT_VOCAB_FILE);
        let ids: Vec<u8> = [2i32, 0, 17, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
        write_ranking(&path, StDtype::I32, ids, 4, Some("4096"));
        let r = VocabRanking::read_dir(dir.path()).expect("read").expect("present");
        assert_eq!(r, VocabRanking { token_ids: vec![2, 0, 17, 5], default_size: Some(4096) });
        let ids: Vec<u8> = [3i64, 1].iter().flat_map(|v| v.to_le_bytes()).collect();
        write_ranking(&path, StDtype::I64, ids, 2, None);
        assert_eq!(VocabRanking::read(&path).expect("i64").token_ids, vec![3, 1]);
        let ids: Vec<u8> = [3i32, -1].iter().flat_map(|v| v.to_le_bytes()).collect();
        write_ranking(&path, StDtype::I32, ids, 2, None);
        assert!(VocabRanking::read(&path).is_err(), "negative id");
        write_ranking(&path, StDtype::F32, 1f32.to_le_bytes().to_vec(), 1, None);
        assert!(VocabRanking::read(&path).is_err(), "float ids");
        let ids: Vec<u8> = [3i32].iter().flat_map(|v| v.to_le_bytes()).collect();
        write_ranking(&path, StDtype::I32, ids, 1, Some("lots"));
        assert!(VocabRanking::read(&path).is_err(), "bad default_size");
    }
}
