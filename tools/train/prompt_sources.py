"""Raw material for prompts, read from the Python standard library of the running interpreter.

* Code items: public functions, classes and methods defined in stdlib modules, with their docstrings, signatures
  and (for pure-Python ones) source code, via `inspect`.
* Passages: module docstrings and the language-reference topics that `pydoc` ships (`pydoc_data.topics`).

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
    source: str  # "module:NAME" or "topic:NAME"
    text: str


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
    if isinstance(value, str) and len(value) <= 30 and value.isprintable():
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
        doc = inspect.getdoc(obj) or ""
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
        doc = inspect.getdoc(obj) or ""
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
