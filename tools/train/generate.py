#!/usr/bin/env python3
"""Regenerates training responses with the target itself (SmolLM2-135M-Instruct from its GGUF): one shard of
fresh data per training run.

Every prompt of tools/train/data/prompts.jsonl.gz is chat-templated (the GGUF's template, no BOS, as served).
A run takes one shard of the training prompts (a hash of the prompt id; `--shard`, usually the run index) and
answers each of them
  * greedily (the chain greedy verification accepts), and
  * `--variants` more times with a sampled prefix: the first 1..`--prefix-max` response tokens sampled at
    `--prefix-temperature` (seeded by the run's seed), then greedy. The prefix varies the context; the greedy
    rest is another greedy chain. Across runs, the shards and the prefixes are new.
Multi-turn prompts continue: the target's greedy reply to turn k becomes the assistant turn before user turn
k+1 (rendered as text, as a chat client sends it), and every turn's reply is a sample.
Evaluation samples come with every run, greedy only, never trained on: the first `--eval-prompts` held-out
training-distribution prompts (the same in every run, so runs compare) and every hand-written prompt of
bench/prompts/heldout.json (out of distribution).

Generation runs on decode_pool.py (bf16 weights and KV cache on GPU, continuous batching, f32 LM head). Output:
an .npz (prompt + response token ids, flat uint16 with offsets; prompt_len, greedy_from, temperature, split,
turn, prompt_row, ended per sample) and a .json with provenance and statistics. The samples are consumed on the
machine that made them; only checkpoints and metrics travel.

    python tools/train/generate.py --out RUN/data/samples.npz --shard 0 --num-shards 2 --seed 0     # GPU
    python tools/train/generate.py --smoke --out /tmp/smoke/samples.npz     # CPU, tiny random target, seconds
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import platform
import random
import time
from pathlib import Path

import numpy as np
import torch

import prompts as prompt_set
import tiny_target
from decode_pool import DecodePool, Job
from target import DEFAULT_GGUF, REPO_ROOT, configure_torch, load_target, render_messages
from train_data import SPLIT_BENCH, SPLIT_HELDOUT, SPLIT_TRAIN

BENCH_PROMPTS = REPO_ROOT / "bench" / "prompts" / "heldout.json"
# The decode pool's KV cache takes this share of the GPU memory free after loading (--kv-gib 0): on an H200 it
# is more than 1,024 rows need; on an H100 (80 GB) about 960 rows, where a fixed 64 GiB left too little for the
# graphs and the rest.
KV_SHARE_OF_FREE = 0.65
EVAL_FRACTION = 0.005  # share of the training prompts held out for the training-side evaluation, by id hash


def log(msg: str) -> None:
    print(f"[generate {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def id_hash(prompt_id: str, salt: str) -> int:
    return int(hashlib.sha256(f"{salt}:{prompt_id}".encode()).hexdigest()[:12], 16)


def is_heldout(prompt_id: str) -> bool:
    """Fixed for good: a held-out prompt is never in any shard."""
    return id_hash(prompt_id, "eval") / 16**12 < EVAL_FRACTION


def shard_of(prompt_id: str, num_shards: int) -> int:
    return id_hash(prompt_id, "shard") % num_shards


def select_records(records: list[dict], shard: int, num_shards: int, eval_prompts: int) -> list[dict]:
    """The shard's training prompts (split 0) and the first eval_prompts held-out ones (split 1)."""
    heldout = sorted((r for r in records if is_heldout(r["id"])), key=lambda r: id_hash(r["id"], "eval"))
    train = [r for r in records if not is_heldout(r["id"]) and shard_of(r["id"], num_shards) == shard]
    return [{**r, "split": SPLIT_TRAIN} for r in train] + [{**r, "split": SPLIT_HELDOUT}
                                                           for r in heldout[:eval_prompts]]


def bench_records() -> list[dict]:
    entries = json.loads(BENCH_PROMPTS.read_text(encoding="utf-8"))
    return [{"id": f"bench-{i:03d}", "group": f"bench-{e['group']}", "prompt": e["prompt"], "row": -1,
             "split": SPLIT_BENCH} for i, e in enumerate(entries)]


