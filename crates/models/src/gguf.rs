//! GGUF reader (versions 2 and 3): header, metadata, tensor directory, memory-mapped tensor data.
//!
//! Layout (ggml's `gguf.md`): magic `GGUF`, version u32, tensor count u64, metadata count u64, metadata key/values,
//! tensor infos (name, dims innermost first, ggml type, offset relative to the data section), then padding to
//! `general.alignment` (default 32) and the data section. Tensors are returned as read-only views of the map.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dflash_runtime::{DType, Tensor};
use memmap2::Mmap;

use crate::error::{ModelError, Result};
use crate::tokenizer::GgufVocab;

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => self.as_u64().map(|v| v != 0),
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A tensor's entry in the directory.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions outermost first (GGUF stores them innermost first).
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Absolute byte offset in the file.
    pub offset: usize,
}

/// An open GGUF file.
pub struct GgufFile {
    path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    index: HashMap<String, usize>,
    map: Arc<Mmap>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file; tensor data stays mapped, not read.
    ///
    /// # Errors
    /// I/O errors, a wrong magic or version, truncated or inconsistent headers, unsupported tensor types
    /// (named), tensors that run past the end of the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
        // SAFETY: the file is opened read-only; we never write through the map. Concurrent truncation by
        // another process would be undefined behaviour, as with every mmap-based loader.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
        let map = Arc::new(map);
        let mut r = Reader { buf: &map, pos: 0, path: &path };
        let magic = r.bytes(4)?;
        if magic != b"GGUF" {
            return Err(ModelError::format(&path, "not a GGUF file (bad magic)"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::format(&path, format!("GGUF version {version} is not supported (2 or 3)")));
        }
        let n_tensors = r.u64()? as usize;
        let n_kv = r.u64()? as usize;
        let mut metadata = HashMap::with_capacity(n_kv);
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty)?;
            metadata.insert(key, value);
        }
        let mut raw = Vec::with_capacity(n_tensors.min(1 << 16));
        for _ in 0..n_tensors {
            raw.push(r.tensor_info()?);
        }
        let alignment = metadata.get("general.alignment").and_then(GgufValue::as_u64).unwrap_or(32) as usize;
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(ModelError::format(&path, format!("bad general.alignment {alignment}")));
        }
        let data_start = r.pos.div_ceil(alignment) * alignment;
        let tensors = place_tensors(&path, raw, data_start, map.len())?;
        let index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile { path, version, metadata, tensors, index, map })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor directory, in file order.
    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// A read-only view of a tensor's data (no copy).
    ///
    /// # Errors
    /// `MissingTensor` when absent.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let info = self.tensor_info(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        Ok(Tensor::from_mmap(info.dtype, &info.shape, Arc::clone(&self.map), info.offset)?)
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// A required unsigned metadata value.
    ///
    /// # Errors
    /// `Config` naming the key when absent or not an unsigned integer.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.get(key)
            .and_then(GgufValue::as_u64)
            .ok_or_else(|| ModelError::Config(format!("GGUF key `{key}` missing or not an integer")))
    }

    /// A required float metadata value.
    ///
    /// # Errors
    /// `Config` naming the key when absent or not numeric.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.get(key)
            .and_then(GgufValue::as_f64)
            .ok_or_else(|| ModelError::Config(format!("GGUF key `{key}` missing or not a number")))
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(GgufValue::as_str)
    }

    /// The `general.architecture` string.
    ///
    /// # Errors
    /// `Config` when absent.
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
            .ok_or_else(|| ModelError::Config("GGUF has no general.architecture".into()))
    }

    /// The tokenizer as stored under `tokenizer.ggml.*` and `tokenizer.chat_template`.
    ///
    /// # Errors
    /// `Config` when the token list is missing or the arrays have the wrong element types.
    pub fn tokenizer_vocab(&self) -> Result<GgufVocab> {
        let strings = |key: &str| -> Result<Vec<String>> {
            let Some(v) = self.get(key) else { return Ok(Vec::new()) };
            let arr = v.as_array().ok_or_else(|| ModelError::Config(format!("`{key}` is not an array")))?;
            arr.iter()
                .map(|s| s.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| ModelError::Config(format!("`{key}` holds non-strings")))
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        if tokens.is_empty() {
            return Err(ModelError::Config("GGUF has no tokenizer.ggml.tokens".into()));
        }
        let token_types = match self.get("tokenizer.ggml.token_type").and_then(GgufValue::as_array) {
            Some(a) => a.iter().map(|v| v.as_f64().map(|x| x as i32).unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        let id = |key: &str| self.get(key).and_then(GgufValue::as_u64).map(|v| v as u32);
        let flag = |key: &str, default: bool| self.get(key).and_then(GgufValue::as_bool).unwrap_or(default);
        Ok(GgufVocab {
            model: self.get_str("tokenizer.ggml.model").unwrap_or("gpt2").to_string(),
            pre: self.get_str("tokenizer.ggml.pre").map(str::to_string),
            tokens,
            token_types,
            merges: strings("tokenizer.ggml.merges")?,
            bos_id: id("tokenizer.ggml.bos_token_id"),
            eos_id: id("tokenizer.ggml.eos_token_id"),
            add_bos: flag("tokenizer.ggml.add_bos_token", false),
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix", false),
            chat_template: self.get_str("tokenizer.chat_template").map(str::to_string),
        })
    }
}

struct RawTensorInfo {
    name: String,
    shape: Vec<usize>,
    ggml_type: u32,
    rel_offset: u64,
}

fn place_tensors(
    path: &Path,
    raw: Vec<RawTensorInfo>,
    data_start: usize,
    file_len: usize,
) -> Result<Vec<GgufTensorInfo>> {
    raw.into_iter()
        .map(|t| {
            let dtype = DType::from_ggml_id(t.ggml_type).ok_or_else(|| ModelError::TensorDType {
                name: t.name.clone(),
                dtype: format!("ggml type {}", t.ggml_type),
            })?;
            let row = t.shape.last().copied().unwrap_or(1);
            let rows: usize = t.shape.iter().rev().skip(1).product();
            let bytes = dtype
                .bytes_for(row)
                .and_then(|rb| rb.checked_mul(rows))
                .ok_or_else(|| ModelError::format(path, format!("tensor `{}`: bad shape {:?}", t.name, t.shape)))?;
            let offset = usize::try_from(t.rel_offset)
                .ok()
                .and_then(|o| o.checked_add(data_start))
                .filter(|o| o.checked_add(bytes).is_some_and(|end| end <= file_len))
                .ok_or_else(|| {
                    ModelError::format(path, format!("tensor `{}` runs past the end of the file", t.name))
                })?;
            Ok(GgufTensorInfo { name: t.name, shape: t.shape, dtype, offset })
        })
        .collect()
}

/// A bounds-checked little-endian cursor over the header.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| ModelError::format(self.path, "truncated header"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.bytes(N)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn len(&mut self) -> Result<usize> {
        let n = self.u64()?;
        // Any length beyond the file is corrupt; checking here avoids huge allocations.
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= self.buf.len())
            .ok_or_else(|| ModelError::format(self.path, format!("implausible length {n}")))
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len()?;
        let b = self.bytes(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| ModelError::format(self.path, "metadata string is not UTF-8"))
    }

    fn value(&mut self, ty: u32) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>()?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.array()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array()?)),
            7 => GgufValue::Bool(self.array::<1>()?[0] != 0),
            8 => GgufValue::String(self.string()?),
            9 => {
                let elem = self.u32()?;
                let n = self.len()?;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(elem)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array()?)),
            _ => return Err(ModelError::format(self.path, format!("unknown metadata type {ty}"))),
        })
    }

    fn tensor_info(&mut self) -> Result<RawTensorInfo> {
        let name = self.string()?;
        let n_dims = self.u32()? as usize;
        if n_dims > 4 {
            return Err(ModelError::format(self.path, format!("tensor `{name}` has {n_dims} dims")));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            dims.push(self.len()?);
        }
        dims.reverse();
        let ggml_type = self.u32()?;
        let rel_offset = self.u64()?;
        Ok(RawTensorInfo { name, shape: dims, ggml_type, rel_offset })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn put_str(b: &mut Vec<u8>, s: &str) {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    }

    /// A minimal GGUF with one metadata key and one 2x4 f32 tensor.
    fn tiny_gguf(truncate_data: bool) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        put_str(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        put_str(&mut b, "llama");
        put_str(&mut b, "w");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        let n = if truncate_data { 7 } else { 8 };
        for i in 0..n {
            b.extend_from_slice(&(i as f32).to_le_bytes());
        }
        b
    }

    fn write_tmp(name: &str, bytes: &[u8]) -> PathBuf {
        let p = std::env::temp_dir().join(format!("dflash-gguf-{}-{name}", std::process::id()));
        let mut f = File::create(&p).expect("create");
        f.write_all(bytes).expect("write");
        p
    }

    #[test]
    fn reads_metadata_and_tensor() {
        let p = write_tmp("ok.gguf", &tiny_gguf(false));
        let g = GgufFile::open(&p).expect("open");
        assert_eq!(g.architecture().expect("arch"), "llama");
        let t = g.tensor("w").expect("tensor");
        assert_eq!(t.shape(), &[2, 4]);
        assert_eq!(t.as_f32().expect("f32"), &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
        assert!(matches!(g.tensor("nope"), Err(ModelError::MissingTensor(n)) if n == "nope"));
        std::fs::remove_file(p).ok();
    }

    #[test]
    fn rejects_truncated_and_foreign_files() {
        let p = write_tmp("trunc.gguf", &tiny_gguf(true));
        let err = GgufFile::open(&p).expect_err("truncated");
        assert!(err.to_string().contains("runs past the end"), "{err}");
        let p2 = write_tmp("bad.gguf", b"GGML0000");
        assert!(GgufFile::open(&p2).expect_err("magic").to_string().contains("bad magic"));
        let mut short = tiny_gguf(false);
        short.truncate(30);
        let p3 = write_tmp("short.gguf", &short);
        assert!(GgufFile::open(&p3).expect_err("short").to_string().contains("truncated"));
        for p in [p, p2, p3] {
            std::fs::remove_file(p).ok();
        }
    }
}
