//! Row gathers and elementwise ops: embedding lookup, row gather, residual add, output gate, fused SwiGLU.

use rayon::prelude::*;

use super::simd::{self, has_avx2};
use super::{f32_rows, rows_per_chunk, shape_err};
use crate::{convert, DType, Result, Tensor};

/// `out[t, :] = table[ids[t], :]` as f32; only the looked-up rows are decoded, so `table` may be of
/// any dtype including block-quantized ones.
///
/// `table`: `[vocab, hidden]`; `out`: `[ids.len(), hidden]` f32, overwritten.
///
/// # Errors
/// An id `>= vocab`, shape or dtype mismatches, or a read-only `out`.
pub fn embedding(table: &Tensor, ids: &[u32], out: &mut Tensor) -> Result<()> {
    let &[vocab, hidden] = table.shape() else {
        return Err(shape_err(format!("embedding: table must be 2-D, got {:?}", table.shape())));
    };
    if f32_rows(out, hidden, "embedding out")? != ids.len() {
        return Err(shape_err(format!("embedding: {} ids but out {:?}", ids.len(), out.shape())));
    }
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(shape_err(format!("embedding: id {bad} out of range for vocab {vocab}")));
    }
    let row_bytes = table.row_bytes();
    let src = table.bytes()?;
    let dst = out.as_f32_mut()?;
    if hidden == 0 {
        return Ok(());
    }
    for (&id, row) in ids.iter().zip(dst.chunks_exact_mut(hidden)) {
        let start = id as usize * row_bytes;
        convert::row_to_f32(table.dtype(), &src[start..start + row_bytes], row);
    }
    Ok(())
}

/// Rows `rows` of `x` (in that order) as a new tensor.
///
/// `x`: `[T, w]` f32; returns `[rows.len(), w]` f32.
///
/// # Errors
/// A row `>= T`, a non-f32 `x`.
pub fn gather_rows(x: &Tensor, rows: &[usize]) -> Result<Tensor> {
    let w = x.row_len();
    let t = f32_rows(x, w, "gather_rows x")?;
    if let Some(&bad) = rows.iter().find(|&&r| r >= t) {
        return Err(shape_err(format!("gather_rows: row {bad} of {t}")));
    }
    let src = x.as_f32()?;
    let mut out = Tensor::zeros(DType::F32, &[rows.len(), w])?;
    let dst = out.as_f32_mut()?;
    for (j, &r) in rows.iter().enumerate() {
        dst[j * w..(j + 1) * w].copy_from_slice(&src[r * w..(r + 1) * w]);
    }
    Ok(out)
}

/// `residual += delta` elementwise.
///
/// `residual`, `delta`: f32 tensors of equal shape.
///
/// # Errors
/// Shape or dtype mismatches, or a read-only `residual`.
pub fn add_in_place(residual: &mut Tensor, delta: &Tensor) -> Result<()> {
    if residual.shape() != delta.shape() {
        return Err(shape_err(format!("add_in_place: residual {:?} but delta {:?}", residual.shape(), delta.shape())));
    }
    let row_len = residual.row_len();
    let rows = f32_rows(residual, row_len, "add_in_place residual")?;
    f32_rows(delta, row_len, "add_in_place delta")?;
    let ds = delta.as_f32()?;
    let rs = residual.as_f32_mut()?;
    let chunk = rows_per_chunk(rows, row_len) * row_len.max(1);
    rs.par_chunks_mut(chunk).zip(ds.par_chunks(chunk)).for_each(|(rc, dc)| {
        for (r, d) in rc.iter_mut().zip(dc) {
            *r += *d;
        }
    });
    Ok(())
}

