"""Multi-turn conversations: a first user turn from the chat, math or code templates, then one or two follow-up
turns written here. The assistant turns between them are the target's own greedy replies, produced by
generate.py turn by turn (a chat client sends the earlier replies back as text), so they are not stored here.

`followups(rng, kind)` returns (template names, follow-up user turns) for a first turn of the given kind.
"""

from __future__ import annotations

import random

GENERIC = (
    ("shorter", "Can you make that shorter?"),
    ("simpler", "Explain that again in simpler words."),
    ("example", "Can you give me a concrete example?"),
    ("more", "Thanks! What else should I know about this?"),
    ("table", "Can you put that in a table?"),
    ("bullets", "Now write it as a bulleted list."),
    ("why", "Why is that?"),
    ("key_point", "What is the single most important point here?"),
    ("second_point", "Can you explain the second point in more detail?"),
    ("summary", "Please add a two-sentence summary of your answer."),
    ("formal", "Great. Can you rewrite it in a more formal style?"),
    ("friendly", "Make it sound friendlier."),
    ("mistake", "What is a common mistake people make with this?"),
    ("beginner", "How would you explain this to a complete beginner?"),
    ("questions", "Give me three follow-up questions I could ask about this."),
    ("sources", "How could I check whether this is right?"),
    ("counter", "What would someone who disagrees say?"),
    ("steps", "Can you turn that into step-by-step instructions?"),
    ("analogy", "Can you explain it with an analogy?"),
    ("kid", "How would you explain this to a child?"),
)
MATH = (
    ("check", "Can you check that answer in a different way?"),
    ("double", "What would the answer be if all the numbers were doubled?"),
    ("first_step", "I did not follow the first step. Can you explain it again?"),
    ("formula", "Can you write this as a general formula?"),
    ("similar", "Give me a similar problem to practise, without the answer."),
    ("mental", "Is there a quick way to do this in my head?"),
    ("units", "Can you state the answer with its units and round it sensibly?"),
)
CODE = (
    ("comments", "Can you add comments to the code?"),
    ("tests", "Now write a few tests for it."),
    ("javascript", "How would you write the same thing in JavaScript?"),
    ("complexity", "What is the time complexity of that?"),
    ("empty_input", "What happens with empty input? Can you handle it?"),
    ("errors", "How should it report errors?"),
    ("shorter_code", "Can you make the code shorter?"),
    ("explain_code", "Can you explain how the code works, line by line?"),
)
BY_KIND = {"chat": (GENERIC,), "math": (MATH, GENERIC), "code": (CODE, GENERIC)}


def followups(rng: random.Random, kind: str) -> tuple[list[str], list[str]]:
    """One or two follow-up turns (two in two conversations of five), drawn without repeats."""
    pool = [f for group in BY_KIND[kind] for f in group]
    chosen = rng.sample(pool, 2 if rng.random() < 0.4 else 1)
    return [name for name, _ in chosen], [text for _, text in chosen]
