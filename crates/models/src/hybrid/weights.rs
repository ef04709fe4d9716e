//! Weight plumbing for the hybrid model: norm weights as f32 (zero-centred ones folded to `1 + w`), and fused
//! matrices built from row ranges of several checkpoint tensors.

use std::ops::Range;

use dflash_runtime::{DType, Tensor};

use crate::error::{ModelError, Result};
use crate::weights::WeightStore;

/// A norm weight as f32; `zero_centred` folds HF's `x̂ · (1 + w)` into a plain `x̂ · w'` (`w' = 1 + w`, the same
/// f32 sum HF forms).
pub(crate) fn norm_weight(store: &mut WeightStore, name: &str, len: usize, zero_centred: bool) -> Result<Tensor> {
    let w = f32_values(store.take(name, &[len])?)?;
    let w: Vec<f32> = if zero_centred { w.iter().map(|&x| 1.0 + x).collect() } else { w };
    Ok(Tensor::from_f32(&w, &[len])?)
}

/// Any small tensor's values as f32.
pub(crate) fn f32_values(t: Tensor) -> Result<Vec<f32>> {
    let t = if t.dtype() == DType::F32 { t } else { t.to_f32()? };
    Ok(t.as_f32()?.to_vec())
}

/// Stacks row ranges of 2-D tensors with one row length: `[(a, 0..2), (b, 4..5)]` gives a's rows 0, 1 then b's
/// row 4. Kept in the stored dtype when all parts share it, else widened to f32.
pub(crate) fn stack_rows(parts: &[(&Tensor, Range<usize>)]) -> Result<Tensor> {
    let Some((first, _)) = parts.first() else {
        return Err(ModelError::Config("no rows to stack".into()));
    };
    let cols = first.row_len();
    if let Some((t, _)) = parts.iter().find(|(t, r)| t.shape().len() != 2 || t.row_len() != cols || r.end > t.rows()) {
        return Err(ModelError::Config(format!("cannot stack rows of {:?} with rows of {cols}", t.shape())));
    }
    let same = parts.iter().all(|(t, _)| t.dtype() == first.dtype());
    let widened: Vec<Tensor>;
    let sources: Vec<&Tensor> = if same {
        parts.iter().map(|(t, _)| *t).collect()
    } else {
        widened = parts.iter().map(|(t, _)| t.to_f32()).collect::<Result<_, _>>()?;
        widened.iter().collect()
    };
    let dtype = sources[0].dtype();
    let rows: usize = parts.iter().map(|(_, r)| r.len()).sum();
    let mut out = Tensor::zeros(dtype, &[rows, cols])?;
    let row_bytes = sources[0].row_bytes();
    let dst = out.bytes_mut()?;
    let mut at = 0;
    for (src, (_, range)) in sources.iter().zip(parts) {
        let bytes = &src.bytes()?[range.start * row_bytes..range.end * row_bytes];
        dst[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    }
    Ok(out)
}

/// Whole tensors stacked: `[a; b; …]`.
pub(crate) fn concat_rows(parts: &[&Tensor]) -> Result<Tensor> {
    let ranges: Vec<(&Tensor, Range<usize>)> = parts.iter().map(|t| (*t, 0..t.rows())).collect();
    stack_rows(&ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacks_ranges_and_widens_mixed_dtypes() {
        let a = Tensor::from_f32(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]).expect("a");
        let b = Tensor::from_f32(&[7.0, 8.0], &[1, 2]).expect("b");
        let s = stack_rows(&[(&a, 2..3), (&b, 0..1), (&a, 0..1)]).expect("stack");
        assert_eq!(s.shape(), &[3, 2]);
        assert_eq!(s.as_f32().expect("f32"), &[5.0, 6.0, 7.0, 8.0, 1.0, 2.0]);
        let half = Tensor::from_bytes(DType::BF16, &[1, 2], &[0x80, 0x3f, 0x00, 0x40]).expect("bf16");
        let mixed = concat_rows(&[&b, &half]).expect("mixed");
        assert_eq!(mixed.dtype(), DType::F32);
        assert_eq!(mixed.as_f32().expect("f32"), &[7.0, 8.0, 1.0, 2.0]);
        assert!(stack_rows(&[(&a, 0..4)]).is_err());
    }
}