/// `x[t, i] ← x[t, i] · sigmoid(gate[t, i])`: the gated attention's output gate.
///
/// `x`: `[rows, n]`; `gate`: `[rows, gate_ld]` from column 0 (`n` used).
///
/// # Errors
/// Lengths that do not form the shapes.
pub fn sigmoid_gate_mul(x: &mut [f32], n: usize, gate: &[f32], gate_ld: usize) -> Result<()> {
    let rows = x.len() / n.max(1);
    let gate_ok = rows == 0 || gate.len() >= (rows - 1) * gate_ld + n;
    if n == 0 || x.len() != rows * n || gate_ld < n || !gate_ok {
        return Err(shape_err(format!(
            "sigmoid_gate_mul: x {} in rows of {n}, gate {} at ld {gate_ld}",
            x.len(),
            gate.len()
        )));
    }
    for (r, row) in x.chunks_exact_mut(n).enumerate() {
        for (a, &g) in row.iter_mut().zip(&gate[r * gate_ld..r * gate_ld + n]) {
            *a *= 1.0 / (1.0 + (-g).exp());
        }
    }
    Ok(())
}

/// `out[t, i] = silu(gate_up[t, i]) · gate_up[t, I + i]` — gate and up projections fused in one matmul.
///
/// `gate_up`: `[T, 2I]` f32; `out`: `[T, I]` f32, overwritten.
///
/// # Errors
/// Shape or dtype mismatches, or a read-only `out`.
pub fn swiglu_fused(gate_up: &Tensor, out: &mut Tensor) -> Result<()> {
    let inter = out.row_len();
    let rows = f32_rows(out, inter, "swiglu out")?;
    if f32_rows(gate_up, 2 * inter, "swiglu gate_up")? != rows {
        return Err(shape_err(format!("swiglu_fused: gate_up {:?} but out {:?}", gate_up.shape(), out.shape())));
    }
    let gs = gate_up.as_f32()?;
    let os = out.as_f32_mut()?;
    if inter == 0 {
        return Ok(());
    }
    let rows_per = rows_per_chunk(rows, 2 * inter);
    let avx2 = has_avx2();
    gs.par_chunks(rows_per * 2 * inter).zip(os.par_chunks_mut(rows_per * inter)).for_each(|(gc, oc)| {
        for (gu, o) in gc.chunks_exact(2 * inter).zip(oc.chunks_exact_mut(inter)) {
            let (gate, up) = gu.split_at(inter);
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: AVX2, FMA and F16C were detected.
                unsafe { swiglu_row_avx2(gate, up, o) };
                continue;
            }
            let _ = avx2;
            swiglu_row::<false>(gate, up, o);
        }
    });
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn swiglu_row_avx2(gate: &[f32], up: &[f32], out: &mut [f32]) {
    swiglu_row::<true>(gate, up, out);
}

