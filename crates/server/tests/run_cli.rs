//! End to end: the real `dflash` binary with the real default model.

use std::process::Command;

fn dflash() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dflash"))
}

/// The README's main job: the default model, quantized weights, default flags. The first token is a near-tie
/// (reference top-2 gap 0.08) that one 8-bit activation pass flips ("L'Étoile, ..."); the default two-pass
/// activations answer as HF transformers does at f32.
#[test]
fn run_answers_a_question_on_stdout_with_stats_on_stderr() {
    let out = dflash()
        .args(["run", "--prompt", "What is the capital of France?", "--max-tokens", "24", "--threads", "2"])
        .output()
        .expect("spawn dflash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "exit {:?}\nstderr: {stderr}", out.status);
    assert!(stdout.contains("Paris"), "stdout: {stdout}");
    assert!(!stdout.contains("[stats]") && !stdout.contains("loaded"), "logs leaked to stdout: {stdout}");
    assert!(stderr.contains("[stats] prompt"), "stderr: {stderr}");
}

#[test]
fn one_pass_activations_run_streams_text_and_stops_at_max_tokens() {
    let out = dflash()
        .args(["run", "-p", "Tell me about the sea.", "-n", "12", "--ignore-eos", "--threads", "2"])
        .args(["--act-precision", "int8"])
        .output()
        .expect("spawn dflash");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).trim().is_empty());
    assert!(stderr.contains("generated 12 (Length)"), "{stderr}");
}

#[test]
fn seeded_sampling_is_reproducible_and_stdout_is_text_only() {
    let run = || {
        let out = dflash()
            .args(["run", "-p", "Write a haiku about the sea.", "-n", "16", "--temperature", "0.9", "--seed", "7"])
            .args(["--top-p", "0.95", "--threads", "2", "--ignore-eos"])
            .output()
            .expect("spawn dflash");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8 stdout")
    };
    let a = run();
    assert!(!a.trim().is_empty());
    assert_eq!(a, run(), "same seed, same text");
}