class Conversation:
    """One prompt record's dialogue so far: user turns from the record, assistant turns from the target."""

    def __init__(self, record: dict):
        self.record = record
        self.users = [record["prompt"], *record.get("followups", [])]
        self.replies: list[str] = []

    def messages(self) -> list[dict]:
        out = []
        for i, user in enumerate(self.users[: len(self.replies) + 1]):
            out.append({"role": "user", "content": user})
            if i < len(self.replies):
                out.append({"role": "assistant", "content": self.replies[i]})
        return out

    @property
    def turn(self) -> int:
        return len(self.replies)


def phase_jobs(conversations, tokenizer, template: str, args, rng: random.Random):
    """(meta, Job) for the current turn of every conversation: greedy, plus sampled-prefix variants for training
    prompts. Prompts longer than --max-prompt-tokens are left out."""
    out = []
    texts = [render_messages(template, conv.messages()) for conv in conversations]
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)  # in parallel, in the tokenizer's threads
    for conv, enc in zip(conversations, encoded, strict=True):
        ids = enc.ids
        if len(ids) > args.max_prompt_tokens:
            continue
        out.append(({"conv": conv, "greedy": True, "turn": conv.turn}, Job(ids)))
        if conv.record["split"] == SPLIT_TRAIN:
            for _ in range(args.variants):
                prefix = rng.randint(1, args.prefix_max)
                out.append(({"conv": conv, "greedy": False, "turn": conv.turn},
                            Job(ids, prefix, args.prefix_temperature)))
    return out


def order_jobs(jobs: list, chunk: int, seed: int) -> list:
    """Evaluation jobs first (a time cut must not drop them); training jobs sorted by prompt length (a decode
    pool's rows stay alike) in chunks whose order is shuffled, so a time cut drops a random set of chunks."""
    evals = [j for j in jobs if j[0]["conv"].record["split"] != SPLIT_TRAIN]
    train = sorted((j for j in jobs if j[0]["conv"].record["split"] == SPLIT_TRAIN), key=lambda j: len(j[1].prompt))
    chunks = [train[i: i + chunk] for i in range(0, len(train), chunk)]
    random.Random(seed).shuffle(chunks)
    return evals + [j for c in chunks for j in c]


def generate_all(model, tokenizer, cfg, records: list[dict], args, deadline: float) -> list[dict]:
    """Every turn of every conversation: samples as dicts (prompt ids, response ids, flags)."""
    rng = random.Random(f"prefix:{args.seed}")
    conversations = [Conversation(r) for r in records]
    samples, turn, seen = [], 0, set()
    while conversations and time.time() < deadline:
        jobs = order_jobs(phase_jobs(conversations, tokenizer, cfg.chat_template, args, rng), args.chunk_jobs,
                          args.seed + turn)
        log(f"turn {turn + 1}: {len(jobs)} jobs from {len(conversations)} conversations")
        results = run_pool(model, cfg, [job for _, job in jobs], args, args.seed * 1009 + turn, deadline)
        for (meta, job), result in zip(jobs, results, strict=True):
            if result is None:
                continue
            conv = meta["conv"]
            if meta["greedy"] and conv.turn + 1 < len(conv.users):
                # The greedy reply (cut at max_new or not) is the assistant turn of the conversation's history.
                reply = result.tokens[:-1] if result.ended else result.tokens
                conv.replies.append(tokenizer.decode(reply, skip_special_tokens=True).strip())
            key = hash((tuple(job.prompt), tuple(result.tokens)))
            if key in seen:  # a sampled prefix that happened to be the greedy one adds nothing
                continue
            seen.add(key)
            samples.append({"record": conv.record, "prompt": job.prompt, "response": result.tokens,
                            "greedy_from": min(job.sampled, len(result.tokens)),
                            "temperature": job.temperature if job.sampled else 0.0, "turn": meta["turn"],
                            "ended": result.ended})
        conversations = [c for c in conversations if c.turn > turn]
        turn += 1
    return samples


