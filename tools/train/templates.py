"""Prompt templates: code tasks over stdlib items, summaries and rewrites over passages, math word problems with
generated numbers, and general chat instructions over word lists written for this project.

Every function takes a seeded `random.Random` and returns (template name, prompt text).
"""

from __future__ import annotations

import random

from prompt_sources import CodeItem, first_paragraph, strip_docstring

STEP_SUFFIXES = ("", " Show your steps.", " Explain your reasoning step by step.", " Give the final answer first.")


def _code_block(source: str, lang: str = "python") -> str:
    return f"```{lang}\n{source}\n```"


def code_prompt(rng: random.Random, item: CodeItem) -> tuple[str, str]:
    """One coding task about a documented stdlib function, class or method."""
    qual = f"{item.module}.{item.qualname}"
    short = item.qualname.split(".")[-1]
    summary = first_paragraph(item.doc)
    choices = ["write_function", "explain_doc", "usage_example"]
    if item.source is not None:
        choices += ["explain_source", "unit_tests", "refactor", "translate_js", "edge_cases", "type_hints",
                    "add_comments"]
        if item.kind != "class" and strip_docstring(item.source):
            choices.append("add_docstring")
    if item.kind == "class":
        choices = [c for c in choices if c not in ("write_function", "type_hints")] + ["explain_class"]
    name = rng.choice(choices)
    if name == "write_function":
        text = f"Write a Python function `{short}{item.signature}` that does the following:\n\n{summary}"
    elif name == "explain_doc":
        text = (f"Here is the documentation of `{qual}`:\n\n{item.doc}\n\n"
                "Explain in simple terms what it does and show a short example.")
    elif name == "usage_example":
        text = f"Show how to use `{qual}` in a small Python program. Its documentation says:\n\n{summary}"
    elif name == "explain_class":
        text = f"Explain what the class `{qual}` is for, based on its documentation:\n\n{item.doc}"
    elif name == "explain_source":
        text = f"Explain what this Python code does:\n\n{_code_block(item.source)}"
    elif name == "unit_tests":
        text = f"Write unit tests with the unittest module for this code:\n\n{_code_block(item.source)}"
    elif name == "refactor":
        text = ("Rewrite this Python code to make it easier to read, and explain the changes:\n\n"
                f"{_code_block(item.source)}")
    elif name == "translate_js":
        text = f"Translate this Python code into JavaScript:\n\n{_code_block(item.source)}"
    elif name == "edge_cases":
        text = f"What edge cases should the tests of this code cover?\n\n{_code_block(item.source)}"
    elif name == "type_hints":
        text = f"Add type hints to this Python code and show the full result:\n\n{_code_block(item.source)}"
    elif name == "add_comments":
        text = f"Add helpful comments to this code:\n\n{_code_block(item.source)}"
    else:  # add_docstring
        text = f"Write a docstring for this Python function:\n\n{_code_block(strip_docstring(item.source))}"
    return name, text


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
)


def summary_prompt(rng: random.Random, passage: str) -> tuple[str, str]:
    index = rng.randrange(len(SUMMARY_INSTRUCTIONS))
    instruction = SUMMARY_INSTRUCTIONS[index].format(n=rng.choice((2, 3, 4, 5)))
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
)


