"""A small reader for R's serialization format, in pure Python.

R packages ship their data sets in three containers, all built on the same
serialization stream (``serialize()`` in R, documented in R Internals §1.8):

* ``.rds`` — one serialized object, usually gzip-compressed (``readRDS``);
* ``.rda`` / ``.RData`` — the magic ``RDX2\\n`` / ``RDX3\\n`` followed by a
  serialized pairlist of ``name = value`` bindings, the whole file gzip,
  bzip2 or xz compressed (``load``);
* lazy-load databases ``Rdata.rdb`` + ``Rdata.rdx`` — the ``.rdx`` is an
  ``.rds`` holding ``list(variables=, references=, compressed=)``, where each
  variable maps to an integer ``c(offset, length)`` into the ``.rdb``; each
  ``.rdb`` entry is a 4-byte big-endian uncompressed length followed by the
  compressed serialized object.

R itself is not available on the machines this project runs on, so this
module reads those containers directly. It supports the XDR (big-endian)
stream, format versions 2 and 3, and the object types that data sets are made
of: character, integer, double, logical, complex and raw vectors, generic
vectors (lists, data frames, tibbles), pairlists with attributes, symbols,
references, and the ALTREP compact sequences and wrappers that R ≥ 3.5 writes.
Environments and persistent references are read only as far as needed to step
over them; closures and byte code are not expected in data and are rejected.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "NA_INTEGER",
    "RDataError",
    "RObject",
    "LazyLoadDatabase",
    "unserialize",
    "read_rds",
    "read_rda",
    "decompress_r_file",
    "factor_labels",
    "data_frame_columns",
    "as_python",
]

#: R's integer NA is the most negative 32-bit integer.
NA_INTEGER = -(2**31)

# SEXP type codes (Rinternals.h).
NILSXP = 0
SYMSXP = 1
LISTSXP = 2
CLOSXP = 3
ENVSXP = 4
PROMSXP = 5
LANGSXP = 6
SPECIALSXP = 7
BUILTINSXP = 8
CHARSXP = 9
LGLSXP = 10
INTSXP = 13
REALSXP = 14
CPLXSXP = 15
STRSXP = 16
DOTSXP = 17
VECSXP = 19
EXPRSXP = 20
BCODESXP = 21
EXTPTRSXP = 22
WEAKREFSXP = 23
RAWSXP = 24
S4SXP = 25

# Pseudo-types that exist only in the serialization stream (serialize.c).
REFSXP = 255
NILVALUE_SXP = 254
GLOBALENV_SXP = 253
UNBOUNDVALUE_SXP = 252
MISSINGARG_SXP = 251
BASENAMESPACE_SXP = 250
NAMESPACESXP = 249
PACKAGESXP = 248
PERSISTSXP = 247
EMPTYENV_SXP = 242
BASEENV_SXP = 241
ATTRLANGSXP = 240
ATTRLISTSXP = 239
ALTREP_SXP = 238

# Bits of the 32-bit flags word that precedes every item.
_HAS_ATTR_BIT = 1 << 9
_HAS_TAG_BIT = 1 << 10

# CHARSXP encoding bits, stored in the "levels" field (flags >> 12).
_BYTES_MASK = 1 << 1
_LATIN1_MASK = 1 << 2
_UTF8_MASK = 1 << 3
_ASCII_MASK = 1 << 6

_VECTOR_TYPE_NAMES = {
    LGLSXP: "logical",
    INTSXP: "integer",
    REALSXP: "double",
    CPLXSXP: "complex",
    STRSXP: "character",
    VECSXP: "list",
    EXPRSXP: "expression",
    RAWSXP: "raw",
}

_SINGLETON_TYPE_NAMES = {
    NILVALUE_SXP: "NULL",
    GLOBALENV_SXP: "globalenv",
    UNBOUNDVALUE_SXP: "unbound",
    MISSINGARG_SXP: "missing_arg",
    BASENAMESPACE_SXP: "base_namespace",
    EMPTYENV_SXP: "emptyenv",
    BASEENV_SXP: "baseenv",
}


class RDataError(ValueError):
    """The bytes are not an R serialization stream this reader understands."""


@dataclass
class RObject:
    """One R value.

    ``rtype`` is R's ``typeof()`` name (``"character"``, ``"integer"``,
    ``"double"``, ``"logical"``, ``"list"``, ``"pairlist"``, ``"symbol"``,
    ``"environment"``, ``"NULL"``, …). ``values`` holds the elements:

    * character: ``str`` or ``None`` for ``NA_character_``;
    * integer / logical: ``int`` or ``None`` for ``NA`` (logicals as ``bool``);
    * double: ``float`` (``NA_real_`` and ``NaN`` both become ``nan``);
    * list / expression: ``RObject`` elements;
    * pairlist / language: ``RObject`` elements, their tags in ``tags``;
    * symbol: a one-element list with the symbol's name;
    * raw: a one-element list holding ``bytes``.

    ``attributes`` maps attribute names (``names``, ``class``, ``levels``,
    ``row.names``, …) to ``RObject`` values, in the order R wrote them.
    """

    rtype: str
    values: list[Any] = field(default_factory=list)
    attributes: dict[str, "RObject"] = field(default_factory=dict)
    tags: list[str | None] | None = None
    #: For a dotted pair (a cons cell whose CDR is not a pairlist, as in the
    #: states of ALTREP wrappers) the final CDR; ``None`` for proper lists.
    tail: "RObject | None" = None

    def __len__(self) -> int:
        return len(self.values)

    def attribute_strings(self, name: str) -> list[str | None] | None:
        """A character attribute such as ``names`` or ``class``, or ``None``."""
        value = self.attributes.get(name)
        if value is None or value.rtype != "character":
            return None
        return list(value.values)

    @property
    def names(self) -> list[str | None] | None:
        """``names(x)``; for pairlists, the tags."""
        names = self.attribute_strings("names")
        if names is None and self.tags is not None:
            return list(self.tags)
        return names

    @property
    def classes(self) -> list[str]:
        """``class(x)`` as written; empty when the object has no class attribute."""
        return [c for c in (self.attribute_strings("class") or []) if c is not None]

    def is_factor(self) -> bool:
        return self.rtype == "integer" and "factor" in self.classes

    def is_data_frame(self) -> bool:
        return self.rtype == "list" and "data.frame" in self.classes

    def __getitem__(self, key: int | str) -> Any:
        """Element by position, or by name for named lists and pairlists."""
        if isinstance(key, str):
            names = self.names
            if names is None or key not in names:
                raise KeyError(f"R {self.rtype} has no element named {key!r}")
            return self.values[names.index(key)]
        return self.values[key]


@dataclass
class _Header:
    version: int
    native_encoding: str


class _StreamReader:
    """Reads one XDR serialization stream (R Internals §1.8, serialize.c)."""

    def __init__(self, data: bytes):
        self._buffer = memoryview(data)
        self._position = 0
        # REFSXP items point back into this table, 1-based, in the order the
        # referenced symbols/environments were first written.
        self._references: list[RObject] = []
        self.header = self._read_header()

    # -- primitive reads ---------------------------------------------------
    def _take(self, size: int) -> memoryview:
        end = self._position + size
        if end > len(self._buffer):
            raise RDataError(
                f"R stream truncated: wanted {size} bytes at offset {self._position}, "
                f"only {len(self._buffer) - self._position} left"
            )
        chunk = self._buffer[self._position : end]
        self._position = end
        return chunk

    def _int(self) -> int:
        (value,) = struct.unpack(">i", self._take(4))
        return value

    def _length(self) -> int:
        length = self._int()
        if length == -1:
            # Long vectors (>= 2^31 elements) store the length as two ints.
            upper, lower = self._int(), self._int()
            return (upper << 32) + (lower & 0xFFFFFFFF)
        if length < 0:
            raise RDataError(f"negative vector length {length} in R stream")
        return length

    def _read_header(self) -> _Header:
        magic = bytes(self._take(2))
        if magic != b"X\n":
            kinds = {b"A\n": "ASCII", b"B\n": "native binary"}
            kind = kinds.get(magic, f"unknown ({magic!r})")
            raise RDataError(f"only XDR R serialization is supported, found {kind} format")
        version = self._int()
        if version not in (2, 3):
            raise RDataError(f"unsupported R serialization format version {version}")
        self._int()  # R version that wrote the stream
        self._int()  # oldest R version able to read it
        native_encoding = "UTF-8"
        if version == 3:
            native_encoding = bytes(self._take(self._int())).decode("ascii", "replace")
        return _Header(version=version, native_encoding=native_encoding)

    # -- items ---------------------------------------------------------------
    def read_item(self) -> RObject:
        flags = self._int()
        sexp_type = flags & 0xFF
        levels = flags >> 12
        has_attributes = bool(flags & _HAS_ATTR_BIT)
        has_tag = bool(flags & _HAS_TAG_BIT)

        if sexp_type in _SINGLETON_TYPE_NAMES:
            return RObject(_SINGLETON_TYPE_NAMES[sexp_type])
        if sexp_type == REFSXP:
            index = flags >> 8
            if index == 0:
                index = self._int()
            if not 1 <= index <= len(self._references):
                raise RDataError(f"R stream refers to unknown reference #{index}")
            return self._references[index - 1]
        if sexp_type == PERSISTSXP:
            # A hook-provided reference (lazy-load databases use these for
            # environments); the key is kept so callers can resolve it.
            key = self._read_persistent_names()
            obj = RObject("persistent_reference", key)
            self._references.append(obj)
            return obj
        if sexp_type == SYMSXP:
            name = self.read_item()
            obj = RObject("symbol", [name.values[0] if name.values else None])
            self._references.append(obj)
            return obj
        if sexp_type in (PACKAGESXP, NAMESPACESXP):
            obj = RObject("environment", self._read_persistent_names(), tags=None)
            self._references.append(obj)
            return obj
        if sexp_type == ENVSXP:
            return self._read_environment()
        if sexp_type in (LISTSXP, LANGSXP, CLOSXP, PROMSXP, DOTSXP, ATTRLANGSXP, ATTRLISTSXP):
            return self._read_pairlist(sexp_type, has_attributes, has_tag)
        if sexp_type == ALTREP_SXP:
            return self._read_altrep()
        if sexp_type == CHARSXP:
            return RObject("char", [self._read_charsxp_body(levels)])
        if sexp_type in (SPECIALSXP, BUILTINSXP):
            name = bytes(self._take(self._int())).decode("ascii", "replace")
            return RObject("builtin", [name])
        if sexp_type in (EXTPTRSXP, WEAKREFSXP):
            obj = RObject("externalptr" if sexp_type == EXTPTRSXP else "weakref")
            self._references.append(obj)
            if sexp_type == EXTPTRSXP:
                self.read_item()  # protected value
                self.read_item()  # tag
        elif sexp_type == S4SXP:
            obj = RObject("S4")
        elif sexp_type in _VECTOR_TYPE_NAMES:
            obj = self._read_vector(sexp_type)
        else:
            raise RDataError(f"R object type {sexp_type} is not supported by this reader")

        if has_attributes:
            obj.attributes = self._read_attributes()
        return obj

    def _read_persistent_names(self) -> list[str | None]:
        if self._int() != 0:
            raise RDataError("malformed persistent-name string vector in R stream")
        return [self._read_charsxp() for _ in range(self._int())]

    def _read_charsxp(self) -> str | None:
        flags = self._int()
        if flags & 0xFF != CHARSXP:
            raise RDataError(f"expected a CHARSXP in R stream, found type {flags & 0xFF}")
        return self._read_charsxp_body(flags >> 12)

    def _read_charsxp_body(self, levels: int) -> str | None:
        length = self._int()
        if length == -1:
            return None  # NA_character_
        raw = bytes(self._take(length))
        if levels & _UTF8_MASK:
            return raw.decode("utf-8", "replace")
        if levels & (_LATIN1_MASK | _BYTES_MASK):
            # latin-1 maps every byte to a code point, so "bytes" strings
            # survive the round trip without loss.
            return raw.decode("latin-1")
        if levels & _ASCII_MASK:
            return raw.decode("ascii", "replace")
        # Unflagged strings are in the writer's native encoding.
        encoding = self.header.native_encoding
        try:
            return raw.decode(encoding)
        except (LookupError, UnicodeDecodeError):
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                return raw.decode("latin-1")

    def _read_vector(self, sexp_type: int) -> RObject:
        length = self._length()
        rtype = _VECTOR_TYPE_NAMES[sexp_type]
        if sexp_type == STRSXP:
            return RObject(rtype, [self._read_charsxp() for _ in range(length)])
        if sexp_type in (VECSXP, EXPRSXP):
            return RObject(rtype, [self.read_item() for _ in range(length)])
        if sexp_type in (INTSXP, LGLSXP):
            raw_ints = struct.unpack_from(f">{length}i", self._take(4 * length))
            if sexp_type == LGLSXP:
                return RObject(rtype, [None if v == NA_INTEGER else bool(v) for v in raw_ints])
            return RObject(rtype, [None if v == NA_INTEGER else v for v in raw_ints])
        if sexp_type == REALSXP:
            return RObject(rtype, list(struct.unpack_from(f">{length}d", self._take(8 * length))))
        if sexp_type == CPLXSXP:
            parts = struct.unpack_from(f">{2 * length}d", self._take(16 * length))
            return RObject(rtype, [complex(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)])
        if sexp_type == RAWSXP:
            return RObject(rtype, [bytes(self._take(length))])
        raise RDataError(f"R vector type {sexp_type} is not supported")  # unreachable

    def _read_attributes(self) -> dict[str, RObject]:
        attribute_list = self.read_item()
        if attribute_list.rtype == "NULL":
            return {}
        if attribute_list.rtype != "pairlist" or attribute_list.tags is None:
            raise RDataError("R attributes are not a tagged pairlist")
        return {
            (tag if tag is not None else f"<untagged {i}>"): value
            for i, (tag, value) in enumerate(zip(attribute_list.tags, attribute_list.values))
        }

    def _read_pairlist(self, sexp_type: int, has_attributes: bool, has_tag: bool) -> RObject:
        # Pairlists are cons cells written head first: attributes, tag, CAR,
        # then the CDR as the next item. Walk the spine iteratively so long
        # argument lists don't exhaust Python's recursion limit.
        rtype = {LANGSXP: "language", ATTRLANGSXP: "language", CLOSXP: "closure",
                 PROMSXP: "promise", DOTSXP: "..."}.get(sexp_type, "pairlist")
        if rtype in ("closure", "promise"):
            raise RDataError(f"R {rtype} objects are not expected in data sets")
        result = RObject(rtype, [], tags=[])
        first = True
        while True:
            attributes = self._read_attributes() if has_attributes else {}
            if first:
                result.attributes = attributes
                first = False
            tag = self.read_item() if has_tag else None
            result.tags.append(tag.values[0] if tag is not None and tag.values else None)
            result.values.append(self.read_item())
            flags = self._int()
            sexp_type = flags & 0xFF
            if sexp_type not in (LISTSXP, LANGSXP, DOTSXP, ATTRLANGSXP, ATTRLISTSXP):
                # Either the terminating NULL or a dotted tail (a CONS whose
                # CDR is not a pairlist, as in ALTREP wrapper states).
                self._position -= 4
                tail = self.read_item()
                if tail.rtype != "NULL":
                    result.tail = tail
                return result
            has_attributes = bool(flags & _HAS_ATTR_BIT)
            has_tag = bool(flags & _HAS_TAG_BIT)

    def _read_environment(self) -> RObject:
        # Register before reading the contents: an environment may contain
        # references to itself.
        env = RObject("environment", [], tags=[])
        self._references.append(env)
        self._int()  # locked flag
        self.read_item()  # enclosing environment
        frame = self.read_item()
        hashtab = self.read_item()
        attributes = self.read_item()
        bindings: list[tuple[str | None, RObject]] = []
        if frame.rtype == "pairlist":
            bindings.extend(zip(frame.tags or [], frame.values))
        if hashtab.rtype == "list":
            for bucket in hashtab.values:
                if bucket.rtype == "pairlist":
                    bindings.extend(zip(bucket.tags or [], bucket.values))
        env.tags = [name for name, _ in bindings]
        env.values = [value for _, value in bindings]
        if attributes.rtype == "pairlist" and attributes.tags is not None:
            env.attributes = dict(zip(attributes.tags, attributes.values))
        return env

    def _read_altrep(self) -> RObject:
        info = self.read_item()
        state = self.read_item()
        attributes = self.read_item()
        class_name = info.values[0].values[0] if info.values else None
        obj = _expand_altrep(class_name, state)
        if attributes.rtype == "pairlist" and attributes.tags is not None:
            obj.attributes = dict(zip(attributes.tags, attributes.values))
        return obj


def _expand_altrep(class_name: str | None, state: RObject) -> RObject:
    """Materialise the ALTREP classes base R serializes in compact form."""
    if class_name in ("compact_intseq", "compact_realseq"):
        length, start, step = (state.values + [0.0, 0.0, 0.0])[:3]
        count = int(length)
        if class_name == "compact_intseq":
            return RObject("integer", [int(start) + i * int(step) for i in range(count)])
        return RObject("double", [start + i * step for i in range(count)])
    if class_name and class_name.startswith("wrap_"):
        # State is CONS(wrapped vector, metadata): the vector is the CAR.
        return state.values[0] if state.rtype == "pairlist" else state
    if class_name == "deferred_string":
        # State is CONS(numeric vector, scalar info); R would format the
        # numbers lazily, so format them here the way as.character does.
        numbers = state.values[0] if state.rtype == "pairlist" else state
        return RObject("character", [None if v is None or (isinstance(v, float) and math.isnan(v))
                                     else _format_r_number(v) for v in numbers.values])
    raise RDataError(f"ALTREP class {class_name!r} is not supported by this reader")


def _format_r_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


# -- containers ---------------------------------------------------------------


def decompress_r_file(data: bytes) -> bytes:
    """Undo the gzip / bzip2 / xz compression R applies to .rds and .rda files."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