def run_pool(model, cfg, jobs: list[Job], args, seed: int, deadline: float):
    """One decode pool over the jobs; its KV cache is freed on return (before the next turn's is allocated)."""
    pool = DecodePool(model, pool_rows(cfg, args), args.max_prompt_tokens, args.max_new_tokens, seed=seed,
                      prefill_tokens=args.prefill_tokens, profile_steps=args.profile_steps,
                      cuda_graphs=args.cuda_graphs, triton_attention=args.triton_attention)
    results = pool.run(jobs, deadline, progress_logger(time.time(), len(jobs)))
    # The pool refers to itself (its decode step, its graphs): only the cycle collector frees it, so the next
    # turn's pool would size itself beside this one's cache.
    del pool
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return results


def pool_rows(cfg, args) -> int:
    """Rows that fit the KV cache budget (at least 1, at most --max-rows): --kv-gib, or by default
    KV_SHARE_OF_FREE of the GPU memory free once the target is loaded (the graphs' logits, the prefill and the
    compaction's chunks live in the rest)."""
    slots = args.max_prompt_tokens + args.max_new_tokens + 9
    per_row = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * slots * (2 if args.dtype == "bf16" else 4)
    budget = args.kv_gib * 2**30
    if budget <= 0:
        budget = KV_SHARE_OF_FREE * free_gpu_bytes() if torch.cuda.is_available() else 4 * 2**30
    return max(1, min(args.max_rows, int(budget // per_row)))


def free_gpu_bytes() -> int:
    """The driver's free memory plus what PyTorch's allocator holds unused (an earlier turn's freed pool)."""
    return torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()


def progress_logger(start: float, total: int):
    last = [start]

    def progress(done: int, started: int, _in_flight: int) -> None:
        if time.time() - last[0] > 20:
            last[0] = time.time()
            log(f"{done}/{total} done, {started} started, {time.time() - start:.0f} s")

    return progress


def save(out: Path, samples: list[dict], info: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    seqs = [s["prompt"] + s["response"] for s in samples]
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in seqs])
    flat = np.fromiter((t for x in seqs for t in x), dtype=np.int64, count=int(offsets[-1]))
    if flat.size and flat.max() > np.iinfo(np.uint16).max:
        raise ValueError("token ids above 65535 do not fit the uint16 sample format")
    np.savez(
        out,
        tokens=flat.astype(np.uint16),
        offsets=offsets,
        prompt_len=np.array([len(s["prompt"]) for s in samples], dtype=np.int32),
        greedy_from=np.array([s["greedy_from"] for s in samples], dtype=np.int32),
        temperature=np.array([s["temperature"] for s in samples], dtype=np.float32),
        split=np.array([s["record"]["split"] for s in samples], dtype=np.int8),
        turn=np.array([s["turn"] for s in samples], dtype=np.int8),
        prompt_row=np.array([s["record"]["row"] for s in samples], dtype=np.int32),
        ended=np.array([s["ended"] for s in samples], dtype=bool),
    )
    out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def statistics(samples: list[dict], args, seconds: float) -> dict:
    response = sum(len(s["response"]) for s in samples)
    greedy = sum(len(s["response"]) - s["greedy_from"] for s in samples)
    return {
        "samples": len(samples),
        "splits": {name: sum(s["record"]["split"] == v for s in samples)
                   for name, v in (("train", SPLIT_TRAIN), ("heldout", SPLIT_HELDOUT), ("bench", SPLIT_BENCH))},
        "groups": {g: sum(s["record"]["group"] == g for s in samples)
                   for g in sorted({s["record"]["group"] for s in samples})},
        "turns": {str(t): sum(s["turn"] == t for s in samples) for t in sorted({s["turn"] for s in samples})},
        "response_tokens": response,
        "greedy_response_tokens": greedy,
        "prompt_tokens": sum(len(s["prompt"]) for s in samples),
        "ended_with_eos": sum(s["ended"] for s in samples),
        "seconds": round(seconds, 1),
        "tokens_per_second": round(response / max(seconds, 1e-9)),
    }


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", type=Path, default=None, help=f"the target (default {DEFAULT_GGUF})")
    p.add_argument("--prompts", type=Path, default=prompt_set.DEFAULT_OUT)
    p.add_argument("--out", type=Path, required=True, help="samples .npz (a .json with provenance beside it)")
    p.add_argument("--shard", type=int, default=0, help="which shard of the training prompts (the run index)")
    p.add_argument("--num-shards", type=int, default=2)
    p.add_argument("--variants", type=int, default=2, help="sampled-prefix responses per prompt besides greedy")
    p.add_argument("--prefix-max", type=int, default=48, help="sampled prefix: 1..N response tokens")
    p.add_argument("--prefix-temperature", type=float, default=0.7)
    p.add_argument("--eval-prompts", type=int, default=192, help="held-out training-distribution prompts")
    p.add_argument("--no-bench", action="store_true", help="leave out the hand-written held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=768)
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--kv-gib", type=float, default=0.0,
                   help="KV cache budget of the decode pool (0: a share of the GPU's free memory)")
    p.add_argument("--max-rows", type=int, default=1024, help="decode pool rows at most")
    p.add_argument("--prefill-tokens", type=int, default=1 << 16, help="tokens per prefill sub-batch")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile this many decode steps of the first pool once warm (torch.profiler table)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay the decode step as CUDA graphs, one per key-length bucket (on CUDA only; a failed "
                        "capture falls back to eager with a warning); the samples equal eager decoding's")
    p.add_argument("--triton-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="decode attention that reads each row's own keys (Triton, on CUDA), checked against SDPA on "
                        "the first step; SDPA's masked kernel otherwise")
    p.add_argument("--chunk-jobs", type=int, default=4096, help="length-sorted jobs per shuffled chunk")
    p.add_argument("--dtype", default=None, choices=("bf16", "f32"), help="weights and KV (default: bf16 on GPU)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N selected prompts (0: all)")
    p.add_argument("--time-budget-s", type=float, default=float("inf"))
    p.add_argument("--seed", type=int, default=0, help="sampled prefixes and chunk order (the run index)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny random target, one prompt per group, CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.max_new_tokens, args.max_prompt_tokens, args.variants = "cpu", 16, 256, 1
        args.prefix_max, args.eval_prompts, args.max_rows = 4, 2, 4
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "f32")
    if args.gguf is None:
        args.gguf = tiny_target.ensure() if args.smoke else DEFAULT_GGUF
    return args


def smoke_records(records: list[dict]) -> list[dict]:
    """The shortest training prompt of each group and two held-out ones."""
    by_group: dict[str, dict] = {}
    for r in sorted(records, key=lambda r: len(r["prompt"])):
        if r["split"] == SPLIT_TRAIN:
            by_group.setdefault(r["group"], r)
    return list(by_group.values()) + [r for r in records if r["split"] == SPLIT_HELDOUT][:2]


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    configure_torch(device, args.smoke)
    started = time.time()
    raw_records = prompt_set.read(args.prompts)
    all_records = [{**r, "row": i} for i, r in enumerate(raw_records)]
    records = select_records(all_records, args.shard, args.num_shards, args.eval_prompts)
    records = smoke_records(records) if args.smoke else records
    records = records[: args.limit] if args.limit else records
    records += [] if args.no_bench else bench_records()[: 2 if args.smoke else None]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg, model, tokenizer = load_target(args.gguf, device, dtype)
    log(f"target loaded on {device} ({args.dtype}) in {time.time() - started:.1f} s; {len(records)} prompts "
        f"(shard {args.shard}/{args.num_shards}), {pool_rows(cfg, args)} decode rows")
    samples = generate_all(model, tokenizer, cfg, records, args, started + args.time_budget_s)
    gen_seconds = time.time() - started
    info = {
        **statistics(samples, args, gen_seconds),
        "prompts_file": args.prompts.name,
        "prompts_sha256_jsonl": prompt_set.sha256_of(raw_records),
        "bench_prompts_sha256": file_sha256(BENCH_PROMPTS),
        "gguf": args.gguf.name,
        "gguf_sha256": file_sha256(args.gguf),
        **{k: getattr(args, k) for k in ("shard", "num_shards", "seed", "variants", "prefix_max",
                                         "prefix_temperature", "max_new_tokens", "max_prompt_tokens", "dtype")},
        "eval_fraction": EVAL_FRACTION,
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "eos_id": cfg.eos_id,
    }
    save(args.out, samples, info)
    log(f"wrote {info['samples']} samples ({info['response_tokens']} response tokens, "
        f"{info['greedy_response_tokens']} greedy; {info['ended_with_eos']} ended with EOS) to {args.out} in "
        f"{info['seconds']} s: {info['tokens_per_second']} tok/s")


if __name__ == "__main__":
    main()
