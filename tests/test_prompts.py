"""Training prompts never include the held-out evaluation prompts, and are reproducible."""

import re

from specjax.data.corpora import Document
from specjax.data.prompts import HELDOUT_CHAT_PROMPTS, everyday_chat_prompts, training_chat_prompts


def test_everyday_prompts_exclude_the_held_out_ones_and_are_reproducible():
    prompts = everyday_chat_prompts(3000, seed=4)
    assert len(prompts) == 3000 and not set(prompts) & set(HELDOUT_CHAT_PROMPTS)
    assert prompts == everyday_chat_prompts(3000, seed=4)
    assert prompts != everyday_chat_prompts(3000, seed=5)
    # The held-out prompts' topics are absent too, not just their exact wording.
    for topic in ("sea", "cat", "tea", "photosynthesis", "hash table", "France", "vitamin"):
        assert not any(re.search(rf"\b{topic}\b", p) for p in prompts), topic


def test_corpus_passage_prompts_quote_their_documents():
    docs = [Document("austen", "Emma", "word " * 400), Document("python_stdlib", "os.py", "import os\n" * 200)]
    prompts = training_chat_prompts(docs, 50, seed=1)
    assert len(prompts) == 50 and prompts == training_chat_prompts(docs, 50, seed=1)
    assert all("word" in p or "import os" in p for p in prompts)