def _with_typos(rng: random.Random, text: str) -> str:
    """Swaps two adjacent letters in about one word in eight (words of 5+ letters)."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) >= 5 and word.isalpha() and rng.random() < 0.125:
            j = rng.randrange(1, len(word) - 2)
            words[i] = word[:j] + word[j + 1] + word[j] + word[j + 2:]
    return " ".join(words)


def rewrite_prompt(rng: random.Random, paragraph: str) -> tuple[str, str]:
    index = rng.randrange(len(REWRITE_INSTRUCTIONS))
    if "spelling" in REWRITE_INSTRUCTIONS[index]:
        paragraph = _with_typos(rng, paragraph)
    return f"rewrite{index}", f"{REWRITE_INSTRUCTIONS[index]}\n\n{paragraph}"


NAMES = ("Ava", "Ben", "Chen", "Dara", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemal", "Lena", "Marta",
         "Nico", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tomas", "Uma", "Viktor", "Wen", "Yara", "Zoe")
COUNTABLES = ("apples", "marbles", "stickers", "books", "pencils", "coins", "cookies", "stamps", "shells", "cards")
SHOP_ITEMS = ("jacket", "lamp", "bicycle", "backpack", "kettle", "chair", "watch", "pair of shoes", "desk", "radio")


def _name(rng: random.Random) -> str:
    return rng.choice(NAMES)


def _m_inventory(rng):
    n, item = _name(rng), rng.choice(COUNTABLES)
    a, b, c = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 20)
    return f"{n} has {a} {item}. {n} buys {b} more and then gives {c} to a friend. How many {item} does {n} have now?"


def _m_distance(rng):
    v, t = rng.randint(30, 120), rng.choice((1.5, 2, 2.5, 3, 4, 5))
    return f"A train travels at {v} km/h for {t} hours. How far does it go?"


def _m_discount(rng):
    p, d = rng.randint(20, 400), rng.choice((10, 15, 20, 25, 30, 40, 50))
    return f"A {rng.choice(SHOP_ITEMS)} costs ${p}. It is on sale for {d}% off. What is the sale price?"


def _m_arith(rng):
    a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(2, 99)
    form = rng.choice((f"What is {a} + {b} - {c}?", f"What is {a} times {c}?", f"Compute {a} * {c} + {b}.",
                       f"What is {a * c} divided by {c}?", f"Calculate ({a} + {b}) * {c}."))
    return form


def _m_linear(rng):
    a, x, b = rng.randint(2, 12), rng.randint(-10, 20), rng.randint(-30, 30)
    sign = "+" if b >= 0 else "-"
    return f"Solve for x: {a}x {sign} {abs(b)} = {a * x + b}."


def _m_average(rng):
    values = [rng.randint(1, 100) for _ in range(rng.randint(4, 8))]
    return f"What is the average of these numbers: {', '.join(map(str, values))}?"


def _m_rectangle(rng):
    w, h = rng.randint(2, 40), rng.randint(2, 40)
    return f"A rectangle is {w} cm wide and {h} cm long. What are its area and its perimeter?"


def _m_pages(rng):
    n, p, q = _name(rng), rng.randint(8, 40), rng.randint(120, 900)
    return f"{n} reads {p} pages a day. How many days does {n} need to finish a book of {q} pages?"


def _m_minutes(rng):
    return f"Convert {rng.randint(61, 1000)} minutes into hours and minutes."


def _m_recipe(rng):
    a, b = rng.randint(2, 5), rng.choice((12, 18, 24, 30))
    c = b * rng.choice((2, 3)) // rng.choice((1, 2))
    return f"A recipe needs {a} cups of flour for {b} cookies. How much flour is needed for {c} cookies?"


def _m_fraction(rng):
    g = rng.randint(2, 12)
    a, b = rng.randint(1, 12) * g, rng.randint(13, 30) * g
    return f"Simplify the fraction {a}/{b}."


def _m_sequence(rng):
    start, step = rng.randint(1, 20), rng.randint(2, 9)
    if rng.random() < 0.5:
        seq = [start + i * step for i in range(5)]
    else:
        seq = [start * (step // 2 + 1) ** i for i in range(5)]
    return f"What is the next number in the sequence {', '.join(map(str, seq))}?"


def _m_gcd(rng):
    g = rng.randint(2, 15)
    a, b = g * rng.randint(2, 30), g * rng.randint(2, 30)
    return rng.choice((f"Find the greatest common divisor of {a} and {b}.",
                       f"Find the least common multiple of {a // g} and {b // g}."))


def _m_prime(rng):
    return f"Is {rng.randint(20, 500)} a prime number? Explain how you checked."


def _m_tank(rng):
    a, r = rng.randint(100, 2000), rng.randint(5, 60)
    return (f"A tank holds {a} liters of water. A pump fills it at {r} liters per minute. "
            "How long does it take to fill the empty tank?")


def _m_workers(rng):
    n, d = rng.randint(2, 12), rng.randint(2, 30)
    m = rng.choice([k for k in range(2, 25) if k != n])
    return f"{n} workers can paint a fence in {d} days. How long would {m} workers take, working at the same rate?"


def _m_sum_diff(rng):
    x, y = rng.randint(10, 90), rng.randint(1, 60)
    return f"The sum of two numbers is {x + y} and their difference is {abs(x - y)}. What are the two numbers?"


def _m_circle(rng):
    return f"What is the area of a circle with a radius of {rng.randint(1, 30)} meters? Use pi = 3.14."


def _m_savings(rng):
    n, a = _name(rng), rng.randint(5, 80)
    b = a * rng.randint(3, 40) + rng.randint(0, a - 1)
    return f"{n} saves ${a} every week. How many weeks does {n} need to save at least ${b}?"


def _m_interest(rng):
    p, r, t = rng.randint(2, 50) * 100, rng.choice((2, 3, 4, 5, 6, 8)), rng.randint(1, 10)
    return f"How much simple interest does ${p} earn at {r}% per year over {t} years?"


def _m_squares(rng):
    a, b = rng.randint(5, 60), rng.randint(1, 40)
    return f"What is {a} squared minus {b} squared?"


def _m_packs(rng):
    k, n, m = rng.choice((6, 8, 10, 12)), rng.randint(10, 40), rng.randint(2, 5)
    return (f"Pencils are sold in packs of {k}. A teacher needs {m} pencils for each of {n} students. "
            "How many packs must she buy?")


def _m_stats(rng):
    values = sorted(rng.randint(1, 20) for _ in range(rng.randint(5, 9)))
    rng.shuffle(values)
    return f"Find the mean, the median and the mode of: {', '.join(map(str, values))}."


def _m_binary(rng):
    to_binary = f"Write {rng.randint(5, 255)} in binary."
    to_decimal = f"Convert the binary number {bin(rng.randint(5, 255))[2:]} to decimal."
    return rng.choice((to_binary, to_decimal))


def _m_percent(rng):
    a, b = rng.choice((5, 10, 12, 15, 20, 25, 35, 60, 75)), rng.randint(20, 800)
    return f"What is {a}% of {b}?"


def _m_age(rng):
    n1, n2 = rng.sample(NAMES, 2)
    a, d, k = rng.randint(5, 40), rng.randint(2, 30), rng.randint(2, 10)
    return (f"{n1} is {d} years older than {n2}. In {k} years their ages will add up to {2 * (a + k) + d}. "
            f"How old is {n2} now?")


def _m_speed_time(rng):
    d, v = rng.randint(5, 60) * 10, rng.randint(4, 12) * 10
    return f"A car needs to travel {d} km at an average speed of {v} km/h. How long will the trip take?"


def _m_triangle(rng):
    a, b = rng.randint(3, 20), rng.randint(3, 20)
    return f"A right triangle has legs of {a} cm and {b} cm. How long is its hypotenuse?"


MATH_GENERATORS = (
    _m_inventory, _m_distance, _m_discount, _m_arith, _m_linear, _m_average, _m_rectangle, _m_pages, _m_minutes,
    _m_recipe, _m_fraction, _m_sequence, _m_gcd, _m_prime, _m_tank, _m_workers, _m_sum_diff, _m_circle,
    _m_savings, _m_interest, _m_squares, _m_packs, _m_stats, _m_binary, _m_percent, _m_age, _m_speed_time,
    _m_triangle,
)


def math_prompt(rng: random.Random) -> tuple[str, str]:
    gen = rng.choice(MATH_GENERATORS)
    return gen.__name__.removeprefix("_m_"), gen(rng) + rng.choice(STEP_SUFFIXES)
