#!/usr/bin/env python3
"""Builds the training prompt set and writes it to tools/train/data/prompts.jsonl.gz (with a manifest).

Groups (default counts; the provenance of each is in README.md):
    code       coding tasks over documented stdlib functions, classes and methods (docstrings, signatures, source)
    source     "explain this source file" tasks over excerpts of pure-Python stdlib modules
    summarise  summaries of passages: module docstrings, pydoc's language-reference topics, API documentation
    rewrite    rewriting paragraphs of the same passages (plain English, shorter, bullets, typo fixing, ...)
    math       word problems and exercises with seeded numbers
    chat       general instructions from templates over word lists
    multiturn  a chat, math or code question and one or two follow-up turns (the target answers each turn)

Material reserved for evaluation (partition.py) and everything under bench/prompts/ is never used. Output is
deterministic for a given seed and Python version (the stdlib is the material); the committed file was built
with the interpreter named in its manifest, and generate.py reads that file, so training does not depend on the
Python version of the machine it runs on. Records: id, group, template, source, prompt, and for multi-turn ones
followups (the later user turns). Within a group, prompts over the same material get consecutive ids, so the
compressor sees repeated material close together.

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
from math_templates import math_prompt
from multiturn_templates import followups
from templates import FILE_TASKS, code_prompt, code_task_names, rewrite_prompt, source_file_prompt, summary_prompt

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_OUT = DATA_DIR / "prompts.jsonl.gz"
DEFAULT_COUNTS = {"code": 12000, "source": 2200, "summarise": 4000, "rewrite": 4000, "math": 10000, "chat": 10000,
                  "multiturn": 6000}
SMOKE_COUNTS = {"code": 3, "source": 1, "summarise": 2, "rewrite": 1, "math": 2, "chat": 2, "multiturn": 2}
SMOKE_MODULES = ["base64", "colorsys", "glob", "string", "uu"]
PASSAGE_WORDS = (120, 250, 400, 600, 900)
SOURCE_LINES = (30, 45, 60, 80, 110)
MULTITURN_KINDS = ("chat", "chat", "chat", "math", "code")
# Short code questions that open a conversation (the long source-code tasks stay single-turn).
MULTITURN_CODE_TASKS = ("write_function", "usage_example", "when_to_use", "common_mistakes")


def _group_rng(seed: int, group: str) -> random.Random:
    # One stream per group, so changing one group's count leaves the others' prompts unchanged.
    return random.Random(f"{seed}:{group}")


def _round_robin(rng: random.Random, materials: list, choices) -> list[tuple[int, str]]:
    """(material index, template name) pairs: every material once with one of its templates, then again with
    another one, ... (templates without repeats per material, random order)."""
    order = list(range(len(materials)))
    rng.shuffle(order)
    queues = {}
    for i in order:
        names = list(choices(materials[i]))
        rng.shuffle(names)
        queues[i] = names
    out, depth = [], 0
    while any(len(q) > depth for q in queues.values()):
        out += [(i, queues[i][depth]) for i in order if depth < len(queues[i])]
        depth += 1
    return out


def _unique(candidates, count: int) -> list[dict]:
    """The first count candidates with distinct text (two items can share their source code, say)."""
    out, seen = [], set()
    for record in candidates:
        if len(out) == count:
            break
        key = (record["prompt"], *record.get("followups", ()))
        if key not in seen:
            seen.add(key)
            out.append(record)
    return out


def _code_prompts(rng: random.Random, items: list[src.CodeItem], count: int) -> list[dict]:
    def records():
        for i, name in _round_robin(rng, items, code_task_names):
            template, text = code_prompt(rng, items[i], name)
            yield {"template": template, "source": f"code:{items[i].module}.{items[i].qualname}", "prompt": text}

    return _unique(records(), count)


def _source_prompts(rng: random.Random, excerpts: list[src.SourceExcerpt], count: int) -> list[dict]:
    def records():
        for i, name in _round_robin(rng, excerpts, lambda _: [n for n, _ in FILE_TASKS]):
            template, text = source_file_prompt(rng, excerpts[i], name)
            yield {"template": template, "source": excerpts[i].label, "prompt": text}

    return _unique(records(), count)


def _passage_chunks(rng: random.Random, passages: list[src.Passage]) -> list[tuple[str, str]]:
    chunks = []
    for passage in passages:
        for chunk in src.chunk_passage(passage.text, rng.choice(PASSAGE_WORDS)):
            if 60 <= len(chunk.split()) <= 1400:
                chunks.append((passage.source, chunk))
    return chunks


def _repeat_over(rng: random.Random, materials: list, count: int, make, passes: int = 8) -> list[dict]:
    """count distinct prompts over the materials, each used once per pass in a fresh random order (at most
    `passes` passes); make(rng, m) -> dict."""
    def records():
        order = list(range(len(materials)))
        for _ in range(passes):
            rng.shuffle(order)
            yield from (make(rng, materials[i]) for i in order)

    return _unique(records(), count)


def _summary_prompts(rng: random.Random, chunks: list[tuple[str, str]], count: int) -> list[dict]:
    def make(r, chunk):
        template, text = summary_prompt(r, chunk[1])
        return {"template": template, "source": chunk[0], "prompt": text}

    return _repeat_over(rng, chunks, count, make)


def _rewrite_prompts(rng: random.Random, passages: list[src.Passage], count: int) -> list[dict]:
    paras = [(p.source, para) for p in passages for para in src.paragraphs(p.text)
             if 30 <= len(para.split()) <= 160 and not para.startswith(">>>")]

    def make(r, para):
        template, text = rewrite_prompt(r, para[1])
        return {"template": template, "source": para[0], "prompt": text}

    return _repeat_over(rng, paras, count, make)


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


def _first_turn(rng: random.Random, kind: str, items: list[src.CodeItem]) -> tuple[str, str, str]:
    """(template, source, text) of a conversation's opening question."""
    if kind == "chat":
        template, text = chat_prompt(rng)
        return template, "chat:generated", text
    if kind == "math":
        template, text = math_prompt(rng)
        return template, "math:generated", text
    item = rng.choice(items)
    names = [n for n in code_task_names(item) if n in MULTITURN_CODE_TASKS]
    template, text = code_prompt(rng, item, rng.choice(names))
    return template, f"code:{item.module}.{item.qualname}", text


