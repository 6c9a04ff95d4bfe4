"""Training prompts never include the held-out evaluation prompts, and are reproducible."""

import re

import pytest

from specjax.data.corpora import Document
from specjax.data.prompts import HELDOUT_CHAT_PROMPTS, everyday_capacity, everyday_chat_prompts, training_chat_prompts


def test_everyday_prompts_are_distinct_exclude_the_held_out_ones_and_are_reproducible():
    every = everyday_capacity()
    prompts = everyday_chat_prompts(every, seed=4)
    assert len(set(prompts)) == every > 1000 and not set(prompts) & set(HELDOUT_CHAT_PROMPTS)
    assert prompts == everyday_chat_prompts(every, seed=4)
    assert prompts != everyday_chat_prompts(every, seed=5)
    assert len(set(everyday_chat_prompts(400, seed=1))) == 400
    with pytest.raises(ValueError, match=f"at most {every} distinct"):
        everyday_chat_prompts(every + 1)
    # The held-out prompts' topics are absent too, not just their exact wording.
    for topic in ("sea", "cat", "tea", "photosynthesis", "hash table", "France", "vitamin"):
        assert not any(re.search(rf"\b{topic}\b", p) for p in prompts), topic


def test_corpus_passage_prompts_quote_their_documents():
    docs = [Document("austen", "Emma", "word " * 400), Document("python_stdlib", "os.py", "import os\n" * 200)]
    prompts = training_chat_prompts(docs, 50, seed=1)
    assert len(prompts) == 50 and prompts == training_chat_prompts(docs, 50, seed=1)
    assert all("word" in p or "import os" in p for p in prompts)


def test_math_and_code_prompts_are_reproducible_and_varied():
    from specjax.data.prompts import code_task_prompts, math_word_prompts

    math = math_word_prompts(500, seed=3)
    assert math == math_word_prompts(500, seed=3) and math != math_word_prompts(500, seed=4)
    assert len(set(math)) > 450 and all(re.search(r"\d", p) for p in math)
    code = code_task_prompts(300, seed=3)
    assert code == code_task_prompts(300, seed=3) and len(set(code)) > 60


def _word_runs(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_the_heldout_set_is_disjoint_from_every_training_prompt_kind():
    from specjax.data import prompts as p

    heldout = p.heldout_prompts()
    assert len(heldout) >= 100 and len(set(heldout)) == len(heldout)
    assert all(len(p.heldout_prompts(c)) == 30 for c in p.HELDOUT_CATEGORIES)
    training = p.everyday_chat_prompts(p.everyday_capacity(), seed=0) + p.math_word_prompts(3000, seed=0) + p.code_task_prompts(1000, 0)
    seen = set().union(*(_word_runs(t) for t in training))
    openings = [t.split("{")[0].strip() for t in p._TEMPLATES_PROSE + p._TEMPLATES_CODE + p._CODE_TEMPLATES]
    for prompt in heldout:
        assert not _word_runs(prompt) & seen, f"shares an 8-word run with a training prompt: {prompt!r}"
        assert not any(prompt.startswith(o) for o in openings), f"opens like a training template: {prompt!r}"
        assert prompt not in HELDOUT_CHAT_PROMPTS
    assert not set(p.DEMO_PROMPTS) & (set(heldout) | set(HELDOUT_CHAT_PROMPTS))  # the demo measures no held-out prompt


def test_self_instruct_instructions_are_distinct_and_reproducible():
    from specjax.data.prompts import self_instruct_requests

    first = self_instruct_requests(2000, seed=2)
    assert len(set(first)) == 2000 and first == self_instruct_requests(2000, seed=2)
    assert first != self_instruct_requests(2000, seed=3)
    import pytest

    with pytest.raises(ValueError, match="distinct"):
        self_instruct_requests(10**7)


def test_a_written_request_is_cleaned_and_one_that_touches_the_held_out_set_is_dropped():
    from specjax.data import prompts as p

    assert p.clean_self_instruct('Question: "How do volcanoes form?"\nThey form when...') == "How do volcanoes form?"
    assert p.clean_self_instruct("**Request:** Can you list five fun facts about whales?") == \
        "Can you list five fun facts about whales?"
    assert p.clean_self_instruct("Sure") is None and p.clean_self_instruct("\n\n") is None
    assert p.clean_self_instruct("Here is a question about bees that goes on and on") is None  # no sentence end
    # Every held-out prompt, and rewordings of their subjects, are refused.
    for prompt in p.heldout_prompts() + list(HELDOUT_CHAT_PROMPTS):
        assert p.touches_heldout(prompt), prompt
    for reworded in ("Why do onions make you cry?", "How do I get rid of hiccups fast?",
                     "What is a good way to start learning a new language as a grown-up?",
                     "Write a funny poem about a lost umbrella."):
        assert p.clean_self_instruct(reworded) is None, reworded
    for fine in ("How can I keep my houseplants alive in winter?", "Explain recursion with a Python example.",
                 "What should a beginner know before running a marathon?"):
        assert p.clean_self_instruct(fine) == fine
    # Lead-ins and speaker labels go; the quoted request stays.
    assert p.clean_self_instruct('A cook might ask: "What is the best way to store fresh herbs?') == \
        "What is the best way to store fresh herbs?"
    assert p.clean_self_instruct('What a lovely idea! A runner could ask, "How should I pace a 10k race?"') == \
        "How should I pace a 10k race?"
    assert p.clean_self_instruct("Teacher: How can I explain fractions with pizza?") == \
        "How can I explain fractions with pizza?"
    assert p.clean_self_instruct("I'm looking for advice on pruning apple trees.") == \
        "I'm looking for advice on pruning apple trees."
    for not_a_request in (
            "A teacher might send a request like this:",  # the request never comes
            "I'm a helpful AI designed to assist with gardening. What can I help you with today?",
            "I'm so glad you asked about knitting. Let me know what you need!",
            "What is a practical question about bees that a student could ask?",  # the instruction echoed
            "The task is to explain, write, list, or compare a vegetable garden.",
            "The piano is a magical instrument that has inspired people for centuries."):  # no request at all
        assert p.clean_self_instruct(not_a_request) is None, not_a_request
