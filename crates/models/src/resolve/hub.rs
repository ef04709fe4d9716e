//! Hugging Face repo ids: the checkpoint's files, from the Hugging Face cache when all are there,
//! else downloaded with `hf-hub` after one timed request that lists the repo.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hf_hub::api::sync::{ApiBuilder, ApiRepo};
use hf_hub::api::RepoInfo;
use hf_hub::Cache;

use super::ResolveError;

/// Bound on the Hub's first request, so an unreachable Hub fails in seconds rather than hanging.
const HUB_TIMEOUT: Duration = Duration::from_secs(15);

/// How to reach the Hub and where its cache is.
#[derive(Clone, Debug)]
pub(super) struct HubOptions {
    /// Overrides the Hub's address (`HF_ENDPOINT`).
    endpoint: Option<String>,
    /// The Hugging Face cache (`$HF_HOME/hub`, else `$HOME/.cache/huggingface/hub`).
    cache_dir: PathBuf,
    token: Option<String>,
}

impl HubOptions {
    /// Options from the environment variables `var` returns (the system temp dir stands in for a
    /// missing home, as in [`super::cache_dir`]).
    pub(super) fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let set = |name: &str| var(name).filter(|value| !value.is_empty());
        let cache_dir = match set("HF_HOME") {
            Some(hf_home) => PathBuf::from(hf_home).join("hub"),
            None => {
                let home = set("HOME").map_or_else(std::env::temp_dir, PathBuf::from);
                home.join(".cache").join("huggingface").join("hub")
            }
        };
        HubOptions { endpoint: set("HF_ENDPOINT"), cache_dir, token: set("HF_TOKEN") }
    }
}

/// Files every downloaded checkpoint must have, and ones fetched when the repo has them.
const REQUIRED_FILES: [&str; 2] = ["config.json", "tokenizer.json"];
const OPTIONAL_FILES: [&str; 2] = ["tokenizer_config.json", "generation_config.json"];
const SINGLE_WEIGHTS: &str = "model.safetensors";
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

/// Downloads (or finds in the cache) the files of `repo` and returns its snapshot directory.
///
/// A repo whose files are all cached resolves without touching the network. Otherwise one timed
/// request lists the repo's files, so an unreachable Hub fails within [`HUB_TIMEOUT`].
pub(super) fn download_repo(repo_id: &str, options: &HubOptions) -> Result<PathBuf, ResolveError> {
    let hub_error = |reason: String| ResolveError::Hub { repo: repo_id.to_string(), reason };
    let cache = Cache::new(options.cache_dir.clone());
    if let Some(dir) = cached_snapshot(&cache, repo_id) {
        tracing::info!("using cached {repo_id} at {}", dir.display());
        return Ok(dir);
    }
    let mut builder = ApiBuilder::from_cache(cache).with_progress(true).with_token(options.token.clone());
    if let Some(endpoint) = &options.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let api = builder.build().map_err(|e| hub_error(e.to_string()))?;
    let repo = api.model(repo_id.to_string());
    let info = fetch_info(&repo).map_err(hub_error)?;
    let listed = |name: &str| info.siblings.iter().any(|s| s.rfilename == name);
    let contents_error =
        |missing: &str| ResolveError::RepoContents { repo: repo_id.to_string(), missing: missing.to_string() };
    if let Some(missing) = REQUIRED_FILES.iter().find(|name| !listed(name)) {
        return Err(contents_error(missing));
    }
    tracing::info!("downloading {repo_id}");
    let get = |name: &str| repo.get(name).map_err(|e| hub_error(format!("{name}: {e}")));
    let config = get(REQUIRED_FILES[0])?;
    for name in REQUIRED_FILES[1..].iter().chain(OPTIONAL_FILES.iter().filter(|name| listed(name))) {
        get(name)?;
    }
    if listed(SINGLE_WEIGHTS) {
        get(SINGLE_WEIGHTS)?;
    } else if listed(WEIGHTS_INDEX) {
        let index = get(WEIGHTS_INDEX)?;
        for shard in shard_names(&index)? {
            get(&shard)?;
        }
    } else {
        return Err(contents_error("model.safetensors or model.safetensors.index.json"));
    }
    Ok(snapshot_dir(&config))
}

/// The repo's file list, from a request bounded by [`HUB_TIMEOUT`].
fn fetch_info(repo: &ApiRepo) -> Result<RepoInfo, String> {
    let response = repo.info_request().timeout(HUB_TIMEOUT).call().map_err(|e| e.to_string())?;
    response.into_json::<RepoInfo>().map_err(|e| format!("unreadable file list: {e}"))
}

/// The snapshot directory of a repo whose required files and weights are all in the cache.
fn cached_snapshot(cache: &Cache, repo_id: &str) -> Option<PathBuf> {
    let cached = cache.model(repo_id.to_string());
    let config = cached.get(REQUIRED_FILES[0])?;
    if !REQUIRED_FILES.iter().all(|name| cached.get(name).is_some()) {
        return None;
    }
    let weights_cached = cached.get(SINGLE_WEIGHTS).is_some()
        || cached.get(WEIGHTS_INDEX).is_some_and(|index| {
            shard_names(&index).is_ok_and(|shards| shards.iter().all(|shard| cached.get(shard).is_some()))
        });
    weights_cached.then(|| snapshot_dir(&config))
}

fn snapshot_dir(config: &Path) -> PathBuf {
    config.parent().map_or_else(|| config.to_path_buf(), Path::to_path_buf)
}

