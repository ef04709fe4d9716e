//! Helpers the CUDA test binaries share: reproducible random inputs and lines written past the harness's
//! capture (so tables and SKIP notices show without `--nocapture`); [`gpu`]: the device, the error table and the
//! CPU references of the model-op binaries. Each binary uses a part of them.
#![allow(dead_code)]

use std::io::Write;

#[cfg(feature = "cuda")]
pub mod gpu;

/// xorshift64*: reproducible inputs without a dependency; each test seeds its own.
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

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Writes one line straight to stderr.
pub fn say(line: &str) {
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}
