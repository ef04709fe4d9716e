//! Helpers shared by the model parity tests: golden files and single-sequence forwards.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use dflash_models::llama::LlamaModel;
use dflash_models::{ForwardBatch, ForwardOut, KvCache, SeqRows};
use safetensors::{Dtype, SafeTensors};

pub mod hybrid;
pub mod mtp;

/// Writes one line straight to stderr, past the harness's capture (tables and SKIP notices show without
/// `--nocapture`).
pub fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// CUDA device 0, opened once per test binary and lent to one test at a time (see [`DeviceTurn`]); without one,
/// `None` after a SKIP notice naming `tests`.
#[cfg(feature = "cuda")]
pub fn cuda_device(tests: &str) -> Option<DeviceTurn> {
    use std::sync::{Arc, Mutex, OnceLock, PoisonError};
    static DEVICE: OnceLock<Option<Arc<dflash_runtime::cuda::CudaDevice>>> = OnceLock::new();
    static TURN: Mutex<()> = Mutex::new(());
    let dev = DEVICE
        .get_or_init(|| match dflash_runtime::cuda::CudaDevice::new(0) {
            Ok(dev) => Some(Arc::new(dev)),
            Err(e) if e.is_no_device() => {
                say(&format!("SKIP {tests}: no usable CUDA device ({e})"));
                None
            }
            Err(e) => panic!("the CUDA device failed to open: {e}"),
        })
        .clone()?;
    // A test that failed while holding the turn leaves the device usable.
    let turn = TURN.lock().unwrap_or_else(PoisonError::into_inner);
    Some(DeviceTurn { _turn: turn, dev })
}

/// The shared device while a test holds it: every test works on the device's one stream, and a test that captures
/// a graph while another launches on that stream has its capture invalidated.
#[cfg(feature = "cuda")]
pub struct DeviceTurn {
    _turn: std::sync::MutexGuard<'static, ()>,
    dev: std::sync::Arc<dflash_runtime::cuda::CudaDevice>,
}

#[cfg(feature = "cuda")]
impl std::ops::Deref for DeviceTurn {
    type Target = std::sync::Arc<dflash_runtime::cuda::CudaDevice>;

    fn deref(&self) -> &Self::Target {
        &self.dev
    }
}

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A golden tensor: shape and values widened to f32 (ints are exact below 2^24).
pub struct Golden {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Reads every tensor of a golden safetensors file.
pub fn read_golden(path: &Path) -> HashMap<String, Golden> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let st = SafeTensors::deserialize(&bytes).expect("golden file parses");
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            let data: Vec<f32> = match view.dtype() {
                Dtype::F32 => {
                    view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
                }
                Dtype::I32 => {
                    view.data().chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect()
                }
                Dtype::I64 => view
                    .data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as f32)
                    .collect(),
                d => panic!("golden tensor {name}: unexpected dtype {d:?}"),
            };
            (name, Golden { shape: view.shape().to_vec(), data })
        })
        .collect()
}

/// Runs `tokens` as one sequence from position `start`, all rows' logits requested, in chunks of `chunk`
/// rows (exercising the cache across forwards). Returns (logits [T, V], captured [T, taps*H] if any).
pub fn run_sequence(model: &LlamaModel, tokens: &[u32], start: usize, chunk: usize) -> (Vec<f32>, Vec<f32>) {
    let page_size = 4;
    let total = start + tokens.len();
    let pages = total.div_ceil(page_size);
    let mut kv: KvCache = model.new_kv_cache(pages + 3, page_size).expect("cache");
    // A reversed, offset block table proves attention follows it rather than assuming contiguous pages.
    let table: Vec<u32> = (0..pages as u32).map(|p| pages as u32 + 2 - p).collect();
    let mut logits = Vec::new();
    let mut captured = Vec::new();
    let mut pos = 0;
    // Rows before `start` are filled with token 0 when start > 0 only through positions, not content:
    // we emulate a sequence that begins at `start` by giving positions start.. and a context of 0 keys.
    for part in tokens.chunks(chunk) {
        let positions: Vec<u32> = (0..part.len()).map(|j| (start + pos + j) as u32).collect();
        let slots: Vec<u32> = (0..part.len())
            .map(|j| {
                let p = pos + j;
                table[p / page_size] * page_size as u32 + (p % page_size) as u32
            })
            .collect();
        let rows: Vec<u32> = (0..part.len() as u32).collect();
        let seqs = [SeqRows { num_rows: part.len(), context_len: pos, block_table: &table, prompt_len: usize::MAX }];
        let batch = ForwardBatch { tokens: part, positions: &positions, seqs: &seqs, slots: &slots, logit_rows: &rows };
        let out: ForwardOut = model.forward(&batch, &mut kv).expect("forward");
        logits.extend_from_slice(out.logits.as_f32().expect("f32"));
        if let Some(c) = out.captured {
            captured.extend_from_slice(c.as_f32().expect("f32"));
        }
        pos += part.len();
    }
    (logits, captured)
}

/// Asserts |a - b| <= tol * max(1, |b|) elementwise, reporting the worst element.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0usize, 0f32);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / w.abs().max(1.0);
        assert!(err.is_finite(), "{what}[{i}]: got {g}, want {w}");
        if err > worst.1 {
            worst = (i, err);
        }
    }
    assert!(
        worst.1 <= tol,
        "{what}: worst relative error {} at {} (got {}, want {})",
        worst.1,
        worst.0,
        got[worst.0],
        want[worst.0]
    );
}

/// A copy of a fixture checkpoint whose tensors pass through `edit` (name, dtype, shape, bytes).
pub fn edited_checkpoint(
    name: &str,
    edit: impl Fn(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> tempfile::TempDir {
    let src = fixtures().join(name);
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).expect("copy config");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("read checkpoint");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse checkpoint");
    let mut tensors: Vec<_> =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    edit(&mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    let out = safetensors::tensor::serialize(views, None).expect("serialize");
    std::fs::write(dir.path().join("model.safetensors"), out).expect("write checkpoint");
    dir
}
