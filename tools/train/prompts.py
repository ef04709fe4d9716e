#!/usr/bin/env python3
"""Builds the training prompt set and writes it to tools/train/data/prompts.jsonl.gz (with a manifest).

Groups (default counts; the provenance of each is in README.md):
    code       coding tasks over documented stdlib functions, classes and methods (docstrings, signatures, source)
    summarise  summaries of passages: stdlib module docstrings and pydoc's language-reference topics
    rewrite    rewriting paragraphs of the same passages (plain English, shorter, bullets, typo fixing, ...)
    math       word problems and arithmetic with seeded numbers
    chat       general instructions from templates over word lists

Material reserved for evaluation (partition.py) and everything under bench/prompts/ is never used. Output is
deterministic for a given seed and Python version (the stdlib is the material); the committed file was built
with the interpreter named in its manifest, and generate.py reads that file, so training does not depend on the
Python version of the machine it runs on.

    python tools/train/prompts.py                 # rebuild the committed file (~1 minute)
    python tools/train/prompts.py --smoke --out /tmp/p.jsonl.gz   # a few prompts from a few modules
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import platform
import random
import sys
from pathlib import Path

import prompt_sources as src
from chat_templates import chat_prompt
from templates import code_prompt, math_prompt, rewrite_prompt, summary_prompt

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_OUT = DATA_DIR / "prompts.jsonl.gz"
DEFAULT_COUNTS = {"code": 2200, "summarise": 700, "rewrite": 400, "math": 900, "chat": 1000}
SMOKE_COUNTS = {"code": 3, "summarise": 2, "rewrite": 1, "math": 2, "chat": 2}
SMOKE_MODULES = ["base64", "colorsys", "glob", "string", "uu"]
PASSAGE_WORDS = (120, 250, 400, 600, 900, 1200)


def _group_rng(seed: int, group: str) -> random.Random:
    # One stream per group, so changing one group's count leaves the others' prompts unchanged.
    return random.Random(f"{seed}:{group}")


def _code_prompts(rng: random.Random, items: list[src.CodeItem], count: int) -> list[dict]:
    order = list(range(len(items)))
    rng.shuffle(order)
    out, seen = [], set()
    # Up to four passes: a second prompt for an item uses another random template.
    for _ in range(4):
        for i in order:
            if len(out) == count:
                return out
            item = items[i]
            template, text = code_prompt(rng, item)
            if text not in seen:
                seen.add(text)
                out.append({"template": template, "source": f"code:{item.module}.{item.qualname}", "prompt": text})
    return out


def _passage_chunks(rng: random.Random, passages: list[src.Passage]) -> list[tuple[str, str]]:
    chunks = []
    for passage in passages:
        for chunk in src.chunk_passage(passage.text, rng.choice(PASSAGE_WORDS)):
            if 60 <= len(chunk.split()) <= 1400:
                chunks.append((passage.source, chunk))
    return chunks


def _summary_prompts(rng: random.Random, chunks: list[tuple[str, str]], count: int) -> list[dict]:
    out = []
    order = list(range(len(chunks)))
    while len(out) < count and order:
        rng.shuffle(order)
        for i in order[: count - len(out)]:
            source, chunk = chunks[i]
            template, text = summary_prompt(rng, chunk)
            out.append({"template": template, "source": source, "prompt": text})
    return out


def _rewrite_prompts(rng: random.Random, passages: list[src.Passage], count: int) -> list[dict]:
    paras = [(p.source, para) for p in passages for para in src.paragraphs(p.text)
             if 30 <= len(para.split()) <= 160 and not para.startswith(">>>")]
    rng.shuffle(paras)
    out = []
    for source, para in paras[:count]:
        template, text = rewrite_prompt(rng, para)
        out.append({"template": template, "source": source, "prompt": text})
    return out


def _generated_prompts(rng: random.Random, make, count: int, group: str) -> list[dict]:
    out, seen = [], set()
    for _ in range(count * 20):
        if len(out) == count:
            break
        template, text = make(rng)
        if text not in seen:
            seen.add(text)
            out.append({"template": template, "source": f"{group}:generated", "prompt": text})
    return out


def build(seed: int, counts: dict[str, int], smoke: bool = False) -> list[dict]:
    """The training prompts: dicts with id, group, template, source, prompt; sorted by id."""
    modules = SMOKE_MODULES if smoke else src.stdlib_module_names()
    items = src.code_items(modules)
    passages = src.module_passages(modules) + ([] if smoke else src.topic_passages())
    if smoke:
        passages += src.topic_passages(names=("lambda", "pass", "while"))
    groups = {
        "code": _code_prompts(_group_rng(seed, "code"), items, counts["code"]),
        "summarise": _summary_prompts(
            _group_rng(seed, "summarise"), _passage_chunks(_group_rng(seed, "chunks"), passages), counts["summarise"]
        ),
        "rewrite": _rewrite_prompts(_group_rng(seed, "rewrite"), passages, counts["rewrite"]),
        "math": _generated_prompts(_group_rng(seed, "math"), math_prompt, counts["math"], "math"),
        "chat": _generated_prompts(_group_rng(seed, "chat"), chat_prompt, counts["chat"], "chat"),
    }
    records = []
    for group, prompts in groups.items():
        for i, p in enumerate(prompts):
            records.append({"id": f"{group}-{i:05d}", "group": group, **p})
    return sorted(records, key=lambda r: r["id"])


def encode_jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode("utf-8")


def write(path: Path, records: list[dict], seed: int, counts: dict[str, int]) -> dict:
    """Writes records as gzip JSON lines (mtime 0, so the bytes are reproducible) and a manifest beside them."""
    raw = encode_jsonl(records)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(raw)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())
    manifest = {
        "file": path.name,
        "sha256_jsonl": hashlib.sha256(raw).hexdigest(),
        "records": len(records),
        "per_group": {g: sum(r["group"] == g for r in records) for g in counts},
        "seed": seed,
        "python": platform.python_version(),
        "builder": "tools/train/prompts.py",
    }
    manifest_path = path.with_name(path.name.removesuffix(".jsonl.gz") + ".manifest.json")
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return manifest


def read(path: Path = DEFAULT_OUT) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def sha256_of(records: list[dict]) -> str:
    return hashlib.sha256(encode_jsonl(records)).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--smoke", action="store_true", help="a handful of prompts from a few modules")
    args = parser.parse_args()
    counts = SMOKE_COUNTS if args.smoke else DEFAULT_COUNTS
    records = build(args.seed, counts, smoke=args.smoke)
    manifest = write(args.out, records, args.seed, counts)
    print(json.dumps(manifest, indent=1))
    words = sorted(len(r["prompt"].split()) for r in records)
    print(f"prompt words: median {words[len(words) // 2]}, max {words[-1]}", file=sys.stderr)


if __name__ == "__main__":
    main()
