//! Rotary position embeddings with HF transformers' frequency schemes (default, linear, llama3, YaRN).
//!
//! Frequencies are computed in f64 from the formulas in transformers' `modeling_rope_utils`, stored as
//! f32; angles `position · inv_freq` are formed in f64 and their cos/sin rounded to f32.

use std::f64::consts::PI;

use rayon::prelude::*;

use super::{f32_rows, rows_per_chunk, shape_err};
use crate::{Result, RuntimeError, Tensor};

/// Which dimensions form a rotated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// `rotate_half`: pairs `(i, i + d/2)` — HF checkpoints.
    Neox,
    /// Pairs `(2i, 2i + 1)` — GGUF llama (the converter permutes q/k rows into this order).
    Interleaved,
}

/// How the base frequencies are rescaled for context extension.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Position interpolation: every frequency divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend in between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// YaRN. `factor` is the effective one: HF replaces the configured factor by
    /// `max_position_embeddings / original_max_position_embeddings` when the latter is present in the
    /// config, and callers must do the same. `truncate` is HF's default `true` unless the config says
    /// otherwise; `beta_fast`/`beta_slow` default to 32/1 there.
    Yarn {
        factor: f32,
        original_max_position_embeddings: usize,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: Option<f32>,
        mscale: Option<f32>,
        mscale_all_dim: Option<f32>,
        truncate: bool,
    },
}

/// Precomputed rotary frequencies for one attention configuration.
#[derive(Clone, Debug)]
pub struct RopeTable {
    /// One inverse frequency per rotated pair (`rotary_dim / 2`).
    inv_freq: Vec<f32>,
    /// Factor applied to cos and sin (YaRN's attention scaling; 1 otherwise).
    attention_scaling: f32,
    style: RopeStyle,
    rotary_dim: usize,
}

impl RopeTable {
    /// Frequencies for rotating the first `rotary_dim` dims of each head with base `base`.
    ///
    /// # Errors
    /// `rotary_dim` zero or odd, a non-positive base or factor, or llama3 factors that coincide.
    pub fn new(rotary_dim: usize, base: f32, scaling: &RopeScaling, style: RopeStyle) -> Result<Self> {
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(invalid(format!("rotary_dim must be even and positive, got {rotary_dim}")));
        }
        if base.is_nan() || base <= 0.0 {
            return Err(invalid(format!("rope base must be positive, got {base}")));
        }
        let dim = rotary_dim as f64;
        let base = base as f64;
        // HF: inv_freq = 1 / base^(2i / dim).
        let default: Vec<f64> = (0..rotary_dim / 2).map(|i| 1.0 / base.powf(2.0 * i as f64 / dim)).collect();
        let (inv_freq, attention_scaling) = match *scaling {
            RopeScaling::None => (default, 1.0),
            RopeScaling::Linear { factor } => {
                let factor = positive_factor(factor)?;
                (default.iter().map(|f| f / factor).collect(), 1.0)
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let params = Llama3Params {
                    factor: positive_factor(factor)?,
                    low_freq_factor: low_freq_factor as f64,
                    high_freq_factor: high_freq_factor as f64,
                    old_context_len: original_max_position_embeddings as f64,
                };
                if params.high_freq_factor == params.low_freq_factor {
                    return Err(invalid("llama3 rope: high_freq_factor equals low_freq_factor".into()));
                }
                (llama3_inv_freq(&default, &params), 1.0)
            }
            RopeScaling::Yarn { .. } => yarn_inv_freq(dim, base, scaling)?,
        };
        Ok(RopeTable {
            inv_freq: inv_freq.iter().map(|&f| f as f32).collect(),
            attention_scaling: attention_scaling as f32,
            style,
            rotary_dim,
        })
    }

    /// Number of leading dims of each head that are rotated.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// The inverse frequency of each rotated pair.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The factor cos and sin are multiplied by (YaRN's attention factor; 1 for other schemes).
    pub fn attention_scaling(&self) -> f32 {
        self.attention_scaling
    }

    pub fn style(&self) -> RopeStyle {
        self.style
    }

    /// cos and sin of every pair's angle at `position`, times the attention scaling.
    fn cos_sin(&self, position: u32, cos: &mut [f32], sin: &mut [f32]) {
        for ((c, s), &f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let (sv, cv) = (position as f64 * f as f64).sin_cos();
            *c = cv as f32 * self.attention_scaling;
            *s = sv as f32 * self.attention_scaling;
        }
    }
}

