//! The cos/sin table the RoPE kernel reads: for every position below a bound and every rotated pair, the
//! values the CPU op computes on the fly (angle `position · inv_freq` in f64, cos and sin rounded to f32,
//! then times the attention scaling in f32), so the kernel's rotation is bit-identical to the CPU's.

use super::device::{CudaDevice, DeviceBuf};
use super::{CudaError, Result};
use crate::ops::{RopeStyle, RopeTable};

/// A [`RopeTable`]'s cos and sin for positions `0..max_positions`, on the device.
#[derive(Debug)]
pub struct CudaRopeTable {
    /// `[max_positions, pairs]`.
    pub(crate) cos: DeviceBuf<f32>,
    /// `[max_positions, pairs]`.
    pub(crate) sin: DeviceBuf<f32>,
    pub(crate) pairs: usize,
    pub(crate) rotary_dim: usize,
    pub(crate) max_positions: usize,
    pub(crate) style: RopeStyle,
}

impl CudaRopeTable {
    /// Uploads cos and sin of `table` for positions `0..max_positions` (`8 · max_positions · rotary_dim / 2`
    /// bytes: 8 MB for 32K positions of a 64-dim rotation).
    ///
    /// # Errors
    /// `max_positions` zero or beyond `u32`, or the upload failing.
    pub fn new(dev: &CudaDevice, table: &RopeTable, max_positions: usize) -> Result<Self> {
        if max_positions == 0 || u32::try_from(max_positions).is_err() {
            return Err(CudaError::Shape(format!("rope table: max_positions {max_positions} must be in 1..2^32")));
        }
        let (cos, sin) = cos_sin_table(table, max_positions);
        Ok(CudaRopeTable {
            cos: dev.upload(&cos)?,
            sin: dev.upload(&sin)?,
            pairs: table.rotary_dim() / 2,
            rotary_dim: table.rotary_dim(),
            max_positions,
            style: table.style(),
        })
    }

    /// Positions at or beyond this are not in the table.
    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    pub fn style(&self) -> RopeStyle {
        self.style
    }
}

/// Host cos and sin tables, each `[max_positions, rotary_dim / 2]`, computed as `ops::rope` does.
fn cos_sin_table(table: &RopeTable, max_positions: usize) -> (Vec<f32>, Vec<f32>) {
    let pairs = table.rotary_dim() / 2;
    let scaling = table.attention_scaling();
    let mut cos = Vec::with_capacity(max_positions * pairs);
    let mut sin = Vec::with_capacity(max_positions * pairs);
    for position in 0..max_positions {
        for &freq in table.inv_freq() {
            let (s, c) = (position as f64 * freq as f64).sin_cos();
            cos.push(c as f32 * scaling);
            sin.push(s as f32 * scaling);
        }
    }
    (cos, sin)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{rope, RopeScaling};
    use crate::Tensor;

    /// The kernel's arithmetic, on the host: rotate with the table's cos/sin.
    fn rotate_with_table(x: &mut [f32], head_dim: usize, pos: usize, cos: &[f32], sin: &[f32], t: &RopeTable) {
        let pairs = t.rotary_dim() / 2;
        for head in x.chunks_exact_mut(head_dim) {
            for p in 0..pairs {
                let (a, b) = match t.style() {
                    RopeStyle::Neox => (p, p + pairs),
                    RopeStyle::Interleaved => (2 * p, 2 * p + 1),
                };
                let (c, s) = (cos[pos * pairs + p], sin[pos * pairs + p]);
                let (x1, x2) = (head[a], head[b]);
                head[a] = x1 * c - x2 * s;
                head[b] = x2 * c + x1 * s;
            }
        }
    }

    #[test]
    fn table_reproduces_the_cpu_rope_bit_for_bit() {
        // YaRN has an attention scaling != 1, so the scaling path is covered too.
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        };
        for style in [RopeStyle::Neox, RopeStyle::Interleaved] {
            let table = RopeTable::new(12, 10_000.0, &scaling, style).expect("table");
            let (heads, head_dim, max_pos) = (2, 16, 300);
            let (cos, sin) = cos_sin_table(&table, max_pos);
            let positions = [0u32, 1, 7, 299];
            let xv: Vec<f32> =
                (0..positions.len() * heads * head_dim).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
            let mut want = Tensor::from_f32(&xv, &[positions.len(), heads * head_dim]).expect("x");
            rope(&mut want, head_dim, &positions, &table).expect("rope");
            let mut got = xv.clone();
            for (row, &pos) in got.chunks_exact_mut(heads * head_dim).zip(&positions) {
                rotate_with_table(row, head_dim, pos as usize, &cos, &sin, &table);
            }
            let want = want.as_f32().expect("want");
            assert!(got.iter().zip(want).all(|(g, w)| g.to_bits() == w.to_bits()), "{style:?}: {got:?} vs {want:?}");
        }
    }
}
