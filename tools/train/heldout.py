#!/usr/bin/env python3
"""Writes the held-out evaluation prompts: bench/prompts/heldout.json and its subset heldout-small.json.

Four groups of 12 (same format as bench/prompts/lanes.json: a list of {"group", "prompt"}):
    code            5 tasks over functions of stdlib modules reserved for evaluation + 7 hand-written tasks
    math            hand-written word problems (not the training generators)
    chat            hand-written everyday requests
    summarise-long  700-1500-word passages: reserved pydoc topics and reserved module docs (with their main
                    classes' and functions' docs appended)

The reserved modules and topics (partition.py) never enter the training set, so these prompts are held out by
construction; check_heldout.py verifies it against the committed training prompts. The JSON files are the
artifact: the stdlib texts come from the interpreter that ran this script (Python 3.11, see README.md), and
re-running it on another Python version may change them.

    python tools/train/heldout.py            # rewrite both files
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import prompt_sources as src
from partition import HELDOUT_MODULES, HELDOUT_TOPICS

REPO_ROOT = Path(__file__).resolve().parents[2]
OUT_FULL = REPO_ROOT / "bench" / "prompts" / "heldout.json"
OUT_SMALL = REPO_ROOT / "bench" / "prompts" / "heldout-small.json"
LONG_WORDS = (700, 1500)

# (module, attribute path, task): coding tasks over reserved modules.
CODE_FROM_MODULES = (
    ("textwrap", "dedent", "Explain what this Python code does:"),
    ("fnmatch", "filter", "Write unit tests with the unittest module for this code:"),
    ("colorsys", "rgb_to_hsv", "Translate this Python code into JavaScript:"),
    ("shlex", "join", "Add type hints to this Python code and show the full result:"),
    ("statistics", "median", "What edge cases should the tests of this code cover?"),
)

CODE_HANDWRITTEN = (
    "Write a Python function that merges two sorted lists into one sorted list without calling sort() or sorted().",
    "Write a JavaScript function `debounce(fn, ms)` that returns a function which delays calling `fn` until `ms` "
    "milliseconds have passed since the last call.",
    "Write an SQL query that returns the five customers with the highest total order amount, given the tables "
    "customers(id, name) and orders(id, customer_id, amount).",
    "This function should return the last `n` items of a list, but it returns one item too many. Fix it:\n\n"
    "```python\ndef last_items(items, n):\n    return items[len(items) - n - 1:]\n```",
    "Write a Rust function that counts how often each word appears in a string and returns a "
    "`HashMap<String, usize>`.",
    "Refactor this code so the repeated logic lives in one helper function:\n\n```python\n"
    "def area_report(rooms):\n    total = 0\n    for r in rooms:\n        total += r['w'] * r['h']\n"
    "    print('rooms:', len(rooms), 'area:', total)\n\n"
    "def garden_report(beds):\n    total = 0\n    for b in beds:\n        total += b['w'] * b['h']\n"
    "    print('beds:', len(beds), 'area:', total)\n```",
    "Write a bash script that renames every `.txt` file in the current folder to end in `.md` instead.",
)

MATH = (
    "A farmer has chickens and cows. Together they have 30 heads and 74 legs. How many cows does the farmer have?",
    "A bookshop sold 120 books on Monday, 25% more on Tuesday, and half of Tuesday's number on Wednesday. "
    "How many books did it sell over the three days?",
    "Mia's phone battery drops 8% per hour while she uses maps and 2% per hour otherwise. It starts at 90%, and "
    "she uses maps for 3 hours of a 7-hour day. What is the battery level at the end of the day?",
    "A ladder 5 meters long leans against a wall with its foot 3 meters from the wall. How high up the wall "
    "does it reach?",
    "Three notebooks and two pens cost $13. One notebook and four pens cost $11. How much does one pen cost?",
    "A cyclist rides 18 km uphill at 12 km/h and comes back down the same road at 36 km/h. What is her average "
    "speed for the whole round trip?",
    "What is the sum of all whole numbers from 1 to 200 that are divisible by 7?",
    "A bag holds 4 red, 5 blue and 6 green marbles. Two marbles are drawn without putting the first one back. "
    "What is the probability that both are blue?",
    "A culture of bacteria doubles every 20 minutes. It starts with 500 bacteria. How many are there after "
    "2 hours?",
    "Tickets cost $8 for adults and $5 for children. A group of 14 people paid $94 in total. How many children "
    "were in the group?",
    "A square garden has an area of 196 square meters. A path 1 meter wide runs all around the outside of it. "
    "What is the area of the path?",
    "Jon is twice as old as his sister. Six years ago he was three times as old as she was. How old are they now?",
)

CHAT = (
    "What should I pack for a week-long camping trip when rain is expected every day?",
    "My friend forgot my birthday. How can I tell her I was hurt without starting a fight?",
    "Write a toast for my parents' thirtieth wedding anniversary.",
    "In a few sentences, what is the difference between weather and climate?",
    "I have chicken, rice, spinach and lemons. What could I cook for dinner tonight?",
    "Why do cats purr?",
    "Write a short product description for a reusable glass water bottle with a bamboo lid.",
    "Give me a simple weekly exercise plan for someone who sits at a desk all day.",
    "What are some good questions to ask at the end of a job interview?",
    "Describe a sunrise over the ocean to someone who has never seen one.",
    "How can a small cafe attract more customers on weekday mornings?",
    "Write the chorus of a cheerful song about Monday mornings.",
)

LONG_INSTRUCTIONS = (
    "Read the following documentation and summarise it in about 150 words.",
    "Summarise the main ideas of this document in one paragraph, then list three details a programmer should "
    "remember.",
    "Here is a long technical text. Write a summary of it for a colleague who has five minutes to read it.",
    "Write a structured summary of the following text with a heading and up to six bullet points.",
)
LONG_TOPICS = ("debugger", "formatstrings", "execmodel", "comparisons", "import")
LONG_MODULES = ("re", "configparser", "socketserver", "fileinput", "difflib", "statistics", "argparse")


def _code_from_modules() -> list[str]:
    out = []
    for module_name, attr, task in CODE_FROM_MODULES:
        module = src.import_quietly(module_name)
        source = src.short_source(getattr(module, attr))
        if source is None:
            raise RuntimeError(f"no source for {module_name}.{attr}")
        out.append(f"{task}\n\n```python\n{source}\n```")
    return out


def _trim_words(text: str, limit: int) -> str:
    """The leading blank-line separated blocks of text that fit in limit words (at least one block)."""
    kept, words = [], 0
    for block in text.split("\n\n"):
        n = len(block.split())
        if kept and words + n > limit:
            break
        kept.append(block)
        words += n
    return "\n\n".join(kept)


def _module_long_text(name: str) -> str:
    """Module docstring, then the docs of its documented public classes and functions, up to the word cap."""
    module = src.import_quietly(name)
    parts = [inspect.getdoc(module) or ""]
    for item in src.code_items([name]):
        if sum(len(p.split()) for p in parts) >= LONG_WORDS[1]:
            break
        if item.kind in ("class", "function") and len(item.doc.split()) >= 25:
            parts.append(f"{item.qualname}{item.signature}\n\n{item.doc}")
    return _trim_words("\n\n".join(parts), LONG_WORDS[1])


def _long_prompts() -> list[str]:
    texts = [_trim_words(p.text, LONG_WORDS[1]) for p in src.topic_passages(include_heldout=True, names=LONG_TOPICS)]
    texts += [_module_long_text(m) for m in LONG_MODULES]
    out = []
    for i, text in enumerate(texts):
        words = len(text.split())
        if not LONG_WORDS[0] <= words <= LONG_WORDS[1]:
            raise RuntimeError(f"long passage {i} has {words} words, outside {LONG_WORDS}")
        out.append(f"{LONG_INSTRUCTIONS[i % len(LONG_INSTRUCTIONS)]}\n\n{text}")
    return out


def build() -> list[dict]:
    assert set(LONG_TOPICS) <= set(HELDOUT_TOPICS) and set(LONG_MODULES) <= set(HELDOUT_MODULES)
    assert {m for m, _, _ in CODE_FROM_MODULES} <= set(HELDOUT_MODULES)
    groups = {
        "code": _code_from_modules() + list(CODE_HANDWRITTEN),
        "math": list(MATH),
        "chat": list(CHAT),
        "summarise-long": _long_prompts(),
    }
    return [{"group": g, "prompt": p} for g, prompts in groups.items() for p in prompts]


def small_subset(entries: list[dict], per_group: int = 2) -> list[dict]:
    """The first per_group prompts of each group, except that summarise-long takes its shortest ones."""
    out = []
    for group in dict.fromkeys(e["group"] for e in entries):
        members = [e for e in entries if e["group"] == group]
        if group == "summarise-long":
            members = sorted(members, key=lambda e: len(e["prompt"]))
        out.extend(members[:per_group])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT_FULL)
    parser.add_argument("--out-small", type=Path, default=OUT_SMALL)
    args = parser.parse_args()
    entries = build()
    for path, data in ((args.out, entries), (args.out_small, small_subset(entries))):
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {len(data)} prompts to {path}")


if __name__ == "__main__":
    main()
