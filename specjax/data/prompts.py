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

DEMO_PROMPTS = (
    "Tell me a fun fact about octopuses.",
    "What should I pack for a weekend camping trip?",
    "Explain how a rainbow forms.",
    "Write a Python function that reverses a string.",
)
"""What `specjax demo` asks. Kept out of every held-out set, so evaluation never measures on them, and
chosen among ten candidates for answers that do not loop (SmolLM2's greedy answers score distinct-3
0.94, 0.95, 0.95 and 0.98 at 128 tokens): a looping answer is drafted perfectly and would overstate
tau (the demo prints distinct-3 beside tau, so that stays visible)."""

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


# Topics added when the first 1,000 everyday requests had been answered (2026-12-06). A topic that
# touches the held-out set (`touches_heldout`) is left out rather than trusted to this list.
_MORE_EVERYDAY_TOPICS = (
    "the Great Wall of China", "pyramids", "castles", "knights", "pirates", "the Vikings", "the Olympic Games",
    "the telephone", "the radio", "television", "cameras", "a microscope", "a telescope", "stars", "comets",
    "black holes", "the sun", "eclipses", "rockets", "astronauts", "satellites", "electric cars", "wind turbines",
    "nuclear energy", "plastic", "glass", "paper", "cotton", "wool", "silk", "chocolate", "cheese", "honey",
    "bananas", "potatoes", "tomatoes", "mushrooms", "salt", "sugar", "ice", "caves", "islands", "lakes",
    "waterfalls", "canyons", "the Arctic", "Antarctica", "the Amazon river", "the Sahara", "the Himalayas",
    "tigers", "lions", "giraffes", "zebras", "kangaroos", "koalas", "pandas", "bears", "foxes", "rabbits",
    "squirrels", "bats", "eagles", "parrots", "crows", "ants", "snails", "octopuses", "sharks", "whales",
    "turtles", "snakes", "camels", "goldfish", "soil", "trees", "flowers", "cactus plants", "seeds", "compost",
    "skateboarding", "basketball", "baseball", "hiking", "skiing", "board games", "video games", "jigsaw puzzles",
    "origami", "knitting", "pottery", "sculpture", "dance", "the theater", "movies", "comics", "novels",
    "newspapers", "the guitar", "drums", "the violin", "an orchestra", "jazz", "opera", "grammar",
    "punctuation", "dictionaries", "handwriting", "kindness", "courage", "curiosity", "teamwork", "leadership",
    "saving money", "taxes", "markets", "villages", "bridges", "tunnels", "skyscrapers", "traffic lights",
    "elevators", "the wheel", "engines", "electric motors", "computers", "keyboards", "smartphones",
    "algorithms", "binary search", "variables in programming", "loops in programming", "open source software",
    "the periodic table", "atoms", "molecules", "friction", "energy", "thermometers", "the human eye", "the lungs",
    "muscles", "blood", "skin", "DNA", "genes", "evolution", "fossils", "the Stone Age", "the Middle Ages",
    "the Renaissance", "the Industrial Revolution", "democracy", "elections", "the post office", "firefighters",
    "nurses", "teachers", "farmers", "architects", "engineers", "inventors",
)


def _everyday_space() -> list[str]:
    """Every distinct everyday request (template x topic), the held-out prompts left out."""
    held_out = set(HELDOUT_CHAT_PROMPTS)
    more = [x for x in _MORE_EVERYDAY_TOPICS if not touches_heldout(x)]
    found = dict.fromkeys(t.format(topic=x) for t in _EVERYDAY_TEMPLATES for x in _EVERYDAY_TOPICS + tuple(more))
    return [p for p in found if p not in held_out]


def everyday_capacity() -> int:
    """How many distinct everyday requests exist."""
    return len(_everyday_space())


def everyday_chat_prompts(count: int, seed: int = 0) -> list[str]:
    """count distinct everyday assistant requests (template x topic, drawn without repetition), never
    one of the held-out prompts. Greedy decoding answers a repeated request alike, so a repeat would
    add the same answer twice to a training set."""
    space = _everyday_space()
    if count > len(space):
        raise ValueError(f"at most {len(space)} distinct everyday requests exist; asked for {count}")
    return random.Random(seed).sample(space, count)


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


