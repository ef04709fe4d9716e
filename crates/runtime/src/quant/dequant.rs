//! Scalar decoders from ggml blocks to f32, one block at a time (ports of ggml's `dequantize_row_*`).

use super::blocks::{
    f16_at, k4_scale_min, Q4K_DMIN, Q4K_QS, Q4K_SCALES, Q4_0_QS, Q4_1_QS, Q6K_D, Q6K_QH, Q6K_SCALES, Q8_0_QS, QK, QK_K,
};

/// Q4_0: `x = d * (q - 8)`. `blk`: 18 bytes, `out`: 32 values.
pub fn block_q4_0(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let qs = &blk[Q4_0_QS..Q4_0_QS + QK / 2];
    for (j, &b) in qs.iter().enumerate() {
        out[j] = d * ((b & 0x0F) as i32 - 8) as f32;
        out[j + QK / 2] = d * ((b >> 4) as i32 - 8) as f32;
    }
}

/// Q4_1: `x = d * q + m`. `blk`: 20 bytes, `out`: 32 values.
pub fn block_q4_1(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let m = f16_at(blk, 2);
    let qs = &blk[Q4_1_QS..Q4_1_QS + QK / 2];
    for (j, &b) in qs.iter().enumerate() {
        out[j] = d * (b & 0x0F) as f32 + m;
        out[j + QK / 2] = d * (b >> 4) as f32 + m;
    }
}

/// Q8_0: `x = d * q`. `blk`: 34 bytes, `out`: 32 values.
pub fn block_q8_0(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    for (o, &b) in out.iter_mut().zip(&blk[Q8_0_QS..Q8_0_QS + QK]) {
        *o = d * (b as i8) as f32;
    }
}

/// Q4_K: 8 sub-blocks of 32 with 6-bit scales and mins. Each 64 elements share 32 bytes of nibbles: the
/// low nibbles are sub-block `2i`, the high nibbles sub-block `2i + 1`. `blk`: 144 bytes, `out`: 256 values.
pub fn block_q4_k(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, 0);
    let dmin = f16_at(blk, Q4K_DMIN);
    let scales = &blk[Q4K_SCALES..Q4K_QS];
    for pair in 0..QK_K / 64 {
        let q = &blk[Q4K_QS + 32 * pair..Q4K_QS + 32 * pair + 32];
        let (sc_lo, m_lo) = k4_scale_min(scales, 2 * pair);
        let (sc_hi, m_hi) = k4_scale_min(scales, 2 * pair + 1);
        let (d_lo, min_lo) = (d * sc_lo as f32, dmin * m_lo as f32);
        let (d_hi, min_hi) = (d * sc_hi as f32, dmin * m_hi as f32);
        let o = &mut out[64 * pair..64 * pair + 64];
        for (l, &b) in q.iter().enumerate() {
            o[l] = d_lo * (b & 0x0F) as f32 - min_lo;
            o[l + 32] = d_hi * (b >> 4) as f32 - min_hi;
        }
    }
}

/// The 6-bit value of element `l` (0..128) of a 128-element half of a Q6_K block (`ql`: 64 bytes, `qh`: 32).
///
/// Elements `l` and `l + 64` share byte `ql[l % 64]` (low / high nibble); the top two bits of elements
/// `l`, `l + 32`, `l + 64`, `l + 96` are bits 0-1, 2-3, 4-5, 6-7 of `qh[l % 32]`.
#[inline]
pub fn q6_value(ql: &[u8], qh: &[u8], l: usize) -> u8 {
    let low = if l < 64 { ql[l] & 0x0F } else { ql[l - 64] >> 4 };
    let high = (qh[l % 32] >> (2 * (l / 32))) & 3;
    low | (high << 4)
}

