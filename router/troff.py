"""Rough troff/man/mdoc to prose: enough to make manual pages read as text, not a renderer."""

from __future__ import annotations

import re

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
}
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


def _unescape(line: str) -> str:
    line = _NAMED.sub(lambda m: _NAMED_CHARS.get(m.group(1) or m.group(2), ""), line)
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