fn invalid(msg: String) -> RuntimeError {
    RuntimeError::Unsupported(msg)
}

fn positive_factor(factor: f32) -> Result<f64> {
    if factor.is_nan() || factor <= 0.0 {
        return Err(invalid(format!("rope scaling factor must be positive, got {factor}")));
    }
    Ok(factor as f64)
}

struct Llama3Params {
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    old_context_len: f64,
}

/// HF `_compute_llama3_parameters`.
fn llama3_inv_freq(default: &[f64], p: &Llama3Params) -> Vec<f64> {
    let low_freq_wavelen = p.old_context_len / p.low_freq_factor;
    let high_freq_wavelen = p.old_context_len / p.high_freq_factor;
    default
        .iter()
        .map(|&f| {
            let wavelen = 2.0 * PI / f;
            let scaled = if wavelen > low_freq_wavelen { f / p.factor } else { f };
            let is_medium = wavelen >= high_freq_wavelen && wavelen <= low_freq_wavelen;
            if is_medium {
                let smooth =
                    (p.old_context_len / wavelen - p.low_freq_factor) / (p.high_freq_factor - p.low_freq_factor);
                (1.0 - smooth) * scaled / p.factor + smooth * scaled
            } else {
                scaled
            }
        })
        .collect()
}

/// HF `_compute_yarn_parameters`: a per-pair blend of interpolated (`/ factor`) and extrapolated
/// frequencies along a linear ramp between the correction dims of `beta_fast` and `beta_slow`
/// rotations, plus the attention factor.
fn yarn_inv_freq(dim: f64, base: f64, scaling: &RopeScaling) -> Result<(Vec<f64>, f64)> {
    let RopeScaling::Yarn {
        factor,
        original_max_position_embeddings,
        beta_fast,
        beta_slow,
        attention_factor,
        mscale,
        mscale_all_dim,
        truncate,
    } = *scaling
    else {
        return Err(invalid("yarn_inv_freq called without YaRN scaling".into()));
    };
    let factor = positive_factor(factor)?;
    let get_mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention = match (attention_factor, mscale, mscale_all_dim) {
        (Some(a), _, _) => a as f64,
        // HF tests `if mscale and mscale_all_dim`: zero counts as absent.
        (None, Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
            get_mscale(factor, m as f64) / get_mscale(factor, ma as f64)
        }
        _ => get_mscale(factor, 1.0),
    };
    let max_pos = original_max_position_embeddings as f64;
    let correction_dim = |rotations: f64| (dim * (max_pos / (rotations * 2.0 * PI)).ln()) / (2.0 * base.ln());
    let (mut low, mut high) = (correction_dim(beta_fast as f64), correction_dim(beta_slow as f64));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min(dim - 1.0);
    if low == high {
        high += 0.001; // HF: prevent a division by zero in the ramp
    }
    let pairs = (dim as usize) / 2;
    let inv_freq = (0..pairs)
        .map(|i| {
            let pos_freq = base.powf(2.0 * i as f64 / dim);
            let extrapolation = 1.0 / pos_freq;
            let interpolation = 1.0 / (factor * pos_freq);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect();
    Ok((inv_freq, attention))
}

/// Rotates the first `rotary_dim` dims of every head of every row, in place, at `positions[t]`.
///
/// `x`: `[T, heads · head_dim]` f32; `positions`: `T` entries.
///
/// # Errors
/// Rows not a multiple of `head_dim`, `rotary_dim > head_dim`, a position count other than `T`, or a
/// read-only `x`.
pub fn rope(x: &mut Tensor, head_dim: usize, positions: &[u32], table: &RopeTable) -> Result<()> {
    let row_len = x.row_len();
    if head_dim == 0 || !row_len.is_multiple_of(head_dim) || table.rotary_dim > head_dim {
        return Err(shape_err(format!(
            "rope: x {:?}, head_dim {head_dim}, rotary_dim {}",
            x.shape(),
            table.rotary_dim
        )));
    }
    let rows = f32_rows(x, row_len, "rope x")?;
    if positions.len() != rows {
        return Err(shape_err(format!("rope: {} positions for {rows} rows", positions.len())));
    }
    let xs = x.as_f32_mut()?;
    if row_len == 0 {
        return Ok(());
    }
    let rows_per = rows_per_chunk(rows, row_len);
    xs.par_chunks_mut(rows_per * row_len).zip(positions.par_chunks(rows_per)).for_each(|(xc, pc)| {
        let half = table.rotary_dim / 2;
        let mut cos_sin = vec![0f32; 2 * half];
        let (cos, sin) = cos_sin.split_at_mut(half);
        for (row, &pos) in xc.chunks_exact_mut(row_len).zip(pc) {
            table.cos_sin(pos, cos, sin);
            for head in row.chunks_exact_mut(head_dim) {
                rotate_head(&mut head[..table.rotary_dim], cos, sin, table.style);
            }
        }
    });
    Ok(())
}

/// x1' = x1·cos − x2·sin, x2' = x2·cos + x1·sin for each pair (x1, x2) of `head` (`rotary_dim` long).
fn rotate_head(head: &mut [f32], cos: &[f32], sin: &[f32], style: RopeStyle) {
    match style {
        RopeStyle::Neox => {
            let (first, second) = head.split_at_mut(cos.len());
            for (((a, b), c), s) in first.iter_mut().zip(second.iter_mut()).zip(cos).zip(sin) {
                let (x1, x2) = (*a, *b);
                *a = x1 * c - x2 * s;
                *b = x2 * c + x1 * s;
            }
        }
        RopeStyle::Interleaved => {
            for ((pair, c), s) in head.chunks_exact_mut(2).zip(cos).zip(sin) {
                let (x1, x2) = (pair[0], pair[1]);
                pair[0] = x1 * c - x2 * s;
                pair[1] = x2 * c + x1 * s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_util::{assert_close, Rng};
    use crate::DType;

    fn assert_rel(got: &[f32], want: &[(usize, f64)], what: &str) {
        for &(i, w) in want {
            let rel = ((got[i] as f64 - w) / w).abs();
            assert!(rel < 1e-5, "{what}[{i}]: got {}, want {w}", got[i]);
        }
    }

    #[test]
    fn llama3_frequencies_match_hf() {
        // Llama 3.1 config: rotary dim 64, base 500000, factor 8, low/high freq factors 1/4, original
        // context 8192. Expected values: HF `_compute_llama3_parameters` transcribed to numpy float32;
        // index 14 is a kept high frequency, 15-17 are smoothed, 20 and 31 are divided by 8.
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let t = RopeTable::new(64, 500_000.0, &scaling, RopeStyle::Neox).expect("table");
        let want = [
            (0, 1.0),
            (5, 1.286873817e-1),
            (14, 3.211446106e-3),
            (15, 1.371893683e-3),
            (16, 5.248460220e-4),
            (17, 1.785077911e-4),
            (20, 3.428102355e-5),
            (31, 3.767322596e-7),
        ];
        assert_rel(t.inv_freq(), &want, "llama3");
        assert_eq!(t.attention_scaling(), 1.0);
    }

    #[test]
    fn yarn_frequencies_match_hf() {
        // Qwen-style YaRN: rotary dim 64, base 1e6, factor 4, original context 32768, beta 32/1,
        // truncate: correction range (11, 20), attention factor 0.1·ln 4 + 1. Expected values: HF
        // `_compute_yarn_parameters` transcribed to numpy float32.
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        };
        let t = RopeTable::new(64, 1_000_000.0, &scaling, RopeStyle::Neox).expect("table");
        let want = [
            (0, 1.0),
            (8, 3.162277862e-2),
            (10, 1.333521493e-2),
            (12, 5.154795479e-3),
            (14, 1.778530306e-3),
            (16, 5.833333707e-4),
            (18, 1.757068676e-4),
            (20, 4.445698505e-5),
            (31, 3.849816324e-7),
        ];
        assert_rel(t.inv_freq(), &want, "yarn");
        assert!((t.attention_scaling() as f64 - 1.138629436111989).abs() < 1e-6);

        // Untruncated range (12.88, 20.11), beta 16/2, base 1e4, factor 8, original context 4096,
        // attention factor from mscale 0.707 / mscale_all_dim 1.0.
        let scaling = RopeScaling::Yarn {
            factor: 8.0,
            original_max_position_embeddings: 4096,
            beta_fast: 16.0,
            beta_slow: 2.0,
            attention_factor: None,
            mscale: Some(0.707),
            mscale_all_dim: Some(1.0),
            truncate: false,
        };
        let t = RopeTable::new(64, 10_000.0, &scaling, RopeStyle::Neox).expect("table");
        let want = [
            (0, 1.0),
            (4, 3.162277639e-1),
            (8, 1.000000015e-1),
            (12, 3.162277862e-2),
            (14, 1.537167653e-2),
            (16, 6.221889053e-3),
            (31, 1.666901881e-5),
        ];
        assert_rel(t.inv_freq(), &want, "yarn untruncated");
        assert!((t.attention_scaling() as f64 - 0.9495608824621653).abs() < 1e-6);
    }

    /// HF-style reference: rotate_half over the first `rot` dims of each head.
    fn naive_neox(x: &[f32], heads: usize, d: usize, rot: usize, pos: u32, t: &RopeTable) -> Vec<f32> {
        let mut out = x.to_vec();
        let half = rot / 2;
        for h in 0..heads {
            for i in 0..half {
                let ang = pos as f64 * t.inv_freq()[i] as f64;
                let (s, c) = (ang.sin() * t.attention_scaling() as f64, ang.cos() * t.attention_scaling() as f64);
                let (a, b) = (x[h * d + i] as f64, x[h * d + i + half] as f64);
                out[h * d + i] = (a * c - b * s) as f32;
                out[h * d + i + half] = (b * c + a * s) as f32;
            }
        }
        out
    }

    #[test]
    fn neox_matches_reference_and_interleaved_under_permutation() {
        let mut rng = Rng::new(31);
        let (rows, heads, d, rot) = (5, 3, 12, 8);
        let neox = RopeTable::new(rot, 10_000.0, &RopeScaling::Linear { factor: 2.0 }, RopeStyle::Neox).expect("neox");
        let inter = RopeTable::new(rot, 10_000.0, &RopeScaling::Linear { factor: 2.0 }, RopeStyle::Interleaved)
            .expect("interleaved");
        let positions = [0u32, 1, 17, 300, 4097];
        let xv = rng.vec(rows * heads * d);
        let mut x = Tensor::from_f32(&xv, &[rows, heads * d]).expect("x");
        rope(&mut x, d, &positions, &neox).expect("rope");
        let want: Vec<f32> =
            xv.chunks(heads * d).zip(positions).flat_map(|(r, p)| naive_neox(r, heads, d, rot, p, &neox)).collect();
        assert_close(x.as_f32().expect("x"), &want, 1e-5, "neox");

        // Interleaved dim 2i <-> neox dim i, 2i+1 <-> i + rot/2 (dims past rot stay in place).
        let perm = |j: usize| {
            if j >= rot {
                j
            } else if j.is_multiple_of(2) {
                j / 2
            } else {
                j / 2 + rot / 2
            }
        };
        let permute = |v: &[f32]| -> Vec<f32> {
            let mut out = v.to_vec();
            for (head_in, head_out) in v.chunks(d).zip(out.chunks_mut(d)) {
                for j in 0..d {
                    head_out[perm(j)] = head_in[j];
                }
            }
            out
        };
        let mut y = Tensor::from_f32(&xv, &[rows, heads * d]).expect("y");
        rope(&mut y, d, &positions, &inter).expect("rope interleaved");
        let y_as_neox = permute(y.as_f32().expect("y"));
        let mut z = Tensor::from_f32(&permute(&xv), &[rows, heads * d]).expect("z");
        rope(&mut z, d, &positions, &neox).expect("rope permuted");
        assert_close(&y_as_neox, z.as_f32().expect("z"), 1e-6, "interleaved vs neox");
    }

    #[test]
    fn rope_parallel_path_and_errors() {
        let mut rng = Rng::new(32);
        let (rows, heads, d) = (300, 4, 64);
        let t = RopeTable::new(d, 100_000.0, &RopeScaling::None, RopeStyle::Neox).expect("table");
        let xv = rng.vec(rows * heads * d);
        let positions: Vec<u32> = (0..rows as u32).map(|p| p * 3).collect();
        let mut x = Tensor::from_f32(&xv, &[rows, heads * d]).expect("x");
        rope(&mut x, d, &positions, &t).expect("rope");
        let want: Vec<f32> =
            xv.chunks(heads * d).zip(&positions).flat_map(|(r, &p)| naive_neox(r, heads, d, d, p, &t)).collect();
        assert_close(x.as_f32().expect("x"), &want, 1e-5, "parallel rope");
        assert!(rope(&mut x, d, &positions[1..], &t).is_err());
        assert!(rope(&mut x, 48, &positions, &t).is_err());
        assert!(RopeTable::new(7, 1e4, &RopeScaling::None, RopeStyle::Neox).is_err());
        assert!(rope(&mut Tensor::zeros(DType::F32, &[2, 64]).expect("x2"), 64, &[0], &t).is_err());
    }
}
