"""Chat prompts: a fixed held-out set for evaluation and demos, and training prompts built from the
training split of the corpora (so a drafter never sees the evaluation prompts)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Sequence

from specjax.data.corpora import Document

# Held out: never used to build training data. Everyday assistant requests, unlike the
# corpus-passage prompts below, so the evaluation measures transfer to chat.
HELDOUT_CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "How do I make a cup of tea?",
    "What are the benefits of regular exercise?",
    "Write a haiku about autumn leaves.",
    "Explain photosynthesis to a child.",
    "What is the difference between weather and climate?",
    "List five fruits that are high in vitamin C.",
)

DEMO_PROMPTS = HELDOUT_CHAT_PROMPTS[:4]

HELDOUT_SET = Path(__file__).with_name("heldout_prompts.jsonl")
"""120 held-out prompts, 30 each of chat, code, math and rewriting, written apart from every
training template and topic (tests/test_prompts.py checks the disjointness). Use it with
`specjax bench --prompts-file` (the path this names)."""
HELDOUT_CATEGORIES = ("chat", "code", "math", "rewrite")


def heldout_prompts(category: str | None = None) -> list[str]:
    """The held-out set's prompts, all or one category's, in file order."""
    if category is not None and category not in HELDOUT_CATEGORIES:
        raise ValueError(f"unknown held-out category {category!r}; choose from {', '.join(HELDOUT_CATEGORIES)}")
    entries = [json.loads(line) for line in HELDOUT_SET.read_text().splitlines() if line.strip()]
    return [e["prompt"] for e in entries if category is None or e["category"] == category]

_TEMPLATES_PROSE = (
    "Continue the following text:\n\n{passage}",
    "Summarize this passage in a few sentences:\n\n{passage}",
    "What is the main idea of this text?\n\n{passage}",
    "Rewrite this passage in simple modern English:\n\n{passage}",
    "Who might be speaking in this passage, and what do they want?\n\n{passage}",
    "Write a short story inspired by this passage:\n\n{passage}",
    "List three questions a reader might ask about this text:\n\n{passage}",
    "Explain this passage to a student:\n\n{passage}",
)
_TEMPLATES_CODE = (
    "Explain what this Python code does:\n\n{passage}",
    "Is there a bug in this code? Explain.\n\n{passage}",
    "Write a docstring for this code:\n\n{passage}",
)


def _passage(text: str, rng: random.Random, words: int) -> str:
    tokens = re.split(r"(\s+)", text)
    if len(tokens) <= 2 * words:
        return text.strip()
    start = rng.randrange(0, len(tokens) - 2 * words)
    return "".join(tokens[start : start + 2 * words]).strip()


def training_chat_prompts(documents: Sequence[Document], count: int, seed: int = 0,
                          passage_words: tuple[int, int] = (12, 45)) -> list[str]:
    """count chat prompts, each a template around a random passage of a training document."""
    if not documents:
        raise ValueError("no documents to build prompts from")
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        doc = rng.choice(documents)
        code = doc.corpus == "python_stdlib"
        template = rng.choice(_TEMPLATES_CODE if code else _TEMPLATES_PROSE)
        prompts.append(template.format(passage=_passage(doc.text, rng, rng.randint(*passage_words))))
    return prompts


# Everyday assistant requests for training: the held-out prompts' kind of request, on other topics.
# The held-out topics (France, the sea, hash tables, cooking, the sky, cats, tea, exercise, autumn
# leaves, photosynthesis, weather and climate, vitamin C) are deliberately absent.
_EVERYDAY_TOPICS = (
    "the moon", "volcanoes", "the ocean tides", "bees", "a rainbow", "the human heart", "gravity", "electricity",
    "the internet", "a bicycle", "chess", "the piano", "bread", "coffee", "rice", "apples", "elephants", "dolphins",
    "owls", "a forest", "the desert", "mountains", "rivers", "snow", "thunderstorms", "the solar system", "Mars",
    "dinosaurs", "the Roman Empire", "ancient Egypt", "the printing press", "trains", "airplanes", "a lighthouse",
    "friendship", "honesty", "patience", "sleep", "music", "painting", "libraries", "museums", "gardening",
    "recycling", "a compass", "maps", "clocks", "money", "banks", "a spreadsheet", "a database", "recursion",
    "a linked list", "sorting algorithms", "binary numbers", "encryption", "email", "passwords", "robots",
    "vaccines", "bacteria", "the immune system", "bones", "teeth", "the brain", "memory", "dreams", "the seasons",
    "spring", "winter", "a city park", "a farm", "cows", "horses", "wolves", "penguins", "spiders", "butterflies",
    "fish", "coral reefs", "the rain forest", "glaciers", "earthquakes", "wind", "solar power", "batteries",
    "magnets", "light", "sound", "colors", "triangles", "fractions", "prime numbers", "the alphabet", "poetry",
    "fairy tales", "a birthday party", "camping", "swimming", "running", "yoga", "football", "tennis", "a marathon",
)
_EVERYDAY_TEMPLATES = (
    "What is {topic}?",
    "Explain {topic} to a child.",
    "Write a short poem about {topic}.",
    "Write a haiku about {topic}.",
    "Give me three interesting facts about {topic}.",
    "Describe {topic} to someone who has never seen it.",
    "Why is {topic} important?",
    "List five things you know about {topic}.",
    "Tell me a short story about {topic}.",
    "What are the advantages and disadvantages of {topic}?",
    "How would you teach a friend about {topic}?",
    "Summarize what people should know about {topic}.",
)


def everyday_chat_prompts(count: int, seed: int = 0) -> list[str]:
    """count everyday assistant requests (template x topic), never one of the held-out prompts."""
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        prompt = rng.choice(_EVERYDAY_TEMPLATES).format(topic=rng.choice(_EVERYDAY_TOPICS))
        if prompt not in HELDOUT_CHAT_PROMPTS:
            prompts.append(prompt)
    return prompts


# Templated math word problems and code tasks for training. The held-out set
# (specjax/data/heldout_prompts.jsonl) avoids these scenarios and tasks; tests/test_prompts.py checks
# that no held-out prompt shares a long word run with any of them.
_NAMES = ("Amir", "Bea", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Juno", "Kofi", "Lena", "Mateo",
          "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tova")
_ITEMS = ("marbles", "stickers", "pencils", "stamps", "cards", "coins", "buttons", "shells", "beads", "crayons")
_MATH_TEMPLATES = (
    "{name} has {a} {item}. They buy {b} more and give away {c}. How many {item} do they have now? "
    "Explain your steps.",
    "A shop sells {item} at {p} dollars each. How much do {n} {item} cost? Show your work.",
    "A train travels at {v} kilometres per hour for {t} hours. How far does it go?",
    "What is {a} multiplied by {b}? Explain how you worked it out.",
    "{name} reads {p} pages a day. How many days does it take to read a {big}-page book?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and its perimeter?",
    "If {n} workers build a wall in {t} days, how long would {m} workers take at the same pace?",
    "What is {pct}% of {big}? Explain the calculation.",
    "{name} saves {p} dollars every week. How many weeks until they have {big} dollars?",
    "A box holds {n} rows of {m} {item}. How many {item} are in {t} boxes?",
)
_CODE_TASKS = (
    "reverses a string", "counts the vowels in a word", "returns the largest number in a list",
    "checks whether a number is even", "removes duplicates from a list while keeping their order",
    "computes the factorial of n", "checks whether a word is a palindrome", "returns the n-th Fibonacci number",
    "sums the digits of an integer", "converts Celsius to Fahrenheit", "counts the words in a sentence",
    "merges two sorted lists into one sorted list", "finds the second smallest item in a list",
    "capitalizes the first letter of every word", "flattens a nested list", "returns the average of a list of numbers",
    "checks whether a year is a leap year", "counts the lines of a text file",
    "finds the greatest common divisor of two numbers", "rotates a list by k positions",
)
_CODE_TEMPLATES = (
    "Write a Python function that {task}.",
    "Write a Python function that {task}, and explain how it works.",
    "How would you write code that {task} in Python? Give an example.",
    "Write a unit test for a Python function that {task}.",
    "Write a JavaScript function that {task}.",
)


def math_word_prompts(count: int, seed: int = 0) -> list[str]:
    """count templated arithmetic word problems with random names, items and numbers."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        a, b = rng.randint(3, 60), rng.randint(2, 40)
        prompts.append(rng.choice(_MATH_TEMPLATES).format(
            name=rng.choice(_NAMES), item=rng.choice(_ITEMS), a=a, b=b, c=rng.randint(1, a + b - 1),
            p=rng.randint(2, 25), n=rng.randint(2, 12), m=rng.randint(2, 12), v=rng.randint(40, 200),
            t=rng.randint(2, 9), pct=rng.choice((5, 10, 15, 20, 25, 40, 50, 75)), big=rng.randint(100, 900)))
    return prompts


def code_task_prompts(count: int, seed: int = 0) -> list[str]:
    """count templated small programming requests."""
    rng = random.Random(seed)
    return [rng.choice(_CODE_TEMPLATES).format(task=rng.choice(_CODE_TASKS)) for _ in range(count)]
