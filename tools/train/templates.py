"""Prompt templates over stdlib material: code tasks over documented items, "explain this source file" tasks over
source excerpts, summaries and rewrites over passages. Math is in math_templates.py, chat in chat_templates.py,
multi-turn follow-ups in multiturn_templates.py.

Every function takes a seeded `random.Random` and returns (template name, prompt text).
"""

from __future__ import annotations

import random

from prompt_sources import CodeItem, SourceExcerpt, first_paragraph, strip_docstring

def _code_block(source: str, lang: str = "python") -> str:
    return f"```{lang}\n{source}\n```"


# Tasks over an item's source code: (name, instruction placed before the code block).
SOURCE_TASKS = (
    ("explain_source", "Explain what this Python code does:"),
    ("unit_tests", "Write unit tests with the unittest module for this code:"),
    ("refactor", "Rewrite this Python code to make it easier to read, and explain the changes:"),
    ("translate_js", "Translate this Python code into JavaScript:"),
    ("edge_cases", "What edge cases should the tests of this code cover?"),
    ("type_hints", "Add type hints to this Python code and show the full result:"),
    ("add_comments", "Add helpful comments to this code:"),
    ("find_bugs", "Review this code. Do you see any bugs or risky inputs? Explain what could go wrong."),
    ("complexity", "What are the time and space complexity of this code? Explain briefly."),
    ("translate_go", "Translate this Python code into Go:"),
    ("translate_ts", "Port this code to TypeScript, keeping the same behaviour:"),
    ("pseudocode", "Describe this code as numbered pseudocode steps:"),
    ("one_sentence", "Summarise in one sentence what this code does:"),
    ("rename", "Suggest clearer names for the variables in this code, and show the renamed version:"),
    ("example_calls", "Give three example calls of this code with the results they produce:"),
    ("simplify", "Can this code be made shorter or simpler? Show a simpler version and explain it:"),
    ("doctest", "Write doctest examples for this code:"),
    ("line_by_line", "Walk through this code line by line:"),
    ("exceptions", "Which exceptions can this code raise, and in which situations?"),
    ("code_review", "Do a short code review of this Python code: what is good, and what would you change?"),
)
SOURCE_TASK_NAMES = {name for name, _ in SOURCE_TASKS}


def code_task_names(item: CodeItem) -> list[str]:
    """Every template that applies to the item (some need its source, some a function)."""
    names = ["write_function", "explain_doc", "usage_example", "when_to_use", "common_mistakes", "doc_quiz"]
    if item.signature and item.signature != "()":
        names.append("explain_parameters")
    if item.source is not None:
        names += [name for name, _ in SOURCE_TASKS]
        if item.kind != "class" and strip_docstring(item.source):
            names.append("add_docstring")
    if item.kind == "class":
        names = [n for n in names if n not in ("write_function", "type_hints", "explain_parameters")]
        names.append("explain_class")
    return names


def code_prompt(rng: random.Random, item: CodeItem, name: str | None = None) -> tuple[str, str]:
    """One coding task about a documented stdlib function, class or method (`name`, or a random template)."""
    name = name or rng.choice(code_task_names(item))
    qual = f"{item.module}.{item.qualname}"
    short = item.qualname.split(".")[-1]
    summary = first_paragraph(item.doc)
    if name in SOURCE_TASK_NAMES:
        instruction = dict(SOURCE_TASKS)[name]
        return name, f"{instruction}\n\n{_code_block(item.source)}"
    texts = {
        "write_function": lambda: f"Write a Python function `{short}{item.signature}` that does the following:\n\n"
                                  f"{summary}",
        "explain_doc": lambda: f"Here is the documentation of `{qual}`:\n\n{item.doc}\n\n"
                               "Explain in simple terms what it does and show a short example.",
        "usage_example": lambda: f"Show how to use `{qual}` in a small Python program. Its documentation says:\n\n"
                                 f"{summary}",
        "explain_class": lambda: f"Explain what the class `{qual}` is for, based on its documentation:\n\n{item.doc}",
        "when_to_use": lambda: f"When would I reach for `{qual}` in a real project? Give a practical example. "
                               f"For reference, its documentation begins:\n\n{summary}",
        "common_mistakes": lambda: f"What mistakes do people often make when using `{qual}`? Here is what it "
                                   f"does:\n\n{summary}",
        "doc_quiz": lambda: f"Write three quiz questions, with answers, that check whether someone understood "
                            f"this documentation of `{qual}`:\n\n{item.doc}",
        "explain_parameters": lambda: f"Explain each parameter of `{qual}{item.signature}`. The documentation "
                                      f"says:\n\n{item.doc}",
        "add_docstring": lambda: "Write a docstring for this Python function:\n\n"
                                 f"{_code_block(strip_docstring(item.source))}",
    }
    return name, texts[name]()