def unserialize(data: bytes) -> RObject:
    """Parse one (uncompressed) XDR serialization stream into an ``RObject``."""
    return _StreamReader(bytes(data)).read_item()


def _read_bytes(source: bytes | str | os.PathLike) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    with open(source, "rb") as handle:
        return handle.read()


def read_rds(source: bytes | str | os.PathLike) -> RObject:
    """Read an ``.rds`` file (or its bytes), as ``readRDS`` would."""
    return unserialize(decompress_r_file(_read_bytes(source)))


def read_rda(source: bytes | str | os.PathLike) -> dict[str, RObject]:
    """Read an ``.rda`` / ``.RData`` file (or its bytes): ``{name: value}``."""
    data = decompress_r_file(_read_bytes(source))
    if data[:5] not in (b"RDX2\n", b"RDX3\n"):
        raise RDataError(f"not an XDR .rda file (magic {data[:5]!r}, expected RDX2/RDX3)")
    bindings = unserialize(data[5:])
    if bindings.rtype != "pairlist" or bindings.tags is None:
        raise RDataError(".rda payload is not a pairlist of bindings")
    return {tag: value for tag, value in zip(bindings.tags, bindings.values) if tag is not None}


class LazyLoadDatabase:
    """An R lazy-load database: ``<stem>.rdb`` with its ``<stem>.rdx`` index."""

    def __init__(self, rdb_path: str | os.PathLike, rdx_path: str | os.PathLike | None = None):
        self.rdb_path = os.fspath(rdb_path)
        self.rdx_path = os.fspath(rdx_path) if rdx_path is not None else (
            os.path.splitext(self.rdb_path)[0] + ".rdx")
        index = read_rds(self.rdx_path)
        variables = index["variables"]
        self._offsets: dict[str, tuple[int, int]] = {}
        for name, location in zip(variables.names or [], variables.values):
            offset, length = (int(v) for v in location.values[:2])
            self._offsets[name] = (offset, length)

    def names(self) -> list[str]:
        """Variable names in the database, in the order R indexed them."""
        return list(self._offsets)

    def load(self, name: str) -> RObject:
        """Read and parse one variable."""
        if name not in self._offsets:
            raise KeyError(f"{name!r} is not in {self.rdb_path} (has: {', '.join(self._offsets)})")
        offset, length = self._offsets[name]
        with open(self.rdb_path, "rb") as handle:
            handle.seek(offset)
            entry = handle.read(length)
        return unserialize(_decompress_lazyload_entry(entry, name))


