"""Text <-> token ids, with the model's chat template.

Backed by the `tokenizers` library; built from an HF `tokenizer.json` or from GGUF metadata.
Chat templates are rendered with jinja2 the same way transformers renders them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Sequence

from specjax.errors import SpecjaxError


@functools.lru_cache(maxsize=8)
def _compiled_chat_template(template: str):
    """The template compiled once: compiling costs about 9 ms, far more than rendering, and a data
    run renders tens of thousands of requests."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise SpecjaxError(f"chat template failed: {e}") from None


def _render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
    from jinja2.exceptions import TemplateError

    compiled = _compiled_chat_template(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
    except TemplateError as e:
        raise SpecjaxError(f"chat template failed: {e}") from None


@dataclasses.dataclass
class TextTokenizer:
    backend: "object"
    """A `tokenizers.Tokenizer`."""
    chat_template: str | None = None
    """Jinja chat template, or None for a base model."""
    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end generation."""
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool = False
    """Prepend the BOS id when encoding plain (non-chat) text."""
    bos_token_id: int | None = None
    post_processor_adds_specials: bool = False
    """The backend's own post-processor adds BOS (Llama-3-style tokenizer.json without add_bos_token)."""

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if add_special_tokens and self.post_processor_adds_specials:
            return self.backend.encode(text, add_special_tokens=True).ids
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict] | str, add_generation_prompt: bool = True) -> str:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if not self.chat_template:
            raise SpecjaxError("this model has no chat template; pass --no-chat to use the prompt as plain text")
        extra = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        return _render_chat_template(self.chat_template, messages, add_generation_prompt, extra)

    def encode_chat(self, messages: list[dict] | str, add_generation_prompt: bool = True) -> list[int]:
        # The template writes its own special tokens (and BOS where the model wants one).
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    @classmethod
    def from_hf_folder(cls, folder: str | Path, eos_token_ids: tuple[int, ...] = ()) -> "TextTokenizer":
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise SpecjaxError(f"{folder}: no tokenizer.json; use --prompt-ids to give token ids directly")
        try:
            backend = Tokenizer.from_file(str(path))
            cfg_path = folder / "tokenizer_config.json"
            cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        except Exception as e:  # tokenizers raises bare Exceptions on malformed files
            raise SpecjaxError(f"{folder}: cannot read the tokenizer ({e})") from None
        template = cfg.get("chat_template")
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.exists():
            template = jinja.read_text()
        token = lambda v: v.get("content") if isinstance(v, dict) else v
        bos, eos = token(cfg.get("bos_token")), token(cfg.get("eos_token"))
        if not eos_token_ids and eos is not None and backend.token_to_id(eos) is not None:
            eos_token_ids = (backend.token_to_id(eos),)
        return cls(
            backend=backend,
            chat_template=template,
            eos_token_ids=tuple(eos_token_ids),
            bos_token=bos,
            eos_token=eos,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            bos_token_id=backend.token_to_id(bos) if bos else None,
            post_processor_adds_specials="add_bos_token" not in cfg and backend.post_processor is not None,
        )

    def save(self, folder: str | Path) -> None:
        """tokenizer.json + tokenizer_config.json, readable by from_hf_folder and by transformers."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos_token,
        }
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def byte_level_bpe_from_vocab(tokens: list[str], merges: list[str], token_types: list[int] | None,
                              pre_tokenizer: str | None):
    """A byte-level BPE `tokenizers.Tokenizer` from a GGUF-style vocabulary.

    pre_tokenizer is llama.cpp's `tokenizer.ggml.pre`. "smollm" (and the StarCoder family it comes
    from) splits every digit on its own before the GPT-2 regex; that is how SmolLM2's own
    tokenizer.json is built, so numbers tokenize as the model was trained.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = set(bytes_to_unicode().values())
    vocab = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_tokenizer in ("smollm", "starcoder", "refact"):
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre_tokenizer in (None, "default", "gpt-2", "gpt2"):
        backend.pre_tokenizer = byte_level
    else:
        raise SpecjaxError(
            f"GGUF pre-tokenizer {pre_tokenizer!r} is not supported; supported: smollm, starcoder, gpt-2"
        )
    backend.decoder = decoders.ByteLevel()
    if token_types is not None:
        control = [t for t, kind in zip(tokens, token_types) if kind == 3 and set(t) <= alphabet]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return backend
