//! Element and block types a buffer can hold.
//!
//! Dense types hold one value per element. The GGUF block types pack `block_len` elements into `block_bytes`
//! bytes (ggml's layouts, see `quant::blocks`); a row of a quantized matrix is a whole number of blocks.

use std::fmt;

/// The type of a buffer's elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    /// Indices (token ids, positions, slots); never a weight type.
    U32,
    F16,
    BF16,
    /// 32 elements: f16 scale + 16 bytes of 4-bit values, value = d * (q - 8).
    Q4_0,
    /// 32 elements: f16 scale, f16 min + 16 bytes of 4-bit values, value = d * q + m.
    Q4_1,
    /// 32 elements: f16 scale + 32 signed bytes, value = d * q.
    Q8_0,
    /// 256-element super-block with 8 sub-blocks of 32, 6-bit scales and mins.
    Q4K,
    /// 256-element super-block with 16 sub-blocks of 16, 8-bit scales, 6-bit values.
    Q6K,
}

impl DType {
    /// Elements per block (1 for dense types).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::U32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 => 32,
            DType::Q4K | DType::Q6K => 256,
        }
    }

    /// Bytes per block (the element size for dense types).
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q8_0 => 34,
            DType::Q4K => 144,
            DType::Q6K => 210,
        }
    }

    /// Whether this is one of the GGUF block-quantized types.
    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Bytes taken by `n` elements; `None` when `n` is not a whole number of blocks.
    pub const fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        Some(n / self.block_len() * self.block_bytes())
    }

    /// The ggml type id used in GGUF files, if this dtype has one.
    pub const fn ggml_id(self) -> Option<u32> {
        Some(match self {
            DType::U32 => return None,
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::Q4K => 12,
            DType::Q6K => 14,
            DType::BF16 => 30,
        })
    }

    /// The dtype for a ggml type id, or `None` for types we do not support.
    pub const fn from_ggml_id(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            8 => DType::Q8_0,
            12 => DType::Q4K,
            14 => DType::Q6K,
            30 => DType::BF16,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            DType::F32 => "f32",
            DType::U32 => "u32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q8_0 => "q8_0",
            DType::Q4K => "q4_k",
            DType::Q6K => "q6_k",
        };
        f.write_str(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml() {
        assert_eq!(DType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(DType::Q6K.bytes_for(512), Some(420));
        assert_eq!(DType::Q4K.bytes_for(100), None);
        for id in [0, 1, 2, 3, 8, 12, 14, 30] {
            let dt = DType::from_ggml_id(id).expect("supported");
            assert_eq!(dt.ggml_id(), Some(id));
        }
        assert_eq!(DType::from_ggml_id(6), None);
    }
}
