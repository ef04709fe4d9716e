//! `dflash`: run, serve and bench LLMs with speculative decoding.

mod assets;
mod bench;
mod cli;
mod drafters;
mod http;
mod live;
mod memory;
mod run;
mod serve;
mod setup;

use clap::Parser;
use tracing_subscriber::EnvFilter;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    let filter = EnvFilter::try_new(&cli.log_level).unwrap_or_else(|_| EnvFilter::new("info"));
    // Logs go to stderr so stdout carries only generated text; colour only on a terminal, so log files stay plain.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(colour)
        .init();
    let result = match cli.command {
        cli::Command::Run(args) => run::run(&args),
        cli::Command::Serve(args) => serve::serve(&args),
        cli::Command::Bench(args) => bench::bench(&args),
        cli::Command::Fetch(args) => run::fetch(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
