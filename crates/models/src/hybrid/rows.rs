//! Row roles and the projections that respect them.
//!
//! A batch row is a *prompt* row (its position is below its sequence's `prompt_len`) or a *generated* row
//! (decode, verify, recomputed output). Generated rows must come out with the same bits however many rows
//! share the forward: a verify over `w` rows followed by a rollback to `kept` rows must leave exactly the state
//! of a forward over those `kept` rows, and speculative output must equal plain decoding. Every op of the
//! forward is row-local except the matmul, whose dense kernel reduces a row differently depending on how many
//! rows it is given (a group of four rows shares one reduction pattern, a lone row another, many rows go
//! through a blocked GEMM). So generated rows go through [`matmul_rows_exact`]: groups of at most
//! [`EXACT_GROUP`] rows, each padded with zero rows to a multiple of four, so every row takes the same
//! four-row reduction. The weights are still read once per group; the padding costs arithmetic only: a lone
//! decode row against bf16 weights took about 2.5x the time of the one-row GEMV on a 2-core AVX2 host, a cost
//! that goes away once the runtime's GEMV reduces every row alike. Prompt rows take the ordinary batched
//! matmul.

use dflash_runtime::ops;
use dflash_runtime::{DType, Tensor};

use crate::batch::ForwardBatch;
use crate::error::Result;

/// Most rows one exact matmul call takes: the dense kernel's GEMV limit.
pub(crate) const EXACT_GROUP: usize = 8;
/// Rows of the dense GEMV's shared reduction.
const EXACT_QUANTUM: usize = 4;

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

    fn rows_with(&self, role: RowRole) -> Vec<usize> {
        self.roles.iter().enumerate().filter(|(_, &r)| r == role).map(|(i, _)| i).collect()
    }
}

/// `y = x · wᵀ`, prompt rows batched and generated rows through [`matmul_rows_exact`].
///
/// `x`: `[T, k]` f32; `w`: `[n, k]`; `y`: `[T, n]` f32, overwritten.
pub(crate) fn linear(plan: &RowPlan, x: &Tensor, w: &Tensor, y: &mut Tensor) -> Result<()> {
    let generated = plan.rows_with(RowRole::Generated);
    if generated.is_empty() {
        return Ok(ops::matmul(x, w, y)?);
    }
    if generated.len() == x.rows() {
        return matmul_rows_exact(x, w, y);
    }
    let prompt = plan.rows_with(RowRole::Prompt);
    for (rows, exact) in [(prompt, false), (generated, true)] {
        let xs = gather_rows(x, &rows)?;
        let mut ys = Tensor::zeros(DType::F32, &[rows.len(), y.row_len()])?;
        if exact {
            matmul_rows_exact(&xs, w, &mut ys)?;
        } else {
            ops::matmul(&xs, w, &mut ys)?;
        }
        scatter_rows(&ys, &rows, y)?;
    }
    Ok(())
}

/// `y = x · wᵀ` where every row's bits depend on that row of `x` and on `w` only.
///
/// `x`: `[T, k]` f32; `w`: `[n, k]`; `y`: `[T, n]` f32, overwritten.
pub(crate) fn matmul_rows_exact(x: &Tensor, w: &Tensor, y: &mut Tensor) -> Result<()> {
    let (k, n) = (x.row_len(), y.row_len());
    let t = x.rows();
    let mut start = 0;
    while start < t {
        let rows = (t - start).min(EXACT_GROUP);
        let padded = rows.next_multiple_of(EXACT_QUANTUM);
        let mut xg = Tensor::zeros(DType::F32, &[padded, k])?;
        xg.as_f32_mut()?[..rows * k].copy_from_slice(&x.as_f32()?[start * k..(start + rows) * k]);
        let mut yg = Tensor::zeros(DType::F32, &[padded, n])?;
        ops::matmul(&xg, w, &mut yg)?;
        y.as_f32_mut()?[start * n..(start + rows) * n].copy_from_slice(&yg.as_f32()?[..rows * n]);
        start += rows;
    }
    Ok(())
}

/// Rows `rows` of `x` `[T, w]` as a new `[rows.len(), w]` tensor.
pub(crate) fn gather_rows(x: &Tensor, rows: &[usize]) -> Result<Tensor> {
    let w = x.row_len();
    let src = x.as_f32()?;
    let mut out = Tensor::zeros(DType::F32, &[rows.len(), w])?;
    let dst = out.as_f32_mut()?;
    for (j, &r) in rows.iter().enumerate() {
        dst[j * w..(j + 1) * w].copy_from_slice(&src[r * w..(r + 1) * w]);
    }
    Ok(out)
}

/// Writes row `j` of `src` to row `rows[j]` of `dst`.
pub(crate) fn scatter_rows(src: &Tensor, rows: &[usize], dst: &mut Tensor) -> Result<()> {
    let w = src.row_len();
    let s = src.as_f32()?;
    let d = dst.as_f32_mut()?;
    for (j, &r) in rows.iter().enumerate() {
        d[r * w..(r + 1) * w].copy_from_slice(&s[j * w..(j + 1) * w]);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::SeqRows;

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

    #[test]
    fn exact_rows_do_not_depend_on_their_company() {
        let (n, k) = (24, 40);
        let x = pseudo_random(16 * k, 1);
        for dtype in [DType::F32, DType::BF16] {
            let w = Tensor::from_f32(&pseudo_random(n * k, 2), &[n, k]).expect("w");
            let w = if dtype == DType::F32 { w } else { to_bf16(&w) };
            let alone = |r: usize| {
                let xr = Tensor::from_f32(&x[r * k..(r + 1) * k], &[1, k]).expect("x");
                let mut y = Tensor::zeros(DType::F32, &[1, n]).expect("y");
                matmul_rows_exact(&xr, &w, &mut y).expect("matmul");
                y.as_f32().expect("f32").to_vec()
            };
            for m in 1..=16 {
                let xs = Tensor::from_f32(&x[..m * k], &[m, k]).expect("x");
                let mut y = Tensor::zeros(DType::F32, &[m, n]).expect("y");
                matmul_rows_exact(&xs, &w, &mut y).expect("matmul");
                for r in 0..m {
                    let got: Vec<u32> =
                        y.as_f32().expect("f32")[r * n..(r + 1) * n].iter().map(|v| v.to_bits()).collect();
                    let want: Vec<u32> = alone(r).iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{dtype:?}: row {r} of {m}");
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

    #[test]
    fn mixed_linear_matches_each_role_alone() {
        let (n, k, t) = (8, 16, 6);
        let x = Tensor::from_f32(&pseudo_random(t * k, 3), &[t, k]).expect("x");
        let w = Tensor::from_f32(&pseudo_random(n * k, 4), &[n, k]).expect("w");
        let plan = RowPlan { roles: [RowRole::Prompt, RowRole::Generated].repeat(3) };
        let mut y = Tensor::zeros(DType::F32, &[t, n]).expect("y");
        linear(&plan, &x, &w, &mut y).expect("linear");
        let generated = [1, 3, 5];
        let mut want = Tensor::zeros(DType::F32, &[3, n]).expect("y");
        matmul_rows_exact(&gather_rows(&x, &generated).expect("gather"), &w, &mut want).expect("matmul");
        let got = gather_rows(&y, &generated).expect("gather");
        assert_eq!(got.as_f32().expect("f32"), want.as_f32().expect("f32"));
    }
}
