//! Conversions between element types.

use half::{bf16, f16};

use crate::{quant, DType};

/// Decodes one row of `dtype` bytes into f32 values.
///
/// `dst.len()` is the row's element count; `src` holds exactly that many elements in `dtype`'s layout.
pub fn row_to_f32(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::U32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32;
            }
        }
        DType::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => quant::dequantize_row(dtype, src, dst),
    }
}

/// Rounds f32 values to bf16 and back, the rounding a bf16 residual stream applies.
pub fn round_to_bf16(x: &mut [f32]) {
    for v in x {
        *v = bf16::from_f32(*v).to_f32();
    }
}
