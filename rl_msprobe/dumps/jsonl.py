"""JSONL logs line by line, with one list of a long line read element by element.

A line that fits in one read (CHUNK) is parsed whole by json. A longer one (a prefill step of a
million requests is ~50 MB) is decoded chunk by chunk and parsed with json's own scanner one
value at a time: its keys up to STREAM (the dispatch log's `requests`, written last) become the
line's dict, and STREAM's value becomes a `Streamed` that yields the list's elements as the reader
asks for them, then reads the rest of the line. Memory holds one chunk and one element, never the
line or its list. Elements are parsed a BATCH of text at a time where they can be, by msgspec
where the caller gives it a decoder (typed values validated in C, or values only checked and
left unparsed), by json where msgspec refuses the batch (NaN, a value of another type), so what
the caller gets is what json reads, validated as the caller would validate it. A line that
turns out not to be JSON (cut short by a killed process) raises ValueError from the iteration:
the caller keeps what it learnt from a line until the line ends. `Parser(whole=True)` reads a
whole file the same way (dump.json's `data` object, pair by pair: layout.check_dump_file).
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import msgspec

from rl_msprobe import bounded
from rl_msprobe.errors import UserError

CHUNK = 1 << 20
READ = 1 << 18  # of a whole file: less is held (a dump.json's entries are short)
MARGIN = 1 << 16  # text kept ahead of the element being parsed (more is read below it)
BATCH = 1 << 16  # characters of a list's elements parsed in one call
_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")
_SEP_OBJECT = re.compile(r"[ \t\n\r]*([,}])[ \t\n\r]*")
_COLON = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")
# an object's pairs checked as JSON, their values left unparsed (dump.json's `data`: layout.check_dump_file)
SKIP_PAIRS = msgspec.json.Decoder(dict[str, msgspec.Raw])
# json's C scanner (typeshed omits the attribute): one value at an offset of a str
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]


class Parser:
    """The text of one long line (or, WHOLE, of a whole file), read on demand; `i` is the offset
    of the next character."""

    def __init__(self, handle: BinaryIO, first: bytes, where: str, limit: int, whole: bool = False) -> None:
        self.handle, self.where, self.limit, self.whole = handle, where, limit, whole
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.size = len(first)
        self.done = not first if whole else first.endswith(b"\n")
        self.text = self.decoder.decode(first, final=self.done)
        self.i = 0
        self.dropped = 0  # characters before `text`
        self.chunk = READ if whole else CHUNK
        self.want = self.chunk

    def _more(self) -> None:
        """Drop the text before `i` and read on (ValueError where the line has ended)."""
        if self.done:
            raise ValueError("the text ends before its JSON does")
        piece = self.handle.read(self.want) if self.whole else self.handle.readline(self.want)
        self.size += len(piece)
        if self.size > self.limit:
            raise UserError(
                f"{self.where}: longer than {bounded.size_text(self.limit)}; not what rl-msprobe reads here. "
                "Remove that line (or pass the folder the run wrote)."
            )
        self.done = not piece or (not self.whole and piece.endswith(b"\n"))
        self.text = self.text[self.i :] + self.decoder.decode(piece, final=self.done)
        self.dropped += self.i
        self.i = 0

    def char(self) -> str:
        """The next character that is not white space ('' at the end of the line), not consumed."""
        while True:
            self.i = _WS.match(self.text, self.i).end()  # type: ignore[union-attr]
            if self.i < len(self.text):
                return self.text[self.i]
            if self.done:
                return ""
            self._more()

    def expect(self, chars: str) -> str:
        c = self.char()
        if not c or c not in chars:
            raise ValueError(f"expected one of {chars!r}")
        self.i += 1
        return c

    def value(self) -> Any:
        """The next JSON value; read on while it may continue past the text held (a number)."""
        self.char()
        self.want = self.chunk
        while True:
            try:
                obj, end = _scan(self.text, self.i)
                if end < len(self.text) or self.done:
                    self.i = end
                    return obj
            except StopIteration:
                if self.done:
                    raise ValueError("not a JSON value") from None
            except ValueError:
                if self.done:
                    raise
            except RecursionError:
                raise UserError(
                    f"{self.where}: JSON nested too deeply; not a line rl-msprobe's helpers write. "
                    "Remove that line (or point at the folder the run wrote)."
                ) from None
            self._more()
            self.want *= 2  # one value longer than a chunk: read it in fewer passes

    def members(self, doc: dict[str, Any], stream: str | None, need: tuple[str, ...] = ()) -> Streamed | None:
        """Read `"key": value` pairs into DOC up to the closing brace (or up to STREAM's list:
        returned as a Streamed, which reads the rest when exhausted)."""
        if self.char() == "}":
            self.i += 1
            self.end()
            return None
        while True:
            key = self.value()
            if not isinstance(key, str):
                raise ValueError("a key that is not a string")
            self.expect(":")
            if key == stream and self.char() in "[{" and all(k in doc for k in need):
                streamed = Streamed(self, doc, self.text[self.i] == "{")
                self.i += 1
                doc[key] = streamed
                return streamed
            doc[key] = self.value()
            if self.expect(",}") == "}":
                self.end()
                return None

    def end(self) -> None:
        if self.char():
            raise ValueError("more after the JSON object")

    def drain(self) -> None:
        """Skip to the end of the line (after a value that is not JSON)."""
        while not self.done:
            self.i = len(self.text)
            self._more()


class Streamed:
    """The elements of a long line's list (or the (key, value) pairs of an object, PAIRS), parsed
    as they are asked for (once)."""

    def __init__(self, parser: Parser, doc: dict[str, Any], pairs: bool = False) -> None:
        self.parser, self.doc, self.finished, self.pairs = parser, doc, False, pairs
        self.boundary: str | None = None  # see _batch; '': none

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches():
            yield from batch

    def batches(self, decoder: msgspec.json.Decoder[Any] | None = None) -> Iterator[list[Any]]:
        """The elements (pairs) a list at a time: a BATCH of text where it holds whole elements,
        else one. DECODER (msgspec's: a list, or for PAIRS a dict, of typed values) decodes a
        batch first, validating it in C without a Python object per value it skips; a batch it
        refuses (NaN, a value of another type) is read as before, by json, so the caller gets
        DECODER's values or json's."""
        p = self.parser
        try:
            if p.char() == ("}" if self.pairs else "]"):
                p.i += 1
            else:
                yield from self._items(decoder)
            if p.expect(",}") == ",":
                p.members(self.doc, None)
            else:
                p.end()
        except ValueError:
            p.drain()
            raise
        finally:
            self.finished = True

    def _batch(
        self, text: str, i: int, decoder: msgspec.json.Decoder[Any] | None
    ) -> tuple[list[Any], str, int] | None:
        """(elements, the `,` or closing bracket after them, the offset after it) of the text from
        I up to a `}` within BATCH characters; None where that is not whole elements. The `}`:
        where the boundary between two elements the last batch ended at (`}`, separator, the next
        element's first character: `},\n  "` in an indented dump.json) is found again, else
        `_cut`'s. A slice that parses, wrapped in its brackets, ends at an element's end (a proper
        prefix of an element that ends in `}` leaves a bracket open), so its elements are the
        container's own."""
        if self.boundary:
            j = text.rfind(self.boundary, i, i + BATCH)
            got = self._parse(text, i, j, decoder) if j > i else None
            if got is not None:
                return got
            if j > i:
                self.boundary = ""  # it is in the elements too (compact JSON): cut by counting
        j = _cut(text, i)
        got = self._parse(text, i, j, decoder) if j > i else None
        if got is not None and self.boundary is None:
            self.boundary = text[j : got[2] + 1]
        return got

    def _parse(
        self, text: str, i: int, j: int, decoder: msgspec.json.Decoder[Any] | None
    ) -> tuple[list[Any], str, int] | None:
        p, pairs = self.parser, self.pairs
        body = text[i : j + 1]
        batch: list[Any] | None = None
        if decoder is not None:
            try:
                got = decoder.decode(f"{{{body}}}" if pairs else f"[{body}]")
                batch = list(got.items()) if pairs else got
            except (msgspec.MsgspecError, RecursionError):
                pass
        if batch is None and not pairs:  # pairs: json would merge repeated keys; read one by one
            try:
                batch = json.loads(f"[{body}]")
            except (ValueError, RecursionError):
                pass
        m = (_SEP_OBJECT if pairs else _SEP).match(text, j + 1) if batch is not None else None
        if batch is None or m is None or (m.end() == len(text) and not p.done):
            return None
        return batch, m.group(1), m.end()

    def _items(self, decoder: msgspec.json.Decoder[Any] | None) -> Iterator[list[Any]]:
        """The list's elements (the object's pairs) up to its closing bracket: batches (`_batch`;
        of pairs only with a DECODER), else one at a time (`_element`, `_pair`), the text read on
        MARGIN + BATCH before its end. After a batch that does not parse, the next BATCH of text
        is read one at a time."""
        p, last = self.parser, "}" if self.pairs else "]"
        one = self._pair if self.pairs else self._element
        batching = decoder is not None or not self.pairs
        i, hold = p.i, 0  # hold: no batch before this offset (of the whole text)
        while True:
            text = p.text
            if len(text) - i < MARGIN + BATCH and not p.done:
                p.i = i
                p._more()
                text, i = p.text, p.i
            got = self._batch(text, i, decoder) if batching and p.dropped + i >= hold else None
            if got is None:
                hold = max(hold, p.dropped + i + BATCH)
                got = one(text, i)
            batch, close, i = got
            yield batch
            if close == last:
                p.i = i
                return

    def _element(self, text: str, i: int) -> tuple[list[Any], str, int]:
        """One element: json's scanner and one regex on the text held; `value` / `expect` (which
        read on as they need) where it or its comma may run past the text held."""
        p, obj = self.parser, None
        try:
            obj, end = _scan(text, i)
        except (StopIteration, ValueError, RecursionError):
            end = len(text)  # `value` says what is wrong, or reads on
        m = _SEP.match(text, end) if end < len(text) else None
        if m is None or (m.end() == len(text) and not p.done):
            p.i = i
            obj = p.value()
            return [obj], p.expect(",]"), p.i
        return [obj], m.group(1), m.end()

    def _pair(self, text: str, i: int) -> tuple[list[Any], str, int]:
        """One (key, value) pair, read as `_element` reads an element."""
        p, m, key, value = self.parser, None, "", None
        try:
            key, end = _scan(text, i)
            c = _COLON.match(text, end)
            if c is not None and isinstance(key, str):
                value, end = _scan(text, c.end())
                m = _SEP_OBJECT.match(text, end) if end < len(text) else None
        except (StopIteration, ValueError, RecursionError):
            pass  # `value` says what is wrong, or reads on
        if m is None or (m.end() == len(text) and not p.done):
            p.i = i
            key = p.value()
            if not isinstance(key, str):
                raise ValueError("a key that is not a string")
            p.expect(":")
            value = p.value()
            return [(key, value)], p.expect(",}"), p.i
        return [(key, value)], m.group(1), m.end()


def _cut(text: str, i: int) -> int:
    """The last `}` within BATCH characters after I that closes every brace and bracket opened
    since I, or -1. Counted as text: a brace inside a string can mislead it, and then the batch
    does not parse and its elements are read one by one."""
    count = text.count
    j = text.rfind("}", i, i + BATCH)
    braces = count("{", i, j + 1) - count("}", i, j + 1)
    brackets = count("[", i, j + 1) - count("]", i, j + 1)
    while j > i and (braces or brackets):
        k = text.rfind("}", i, j)
        braces -= count("{", k + 1, j + 1) - count("}", k + 1, j + 1)
        brackets -= count("[", k + 1, j + 1) - count("]", k + 1, j + 1)
        j = k
    return j if j > i else -1


def read(
    handle: BinaryIO, path: object, stream: str, need: tuple[str, ...] = (), limit: int = bounded.LOG_LINE
) -> Iterator[tuple[int, bytes | dict[str, Any] | None]]:
    """(line number, raw line) for a line that fits in one read; (number, dict) for a longer one,
    whose STREAM list is a Streamed where the keys NEED came before it (else it is read whole, as
    json would: the caller decides by them how to read the list); (number, None) for a longer one
    that is not a JSON object. A Streamed the caller left unread is read to the end of its line
    before the next line."""
    number = 0
    while True:
        first = handle.readline(CHUNK)
        if not first:
            return
        number += 1
        if first.endswith(b"\n") or len(first) < CHUNK:
            yield number, first
            continue
        parser = Parser(handle, first, f"{path}:{number}", limit)
        doc: dict[str, Any] = {}
        try:
            parser.expect("{")
            streamed = parser.members(doc, stream, need)
        except ValueError:
            parser.drain()
            yield number, None
            continue
        yield number, doc
        if streamed is not None and not streamed.finished:
            try:
                for _ in streamed:
                    pass
            except ValueError:  # the caller made what it could of the head; the rest is not JSON
                pass