#[test]
fn bad_arguments_fail_with_a_clear_message() {
    let cases: [(&[&str], &str); 8] = [
        (&["run", "-p", "hi", "--model", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
        (&["run", "-p", "hi", "--device", "tpu"], "--device tpu"),
        (&["run", "-p", "hi", "--temperature", "7"], "temperature"),
        (&["run", "-p", "hi", "--config-overrides", "{not json"], "--config-overrides"),
        (&["run", "-p", "hi", "-n", "0"], "at least 1"),
        (&["serve", "--ctx-size", "0"], "at least 1"),
        // Refused before the weights load, naming what it would take.
        (&["serve", "--port", "0", "--kv-cache-mem", "1K", "--device", "cpu"], "less than one context window"),
        (&["serve", "--port", "0", "--kv-cache-mem", "100000G", "--device", "cpu"], "not enough memory"),
    ];
    // Only Linux says how much memory is available (`/proc/meminfo`); elsewhere the memory check is skipped.
    let knows_memory = std::path::Path::new("/proc/meminfo").exists();
    for (args, needle) in cases.into_iter().filter(|(_, needle)| knows_memory || *needle != "not enough memory") {
        let out = dflash().args(args).output().expect("spawn dflash");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(stderr.contains(needle), "{args:?}: stderr should mention {needle}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    }
}

/// `bench lanes` on a random-weight hybrid target whose prompts are longer than a step, so their first chunk samples
/// no row: the command that once failed on the GPU (the bf16 LM head sent zero rows to the one-row kernel). Needs a
/// CUDA build and device; skips otherwise.
#[cfg(feature = "cuda")]
#[test]
fn random_hybrid_lanes_with_long_prompts_run_on_the_gpu() {
    if dflash_models::family::cuda_devices() == 0 {
        eprintln!("SKIP random-hybrid lanes: no CUDA device");
        return;
    }
    let tokenizer = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tests/fixtures/tiny-qwen3-next");
    // Tests run in the crate's folder: the prompt files are named from the repository's root.
    let prompts = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/prompts/lanes.json");
    let context_text = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/prompts/summarise-1000.txt");
    let out_dir = std::env::temp_dir().join(format!("dflash-random-hybrid-{}", std::process::id()));
    let out = dflash()
        .args(["bench", "--device", "cuda", "lanes", "--random-hybrid", "4", "--tokenizer", tokenizer])
        .args(["--prompts", prompts, "--context-text", context_text])
        .args(["--context", "300", "--per-group", "1", "--max-tokens", "8", "--repeat", "1", "--lanes", "plain"])
        .arg("--out-dir")
        .arg(&out_dir)
        .output()
        .expect("spawn dflash");
    let _ = std::fs::remove_dir_all(&out_dir);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
}

/// The shipped DFlash2 drafter on the GPU (`--drafter-device auto`), on the host, and off give the same
/// text, greedy and seeded: speculation stays lossless with the drafter's passes on the device. Needs a CUDA build
/// and device; skips otherwise.
#[cfg(feature = "cuda")]
#[test]
fn the_drafter_on_the_gpu_gives_plain_decodings_text() {
    if dflash_models::family::cuda_devices() == 0 {
        eprintln!("SKIP the drafter on the GPU: no CUDA device");
        return;
    }
    let run = |drafter: &[&str], sampling: &[&str]| {
        let out = dflash()
            .args(["run", "--device", "cuda", "-p", "Write a Python function that reverses a list.", "-n", "64"])
            .args(["--ignore-eos", "--spec-policy", "fixed"])
            .args(drafter)
            .args(sampling)
            .output()
            .expect("spawn dflash");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{stderr}");
        (String::from_utf8(out.stdout).expect("utf-8 stdout"), stderr)
    };
    for sampling in [&[][..], &["--temperature", "0.8", "--seed", "11"][..]] {
        let (plain, _) = run(&["--no-drafter", "--no-pld"], sampling);
        let (on_gpu, log) = run(&["--no-pld", "--drafter-device", "auto"], sampling);
        assert!(log.contains("drafter on cuda:"), "the drafter stayed on the host: {log}");
        let (on_host, _) = run(&["--no-pld", "--drafter-device", "cpu"], sampling);
        assert_eq!(on_gpu, plain, "drafter on the GPU, {sampling:?}");
        assert_eq!(on_host, plain, "drafter on the host, {sampling:?}");
    }
}

/// Rows drawn on the GPU (`--sampling-device auto`: only tokens come back) give the host sampler's text: seeded
/// sampling with filters, penalties over the history, greedy with a penalty, and with prompt lookup's verify rows
/// drawn there too. Needs a CUDA build and device; skips otherwise.
#[cfg(feature = "cuda")]
#[test]
fn rows_drawn_on_the_gpu_give_the_host_samplers_text() {
    if dflash_models::family::cuda_devices() == 0 {
        eprintln!("SKIP draws on the GPU: no CUDA device");
        return;
    }
    let run = |flags: &[&str], sampling: &[&str]| {
        let prompt = "Repeat exactly: one two three four, one two three four, one two three four.";
        let out = dflash()
            .args(["run", "--device", "cuda", "--no-drafter", "-p", prompt, "-n", "64", "--ignore-eos"])
            .args(flags)
            .args(sampling)
            .output()
            .expect("spawn dflash");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf-8 stdout")
    };
    let cases: [&[&str]; 3] = [
        &["--temperature", "0.8", "--seed", "11", "--top-p", "0.9", "--min-p", "0.02"],
        &["--temperature", "0.7", "--seed", "5", "--top-k", "40", "--frequency-penalty", "0.5"],
        &["--repetition-penalty", "1.3", "--presence-penalty", "0.4"],
    ];
    for sampling in cases {
        let host = run(&["--no-pld", "--sampling-device", "cpu"], sampling);
        for lane in [&["--no-pld"][..], &["--spec-policy", "fixed"][..]] {
            let on_gpu = run(&[lane, &["--sampling-device", "auto"][..]].concat(), sampling);
            assert_eq!(on_gpu, host, "{sampling:?}, {lane:?}");
        }
    }
}

/// `bench lanes --concurrency`: copies of each request batched together give one another's tokens and plain
/// decoding's, on every lane.
#[test]
fn lanes_with_concurrent_copies_give_plain_tokens_on_every_lane() {
    let dir = std::env::temp_dir().join(format!("dflash-lanes-copies-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let prompts = dir.join("prompts.json");
    let list = r#"[{"group": "chat", "prompt": "Name three colours of the rainbow."},
                   {"group": "code", "prompt": "Write a Python function that adds two numbers."}]"#;
    std::fs::write(&prompts, list).expect("prompts");
    let out = dflash()
        .args(["bench", "--device", "cpu", "--threads", "2", "lanes"])
        .arg("--prompts")
        .arg(&prompts)
        .args(["--max-tokens", "12", "--repeat", "1", "--concurrency", "3", "--lanes", "plain,pld,oracle4-fixed"])
        .arg("--out-dir")
        .arg(dir.join("out"))
        .output()
        .expect("spawn dflash");
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("| all | 0 | oracle4-fixed |"), "{stdout}");
}