def _multiturn_prompts(rng: random.Random, items: list[src.CodeItem], count: int) -> list[dict]:
    out, seen = [], set()
    for _ in range(count * 20):
        if len(out) == count:
            break
        kind = rng.choice(MULTITURN_KINDS)
        template, source, first = _first_turn(rng, kind, items)
        names, turns = followups(rng, kind)
        key = (first, *turns)
        if key not in seen:
            seen.add(key)
            out.append({"template": "+".join([template, *names]), "source": source, "prompt": first,
                        "followups": turns})
    return out


def _numbered(group: str, prompts: list[dict], by_material: bool) -> list[dict]:
    if by_material:  # prompts over the same material side by side (a gzip window is only 32 KiB)
        prompts = sorted(prompts, key=lambda p: (p["source"], p["template"], p["prompt"]))
    return [{"id": f"{group}-{i:05d}", "group": group, **p} for i, p in enumerate(prompts)]


def build(seed: int, counts: dict[str, int], smoke: bool = False) -> list[dict]:
    """The training prompts: dicts with id, group, template, source, prompt (and followups); sorted by id."""
    modules = SMOKE_MODULES if smoke else src.stdlib_module_names()
    items = src.code_items(modules)
    passages = src.module_passages(modules) + ([] if smoke else src.topic_passages())
    if smoke:
        passages += src.topic_passages(names=("lambda", "pass", "while"))
    passages += src.api_passages(items)
    excerpts = src.source_excerpts(modules, SOURCE_LINES, f"{seed}:excerpts")
    groups = {
        "code": _code_prompts(_group_rng(seed, "code"), items, counts["code"]),
        "source": _source_prompts(_group_rng(seed, "source"), excerpts, counts["source"]),
        "summarise": _summary_prompts(
            _group_rng(seed, "summarise"), _passage_chunks(_group_rng(seed, "chunks"), passages), counts["summarise"]
        ),
        "rewrite": _rewrite_prompts(_group_rng(seed, "rewrite"), passages, counts["rewrite"]),
        "math": _generated_prompts(_group_rng(seed, "math"), math_prompt, counts["math"], "math"),
        "chat": _generated_prompts(_group_rng(seed, "chat"), chat_prompt, counts["chat"], "chat"),
        "multiturn": _multiturn_prompts(_group_rng(seed, "multiturn"), items, counts["multiturn"]),
    }
    records = []
    for group, prompts in groups.items():
        records += _numbered(group, prompts, by_material=group in ("code", "source", "summarise", "rewrite"))
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
