"""Retrieval for RAPID drafting: the Flax BERT against transformers' BertModel on the same weights,
the real MiniLM-L6 encoder, chunking, selection within a budget in document order, BM25, and the
index cache keyed by content."""

from __future__ import annotations

import numpy as np
import pytest

from specjax.data.retrieval import IndexCache, RetrievalConfig, chunk_bounds
from specjax.errors import SpecjaxError


def _hf_bert(config_kwargs, seed=0):
    import torch
    from transformers import BertConfig as HFBertConfig, BertModel

    torch.manual_seed(seed)
    model = BertModel(HFBertConfig(**config_kwargs), add_pooling_layer=False).eval()
    return model, {k: v.detach().numpy() for k, v in model.state_dict().items()}


def test_the_flax_bert_matches_transformers_bert_model_on_the_same_weights():
    """A random 3-layer BERT with padding in the batch: last_hidden_state agrees on real tokens."""
    import jax.numpy as jnp
    import torch

    from specjax.io.encoder import bert_params_from_hf
    from specjax.models.bert import BertConfig, encode_states

    shape = dict(vocab_size=97, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, intermediate_size=96,
                 max_position_embeddings=64)
    model, tensors = _hf_bert(shape)
    config = BertConfig(**shape)
    ids = np.random.default_rng(0).integers(1, 97, (3, 11)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 7:], mask[2, 3:] = 0, 0
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(ids, dtype=torch.long),
                         attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    got = np.asarray(encode_states(bert_params_from_hf(tensors, config), config, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(got[real] - expected[real]).max() < 2e-5
    # A broken mapping (value and attention output swapped in one layer) is caught by the same comparison.
    broken = bert_params_from_hf(tensors, config)
    layer = broken["layer_1"]
    layer["value"], layer["attention_out"] = layer["attention_out"], layer["value"]
    bad = np.asarray(encode_states(broken, config, jnp.asarray(ids), jnp.asarray(mask)))
    assert np.abs(bad[real] - expected[real]).max() > 1e-2


@pytest.fixture(scope="module")
def minilm():
    from specjax.io.encoder import load_sentence_encoder

    return load_sentence_encoder()


def test_minilm_embeds_as_sentence_transformers_does_and_ranks_by_meaning(minilm):
    """The real MiniLM-L6 weights: our pooled, normalised embeddings equal transformers' BertModel
    mean-pooled over the same WordPiece ids; and similar sentences score higher than unrelated ones."""
    import torch
    from safetensors.numpy import load_file
    from transformers import BertConfig as HFBertConfig, BertModel

    from specjax.io.encoder import fetch_minilm

    texts = ["The cat sat on the mat.", "A kitten is sitting on a rug.", "Stock markets fell sharply on Monday.",
             "Thou shalt not kill. " * 80]  # the last is truncated to 256 WordPiece tokens
    got = minilm.encode(texts)
    assert got.shape == (4, 384) and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)

    folder = fetch_minilm()
    import json

    model = BertModel(HFBertConfig(**json.loads((folder / "config.json").read_text())), add_pooling_layer=False)
    model.load_state_dict({k: torch.tensor(v) for k, v in load_file(folder / "model.safetensors").items()
                           if not k.startswith("pooler.")}, strict=False)
    model.eval()
    ids = minilm.token_ids(texts)
    assert len(ids[3]) == 256 and ids[3][0] == 101 and ids[3][-1] == 102  # [CLS] ... [SEP], truncated
    for text_ids, vector in zip(ids, got):
        with torch.no_grad():
            states = model(input_ids=torch.tensor([text_ids])).last_hidden_state[0].numpy()
        pooled = states.mean(0)
        assert np.abs(vector - pooled / np.linalg.norm(pooled)).max() < 1e-5
    cosine = got @ got.T
    assert cosine[0, 1] > 0.5 > cosine[0, 2] and cosine[0, 1] > cosine[1, 2]


def test_chunks_cover_the_document_without_overlap():
    assert chunk_bounds(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(8, 4) == [(0, 4), (4, 8)]
    with pytest.raises(SpecjaxError, match="chunk_tokens"):
        RetrievalConfig(chunk_tokens=0)
    with pytest.raises(SpecjaxError, match="unknown retriever"):
        RetrievalConfig(retriever="tfidf")


WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def _document(needle_chunk: int, chunks: int = 12, chunk_words: int = 8):
    """Word ids (one token per word) of a filler document with a needle sentence in one chunk."""
    rng = np.random.default_rng(1)
    words = [WORDS[i] for i in rng.integers(0, len(WORDS), chunks * chunk_words)]
    needle = "the secret password is marmalade".split()
    start = needle_chunk * chunk_words
    words[start : start + len(needle)] = needle
    vocab = sorted(set(words) | {"\n\n"})
    return [vocab.index(w) for w in words], lambda ids: " ".join(vocab[i] for i in ids), vocab.index("\n\n")


def test_bm25_finds_the_needle_and_selection_keeps_document_order_within_the_budget():
    document, decode, blank = _document(needle_chunk=7)
    cache = IndexCache()
    config = RetrievalConfig(retriever="bm25", chunk_tokens=8, budget_tokens=17, min_score=0.0)
    index = cache.get_or_build(document, decode, config)
    assert len(index.bounds) == 12 and 0 < index.build_seconds < 60
    picked = index.select("what is the secret password", config, separator=[blank])
    assert picked.chunks == [7] and picked.token_ids == index.chunk_ids(7)  # no other chunk shares a term
    # Two matching chunks and one separator fill the 17 tokens, in document order.
    both = index.select("secret password golf", config, separator=[blank])
    assert len(both.chunks) == 2 and 7 in both.chunks and both.chunks == sorted(both.chunks)
    first = index.chunk_ids(both.chunks[0])
    assert both.token_ids == first + [blank] + index.chunk_ids(both.chunks[1])
    only = index.select("the secret password", RetrievalConfig(retriever="bm25", chunk_tokens=8, top_k=1))
    assert only.chunks == [7] and only.token_ids == index.chunk_ids(7)
    assert index.select("zzzz qqqq", config).chunks == []  # no shared term: nothing passes the threshold


def test_the_index_is_built_once_per_document_and_retriever():
    document, decode, _ = _document(needle_chunk=2)
    cache = IndexCache(capacity=2)
    bm25 = RetrievalConfig(retriever="bm25", chunk_tokens=8)
    first = cache.get_or_build(document, decode, bm25)
    assert cache.get_or_build(list(document), decode, RetrievalConfig(retriever="bm25", chunk_tokens=8,
                                                                       budget_tokens=8)) is first
    assert cache.get_or_build(document, decode, RetrievalConfig(retriever="bm25", chunk_tokens=4)) is not first
    assert (cache.hits, cache.misses) == (1, 2)
    other, _, _ = _document(needle_chunk=5)
    cache.get_or_build(other, decode, bm25)  # a third index: the least recently used goes
    assert cache.get_or_build(document, decode, bm25) is not first
    with pytest.raises(SpecjaxError, match="empty"):
        cache.get_or_build([], decode, bm25)
    with pytest.raises(SpecjaxError, match="needs a sentence encoder"):
        cache.get_or_build(document, decode, RetrievalConfig(retriever="minilm", chunk_tokens=8))


def test_dense_retrieval_with_minilm_finds_the_passage_about_the_question(minilm):
    passages = ["The committee met on Tuesday to discuss the annual budget and approved new spending.",
                "Photosynthesis converts light energy into chemical energy stored in glucose.",
                "The river flooded the village after three days of heavy rain.",
                "Mozart composed his first symphony at the age of eight."]
    document = list(range(len(passages)))  # one token per passage: chunks of 1 are the passages
    cache = IndexCache()
    config = RetrievalConfig(retriever="minilm", chunk_tokens=1, budget_tokens=1, min_score=0.2)
    index = cache.get_or_build(document, lambda ids: " ".join(passages[i] for i in ids), config, encoder=minilm)
    assert index.select("How do plants make sugar from sunlight?", config).chunks == [1]
    assert index.select("When did the young composer write music?", config).chunks == [3]
    assert index.select("quarterly semiconductor tariffs", config).chunks == []  # below the cosine threshold


def test_a_chat_gets_the_document_before_its_last_user_message():
    from specjax.data.retrieval import long_context_prompt

    class Echo:  # renders messages as text, so the test reads where the document went
        def encode(self, text, add_special_tokens=True):
            return list(text.encode()) if isinstance(text, str) else list(repr(text).encode())

        def encode_chat(self, messages):
            return list(repr(messages).encode())

        def decode(self, ids):
            return bytes(ids).decode()

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "hi"}, {"role": "user", "content": "who won?"}]
    built = long_context_prompt(Echo(), "DOC", messages, chat=True)
    want = messages[:3] + [{"role": "user", "content": "DOC\n\nwho won?"}]
    assert bytes(built.full).decode() == repr(want)
    with pytest.raises(SpecjaxError, match="last user message"):
        long_context_prompt(Echo(), "DOC", messages[:1])
    with pytest.raises(SpecjaxError, match="chat template"):
        long_context_prompt(Echo(), "DOC", messages, chat=False)