# "Explain this source file": (name, instruction); {path} is the file inside the standard library.
FILE_TASKS = (
    ("explain_file", "Explain what this part of `{path}` does, piece by piece."),
    ("list_api", "List the functions and classes defined in this code from `{path}`, with one line on each."),
    ("readme", "Write a short README section that documents the code below (from `{path}`)."),
    ("review_file", "Review this code from `{path}`: what could be simplified, and what looks fragile?"),
    ("how_it_fits", "Explain how the functions and classes in this code work together."),
    ("user_guide", "From the code below, explain what a programmer using this module needs to know."),
    ("tests_for_file", "Write unit tests for the main functions in this code."),
    ("data_flow", "Describe how data flows through this code, from its inputs to its outputs."),
    ("python_features", "Which Python features used in this code might a beginner not know? Explain them."),
    ("module_docstring", "Write a module docstring that describes this code from `{path}`."),
    ("junior_dev", "What is this code for? Explain it to a junior developer who has just joined the team."),
    ("questions_file", "Write five questions a code reviewer might ask about this code, and answer them."),
)


def source_file_prompt(rng: random.Random, excerpt: SourceExcerpt, name: str | None = None) -> tuple[str, str]:
    """A task over an excerpt of a stdlib source file; the instruction comes before or after the code."""
    tasks = dict(FILE_TASKS)
    name = name or rng.choice(sorted(tasks))
    instruction = tasks[name].format(path=excerpt.path)
    code = _code_block(excerpt.text)
    if rng.random() < 0.7:
        return name, f"{instruction}\n\n{code}"
    return f"{name}-after", f"{code}\n\n{instruction}"


SUMMARY_INSTRUCTIONS = (
    "Summarise the following text in {n} sentences.",
    "Summarise the following documentation in {n} bullet points.",
    "Write a short summary of this text for a beginner.",
    "What are the main points of the following text?",
    "Read the following text and list the key terms it defines.",
    "Give this text a title and a one-paragraph summary.",
    "Write {n} questions that this text answers, with their answers.",
    "Explain the following text to someone who has never programmed.",
    "TL;DR the following text.",
    "Write an abstract of at most {words} words for the following text.",
    "Summarise this for a busy programmer who needs only the essentials.",
    "Turn the following documentation into a cheat sheet.",
    "What would be the three most useful things to remember from this text?",
    "Summarise the following text, then list anything it warns about.",
    "Write study notes for the following text.",
    "Condense this documentation into a short paragraph, keeping every name it mentions.",
    "Which examples or use cases does this text describe? Summarise them.",
    "Give a one-sentence summary, then a longer one of about {words} words.",
)


def summary_prompt(rng: random.Random, passage: str) -> tuple[str, str]:
    index = rng.randrange(len(SUMMARY_INSTRUCTIONS))
    instruction = SUMMARY_INSTRUCTIONS[index].format(n=rng.choice((2, 3, 4, 5)), words=rng.choice((50, 80, 120)))
    if rng.random() < 0.5:
        return f"summary{index}", f"{instruction}\n\n{passage}"
    return f"summary{index}-after", f"{passage}\n\n{instruction}"


REWRITE_INSTRUCTIONS = (
    "Rewrite the following paragraph in plain English:",
    "Make this text shorter without losing information:",
    "Rewrite this text as a bulleted list:",
    "Rewrite this in a friendly, informal tone:",
    "Turn this paragraph into a single sentence:",
    "Fix the spelling mistakes in this text and return the corrected text:",
    "Rewrite this paragraph for a ten-year-old:",
    "Rewrite this text in a formal tone:",
    "Paraphrase this paragraph so that it uses different words but means the same:",
    "Rewrite this in the active voice where possible:",
    "Split this paragraph into shorter sentences:",
    "Rewrite this text as a numbered list of steps or facts:",
    "Make this paragraph more concise and precise:",
    "Rewrite this as a short message to a colleague:",
    "Fix the grammar and punctuation of this text:",
    "Rewrite this paragraph so that it starts with its most important point:",
)


def _with_typos(rng: random.Random, text: str) -> str:
    """Swaps two adjacent letters in about one word in eight (words of 5+ letters)."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) >= 5 and word.isalpha() and rng.random() < 0.125:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


def _with_grammar_slips(rng: random.Random, text: str) -> str:
    """Drops about one comma or period in four."""
    out = []
    for word in text.split(" "):
        if word[-1:] in ",." and rng.random() < 0.25:
            word = word[:-1]
        out.append(word)
    return " ".join(out)


def rewrite_prompt(rng: random.Random, paragraph: str) -> tuple[str, str]:
    index = rng.randrange(len(REWRITE_INSTRUCTIONS))
    instruction = REWRITE_INSTRUCTIONS[index]
    if "spelling" in instruction:
        paragraph = _with_typos(rng, paragraph)
    elif "grammar and punctuation" in instruction:
        paragraph = _with_grammar_slips(rng, paragraph)
    return f"rewrite{index}", f"{instruction}\n\n{paragraph}"
