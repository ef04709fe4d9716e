//! ggml's block layouts (bit-exact with `ggml-common.h` / `ggml-quants.c`) and helpers shared by the
//! (de)quantizers and the kernels.
//!
//! All multi-byte fields are little-endian; scales are IEEE f16.
//!
//! | type | elements | bytes | layout                                                        | value            |
//! |------|----------|-------|---------------------------------------------------------------|------------------|
//! | Q4_0 | 32       | 18    | `d: f16, qs: [u8; 16]`                                        | `d * (q - 8)`    |
//! | Q4_1 | 32       | 20    | `d: f16, m: f16, qs: [u8; 16]`                                | `d * q + m`      |
//! | Q8_0 | 32       | 34    | `d: f16, qs: [i8; 32]`                                        | `d * q`          |
//! | Q4_K | 256      | 144   | `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`          | `d*sc*q - dmin*m`|
//! | Q6_K | 256      | 210   | `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`       | `d * sc * (q-32)`|
//!
//! In Q4_0/Q4_1 byte `j` holds element `j` in its low nibble and element `j + 16` in its high nibble.
//! Q4_K and Q6_K nibble orders are described on [`k4_scale_min`] and in `dequant.rs`.

use half::f16;

/// Elements per Q4_0 / Q4_1 / Q8_0 block (ggml's `QK4_0`, `QK4_1`, `QK8_0`).
pub const QK: usize = 32;
/// Elements per K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// Byte offsets inside a Q4_1 block (Q4_0 is the same without `m`: its nibbles start at 2).
pub const Q4_1_QS: usize = 4;
pub const Q4_0_QS: usize = 2;
pub const Q8_0_QS: usize = 2;

/// Byte offsets inside a Q4_K block.
pub const Q4K_DMIN: usize = 2;
pub const Q4K_SCALES: usize = 4;
pub const Q4K_QS: usize = 16;

/// Byte offsets inside a Q6_K block (note `d` comes last).
pub const Q6K_QH: usize = 128;
pub const Q6K_SCALES: usize = 192;
pub const Q6K_D: usize = 208;

/// Reads the f16 at `off` as f32.
#[inline]
pub fn f16_at(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Writes `v` rounded to f16 (round to nearest even, as ggml's `GGML_FP32_TO_FP16`) at `off`.
#[inline]
pub fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Rounds `v` through f16, the value a stored f16 scale will decode to.
#[inline]
pub fn round_f16(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K block (ggml's `get_scale_min_k4`).
///
/// The 12 bytes hold eight 6-bit scales and eight 6-bit mins: bytes 0..4 carry scales 0..4 in their low 6
/// bits, bytes 4..8 mins 0..4; bytes 8..12 carry scale `j` (4..8) in the low nibble and min `j` in the high
/// nibble, whose top 2 bits sit in the top 2 bits of bytes `j - 4` (scales) and `j` (mins).
#[inline]
pub fn k4_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        let sc = (scales[j + 4] & 0x0F) | ((scales[j - 4] >> 6) << 4);
        let m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (sc, m)
    }
}

/// Packs eight 6-bit scales and mins into Q4_K's 12 bytes (the inverse of [`k4_scale_min`]).
pub fn pack_k4_scales(sc: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for j in 0..8 {
        let (ls, lm) = (sc[j] & 63, mins[j] & 63);
        if j < 4 {
            out[j] = ls;
            out[j + 4] = lm;
        } else {
            out[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
            out[j - 4] |= (ls >> 4) << 6;
            out[j] |= (lm >> 4) << 6;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k4_scales_round_trip() {
        let sc = [1, 63, 17, 32, 5, 62, 40, 33];
        let mins = [63, 0, 9, 48, 60, 1, 31, 16];
        let packed = pack_k4_scales(&sc, &mins);
        for j in 0..8 {
            assert_eq!(k4_scale_min(&packed, j), (sc[j], mins[j]), "sub-block {j}");
        }
    }

    #[test]
    fn k4_scales_known_bytes() {
        // Scale 4 = 0b11_0101 and min 4 = 0b10_1010: low nibbles in byte 8, top bits in bytes 0 and 4.
        let mut s = [0u8; 12];
        s[8] = 0b1010_0101;
        s[0] = 0b1100_0000;
        s[4] = 0b1000_0000;
        assert_eq!(k4_scale_min(&s, 4), (0b11_0101, 0b10_1010));
        assert_eq!(k4_scale_min(&s, 0), (0, 0));
    }
}
