"""Which local material is reserved for evaluation and never enters the training prompt set.

The held-out prompts in bench/prompts/heldout*.json are built from these modules and pydoc topics (plus
hand-written prompts); prompts.py skips them, and everything under bench/prompts/, when it assembles the
training set. check_heldout.py verifies both directions.
"""

from __future__ import annotations

# Standard-library modules (and their submodules) reserved for evaluation. `json` is also the passage of
# bench/prompts/summarise-1000.txt; `pdb` and `bdb` (pdb's base class) share text with the `debugger` topic.
HELDOUT_MODULES: tuple[str, ...] = (
    "argparse",
    "bdb",
    "bisect",
    "calendar",
    "cmd",
    "colorsys",
    "configparser",
    "copy",
    "csv",
    "difflib",
    "fileinput",
    "fnmatch",
    "fractions",
    "graphlib",
    "heapq",
    "json",
    "pdb",
    "re",
    "shelve",
    "shlex",
    "socketserver",
    "statistics",
    "textwrap",
)

# pydoc_data.topics entries reserved for evaluation. Some topics are sections of others and are reserved with
# them: `in` of `comparisons`; `naming`, `exceptions` and `dynamic-features` of `execmodel`.
HELDOUT_TOPICS: tuple[str, ...] = (
    "comparisons",
    "debugger",
    "dynamic-features",
    "exceptions",
    "execmodel",
    "formatstrings",
    "import",
    "in",
    "naming",
)


def is_heldout_module(name: str) -> bool:
    """True for a reserved module or any of its submodules."""
    return any(name == m or name.startswith(m + ".") for m in HELDOUT_MODULES)
