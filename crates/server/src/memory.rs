//! Host memory for the CPU backend: the KV cache sized from the memory the system has available, and a check
//! before the weights load that they and one context window of KV fit.

use std::path::Path;

use anyhow::{bail, Result};
use dflash_models::resolve::ModelSource;

/// The KV cache's share of available memory when `--kv-cache-mem` is not given on the CPU.
const KV_SHARE: u64 = 4;
/// The most the CPU's default KV cache takes, however much memory is free.
const KV_DEFAULT_MAX: u64 = 16 << 30;
/// The CPU's default KV cache where the system does not say how much memory is available.
const KV_DEFAULT_UNKNOWN: u64 = 1 << 30;

const GIB: f64 = (1u64 << 30) as f64;

/// Bytes of memory the system says are available to a new process (Linux: `MemAvailable`); `None` elsewhere.
pub fn available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    mem_available(&meminfo)
}

/// The `MemAvailable` line of `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The CPU's KV cache without `--kv-cache-mem`: a quarter of the available memory, at most 16 GiB (1 GiB where
/// the system does not say), and never less than one context window (`window_bytes`).
pub fn default_cpu_kv(available: Option<u64>, window_bytes: u64) -> u64 {
    let share = available.map_or(KV_DEFAULT_UNKNOWN, |a| (a / KV_SHARE).min(KV_DEFAULT_MAX));
    share.max(window_bytes)
}

/// Bytes of the model's weight files (the GGUF, or an HF directory's safetensors).
pub fn weight_file_bytes(source: &ModelSource) -> u64 {
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    match source {
        ModelSource::GgufFile(path) => size(path),
        ModelSource::HfDir(dir) => std::fs::read_dir(dir)
            .map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                    .map(|p| size(&p))
                    .sum()
            })
            .unwrap_or(0),
    }
}

/// Refuses, before anything loads, a CPU run whose weights and KV cache cannot fit the available memory.
///
/// # Errors
/// When `weights + kv` is more than `available`, naming the three figures.
pub fn check_fits(weights: u64, kv: u64, available: Option<u64>) -> Result<()> {
    let Some(available) = available else { return Ok(()) };
    if weights.saturating_add(kv) > available {
        bail!(
            "not enough memory: the weights take {:.2} GiB and the KV cache {:.2} GiB, but {:.2} GiB are available; \
             give a smaller --kv-cache-mem or --ctx-size",
            weights as f64 / GIB,
            kv as f64 / GIB,
            available as f64 / GIB
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   16384000 kB\n";
        assert_eq!(mem_available(text), Some(16_384_000 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn the_default_kv_is_a_capped_share_of_free_memory_and_at_least_a_window() {
        let gib = 1u64 << 30;
        assert_eq!(default_cpu_kv(Some(24 * gib), gib / 8), 6 * gib);
        assert_eq!(default_cpu_kv(Some(512 * gib), gib / 8), 16 * gib, "capped");
        assert_eq!(default_cpu_kv(Some(gib), 2 * gib), 2 * gib, "one context window at least");
        assert_eq!(default_cpu_kv(None, gib / 8), gib, "unknown: 1 GiB");
    }

    #[test]
    fn a_run_that_cannot_fit_is_refused_naming_the_figures() {
        let gib = 1u64 << 30;
        assert!(check_fits(gib, gib, Some(4 * gib)).is_ok());
        assert!(check_fits(gib, gib, None).is_ok(), "unknown memory: no check");
        let err = check_fits(3 * gib, 2 * gib, Some(4 * gib)).expect_err("too big").to_string();
        assert!(err.contains("3.00 GiB") && err.contains("2.00 GiB") && err.contains("4.00 GiB"), "{err}");
    }
}