/// silu(g) = g / (1 + e^-g), vectorized through the polynomial `exp`.
#[inline(always)]
fn swiglu_row<const AVX2: bool>(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = *g / (1.0 + simd::exp::<AVX2>(-*g)) * *u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_util::{assert_close, Rng};

    #[test]
    fn embedding_gathers_rows_of_dense_tables() {
        let (vocab, hidden) = (7, 5);
        let vals: Vec<f32> = (0..vocab * hidden).map(|i| i as f32 * 0.25).collect();
        let bytes: Vec<u8> = vals.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        for table in [
            Tensor::from_f32(&vals, &[vocab, hidden]).expect("f32 table"),
            Tensor::from_bytes(DType::BF16, &[vocab, hidden], &bytes).expect("bf16 table"),
        ] {
            let ids = [3u32, 0, 6, 3];
            let mut out = Tensor::zeros(DType::F32, &[4, hidden]).expect("out");
            embedding(&table, &ids, &mut out).expect("embedding");
            let want: Vec<f32> = ids.iter().flat_map(|&i| vals[i as usize * hidden..][..hidden].to_vec()).collect();
            assert_close(out.as_f32().expect("out"), &want, 0.0, "embedding");
            let mut one = Tensor::zeros(DType::F32, &[1, hidden]).expect("out");
            assert!(embedding(&table, &[7], &mut one).is_err());
        }
    }

    #[test]
    fn embedding_dequantizes_only_the_looked_up_rows() {
        let mut rng = Rng::new(13);
        let (vocab, hidden) = (5, 64);
        let vals = rng.vec(vocab * hidden);
        let mut bytes = vec![0u8; DType::Q8_0.bytes_for(vocab * hidden).expect("whole blocks")];
        crate::quant::quantize_row(DType::Q8_0, &vals, &mut bytes);
        let table = Tensor::from_bytes(DType::Q8_0, &[vocab, hidden], &bytes).expect("q8_0 table");
        let dense = table.to_f32().expect("dequantized");
        let ids = [4u32, 1];
        let mut out = Tensor::zeros(DType::F32, &[2, hidden]).expect("out");
        embedding(&table, &ids, &mut out).expect("embedding");
        let dense = dense.as_f32().expect("dense");
        let want: Vec<f32> = ids.iter().flat_map(|&i| dense[i as usize * hidden..][..hidden].to_vec()).collect();
        assert_close(out.as_f32().expect("out"), &want, 0.0, "q8_0 embedding");
        // Quantization error stays small, so the rows really are the requested ones.
        assert_close(&want[..hidden], &vals[4 * hidden..5 * hidden], 0.02, "q8_0 vs source");
    }

    #[test]
    fn gather_rows_copies_rows_in_order_and_refuses_missing_ones() {
        let x = Tensor::from_f32(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]).expect("x");
        let g = gather_rows(&x, &[2, 0, 2]).expect("gather");
        assert_eq!(g.shape(), &[3, 2]);
        assert_eq!(g.as_f32().expect("f32"), &[5.0, 6.0, 1.0, 2.0, 5.0, 6.0]);
        assert!(gather_rows(&x, &[3]).is_err());
    }

    #[test]
    fn sigmoid_gate_reads_strided_gates() {
        let mut x = vec![2.0f32, 4.0, -1.0, 8.0];
        let gate = [0.0f32, f32::INFINITY, 9.0, f32::NEG_INFINITY, 0.0];
        sigmoid_gate_mul(&mut x, 2, &gate, 3).expect("gate");
        assert_eq!(x, [1.0, 4.0, -0.0, 4.0]);
        assert!(sigmoid_gate_mul(&mut x, 2, &gate[..4], 3).is_err());
    }

    #[test]
    fn add_in_place_adds() {
        let mut rng = Rng::new(11);
        let (a, b) = (rng.vec(3 * 13), rng.vec(3 * 13));
        let mut r = Tensor::from_f32(&a, &[3, 13]).expect("r");
        let d = Tensor::from_f32(&b, &[3, 13]).expect("d");
        add_in_place(&mut r, &d).expect("add");
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        assert_close(r.as_f32().expect("r"), &want, 0.0, "add");
        let wrong = Tensor::zeros(DType::F32, &[13, 3]).expect("wrong");
        assert!(add_in_place(&mut r, &wrong).is_err());
    }

    #[test]
    fn swiglu_matches_naive() {
        let mut rng = Rng::new(12);
        // 2 x 21 runs on one thread; 40 x 1001 crosses the parallel threshold.
        for (t, i) in [(2, 21), (40, 1001)] {
            let gu: Vec<f32> = rng.vec(t * 2 * i).iter().map(|v| v * 12.0).collect();
            let x = Tensor::from_f32(&gu, &[t, 2 * i]).expect("gate_up");
            let want: Vec<f32> = gu
                .chunks(2 * i)
                .flat_map(|r| {
                    (0..i).map(move |j| {
                        let g = r[j] as f64;
                        (g / (1.0 + (-g).exp()) * r[i + j] as f64) as f32
                    })
                })
                .collect();
            simd::on_both_paths(|path| {
                let mut out = Tensor::zeros(DType::F32, &[t, i]).expect("out");
                swiglu_fused(&x, &mut out).expect("swiglu");
                assert_close(out.as_f32().expect("out"), &want, 1e-5, &format!("swiglu {path}"));
            });
        }
    }
}
