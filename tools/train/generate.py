#!/usr/bin/env python3
"""Regenerates the training responses with the target itself (SmolLM2-135M-Instruct from its GGUF).

Every prompt of tools/train/data/prompts.jsonl.gz is chat-templated (the GGUF's template, no BOS, as served) and
answered once per listed temperature (default: greedy and T 0.7, plain temperature sampling, seeded). Batches
are formed from prompts of similar length under a KV-token budget and run in a seeded random order, so a time
budget that cuts the run short drops a random subset. Output: an .npz with all sequences (prompt + response,
uint16 token ids, flat with offsets) and a .json with provenance and statistics.

    python tools/train/generate.py --out /tmp/gen/samples.npz                 # GPU run
    python tools/train/generate.py --smoke --out /tmp/smoke/samples.npz       # CPU, a few prompts, ~1 minute
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import time
from pathlib import Path

import numpy as np
import torch

import prompts as prompt_set
from target import DEFAULT_GGUF, configure_torch, load_target, render_chat

SMOKE_PROMPTS = 4


def log(msg: str) -> None:
    print(f"[generate {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def tokenize_prompts(records: list[dict], tokenizer, template: str, max_tokens: int) -> list[tuple[int, list[int]]]:
    """(row in the prompts file, token ids) of every prompt that fits max_tokens."""
    out = []
    for r in records:
        ids = tokenizer.encode(render_chat(template, r["prompt"]), add_special_tokens=False).ids
        if len(ids) <= max_tokens:
            out.append((r["row"], ids))
    return out


def plan_batches(jobs: list[tuple[int, list[int], float]], max_new: int, batch_tokens: int, max_batch: int,
                 seed: int) -> list[list[tuple[int, list[int], float]]]:
    """Groups jobs (row, ids, temperature) of one temperature and similar length; shuffles the batch order."""
    batches = []
    for temp in sorted({t for _, _, t in jobs}):
        same = sorted((j for j in jobs if j[2] == temp), key=lambda j: len(j[1]))
        current: list = []
        for job in same:
            longest = len(job[1])  # sorted by length: the newest job is the longest of its batch
            if current and ((len(current) + 1) * (longest + max_new) > batch_tokens or len(current) >= max_batch):
                batches.append(current)
                current = []
            current.append(job)
        if current:
            batches.append(current)
    random.Random(seed).shuffle(batches)
    return batches


def run_batches(model, batches, max_new: int, seed: int, budget_s: float, device) -> list[dict]:
    start = time.time()
    samples, tokens_out, slowest = [], 0, 0.0
    for index, batch in enumerate(batches):
        elapsed = time.time() - start
        if elapsed + slowest > budget_s:
            log(f"time budget reached after {index}/{len(batches)} batches ({elapsed:.0f} s)")
            break
        t0 = time.time()
        temperature = batch[0][2]
        generator = torch.Generator(device=device).manual_seed(seed * 100003 + index)
        outputs = model.generate([ids for _, ids, _ in batch], max_new, temperature, generator)
        for (row, ids, temp), new in zip(batch, outputs, strict=True):
            samples.append({"row": row, "prompt": ids, "response": new, "temperature": temp,
                            "ended": bool(new) and new[-1] == model.cfg.eos_id})
            tokens_out += len(new)
        took = time.time() - t0
        slowest = max(slowest, took)
        log(f"batch {index + 1}/{len(batches)}: {len(batch)} x (<= {max(len(j[1]) for j in batch)} + {max_new}) "
            f"T={temperature} in {took:.1f} s; {len(samples)} samples, {tokens_out} new tokens, "
            f"{tokens_out / (time.time() - start):.0f} tok/s overall")
    return samples


def save(out: Path, samples: list[dict], info: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    seqs = [s["prompt"] + s["response"] for s in samples]
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in seqs])
    if any(t > np.iinfo(np.uint16).max for x in seqs for t in x):
        raise ValueError("token ids above 65535 do not fit the uint16 sample format")
    flat = np.fromiter((t for x in seqs for t in x), dtype=np.uint16, count=int(offsets[-1]))
    np.savez(
        out,
        tokens=flat,
        offsets=offsets,
        prompt_len=np.array([len(s["prompt"]) for s in samples], dtype=np.int32),
        prompt_row=np.array([s["row"] for s in samples], dtype=np.int32),
        temperature=np.array([s["temperature"] for s in samples], dtype=np.float32),
        ended=np.array([s["ended"] for s in samples], dtype=bool),
    )
    out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--prompts", type=Path, default=prompt_set.DEFAULT_OUT)
    parser.add_argument("--out", type=Path, required=True, help="samples .npz (a .json with provenance beside it)")
    parser.add_argument("--temperatures", default="0,0.7", help="one response per prompt per temperature")
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--max-prompt-tokens", type=int, default=1536)
    parser.add_argument("--batch-tokens", type=int, default=400_000, help="batch size x (prompt + new) at most")
    parser.add_argument("--max-batch", type=int, default=768)
    parser.add_argument("--limit", type=int, default=0, help="use only the first N prompts (0: all)")
    parser.add_argument("--time-budget-s", type=float, default=float("inf"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_PROMPTS} short prompts, 16 new tokens, CPU")
    args = parser.parse_args()
    if args.smoke:
        args.limit, args.max_new_tokens, args.device = SMOKE_PROMPTS, 16, "cpu"
        args.max_prompt_tokens = min(args.max_prompt_tokens, 128)
    device = torch.device(args.device)
    configure_torch(device, args.smoke)
    started = time.time()
    all_records = prompt_set.read(args.prompts)
    records = [{**r, "row": i} for i, r in enumerate(all_records)]
    if args.smoke:
        # The shortest prompt of each group (code first), so the smoke run touches several kinds.
        by_group = {}
        for r in sorted(records, key=lambda r: len(r["prompt"])):
            by_group.setdefault(r["group"], r)
        records = sorted(by_group.values(), key=lambda r: r["group"] != "code")
    records = records[: args.limit] if args.limit else records
    cfg, model, tokenizer = load_target(args.gguf, device)
    log(f"target loaded on {device} in {time.time() - started:.1f} s ({cfg.num_layers} layers)")
    prompts = tokenize_prompts(records, tokenizer, cfg.chat_template, args.max_prompt_tokens)
    temps = [float(t) for t in args.temperatures.split(",")]
    jobs = [(row, ids, t) for row, ids in prompts for t in temps]
    batches = plan_batches(jobs, args.max_new_tokens, args.batch_tokens, args.max_batch, args.seed)
    log(f"{len(prompts)}/{len(records)} prompts fit {args.max_prompt_tokens} tokens; {len(jobs)} jobs in "
        f"{len(batches)} batches")
    samples = run_batches(model, batches, args.max_new_tokens, args.seed, args.time_budget_s - (time.time() - started),
                          device)
    info = {
        "samples": len(samples),
        "prompts_file": str(args.prompts.name),
        "prompts_sha256_jsonl": prompt_set.sha256_of(all_records),
        "prompt_ids": [all_records[s["row"]]["id"] for s in samples],
        "groups": {g: sum(all_records[s["row"]]["group"] == g for s in samples)
                   for g in sorted({r["group"] for r in records})},
        "gguf": args.gguf.name,
        "gguf_sha256": file_sha256(args.gguf),
        "temperatures": temps,
        "max_new_tokens": args.max_new_tokens,
        "ended_with_eos": sum(s["ended"] for s in samples),
        "response_tokens": sum(len(s["response"]) for s in samples),
        "prompt_tokens": sum(len(s["prompt"]) for s in samples),
        "seconds": round(time.time() - started, 1),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "eos_id": cfg.eos_id,
    }
    save(args.out, samples, info)
    log(f"wrote {len(samples)} samples ({info['response_tokens']} response tokens, {info['ended_with_eos']} ended "
        f"with EOS) to {args.out} in {info['seconds']} s")


if __name__ == "__main__":
    main()
