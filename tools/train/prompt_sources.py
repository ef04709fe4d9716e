"""Raw material for prompts, read from the Python standard library of the running interpreter.

* Code items: public functions, classes and methods defined in stdlib modules, with their docstrings, signatures
  and (for pure-Python ones) source code, via `inspect`.
* Passages: module docstrings, the language-reference topics that `pydoc` ships (`pydoc_data.topics`), and
  per-module API documentation (the documented items' signatures and docstrings, one after the other).
* Source excerpts: runs of whole top-level statements (imports, functions, classes) of pure-Python stdlib
  modules, for "explain this source file" tasks.

Everything is enumerated in sorted order so that a seeded selection is reproducible for a given Python version.
Modules are imported with their output silenced; modules that open windows, browsers or print on import, and
platform-specific or deprecated-noisy ones, are never imported.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import io
import pkgutil
import re
import sys
import textwrap
import warnings
from dataclasses import dataclass

from partition import HELDOUT_TOPICS, is_heldout_module

# Never imported: side effects on import (this, antigravity, idlelib), GUI, tests, or not importable here.
SKIP_MODULES = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3", "ensurepip", "venv",
    "test", "pydoc_data", "xxsubtype", "msilib", "winreg", "winsound", "nt", "msvcrt", "ntpath", "crypt", "nis",
    "spwd", "ossaudiodev", "webbrowser", "distutils", "pydoc", "sqlite3", "dbm", "curses", "readline", "pty",
    "tty",
}
# Packages whose submodules are walked too (their submodules carry most of their code).
WALKED_PACKAGES = ("asyncio", "collections", "concurrent", "email", "html", "http", "importlib", "json",
                   "logging", "multiprocessing", "unittest", "urllib", "wsgiref", "xml", "xmlrpc", "zoneinfo")
MAX_SOURCE_LINES = 60


@dataclass(frozen=True)
class CodeItem:
    module: str
    qualname: str
    kind: str  # "function", "class" or "method"
    signature: str  # "(a, b=1)" or "" when unknown
    doc: str
    source: str | None  # dedented source when pure Python and short enough


@dataclass(frozen=True)
class Passage:
    source: str  # "module:NAME", "topic:NAME" or "apidoc:NAME"
    text: str


@dataclass(frozen=True)
class SourceExcerpt:
    module: str
    path: str  # the file inside the standard library, e.g. "email/utils.py"
    first_line: int
    last_line: int
    text: str

    @property
    def label(self) -> str:
        return f"source:{self.module}:{self.first_line}-{self.last_line}"


def import_quietly(name: str):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that cannot be imported here is simply not material
            return None


def stdlib_module_names(include_heldout: bool = False) -> list[str]:
    """Public stdlib modules (plus submodules of WALKED_PACKAGES), sorted."""
    names = set()
    for name in sys.stdlib_module_names:
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        names.add(name)
    for package in WALKED_PACKAGES:
        module = import_quietly(package)
        if module is None or not hasattr(module, "__path__"):
            continue
        for info in pkgutil.walk_packages(module.__path__, prefix=package + "."):
            parts = info.name.split(".")
            if any(p.startswith("_") or p in ("test", "tests") for p in parts[1:]):
                continue
            names.add(info.name)
    return sorted(n for n in names if include_heldout or not is_heldout_module(n))


def _default_text(value) -> str:
    """A default value as source text; `...` unless it is a short plain literal.

    Other reprs carry object addresses or process state (os.environ is a default somewhere), which would make
    the prompt set differ from run to run and leak the machine's environment into it.
    """
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    # Paths are machine state too (a default of sys.executable would name this interpreter's location).
    if isinstance(value, str) and len(value) <= 30 and value.isprintable() and "/" not in value and "\\" not in value:
        return repr(value)
    return "..."


def _signature(obj) -> str:
    """"(a, b=1, *args, key=...)": parameter names and plain defaults, without annotations."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = []
    for p in sig.parameters.values():
        text = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.default is not p.empty:
            text += "=" + _default_text(p.default)
        params.append(text)
    return "(" + ", ".join(params) + ")"


def short_source(obj) -> str | None:
    try:
        src = textwrap.dedent(inspect.getsource(obj))
    except (OSError, TypeError):
        return None
    lines = src.rstrip().splitlines()
    if len(lines) > MAX_SOURCE_LINES or len(lines) < 3:
        return None
    return "\n".join(lines)


def own_doc(obj) -> str:
    """The object's own docstring, cleaned; never one inherited from a base class (inspect.getdoc would return
    those, and a base class may live in a module reserved for evaluation)."""
    doc = vars(obj).get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def _items_of(module_name: str, module) -> list[CodeItem]:
    items = []
    for name, obj in inspect.getmembers(module):
        if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
            continue
        if inspect.isfunction(obj) or inspect.isbuiltin(obj):
            kind = "function"
        elif inspect.isclass(obj):
            kind = "class"
        else:
            continue
        doc = own_doc(obj)
        if len(doc) >= 40:
            items.append(CodeItem(module_name, name, kind, _signature(obj), doc, short_source(obj)))
        if kind == "class":
            items.extend(_methods_of(module_name, name, obj))
    return items


