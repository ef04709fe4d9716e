#!/usr/bin/env python3
"""Checks that the evaluation prompts never appear in the training prompt set.

For every prompt file under bench/prompts/ (the held-out groups and the older lane / prefill prompts) against
every training prompt in tools/train/data/prompts.jsonl.gz:
  * no equal prompt (after lower-casing and collapsing whitespace);
  * no shared run of SHINGLE_WORDS consecutive words (catches a passage or code block reused inside another
    prompt; the instruction templates are shorter than that);
  * for prompts under SHORT_WORDS words, no training prompt with a word-set Jaccard similarity of JACCARD or more
    (catches a near-copy of a short question);
and that no training prompt's source is a reserved module or topic (partition.py). Also checks the held-out
files' format: four groups of 8 to 16 prompts in heldout.json, and heldout-small.json a subset of it; and that
the training file matches its manifest. `--rebuild` also rebuilds the training set from the stdlib and compares
(meaningful on the Python version the manifest names). Exits 1 on any finding.

    python tools/train/check_heldout.py
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import prompts as training
from partition import HELDOUT_TOPICS, is_heldout_module

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS_DIR = REPO_ROOT / "bench" / "prompts"
HELDOUT_GROUPS = ("code", "math", "chat", "summarise-long")
SHINGLE_WORDS = 20
SHORT_WORDS = 40
JACCARD = 0.7


def words(text: str) -> list[str]:
    return text.lower().split()


def shingles(tokens: list[str], n: int = SHINGLE_WORDS) -> set[int]:
    if len(tokens) < n:
        return {hash(tuple(tokens))} if tokens else set()
    return {hash(tuple(tokens[i : i + n])) for i in range(len(tokens) - n + 1)}


def jaccard(a: set[str], b: set[str]) -> float:
    return len(a & b) / max(1, len(a | b))


def eval_prompts() -> dict[str, list[str]]:
    """{file name: prompts} for every JSON list and text file under bench/prompts/."""
    out = {}
    for path in sorted(PROMPTS_DIR.iterdir()):
        if path.suffix == ".json":
            out[path.name] = [e["prompt"] for e in json.loads(path.read_text(encoding="utf-8"))]
        elif path.suffix == ".txt":
            out[path.name] = [path.read_text(encoding="utf-8")]
    return out


def user_text(record: dict) -> str:
    """Everything a training record's user says: the prompt and, in a conversation, the follow-up turns."""
    return "\n\n".join([record["prompt"], *record.get("followups", [])])


def overlap_findings(evals: dict[str, list[str]], train: list[dict]) -> list[str]:
    # Each user turn is compared on its own (a held-out prompt could match a conversation's first turn).
    turns = [(text, r["id"]) for r in train for text in [r["prompt"], *r.get("followups", [])]]
    train_norm = {" ".join(words(text)): rid for text, rid in turns}
    train_shingles: dict[int, str] = {}
    for r in train:
        for s in shingles(words(user_text(r))):
            train_shingles.setdefault(s, r["id"])
    short_train = [(set(words(text)), rid) for text, rid in turns if len(words(text)) < 2 * SHORT_WORDS]
    findings = []
    for name, texts in evals.items():
        for i, text in enumerate(texts):
            tokens = words(text)
            where = f"{name}[{i}]"
            if " ".join(tokens) in train_norm:
                findings.append(f"{where}: equals training prompt {train_norm[' '.join(tokens)]}")
                continue
            shared = [train_shingles[s] for s in shingles(tokens) if s in train_shingles]
            if shared:
                findings.append(f"{where}: shares a {SHINGLE_WORDS}-word run with training prompt {shared[0]}")
            if len(tokens) < SHORT_WORDS:
                bag = set(tokens)
                close = [(jaccard(bag, t), rid) for t, rid in short_train]
                best = max(close, default=(0.0, ""))
                if best[0] >= JACCARD:
                    findings.append(f"{where}: word-set similarity {best[0]:.2f} with training prompt {best[1]}")
    return findings


def source_findings(train: list[dict]) -> list[str]:
    out = []
    for r in train:
        kind, _, name = r["source"].partition(":")
        if kind == "code" and any(is_heldout_module(name.rsplit(".", k)[0]) for k in range(name.count(".") + 1)):
            out.append(f"training prompt {r['id']} comes from reserved code {name}")
        elif kind in ("module", "apidoc") and is_heldout_module(name):
            out.append(f"training prompt {r['id']} comes from reserved module {name}")
        elif kind == "source" and is_heldout_module(name.partition(":")[0]):
            out.append(f"training prompt {r['id']} comes from the source of reserved module {name}")
        elif kind == "topic" and name in HELDOUT_TOPICS:
            out.append(f"training prompt {r['id']} comes from reserved topic {name}")
    return out


def format_findings() -> list[str]:
    full = json.loads((PROMPTS_DIR / "heldout.json").read_text(encoding="utf-8"))
    small = json.loads((PROMPTS_DIR / "heldout-small.json").read_text(encoding="utf-8"))
    out = []
    for entries, name in ((full, "heldout.json"), (small, "heldout-small.json")):
        for e in entries:
            if set(e) != {"group", "prompt"} or not isinstance(e["prompt"], str) or not e["prompt"].strip():
                out.append(f"{name}: malformed entry {e!r:.80}")
    groups = {g: sum(e["group"] == g for e in full) for g in {e["group"] for e in full}}
    if set(groups) != set(HELDOUT_GROUPS):
        out.append(f"heldout.json groups {sorted(groups)}, expected {list(HELDOUT_GROUPS)}")
    out += [f"heldout.json group {g} has {n} prompts (8..16)" for g, n in groups.items() if not 8 <= n <= 16]
    full_set = {(e["group"], e["prompt"]) for e in full}
    out += [f"heldout-small.json entry {i} is not in heldout.json" for i, e in enumerate(small)
            if (e["group"], e["prompt"]) not in full_set]
    if len({e["prompt"] for e in full}) != len(full):
        out.append("heldout.json has duplicate prompts")
    return out


def manifest_findings(train: list[dict], rebuild: bool) -> list[str]:
    manifest = json.loads(training.DEFAULT_OUT.with_name("prompts.manifest.json").read_text(encoding="utf-8"))
    out = []
    if training.sha256_of(train) != manifest["sha256_jsonl"]:
        out.append("prompts.jsonl.gz does not match prompts.manifest.json")
    if rebuild:
        if platform.python_version() != manifest["python"]:
            print(f"note: rebuilding with Python {platform.python_version()}, manifest says {manifest['python']}")
        rebuilt = training.build(manifest["seed"], training.DEFAULT_COUNTS)
        if training.sha256_of(rebuilt) != manifest["sha256_jsonl"]:
            out.append("rebuilding the training prompts gives a different set than the committed file")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rebuild", action="store_true", help="also rebuild the training set and compare")
    args = parser.parse_args()
    train = training.read()
    evals = eval_prompts()
    findings = (format_findings() + manifest_findings(train, args.rebuild) + source_findings(train)
                + overlap_findings(evals, train))
    for f in findings:
        print(f"FAIL {f}")
    total = sum(len(v) for v in evals.values())
    print(f"{total} evaluation prompts in {len(evals)} files against {len(train)} training prompts: "
          f"{'ok' if not findings else f'{len(findings)} findings'}")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
