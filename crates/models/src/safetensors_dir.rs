//! HF checkpoint directories: `config.json` plus one `model.safetensors` or an index with shards.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use dflash_runtime::{DType, Tensor};
use memmap2::Mmap;
use safetensors::{Dtype as StDtype, SafeTensors};
use serde_json::Value;

use crate::error::{ModelError, Result};

/// The mapped shards of a checkpoint and which tensor lives where.
pub struct SafetensorsDir {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    /// Tensor name to shard index.
    names: HashMap<String, usize>,
}

impl SafetensorsDir {
    /// Maps the checkpoint's shards (`model.safetensors.index.json` if present, else `model.safetensors`).
    ///
    /// # Errors
    /// I/O errors, a malformed index or shard header, a tensor listed in the index but absent from its shard.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index_path.exists() {
            let v = read_json(&index_path)?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| ModelError::format(&index_path, "no `weight_map` object"))?;
            let set: BTreeSet<String> = map.values().filter_map(Value::as_str).map(str::to_string).collect();
            set.into_iter().collect()
        } else {
            vec!["model.safetensors".to_string()]
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut names = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            let path = dir.join(f);
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: read-only map of a file we do not modify.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let st = SafeTensors::deserialize(&map).map_err(|e| ModelError::format(&path, e.to_string()))?;
            for name in st.names() {
                names.insert(name.to_string(), i);
            }
            shards.push((path, map));
        }
        Ok(SafetensorsDir { dir, shards, names })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// All tensor names in the checkpoint.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// A tensor's shape, read from its header without copying it.
    ///
    /// # Errors
    /// `MissingTensor`, or a malformed file.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let &i = self.names.get(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let (path, map) = &self.shards[i];
        let st = SafeTensors::deserialize(map).map_err(|e| ModelError::format(path, e.to_string()))?;
        let view = st.tensor(name).map_err(|e| ModelError::format(path, e.to_string()))?;
        Ok(view.shape().to_vec())
    }

    /// Copies a tensor out in its stored dtype (f32, f16 or bf16).
    ///
    /// # Errors
    /// `MissingTensor`, or `TensorDType` for other stored dtypes.
    pub fn tensor(&self, name: &str) -> Result<Tensor> {
        let &i = self.names.get(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let (path, map) = &self.shards[i];
        let st = SafeTensors::deserialize(map).map_err(|e| ModelError::format(path, e.to_string()))?;
        let view = st.tensor(name).map_err(|e| ModelError::format(path, e.to_string()))?;
        let dtype = match view.dtype() {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            other => {
                return Err(ModelError::TensorDType { name: name.to_string(), dtype: format!("{other:?}") });
            }
        };
        let shape: Vec<usize> = if view.shape().is_empty() { vec![1] } else { view.shape().to_vec() };
        Ok(Tensor::from_bytes(dtype, &shape, view.data())?)
    }
}

/// Reads and parses a JSON file.
///
/// # Errors
/// I/O or parse errors naming the file.
pub fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::format(path, e.to_string()))
}