def _methods_of(module_name: str, class_name: str, cls) -> list[CodeItem]:
    items = []
    for name, obj in sorted(vars(cls).items()):
        if name.startswith("_") or not inspect.isfunction(obj):
            continue
        doc = own_doc(obj)
        if len(doc) >= 40:
            qual = f"{class_name}.{name}"
            items.append(CodeItem(module_name, qual, "method", _signature(obj), doc, short_source(obj)))
    return items


def code_items(modules: list[str]) -> list[CodeItem]:
    """Documented public functions, classes and methods of the given modules, in module then name order."""
    items = []
    for name in modules:
        module = import_quietly(name)
        if module is not None:
            items.extend(_items_of(name, module))
    return items


def strip_docstring(source: str) -> str | None:
    """The source with the (first) function's docstring removed, re-rendered by ast; None if it has none."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    if not tree.body or not isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    fn = tree.body[0]
    if not (fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
            and isinstance(fn.body[0].value.value, str)):
        return None
    fn.body = fn.body[1:] or [ast.Pass()]
    return ast.unparse(tree)


def module_passages(modules: list[str], min_words: int = 80) -> list[Passage]:
    """Module docstrings of at least min_words words."""
    out = []
    for name in modules:
        module = import_quietly(name)
        doc = inspect.getdoc(module) if module is not None else None
        if doc and len(doc.split()) >= min_words:
            out.append(Passage(f"module:{name}", doc.strip()))
    return out


def topic_passages(include_heldout: bool = False, names: tuple[str, ...] | None = None) -> list[Passage]:
    """The language-reference topics shipped with pydoc, by topic name."""
    from pydoc_data.topics import topics

    wanted = sorted(topics) if names is None else list(names)
    out = []
    for name in wanted:
        if not include_heldout and name in HELDOUT_TOPICS:
            continue
        text = topics[name].strip()
        if len(text.split()) >= 40:
            out.append(Passage(f"topic:{name}", text))
    return out


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, whitespace inside each collapsed."""
    return [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text) if p.strip()]


def chunk_passage(text: str, target_words: int) -> list[str]:
    """Splits text at blank lines into chunks of about target_words words (the layout inside is kept)."""
    blocks = [b for b in re.split(r"\n\s*\n", text) if b.strip()]
    chunks, current, words = [], [], 0
    for block in blocks:
        n = len(block.split())
        if current and words + n > target_words:
            chunks.append("\n\n".join(current))
            current, words = [], 0
        current.append(block.rstrip())
        words += n
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def first_paragraph(doc: str, max_words: int = 120) -> str:
    para = paragraphs(doc)[0] if doc.strip() else ""
    words = para.split()
    return " ".join(words[:max_words]) + (" ..." if len(words) > max_words else "")


def api_passages(items: list[CodeItem], min_words: int = 120) -> list[Passage]:
    """Per module, its documented items' signatures and docstrings in name order (an API reference page)."""
    by_module: dict[str, list[CodeItem]] = {}
    for item in items:
        by_module.setdefault(item.module, []).append(item)
    out = []
    for module in sorted(by_module):
        entries = [f"{i.qualname}{i.signature}\n\n{i.doc.strip()}" for i in sorted(by_module[module],
                                                                                 key=lambda i: i.qualname)]
        text = "\n\n".join(entries)
        if len(text.split()) >= min_words:
            out.append(Passage(f"apidoc:{module}", text))
    return out


def _module_path(name: str, module) -> str:
    file = getattr(module, "__file__", "") or ""
    tail = "/__init__.py" if file.endswith("__init__.py") else ".py"
    return name.replace(".", "/") + tail


def _top_level_spans(source: str) -> list[tuple[int, int, bool]]:
    """(first line, last line, defines something) of every top-level statement, decorators included."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    spans = []
    for node in tree.body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        defines = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        spans.append((first, node.end_lineno or node.lineno, defines))
    return spans


def source_excerpts(modules: list[str], line_targets: tuple[int, ...], seed: str,
                    max_lines: int = 140) -> list[SourceExcerpt]:
    """Consecutive whole top-level statements of each pure-Python module, cut into excerpts of about a target
    length (drawn per excerpt from line_targets), each with at least one function or class; statements longer
    than max_lines are left out."""
    import random

    rng = random.Random(seed)
    out = []
    for name in modules:
        module = import_quietly(name)
        try:
            source = inspect.getsource(module) if module is not None else ""
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        current: list[tuple[int, int, bool]] = []
        target = rng.choice(line_targets)
        for span in _top_level_spans(source) + [(0, 0, False)]:  # the sentinel flushes the last excerpt
            size = span[1] - current[0][0] + 1 if current else span[1] - span[0] + 1
            if current and (span == (0, 0, False) or size > max_lines or
                            current[-1][1] - current[0][0] + 1 >= target):
                if any(d for _, _, d in current):
                    first, last = current[0][0], current[-1][1]
                    out.append(SourceExcerpt(name, _module_path(name, module), first, last,
                                             "\n".join(lines[first - 1: last]).rstrip()))
                current, target = [], rng.choice(line_targets)
            if span != (0, 0, False) and span[1] - span[0] + 1 <= max_lines:
                current.append(span)
    return out