# ---- self-instruct: requests the target writes itself --------------------------------------------
# The target is asked to write a user's request (topic x kind of request x who asks); its answer,
# cleaned and filtered, becomes a training prompt. The topics avoid the held-out ones, and
# `touches_heldout` rejects any written request that drifts onto a held-out prompt anyway.
_SELF_INSTRUCT_TOPICS = _EVERYDAY_TOPICS + (
    "a vegetable garden", "saving money", "a job search", "public speaking", "a road trip", "moving house",
    "a first apartment", "time zones", "the stock market", "insurance", "taxes", "a budget spreadsheet", "podcasts",
    "video games", "board games", "knitting", "woodworking", "photography", "birdwatching", "hiking boots",
    "a tent", "a campfire", "fishing", "sailing", "surfing", "skiing", "ice skating", "basketball", "cricket",
    "the Olympics", "a marathon training plan", "stretching", "posture", "drinking water", "breakfast", "soup",
    "pasta", "pizza", "cheese", "chocolate", "spices", "baking cookies", "a slow cooker", "leftovers", "composting",
    "houseplants", "cacti", "tomatoes", "potatoes", "mushrooms", "sunflowers", "oak trees", "maple syrup", "honey",
    "ants", "squirrels", "rabbits", "parrots", "goldfish", "turtles", "sharks", "whales",
    "octopuses", "jellyfish", "the Arctic", "Antarctica", "the Sahara", "the Amazon river", "the Himalayas",
    "islands", "caves", "waterfalls", "lakes", "canals", "bridges", "skyscrapers", "castles", "pyramids",
    "the Great Wall of China", "Vikings", "samurai", "the Renaissance", "the Industrial Revolution", "the steam engine",
    "the telephone", "radio", "television", "cameras", "satellites", "rockets", "the International Space Station",
    "black holes", "comets", "eclipses", "telescopes", "microscopes", "atoms", "water vapour", "rust", "plastic",
    "glass", "paper", "cotton", "wool", "concrete", "steel", "electric cars", "buses", "traffic lights", "helmets",
    "first aid", "sunscreen", "allergies", "the common cold", "hand washing", "stress", "meditation", "journaling",
    "habits", "goal setting", "a to-do list", "a calendar", "email etiquette", "a meeting agenda", "a resume",
    "negotiating a salary", "teamwork", "leadership", "feedback", "a book club", "a short story",
    "a mystery novel", "science fiction", "comic books", "opera", "jazz", "the guitar", "drums", "singing",
    "dancing", "theatre", "film festivals", "street art", "sculpture", "pottery", "origami", "calligraphy",
    "a family tree", "grandparents", "siblings", "volunteering", "kindness", "gratitude",
    "learning to swim", "learning to drive", "a driving test", "a science fair", "homework", "exams", "a school trip",
    "a spelling bee", "geometry", "percentages", "probability", "statistics", "algebra", "calculus", "the metric system",
    "Roman numerals", "a queue", "a stack", "a binary tree", "graphs and networks", "regular expressions",
    "unit tests", "version control", "a web server", "HTML", "CSS", "a REST API", "JSON", "SQL joins",
    "a command line", "file permissions", "a text editor", "debugging", "a for loop", "variables", "functions",
    "classes and objects", "exceptions", "a dictionary in Python", "a shopping list app", "a password manager",
)
_SELF_INSTRUCT_ASKERS = (
    "a student", "a teacher", "a parent", "a traveller", "a nurse", "an engineer", "a shop owner", "a retiree",
    "a beginner programmer", "a farmer", "an artist", "a runner", "a cook", "a journalist", "a librarian",
    "a new employee", "a manager", "a scientist", "a child", "a musician",
)
_SELF_INSTRUCT_TEMPLATES = (
    "Write one question that {asker} might ask an AI assistant about {topic}. Reply with the question only.",
    "Write a request that {asker} might send to a helpful assistant about {topic}. Reply with the request only.",
    "Invent a short task about {topic} for an assistant, from {asker}: something to explain, write, list or compare. "
    "Reply with the task only.",
    "What is a practical question about {topic} that {asker} could ask? Write only the question.",
    "Write a message from {asker} asking for advice about {topic}. Reply with the message only.",
    "Write an instruction asking an assistant to write something creative about {topic} for {asker}. "
    "Reply with the instruction only.",
)

_STOPWORDS = frozenset(
    "a an the and or but if then than so to of in on at by for with from into about as is are was were be been being "
    "do does did doing have has had having i me my we our you your he she it its they them their this that these those "
    "what which who whom whose why how when where can could should would will shall may might must not no yes any "
    "some more most much many few very just also too only own same other such there here up down out over under "
    "again once all each both between through during before after above below off get got make made give given "
    "write short tell explain describe list three five good best way ways some something someone please help "
    "want need know like use used using let".split())


def self_instruct_capacity() -> int:
    """How many distinct self-instruct instructions exist (topics x templates x askers)."""
    return len(_SELF_INSTRUCT_TOPICS) * len(_SELF_INSTRUCT_TEMPLATES) * len(_SELF_INSTRUCT_ASKERS)


def self_instruct_requests(count: int, seed: int = 0) -> list[str]:
    """count distinct instructions that ask the target to write a user's request (topic x template x
    asker, drawn without repetition). Greedy decoding answers equal instructions alike, so they must differ."""
    space = self_instruct_capacity()
    if count > space:
        raise ValueError(f"at most {space} distinct self-instruct requests exist; asked for {count}")
    rng = random.Random(seed)
    picks = rng.sample(range(space), count)
    out = []
    for k in picks:
        topic, rest = divmod(k, len(_SELF_INSTRUCT_TEMPLATES) * len(_SELF_INSTRUCT_ASKERS))
        template, asker = divmod(rest, len(_SELF_INSTRUCT_ASKERS))
        out.append(_SELF_INSTRUCT_TEMPLATES[template].format(topic=_SELF_INSTRUCT_TOPICS[topic],
                                                             asker=_SELF_INSTRUCT_ASKERS[asker]))
    return out