/// Q6_K: 16 sub-blocks of 16 with i8 scales. `blk`: 210 bytes, `out`: 256 values.
pub fn block_q6_k(blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk, Q6K_D);
    for half in 0..2 {
        let ql = &blk[64 * half..64 * half + 64];
        let qh = &blk[Q6K_QH + 32 * half..Q6K_QH + 32 * half + 32];
        let sc = &blk[Q6K_SCALES + 8 * half..Q6K_SCALES + 8 * half + 8];
        for l in 0..128 {
            let q = q6_value(ql, qh, l) as i32 - 32;
            out[128 * half + l] = d * (sc[l / 16] as i8) as f32 * q as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::blocks::{pack_k4_scales, put_f16};

    // Known-answer tests on hand-built blocks: every value depends on where its bits sit, so a layout
    // error (nibble order, field offsets, scale packing) changes the output.

    #[test]
    fn q4_0_known_block() {
        let mut b = [0u8; 18];
        put_f16(&mut b, 0, 0.5);
        for j in 0..16 {
            b[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut out = [0f32; 32];
        block_q4_0(&b, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * (j as f32 - 8.0));
            assert_eq!(out[j + 16], 0.5 * (7.0 - j as f32));
        }
    }

    #[test]
    fn q4_1_known_block() {
        let mut b = [0u8; 20];
        put_f16(&mut b, 0, 2.0);
        put_f16(&mut b, 2, -1.5);
        b[4] = 0x31; // element 0 = 1, element 16 = 3
        b[19] = 0xF0; // element 15 = 0, element 31 = 15
        let mut out = [0f32; 32];
        block_q4_1(&b, &mut out);
        assert_eq!(out[0], 0.5);
        assert_eq!(out[16], 4.5);
        assert_eq!(out[15], -1.5);
        assert_eq!(out[31], 28.5);
        assert_eq!(out[1], -1.5);
    }

    #[test]
    fn q8_0_known_block() {
        let mut b = [0u8; 34];
        put_f16(&mut b, 0, 0.25);
        for j in 0..32 {
            b[2 + j] = (j as i8 - 16) as u8;
        }
        let mut out = [0f32; 32];
        block_q8_0(&b, &mut out);
        for (j, v) in out.iter().enumerate() {
            assert_eq!(*v, 0.25 * (j as f32 - 16.0));
        }
    }

    #[test]
    fn q4_k_known_block() {
        let mut b = [0u8; 144];
        put_f16(&mut b, 0, 1.0);
        put_f16(&mut b, 2, 0.5);
        let sc = [1, 2, 3, 4, 5, 6, 7, 40];
        let mins = [0, 1, 2, 3, 4, 5, 6, 50];
        b[4..16].copy_from_slice(&pack_k4_scales(&sc, &mins));
        // Byte l of chunk c: low nibble = l % 16, high nibble = c.
        for c in 0..4 {
            for l in 0..32 {
                b[16 + 32 * c + l] = (l as u8 % 16) | ((c as u8) << 4);
            }
        }
        let mut out = [0f32; 256];
        block_q4_k(&b, &mut out);
        for c in 0..4 {
            for l in 0..32 {
                let lo = 64 * c + l;
                let hi = lo + 32;
                let want_lo = sc[2 * c] as f32 * (l % 16) as f32 - 0.5 * mins[2 * c] as f32;
                let want_hi = sc[2 * c + 1] as f32 * c as f32 - 0.5 * mins[2 * c + 1] as f32;
                assert_eq!(out[lo], want_lo, "element {lo}");
                assert_eq!(out[hi], want_hi, "element {hi}");
            }
        }
    }

    #[test]
    fn q6_k_known_block() {
        let mut b = [0u8; 210];
        // Element e (0..256) gets 6-bit value e % 64, placed by hand following ggml's layout.
        for e in 0..256usize {
            let (half, l) = (e / 128, e % 128);
            let v = (e % 64) as u8;
            let ql = 64 * half + l % 64;
            b[ql] |= if l < 64 { v & 0x0F } else { (v & 0x0F) << 4 };
            b[128 + 32 * half + l % 32] |= (v >> 4) << (2 * (l / 32));
        }
        for s in 0..16 {
            b[192 + s] = (s as i8 - 8) as u8;
        }
        put_f16(&mut b, 208, 0.5);
        let mut out = [0f32; 256];
        block_q6_k(&b, &mut out);
        for (e, v) in out.iter().enumerate() {
            let scale = (e / 16) as f32 - 8.0;
            let want = 0.5 * scale * ((e % 64) as f32 - 32.0);
            assert_eq!(*v, want, "element {e}");
        }
    }
}
