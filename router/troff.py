"""Rough troff/man/mdoc to prose: enough to make manual pages read as text, not a renderer."""

from __future__ import annotations

import re
import unicodedata

# Macros whose arguments are text worth keeping (man(7) and the common mdoc(7) ones); every other request
# line (.TH, .PP, .TP, .de, .if, .nr, ...) is layout and is dropped whole.
_TEXT_MACROS = frozenset(
    "SH SS B I BR BI IB IR RB RI SM SB IP UR MT "
    "Nm Nd Sh Ss Fl Ar Op Oo Oc Xr Pa It Dl Em Cm Va Dv Er Ev Fa Fn Ft "
    "Li Sy Ql Dq Sq Pq Ic Ad An Cd Lk".split()
)
_MDOC_CALL = re.compile(r"\b(?:Fl|Ar|Op|Oo|Oc|Xr|Pa|Em|Cm|Va|Dv|Ev|Fa|Li|Sy|Ql|Dq|Sq|Pq|Ic|Ns|No)\b ?")
_NAMED_CHARS = {
    "em": "--",
    "en": "-",
    "hy": "-",
    "bu": "*",
    "co": "(c)",
    "rg": "(R)",
    "aq": "'",
    "dq": '"',
    "lq": '"',
    "rq": '"',
    "oq": "'",
    "cq": "'",
    "mi": "-",
    "pl": "+",
    "mu": "x",
    "ti": "~",
    "ha": "^",
    # Letters of translated pages (groff_char(7); e.g. German `f\\(:ur`, Polish `\\(/l`): those with no accent.
    "ss": "\u00df",
    "ae": "\u00e6",
    "AE": "\u00c6",
    "oe": "\u0153",
    "OE": "\u0152",
    "/o": "\u00f8",
    "/O": "\u00d8",
    "/l": "\u0142",
    "/L": "\u0141",
    "-D": "\u00d0",
    "Sd": "\u00f0",
    "TP": "\u00de",
    "Tp": "\u00fe",
    "Fo": "\u00ab",
    "Fc": "\u00bb",
    "fo": "\u2039",
    "fc": "\u203a",
    "r!": "\u00a1",
    "r?": "\u00bf",
    "de": "\u00b0",
    "Eu": "\u20ac",
    "eu": "\u20ac",
    "shc": "",
}
# groff's composite glyph names: an accent mark then the letter (`:u` is u with diaeresis, `'e` e acute, `oa` a
# with a ring), rendered as the letter plus the combining mark, composed (NFC).
_ACCENTS = {":": "\u0308", "'": "\u0301", "`": "\u0300", "^": "\u0302", "~": "\u0303", ",": "\u0327",
            "o": "\u030a", "v": "\u030c"}  # fmt: skip
_UNICODE_NAME = re.compile(r"^(?:u([0-9A-F]{4,6})(?:_([0-9A-F]{4,6}))*|char(\d{1,3}))$")
_ESCAPES = [
    (re.compile(r"\\f(?:\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\s[+-]?\d+"), ""),  # point-size changes
    (re.compile(r"\\\*(?:\[[^\]]*\]|\(..|.)"), ""),  # string interpolation
    (re.compile(r"\\[nmgkVYF](?:\[[^\]]*\]|\(..|.)"), ""),  # registers, colours, environment
    (re.compile(r"\\[hvwlLoDbxXSRNZ]'[^']*'"), ""),  # motions, drawing, width
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\[ 0~]"), " "),
    (re.compile(r"\\[&c/,:^|%)!]"), ""),
    (re.compile(r"\\e"), "\\\\"),
]
_NAMED = re.compile(r"\\(?:\((..)|\[([^\]]*)\])")
_BLANK_RUNS = re.compile(r"\n{3,}")


def _glyph(name: str) -> str:
    """The text of a named glyph (`\\(xx` or `\\[name]`); "" for one this cleaner does not know."""
    if name in _NAMED_CHARS:
        return _NAMED_CHARS[name]
    if len(name) == 2 and name[0] in _ACCENTS and name[1].isalpha():
        return unicodedata.normalize("NFC", name[1] + _ACCENTS[name[0]])
    unicode_name = _UNICODE_NAME.match(name)
    if unicode_name is not None:
        if unicode_name.group(3) is not None:  # \[char252]: a Latin-1 code
            return chr(int(unicode_name.group(3))) if int(unicode_name.group(3)) < 256 else ""
        codes = [int(code, 16) for code in name[1:].split("_")]  # \[u00FC], \[u0075_0308]
        if all(code <= 0x10FFFF and not 0xD800 <= code <= 0xDFFF for code in codes):
            return unicodedata.normalize("NFC", "".join(map(chr, codes)))
    return ""


def _unescape(line: str) -> str:
    line = _NAMED.sub(lambda m: _glyph(m.group(1) or m.group(2)), line)
    for pattern, repl in _ESCAPES:
        line = pattern.sub(repl, line)
    return line


def troff_to_text(source: str) -> str:
    """Drop comments and layout requests, keep the text of text-bearing macros, strip inline escapes."""
    out: list[str] = []
    for raw in source.splitlines():
        if raw.startswith(('.\\"', "'\\\"", '.\\\\"', '\\"')) or raw.strip() in {".", "'"}:
            continue
        line = raw
        if raw.startswith((".", "'")):
            name, _, args = raw[1:].lstrip().partition(" ")
            if name not in _TEXT_MACROS:
                continue
            line = _MDOC_CALL.sub("", args.replace('"', "")) if name[:1].isupper() else args
        line = _unescape(line).rstrip()
        out.append(line)
    return _BLANK_RUNS.sub("\n\n", "\n".join(out)).strip() + "\n"
