//! The CPU op set every model is written against.
//!
//! All activations are f32 host tensors, row-major; weights may be any [`DType`]. Ops take
//! their outputs as `&mut Tensor` so callers can reuse buffers across steps, check shapes up front and
//! return [`RuntimeError::Shape`] / [`RuntimeError::DType`] instead of panicking. The Gated DeltaNet ops take
//! f32 slices and row strides, as their CUDA twins do, so a layer hands them columns of its projection.
//!
//! Threading: ops run on rayon's global pool (see [`crate::threads`]). Small inputs (decode rows) run on
//! the calling thread, because dispatching tasks costs more than the work.

mod attention;
mod delta_rule;
mod dense;
#[cfg(target_arch = "x86_64")]
mod dense_avx2;
mod elementwise;
pub mod filter;
mod gdn;
mod matmul;
mod moe;
mod norm;
mod reduce;
mod rope;
pub mod sample;
mod simd;

pub use attention::{kv_write, paged_attention, AttnSeq, RowKernel, KEY_CHUNK};
pub use delta_rule::{delta_rule_step, DELTA_RULE_CHUNK};
pub use elementwise::{add_in_place, embedding, gather_rows, sigmoid_gate_mul, swiglu_fused};
pub use gdn::{
    gdn_conv, gdn_gated_norm, gdn_prep, gdn_rule, GdnConvArgs, GdnHeads, GdnPrepArgs, GdnRuleArgs, RuleForm,
};
pub use matmul::matmul;
pub use moe::{moe_forward, moe_route, swiglu_mlp, MlpWeights, MoeArgs};
pub use norm::{add_rms_norm, head_rms_norm, rms_norm};
pub use reduce::{argmax, softmax_in_place, top_k};
pub use rope::{rope, RopeScaling, RopeStyle, RopeTable};

use crate::{DType, Result, RuntimeError, Tensor};

/// Below this many elements an elementwise op runs on the calling thread.
const PAR_MIN_ELEMS: usize = 1 << 15;

/// Rows per parallel chunk for a `[rows, row_len]` elementwise op: all rows in one chunk when the op
/// is small, otherwise about one chunk per thread.
fn rows_per_chunk(rows: usize, row_len: usize) -> usize {
    let rows = rows.max(1);
    if rows * row_len < PAR_MIN_ELEMS {
        return rows;
    }
    rows.div_ceil(crate::threads::count().max(1))
}

/// Checks that `t` is an f32 tensor whose rows are `row_len` long, returning the row count.
fn f32_rows(t: &Tensor, row_len: usize, what: &str) -> Result<usize> {
    t.expect_dtype(DType::F32)?;
    if t.row_len() != row_len {
        return Err(RuntimeError::Shape(format!("{what}: rows of {row_len} expected, got shape {:?}", t.shape())));
    }
    Ok(t.rows())
}

fn shape_err(msg: String) -> RuntimeError {
    RuntimeError::Shape(msg)
}

#[cfg(test)]
mod test_util {
    //! Deterministic pseudo-random inputs and tolerant comparisons for the op tests.

    /// xorshift64* generator: reproducible inputs without a dependency.
    pub struct Rng(u64);

    impl Rng {
        pub fn new(seed: u64) -> Self {
            Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }

        pub fn next_u64(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        /// Uniform in [-1, 1).
        pub fn uniform(&mut self) -> f32 {
            ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }

        pub fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.uniform()).collect()
        }

        pub fn below(&mut self, n: usize) -> usize {
            (self.next_u64() % n as u64) as usize
        }
    }

    /// Asserts `|a - b| <= tol * max(1, |b|)` elementwise.
    pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths differ");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let err = (g - w).abs();
            assert!(err <= tol * w.abs().max(1.0), "{what}[{i}]: got {g}, want {w} (err {err})");
        }
    }
}
