//! End to end: the real `dflash` binary with the default model split over tensor-parallel CPU ranks. SmolLM2-135M
//! has 9 attention heads and 3 KV heads, so it splits over 3 ranks (and not over 2).

use std::process::Command;

/// `dflash run` with `args`, the process's stdout (the reply) and stderr.
fn run(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dflash"))
        .args(["run", "--device", "cpu", "--threads", "3"])
        .args(args)
        .output()
        .expect("spawn dflash");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// Three ranks give one rank's text, with the default lanes on (the DFlash2 drafter reads the split target's
/// whole heads and captured layers), greedy and seeded; start-up reports each rank's memory.
#[test]
fn three_ranks_give_one_ranks_text_with_speculation_on() {
    let cases: [&[&str]; 2] = [
        &["-p", "Write a python function that checks if a number is prime.", "-n", "48", "--ignore-eos"],
        &["-p", "Write a haiku about the sea.", "-n", "24", "--temperature", "0.9", "--seed", "7", "--ignore-eos"],
    ];
    for args in cases {
        let (ok, one, stderr) = run(args);
        assert!(ok, "{stderr}");
        let (ok, three, stderr) = run(&[args, &["--tensor-parallel-size", "3"]].concat());
        assert!(ok, "{stderr}");
        assert_eq!(three, one, "{args:?}");
        for rank in 0..3 {
            assert!(stderr.contains(&format!("tensor-parallel rank {rank} of 3: ")), "{stderr}");
        }
        assert!(stderr.contains("mode=dflash2"), "the drafter ran: {stderr}");
    }
}

#[test]
fn a_split_the_heads_do_not_allow_is_refused_by_name() {
    let (ok, _, stderr) = run(&["-p", "hi", "--tensor-parallel-size", "2"]);
    assert!(!ok);
    assert!(stderr.contains("attention heads (9) divisible by 2"), "{stderr}");
    let (ok, _, stderr) = run(&["-p", "hi", "--tensor-parallel-size", "0"]);
    assert!(!ok && stderr.contains("--tensor-parallel-size"), "{stderr}");
}