# The subjects of the held-out chat prompts (and the 12 demo ones): a written request that names
# one is about a held-out topic, whatever its wording.
_HELDOUT_TOPIC_WORDS = frozenset(
    "wedding sticky residue jar onion limerick umbrella crocodile alligator bookshop backpack hiccup goosebump "
    "networking refrigerator fridge frog toad interview popcorn graduation wrinkly wrinkle neighbor neighbour pisa "
    "riddle notary yawn yawning procrastinate procrastinating procrastination puppy balloon france sea ocean hash "
    "sky cat tea exercise autumn photosynthesis climate vitamin".split())


def _normal(word: str) -> str:
    return word[:-1] if len(word) > 4 and word.endswith("s") and not word.endswith("ss") else word


def _content_words(text: str) -> set[str]:
    return {_normal(w) for w in re.findall(r"[a-z']+", text.lower()) if len(w) >= 3 and w not in _STOPWORDS}


def _word_runs(text: str, run: int) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + run]) for i in range(len(words) - run + 1)}


_HELDOUT_INDEX: dict[int, tuple[list[set[str]], set[tuple[str, ...]]]] = {}


def touches_heldout(prompt: str, shared_words: int = 2, run: int = 5) -> bool:
    """True when a prompt names a held-out topic, or shares a `run`-word sequence or `shared_words`
    content words with any held-out prompt (the 120 of the held-out set and the 12 demo ones):
    training on it would leak the evaluation."""
    if run not in _HELDOUT_INDEX:
        heldout = heldout_prompts() + list(HELDOUT_CHAT_PROMPTS)
        _HELDOUT_INDEX[run] = ([_content_words(h) for h in heldout],
                               set().union(*(_word_runs(h, run) for h in heldout)))
    heldout_words, heldout_runs = _HELDOUT_INDEX[run]
    mine = _content_words(prompt)
    return (bool(mine & _HELDOUT_TOPIC_WORDS) or bool(_word_runs(prompt, run) & heldout_runs)
            or any(len(mine & theirs) >= shared_words for theirs in heldout_words))


# "A teacher might ask: "...", "A cook could ask, "...", "A: "...": the request is the quoted part.
_QUOTED_AFTER_LEAD_IN = re.compile(r'^[^"“]{0,120}?[:,]\s*["“](?P<request>[^"“”]+)["”]?\s*$')
# The assistant talking about itself, or echoing the instruction, rather than writing a user's request.
_NOT_A_REQUEST = re.compile(
    r"^((i'm|i am) (a|an|here|so|very|glad|happy|excited|ready|sorry)|i'd be|as an ai|here's|here is|sure|certainly"
    r"|of course|great question|what a \w+ (question|idea)"
    r"|the (task|question|request|instruction) is)\b"
    r"|\b(helpful (ai|assistant)|smollm|an ai (designed|named|assistant)|practical question about"
    r"|explain, write, list|what brings you|welcome to my|i'm (so |very )?(glad|happy|excited|here))\b",
    re.IGNORECASE)
# How a user's request opens when it does not end in a question mark.
_REQUEST_OPENINGS = frozenset(
    "write explain list compare describe give suggest tell name create plan help summarize summarise recommend "
    "draft outline teach show compose design find make share provide translate rewrite can could please "
    "i'm i need i want i'd how what why which where when who is are should".split())


def clean_self_instruct(answer: str, min_chars: int = 15, max_chars: int = 400) -> str | None:
    """The request in a target's answer to a self-instruct instruction, or None when it has none:
    the first non-empty line, without a leading label ("Question:"), a lead-in ('A cook might ask:
    "...') or surrounding quotes. A line that is not one sentence-like request (a question, or one that
    opens like a request), that is the assistant talking about itself or echoing the instruction, or
    that touches a held-out prompt, is dropped."""
    for line in answer.splitlines():
        line = line.strip()
        if line:
            break
    else:
        return None
    line = re.sub(r"^(\*\*)?(question|request|task|message|instruction|prompt)( \d+)?\s*:\s*(\*\*)?\s*", "", line,
                  flags=re.IGNORECASE)
    line = re.sub(r"^[A-Z][a-z]+( [a-z]+)?:\s+", "", line)  # the asker as a speaker label ("Teacher: ...")
    quoted = _QUOTED_AFTER_LEAD_IN.match(line)
    if quoted:
        line = quoted.group("request")
    line = line.strip().strip('"“”').strip()
    if not min_chars <= len(line) <= max_chars or not re.search(r"[a-zA-Z]{3}", line):
        return None
    if line[-1] not in ".?!" or _NOT_A_REQUEST.search(line) or touches_heldout(line):
        return None
    words = re.findall(r"[a-z']+", line.lower())
    opening = " ".join(words[:2]) if words[:1] == ["i"] else (words[0] if words else "")
    if not line.endswith("?") and opening not in _REQUEST_OPENINGS:
        return None
    return line
