"""JSONL logs line by line, with one list of a long line read element by element.

A line that fits in one read (CHUNK) is parsed whole by json. A longer one (a prefill step of a
million requests is ~50 MB) is decoded chunk by chunk and parsed with json's own scanner one
value at a time: its keys up to STREAM (the dispatch log's `requests`, written last) become the
line's dict, and STREAM's value becomes a `Streamed` that yields the list's elements as the reader
asks for them, then reads the rest of the line. Memory holds one chunk and one element, never the
line or its list (elements are parsed a BATCH of text at a time where they can be). A line that
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

from rl_msprobe import bounded
from rl_msprobe.errors import UserError

CHUNK = 1 << 20
MARGIN = 1 << 16  # text kept ahead of the element being parsed (more is read below it)
BATCH = 1 << 16  # characters of a list's elements parsed in one call
_WS = re.compile(r"[ \t\n\r]*")
_SEP = re.compile(r"[ \t\n\r]*([,\]])[ \t\n\r]*")
_SEP_OBJECT = re.compile(r"[ \t\n\r]*([,}])[ \t\n\r]*")
_COLON = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")
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
        self.want = CHUNK

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
        self.want = CHUNK
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

    def __iter__(self) -> Iterator[Any]:
        p = self.parser
        try:
            if p.char() == ("}" if self.pairs else "]"):
                p.i += 1
            else:
                yield from (self._pairs() if self.pairs else self._elements())
            if p.expect(",}") == ",":
                p.members(self.doc, None)
            else:
                p.end()
        except ValueError:
            p.drain()
            raise
        finally:
            self.finished = True

    def _elements(self) -> Iterator[Any]:
        """The list's elements up to its `]`: json's scanner and one regex per element on the text
        held, read on MARGIN before its end; `value` / `expect` (which read on as they need) where
        an element or its comma may run past the text held."""
        p, scan, sep, loads = self.parser, _scan, _SEP.match, json.loads
        text, i = p.text, p.i
        while True:
            if len(text) - i < MARGIN + BATCH and not p.done:
                p.i = i
                p._more()
                text, i = p.text, p.i
            # many elements in one call: up to the last `}` within BATCH characters. A slice that
            # parses as a list ends at an element's end (a proper prefix of an element that ends
            # in `}` is never a whole JSON value), so its elements are the list's own.
            j = text.rfind("}", i, i + BATCH)
            if j > i:
                try:
                    batch = loads("[" + text[i : j + 1] + "]")
                except (ValueError, RecursionError):
                    batch = None
                m = sep(text, j + 1) if batch is not None else None
                if m is not None and (m.end() < len(text) or p.done):
                    yield from batch
                    close, i = m.group(1), m.end()
                    if close == "]":
                        p.i = i
                        return
                    continue
            obj: Any = None
            try:
                obj, end = scan(text, i)
            except (StopIteration, ValueError, RecursionError):
                end = len(text)  # `value` says what is wrong, or reads on
            m = sep(text, end) if end < len(text) else None
            if m is None or (m.end() == len(text) and not p.done):
                p.i = i
                obj = p.value()
                close = p.expect(",]")
                text, i = p.text, p.i
            else:
                close, i = m.group(1), m.end()
            yield obj
            if close == "]":
                p.i = i
                return

    def _pairs(self) -> Iterator[tuple[str, Any]]:
        """An object's (key, value) pairs up to its `}`, read as `_elements` reads a list's."""
        p, scan, colon, sep = self.parser, _scan, _COLON.match, _SEP_OBJECT.match
        text, i = p.text, p.i
        while True:
            if len(text) - i < MARGIN and not p.done:
                p.i = i
                p._more()
                text, i = p.text, p.i
            m, key, value = None, "", None
            try:
                key, end = scan(text, i)
                c = colon(text, end)
                if c is not None and isinstance(key, str):
                    value, end = scan(text, c.end())
                    m = sep(text, end) if end < len(text) else None
            except (StopIteration, ValueError, RecursionError):
                pass  # `value` says what is wrong, or reads on
            if m is None or (m.end() == len(text) and not p.done):
                p.i = i
                key = p.value()
                if not isinstance(key, str):
                    raise ValueError("a key that is not a string")
                p.expect(":")
                value = p.value()
                close = p.expect(",}")
                text, i = p.text, p.i
            else:
                close, i = m.group(1), m.end()
            yield key, value
            if close == "}":
                p.i = i
                return


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