def _decompress_lazyload_entry(entry: bytes, name: str) -> bytes:
    if len(entry) < 5:
        raise RDataError(f"lazy-load entry {name!r} is truncated")
    expected_length = struct.unpack(">I", entry[:4])[0]
    # compress=TRUE writes zlib straight after the length; compress=2/3 add a
    # one-byte method tag ('Z' zlib, '2' bzip2, 'X' xz, '0' stored).
    method, body = entry[4:5], entry[5:]
    if method == b"2":
        payload = bz2.decompress(body)
    elif method == b"X":
        payload = lzma.decompress(body, format=lzma.FORMAT_XZ)
    elif method == b"0":
        payload = body
    elif method == b"Z" and body[:1] == b"\x78":
        payload = zlib.decompress(body)
    else:
        payload = zlib.decompress(entry[4:])
    if len(payload) != expected_length:
        raise RDataError(
            f"lazy-load entry {name!r} decompressed to {len(payload)} bytes, "
            f"header says {expected_length}"
        )
    return payload


# -- conversions ----------------------------------------------------------------


def factor_labels(factor: RObject) -> list[str | None]:
    """A factor's values as their level labels (``as.character(f)``)."""
    levels = factor.attribute_strings("levels")
    if levels is None:
        raise RDataError("factor has no character 'levels' attribute")
    return [None if code is None else levels[code - 1] for code in factor.values]


