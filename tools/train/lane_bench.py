#!/usr/bin/env python3
"""Speculation lanes on the held-out prompts, greedy and sampled: the table of docs/BENCHMARKS.md.

Greedy requests go through `dflash bench lanes` (one process, lanes alternating per prompt and repeat); sampled
requests (`--temperature`, seeded per prompt so every lane produces the same tokens) through one `dflash run`
per request, lanes again alternating. Every request's `[spec-stats]` log line gives its rounds, tokens per round
and per-position acceptance. Reported per prompt group, temperature and lane: the median decode tok/s, the
median tokens per round, the per-position acceptance pooled over the group's requests (weighted by rounds), and
the speedup over plain (median over prompts of the ratio of median decode speeds).

    python tools/train/lane_bench.py --dflash target/release/dflash --out /tmp/lanes.json -- --threads 2
    python tools/train/lane_bench.py --prompts bench/prompts/heldout-small.json --repeat 1 --temperatures 0.7

Arguments after `--` go to the `dflash` command before the subcommand (model, threads, speculation flags).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
LANES = ("plain", "pld", "dflash")
# `dflash run` flags per lane (as `bench lanes` arms them: plain drafts nothing, pld has no drafter, dflash no pld).
RUN_FLAGS = {"plain": ["--no-pld", "--no-drafter"], "pld": ["--no-drafter"], "dflash": ["--no-pld"]}
SPEC_RE = re.compile(r"\[spec-stats\] mode=(\S+).*? rounds=(\d+) drafted=(\d+) accepted=(\d+).*?per_position=\[([^\]]*)\]")
BENCH_RE = re.compile(r"\[bench\] (\S+) #(\d+) (\w+): (\d+) tokens, decode ([\d.]+) tok/s")
STATS_RE = re.compile(r"\[stats\] prompt (\d+) tokens, generated (\d+).*decode ([\d.]+) tok/s")


def spec_of(line: str) -> dict | None:
    m = SPEC_RE.search(line)
    if not m:
        return None
    rates = [float(x) for x in m.group(5).split(",") if x.strip()]
    rounds, drafted, accepted = int(m.group(2)), int(m.group(3)), int(m.group(4))
    return {"mode": m.group(1), "rounds": rounds, "drafted": drafted, "accepted": accepted, "per_position": rates}


def greedy_runs(dflash: str, pre: list[str], prompts: Path, lanes: list[str], repeat: int, max_tokens: int) -> list:
    """`dflash bench lanes`; each request's stats line precedes its `[bench]` line on stderr."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [dflash, "bench", *pre, "lanes", "--prompts", str(prompts), "--lanes", ",".join(lanes),
               "--repeat", str(repeat), "--max-tokens", str(max_tokens), "--out-dir", out]
        print("+", " ".join(cmd), file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    runs, pending = [], None
    for line in proc.stderr.splitlines():
        pending = spec_of(line) or pending
        m = BENCH_RE.search(line)
        if m:
            runs.append({"temperature": 0.0, "group": m.group(1), "prompt": int(m.group(2)), "lane": m.group(3),
                         "tokens": int(m.group(4)), "decode_tok_s": float(m.group(5)),
                         "spec": pending if m.group(3) != "plain" else None})
            pending = None
    return runs


def sampled_runs(dflash: str, pre: list[str], entries: list[dict], lanes: list[str], repeat: int, max_tokens: int,
                 temperature: float, seed: int) -> list:
    """One `dflash run` per request; seed `seed + prompt index` for every lane and repeat."""
    runs = []
    for i, entry in enumerate(entries):
        for _ in range(repeat):
            for lane in lanes:
                cmd = [dflash, "run", *pre, *RUN_FLAGS[lane], "-p", entry["prompt"], "-n", str(max_tokens),
                       "--temperature", str(temperature), "--seed", str(seed + i)]
                proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
                stats = STATS_RE.search(proc.stderr)
                if stats is None:
                    raise SystemExit(f"no stats line from {lane} on prompt {i}:\n{proc.stderr[-2000:]}")
                spec = next((s for s in map(spec_of, proc.stderr.splitlines()) if s), None)
                runs.append({"temperature": temperature, "group": entry["group"], "prompt": i, "lane": lane,
                             "tokens": int(stats.group(2)), "decode_tok_s": float(stats.group(3)),
                             "spec": spec if lane != "plain" else None})
                print(f"[lanes] T {temperature} {entry['group']} #{i} {lane}: {runs[-1]['decode_tok_s']:.1f} tok/s",
                      file=sys.stderr, flush=True)
    return runs


def pooled_per_position(specs: list[dict], positions: int) -> list[float | None]:
    """Acceptance of each draft position over requests, weighted by their rounds."""
    out = []
    for j in range(positions):
        pairs = [(s["per_position"][j], s["rounds"]) for s in specs if len(s["per_position"]) > j]
        weight = sum(r for _, r in pairs)
        out.append(sum(p * r for p, r in pairs) / weight if weight else None)
    return out


def summarise(runs: list[dict], lanes: list[str], positions: int = 4) -> list[dict]:
    rows = []
    for temperature in sorted({r["temperature"] for r in runs}):
        for group in sorted({r["group"] for r in runs}):
            mine = [r for r in runs if r["temperature"] == temperature and r["group"] == group]
            speed = {}
            for r in mine:
                speed.setdefault((r["lane"], r["prompt"]), []).append(r["decode_tok_s"])
            for lane in lanes:
                lane_runs = [r for r in mine if r["lane"] == lane]
                if not lane_runs:
                    continue
                specs = [r["spec"] for r in lane_runs if r["spec"] and r["spec"]["rounds"] > 0]
                ratios = [statistics.median(v) / statistics.median(speed[("plain", p)])
                          for (l, p), v in speed.items() if l == lane and ("plain", p) in speed]
                rows.append({
                    "temperature": temperature, "group": group, "lane": lane,
                    "mode": specs[0]["mode"] if specs else "-",
                    "decode_tok_s": statistics.median(r["decode_tok_s"] for r in lane_runs),
                    "speedup": statistics.median(ratios) if ratios else None,
                    "tokens_per_round": statistics.median((s["accepted"] + s["rounds"]) / s["rounds"] for s in specs)
                    if specs else None,
                    "per_position": pooled_per_position(specs, positions) if specs else [],
                    "requests": len(lane_runs), "requests_drafting": len(specs),
                })
    return rows


def table(rows: list[dict], positions: int = 4) -> str:
    fmt = lambda x, spec=".2f": "-" if x is None else format(x, spec)  # noqa: E731
    head = "| T | group | lane | decode tok/s | speedup | tokens/round | " + " | ".join(
        f"acc@{j + 1}" for j in range(positions)) + " |\n"
    out = head + "|" + "---|" * (6 + positions) + "\n"
    for r in rows:
        pp = (r["per_position"] + [None] * positions)[:positions]
        out += (f"| {r['temperature']:g} | {r['group']} | {r['lane']} | {r['decode_tok_s']:.1f} | "
                f"{fmt(r['speedup'])}x | {fmt(r['tokens_per_round'])} | " + " | ".join(fmt(p) for p in pp) + " |\n")
    return out


def main() -> None:
    argv = sys.argv[1:]
    pre = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dflash", default=str(REPO_ROOT / "target" / "release" / "dflash"))
    parser.add_argument("--prompts", type=Path, default=REPO_ROOT / "bench" / "prompts" / "heldout.json")
    parser.add_argument("--lanes", default=",".join(LANES))
    parser.add_argument("--temperatures", default="0,0.7", help="0 runs through `bench lanes`, others `run`")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--out", type=Path, help="every run and the summary as JSON")
    args = parser.parse_args(argv)
    lanes = args.lanes.split(",")
    entries = json.loads(args.prompts.read_text(encoding="utf-8"))
    runs = []
    for t in (float(x) for x in args.temperatures.split(",")):
        if t == 0.0:
            runs += greedy_runs(args.dflash, pre, args.prompts, lanes, args.repeat, args.max_tokens)
        else:
            runs += sampled_runs(args.dflash, pre, entries, lanes, args.repeat, args.max_tokens, t, args.seed)
    rows = summarise(runs, lanes)
    if args.out:
        args.out.write_text(json.dumps({"runs": runs, "summary": rows}, indent=1) + "\n", encoding="utf-8")
    print(table(rows))


if __name__ == "__main__":
    main()