def test_the_retrieval_view_shows_every_chunk_its_score_and_the_pick():
    from specjax.data.retrieval import retrieval_view

    class Words:  # one token per word of the filler document (see _document)
        def __init__(self):
            self.vocab = []

        def encode(self, text, add_special_tokens=True):
            words = text.replace("\n\n", " \n\n ").split(" ")
            for w in words:
                if w and w not in self.vocab:
                    self.vocab.append(w)
            return [self.vocab.index(w) for w in words if w]

        def encode_chat(self, messages):
            return self.encode(messages[-1]["content"])

        def decode(self, ids):
            return " ".join(self.vocab[i] for i in ids)

    ids, decode, _ = _document(needle_chunk=4)
    text = decode(ids)
    config = RetrievalConfig(retriever="bm25", chunk_tokens=8, budget_tokens=8, min_score=0.0)
    cache = IndexCache()
    view = retrieval_view(Words(), text, "what is the secret password", config, cache, chat=False)
    assert len(view.chunks) == 12 and view.scores.shape == (12,)
    assert view.selected == [4] and "marmalade" in view.chunks[4]
    assert int(np.argmax(view.scores)) == 4 and view.min_score == 0.0
    assert "retrieved 1 of 12 chunks" in view.summary
    assert (cache.misses, cache.hits) == (1, 1)  # the view reads the index the prompt built


def test_a_long_task_knows_its_answer():
    from specjax.data.longbench import LongTask

    task = LongTask("needle", "ctx", "q?", "blue heron", 3, "austen")
    assert task.answered_by("The passphrase is: blue heron.") and not task.answered_by("red fox")