def _row_count(frame: RObject) -> int:
    row_names = frame.attributes.get("row.names")
    if row_names is None:
        return len(frame.values[0]) if frame.values else 0
    # Automatic row names are stored compactly as c(NA_integer_, -n).
    if row_names.rtype == "integer" and len(row_names) == 2 and row_names.values[0] is None:
        return abs(row_names.values[1])
    return len(row_names)


def data_frame_columns(frame: RObject) -> dict[str, list[Any]]:
    """A data frame (or tibble) as ``{column name: list of values}``.

    Factors become their labels; other columns keep the element types
    described on ``RObject``.
    """
    if frame.rtype != "list":
        raise RDataError(f"expected a data frame (a list), got R {frame.rtype}")
    names = frame.names
    if names is None:
        raise RDataError("data frame has no column names")
    rows = _row_count(frame)
    columns: dict[str, list[Any]] = {}
    for name, column in zip(names, frame.values):
        values = factor_labels(column) if column.is_factor() else list(column.values)
        if len(values) != rows:
            raise RDataError(f"column {name!r} has {len(values)} values, frame has {rows} rows")
        columns[str(name)] = values
    return columns


def as_python(obj: RObject) -> Any:
    """Convert to plain Python: data frames to column dicts, factors to labels,
    named lists to dicts, unnamed lists to lists, length-one atomics stay lists."""
    if obj.rtype == "NULL":
        return None
    if obj.is_data_frame():
        return data_frame_columns(obj)
    if obj.is_factor():
        return factor_labels(obj)
    if obj.rtype in ("list", "pairlist", "expression"):
        items = [as_python(v) for v in obj.values]
        names = obj.names
        if names is not None and all(n is not None for n in names):
            return dict(zip(names, items))
        return items
    if obj.rtype == "raw":
        return obj.values[0] if obj.values else b""
    return list(obj.values)
