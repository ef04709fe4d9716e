//! Row roles and the projections of the hybrid forward.
//!
//! A batch row is a *prompt* row (its position is below its sequence's `prompt_len`) or a *generated* row
//! (decode, verify, recomputed output). Generated rows must come out with the same bits however many rows
//! share the forward: a verify over `w` rows followed by a rollback to `kept` rows must leave exactly the state
//! of a forward over those `kept` rows, and speculative output must equal plain decoding. The roles matter to
//! the ops whose arithmetic differs between a block of rows and rows one at a time (the Gated DeltaNet's
//! chunked and recurrent rules, attention). The projections need no such care: the runtime's matmul gives
//! every row the same bits whatever the other rows of the call, for dense and quantized weights alike.

use dflash_runtime::ops;
use dflash_runtime::Tensor;

use crate::batch::ForwardBatch;
use crate::error::Result;

/// Whether a row is prompt (batched freely) or generated (bit-reproducible alone).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowRole {
    Prompt,
    Generated,
}

/// The role of every row of a forward (or of a gathered subset of its rows).
#[derive(Clone, Debug)]
pub(crate) struct RowPlan {
    roles: Vec<RowRole>,
}

impl RowPlan {
    /// Row `j` of a sequence is prompt while `context_len + j < prompt_len`.
    pub(crate) fn from_batch(batch: &ForwardBatch) -> Self {
        let mut roles = Vec::with_capacity(batch.num_tokens());
        for s in batch.seqs {
            let prompt_rows = s.prompt_len.saturating_sub(s.context_len).min(s.num_rows);
            roles.extend(std::iter::repeat_n(RowRole::Prompt, prompt_rows));
            roles.extend(std::iter::repeat_n(RowRole::Generated, s.num_rows - prompt_rows));
        }
        RowPlan { roles }
    }

    /// The plan of rows `rows` (in that order).
    pub(crate) fn subset(&self, rows: &[usize]) -> Self {
        RowPlan { roles: rows.iter().map(|&r| self.roles[r]).collect() }
    }

    pub(crate) fn role(&self, row: usize) -> RowRole {
        self.roles[row]
    }
}

/// `y = x · wᵀ` over all rows at once, prompt and generated alike.
///
/// `x`: `[T, k]` f32; `w`: `[n, k]`; `y`: `[T, n]` f32, overwritten. Every row of `y` depends only on that row
/// of `x` and on `w` (the runtime matmul is batch-invariant), so the plan does not change how rows are grouped.
pub(crate) fn linear(_plan: &RowPlan, x: &Tensor, w: &Tensor, y: &mut Tensor) -> Result<()> {
    Ok(ops::matmul(x, w, y)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SeqRows;
    use dflash_runtime::ops::gather_rows;
    use dflash_runtime::DType;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// `linear` over rows `rows` of `x` alone, as a `[rows.len(), n]` result.
    fn linear_of(plan: &RowPlan, x: &Tensor, rows: &[usize], w: &Tensor) -> Vec<f32> {
        let xs = gather_rows(x, rows).expect("gather");
        let mut y = Tensor::zeros(DType::F32, &[rows.len(), w.shape()[0]]).expect("y");
        linear(&plan.subset(rows), &xs, w, &mut y).expect("linear");
        y.as_f32().expect("f32").to_vec()
    }

    #[test]
    fn projected_rows_do_not_depend_on_their_company() {
        // A row alone (decode) and the same row among others (verify, a mixed batch) must give the same bits.
        let (n, k, t) = (24, 40, 17);
        let x = Tensor::from_f32(&pseudo_random(t * k, 1), &[t, k]).expect("x");
        let plan = RowPlan { roles: [RowRole::Prompt, RowRole::Generated, RowRole::Generated].repeat(6)[..t].to_vec() };
        for dtype in [DType::F32, DType::BF16] {
            let w = Tensor::from_f32(&pseudo_random(n * k, 2), &[n, k]).expect("w");
            let w = if dtype == DType::F32 { w } else { to_bf16(&w) };
            let alone: Vec<Vec<u32>> =
                (0..t).map(|r| linear_of(&plan, &x, &[r], &w).iter().map(|v| v.to_bits()).collect()).collect();
            for m in 1..=t {
                // Rows m-1, m-2, ... 0: every row lands at another position than its own.
                let rows: Vec<usize> = (0..m).rev().collect();
                let y = linear_of(&plan, &x, &rows, &w);
                for (pos, &r) in rows.iter().enumerate() {
                    let got: Vec<u32> = y[pos * n..(pos + 1) * n].iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, alone[r], "{dtype:?}: row {r} at {pos} of {m}");
                }
            }
        }
    }

    fn to_bf16(w: &Tensor) -> Tensor {
        let bytes: Vec<u8> =
            w.as_f32().expect("f32").iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
        Tensor::from_bytes(DType::BF16, w.shape(), &bytes).expect("bf16")
    }

    #[test]
    fn plan_splits_prompt_and_generated_rows() {
        let table = [0u32];
        let seqs = [
            SeqRows { num_rows: 3, context_len: 2, block_table: &table, prompt_len: 4 },
            SeqRows { num_rows: 2, context_len: 7, block_table: &table, prompt_len: 4 },
        ];
        let tokens = [0u32; 5];
        let batch = ForwardBatch { tokens: &tokens, positions: &tokens, seqs: &seqs, slots: &tokens, logit_rows: &[] };
        let plan = RowPlan::from_batch(&batch);
        use RowRole::{Generated as G, Prompt as P};
        assert_eq!(plan.roles, vec![P, P, G, G, G]);
        assert_eq!(plan.subset(&[4, 0]).roles, vec![G, P]);
    }
}