/// The distinct shard files named in a safetensors index's `weight_map`, sorted.
fn shard_names(index: &Path) -> Result<Vec<String>, ResolveError> {
    let corrupt = |msg: String| ResolveError::Corrupt { path: index.to_path_buf(), msg };
    let text = std::fs::read_to_string(index).map_err(|e| ResolveError::io("read", index, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| corrupt(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| corrupt("no weight_map object".to_string()))?;
    let mut shards: Vec<String> = map.values().filter_map(|v| v.as_str().map(str::to_string)).collect();
    shards.sort();
    shards.dedup();
    if shards.is_empty() {
        return Err(corrupt("weight_map names no shard".to_string()));
    }
    // Shards are fetched to paths inside the snapshot: refuse names that would leave it.
    if let Some(bad) = shards.iter().find(|name| !is_plain_relative(name)) {
        return Err(corrupt(format!("shard name {bad} is not a plain relative path")));
    }
    Ok(shards)
}

fn is_plain_relative(name: &str) -> bool {
    Path::new(name).components().all(|part| matches!(part, std::path::Component::Normal(_)))
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    #[test]
    fn hub_options_follow_the_hf_variables() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| v.to_string())
        };
        let options = HubOptions::from_vars(env(&[("HF_HOME", "/hf"), ("HF_ENDPOINT", "http://e"), ("HF_TOKEN", "t")]));
        assert_eq!(options.cache_dir, PathBuf::from("/hf/hub"));
        assert_eq!(options.endpoint.as_deref(), Some("http://e"));
        assert_eq!(options.token.as_deref(), Some("t"));
        let options = HubOptions::from_vars(env(&[("HOME", "/h"), ("HF_ENDPOINT", "")]));
        assert_eq!(options.cache_dir, PathBuf::from("/h/.cache/huggingface/hub"));
        assert_eq!(options.endpoint, None);
    }

    /// An endpoint on a loopback port with nothing listening: connections are refused at once.
    fn dead_endpoint() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        drop(listener);
        format!("http://127.0.0.1:{port}")
    }

    #[test]
    fn unreachable_hub_gives_one_clear_error() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let endpoint = dead_endpoint();
        let hf_home = tmp.path().to_str().expect("utf-8").to_string();
        let options = HubOptions::from_vars(|name| match name {
            "HF_ENDPOINT" => Some(endpoint.clone()),
            "HF_HOME" => Some(hf_home.clone()),
            _ => None,
        });
        let err = download_repo("org/name", &options).expect_err("nothing listens there");
        let msg = err.to_string();
        assert!(matches!(err, ResolveError::Hub { .. }), "{msg}");
        assert!(msg.contains("org/name") && msg.contains(&endpoint), "{msg}");
        assert!(msg.contains(".gguf file") && msg.contains("local directory"), "{msg}");
    }

    /// Lays out a Hugging Face cache snapshot of `repo` holding `files`; returns the snapshot dir.
    fn fake_snapshot(hub: &Path, repo: &str, files: &[(&str, &str)]) -> PathBuf {
        let repo_dir = hub.join(format!("models--{}", repo.replace('/', "--")));
        std::fs::create_dir_all(repo_dir.join("refs")).expect("mkdir");
        std::fs::write(repo_dir.join("refs").join("main"), "abc123").expect("write ref");
        let snapshot = repo_dir.join("snapshots").join("abc123");
        std::fs::create_dir_all(&snapshot).expect("mkdir");
        for (name, text) in files {
            std::fs::write(snapshot.join(name), text).expect("write");
        }
        snapshot
    }

    #[test]
    fn cached_repos_resolve_without_the_network() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let hub = tmp.path().join("hub");
        let index = r#"{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors",
            "c": "model-1.safetensors"}}"#;
        let sharded = fake_snapshot(
            &hub,
            "org/sharded",
            &[
                ("config.json", "{}"),
                ("tokenizer.json", "{}"),
                (WEIGHTS_INDEX, index),
                ("model-1.safetensors", ""),
                ("model-2.safetensors", ""),
            ],
        );
        let single =
            fake_snapshot(&hub, "org/single", &[("config.json", "{}"), ("tokenizer.json", "{}"), (SINGLE_WEIGHTS, "")]);
        let options = HubOptions { endpoint: Some(dead_endpoint()), cache_dir: hub.clone(), token: None };
        assert_eq!(download_repo("org/sharded", &options).expect("cached"), sharded);
        assert_eq!(download_repo("org/single", &options).expect("cached"), single);

        // A missing shard sends it to the (dead) network.
        std::fs::remove_file(sharded.join("model-2.safetensors")).expect("remove");
        assert!(matches!(download_repo("org/sharded", &options), Err(ResolveError::Hub { .. })));
    }

    #[test]
    fn shard_names_are_deduplicated_and_must_stay_inside_the_snapshot() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let index = tmp.path().join("index.json");
        std::fs::write(&index, r#"{"weight_map": {"x": "b.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}"#)
            .expect("write");
        assert_eq!(shard_names(&index).expect("names"), vec!["a.safetensors", "b.safetensors"]);
        std::fs::write(&index, r#"{"weight_map": {"x": "../../evil.safetensors"}}"#).expect("write");
        assert!(matches!(shard_names(&index), Err(ResolveError::Corrupt { .. })));
        std::fs::write(&index, r#"{"metadata": {}}"#).expect("write");
        assert!(matches!(shard_names(&index), Err(ResolveError::Corrupt { .. })));
    }
}
