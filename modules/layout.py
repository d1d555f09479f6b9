"""Level layouts: how a path's parameters are split into levels of alternative modules (DiPaCo §2.1).

A layout is written as a short string, one level per comma-separated item::

    embed:shared, b0-0:routed2, b1-1:routed2, head:shared

Each level is the token/position embedding (`embed`), the final norm + LM head (`head`), or a run of
consecutive blocks (`bI-J`, inclusive; `bI` for one block). Sharing is `shared` (one module used by every
path), `routedK` (K alternative modules) or `private` (one module per path). The number of paths is the
product of the K of the routed levels; path p picks module digit(p) on each routed level (mixed radix, the
first routed level most significant) and module p on private levels.

An optional third item says how the level's modules are updated, overriding the run's `sync` field:
`round` (at the close of each round, over every path that contributed to it) or `async` (as contributions
arrive, see `modules.asynchrony`), e.g. ``embed:shared:async, b0-1:routed2, head:shared:async``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

Sharing = Literal["shared", "routed", "path_private"]
Kind = Literal["embed", "blocks", "head"]
Mode = Literal["round", "async"]
MODES: tuple[Mode, ...] = ("round", "async")

_BLOCKS = re.compile(r"^b(\d+)(?:-(\d+))?$")
_ROUTED = re.compile(r"^routed(\d+)$")


class LayoutError(ValueError):
    """A layout string or level list is invalid; the message says what and where."""


@dataclass(frozen=True, slots=True)
class Level:
    name: str
    kind: Kind
    sharing: Sharing
    num_modules_routed: int = 1
    """K for routed levels; 1 for shared levels (private levels get one module per path)."""
    first_block: int = -1
    last_block: int = -1
    mode: Mode | None = None
    """How the level's modules are updated, when the layout says (else the run's `sync` field decides)."""

    def owns(self, param_name: str) -> bool:
        """Whether a path-model parameter name belongs to this level."""
        if self.kind == "embed":
            return param_name.startswith(("tok_emb.", "pos_emb."))
        if self.kind == "head":
            return param_name.startswith(("ln_f.", "lm_head."))
        if not param_name.startswith("blocks."):
            return False
        index = int(param_name.split(".", 2)[1])
        return self.first_block <= index <= self.last_block

    def spec(self) -> str:
        where = self.kind if self.kind != "blocks" else f"b{self.first_block}-{self.last_block}"
        how = {"shared": "shared", "path_private": "private"}.get(self.sharing)
        mode = f":{self.mode}" if self.mode is not None else ""
        return f"{where}:{how or f'routed{self.num_modules_routed}'}{mode}"


@dataclass(frozen=True, slots=True)
class Layout:
    levels: tuple[Level, ...]
    n_layers: int

    @property
    def num_paths(self) -> int:
        return math.prod(lv.num_modules_routed for lv in self.levels if lv.sharing == "routed")

    def num_modules(self, level_index: int) -> int:
        level = self.levels[level_index]
        if level.sharing == "path_private":
            return self.num_paths
        return level.num_modules_routed

    def path_modules(self, path_index: int) -> list[int]:
        """Module index on every level for one path."""
        if not 0 <= path_index < self.num_paths:
            raise LayoutError(f"path {path_index} out of range: the layout has {self.num_paths} paths")
        routed = [lv.num_modules_routed for lv in self.levels if lv.sharing == "routed"]
        digits: list[int] = []
        rest = path_index
        for k in reversed(routed):
            digits.append(rest % k)
            rest //= k
        digits.reverse()
        out: list[int] = []
        it = iter(digits)
        for lv in self.levels:
            if lv.sharing == "routed":
                out.append(next(it))
            elif lv.sharing == "path_private":
                out.append(path_index)
            else:
                out.append(0)
        return out

    def level_of(self, param_name: str) -> int:
        for i, lv in enumerate(self.levels):
            if lv.owns(param_name):
                return i
        raise LayoutError(f"parameter {param_name!r} belongs to no level of layout {self.spec()!r}")

    def spec(self) -> str:
        return ", ".join(lv.spec() for lv in self.levels)

    def modes(self, default: Mode) -> list[Mode]:
        """Each level's update mode: its own when the layout names one, else `default` (the run's `sync`)."""
        return [lv.mode if lv.mode is not None else default for lv in self.levels]


def _parse_sharing(text: str, where: str) -> tuple[Sharing, int]:
    if text == "shared":
        return "shared", 1
    if text in ("private", "path_private"):
        return "path_private", 1
    m = _ROUTED.match(text)
    if m:
        k = int(m.group(1))
        if k < 1:
            raise LayoutError(f"{where}: routed level needs at least 1 module, got {text!r}")
        return "routed", k
    raise LayoutError(f"{where}: unknown sharing {text!r}; use shared, private or routedK (e.g. routed4)")


def _parse_mode(text: str, where: str) -> Mode:
    if text in ("round", "sync"):
        return "round"
    if text == "async":
        return "async"
    raise LayoutError(f"{where}: unknown update mode {text!r}; use round (alias sync) or async")


def parse_layout(text: str, *, n_layers: int) -> Layout:
    """Parse and validate a layout string against a model with `n_layers` blocks."""
    items = [part.strip() for part in text.split(",") if part.strip()]
    if not items:
        raise LayoutError("layout is empty; example: 'embed:shared, b0-0:routed2, b1-1:routed2, head:shared'")
    levels: list[Level] = []
    covered: dict[int, str] = {}
    names: set[str] = set()
    for pos, item in enumerate(items):
        where = f"level {pos} ({item!r})"
        if item.count(":") not in (1, 2):
            raise LayoutError(f"{where}: expected 'WHERE:SHARING' or 'WHERE:SHARING:MODE', e.g. 'b0-1:routed2:async'")
        place, how, *rest = (s.strip() for s in item.split(":"))
        sharing, k = _parse_sharing(how, where)
        mode = _parse_mode(rest[0], where) if rest else None
        if place in ("embed", "head"):
            kind: Kind = "embed" if place == "embed" else "head"
            level = Level(name=place, kind=kind, sharing=sharing, num_modules_routed=k, mode=mode)
        else:
            m = _BLOCKS.match(place)
            if not m:
                raise LayoutError(f"{where}: unknown place {place!r}; use embed, head, bI or bI-J")
            first = int(m.group(1))
            last = int(m.group(2)) if m.group(2) is not None else first
            if last < first:
                raise LayoutError(f"{where}: block range {place!r} is reversed")
            if last >= n_layers:
                raise LayoutError(f"{where}: block {last} does not exist; the model has {n_layers} blocks")
            for b in range(first, last + 1):
                if b in covered:
                    raise LayoutError(f"{where}: block {b} is already in level {covered[b]!r}")
                covered[b] = place
            level = Level(
                name=f"b{first}-{last}",
                kind="blocks",
                sharing=sharing,
                num_modules_routed=k,
                first_block=first,
                last_block=last,
                mode=mode,
            )
        if level.name in names:
            raise LayoutError(f"{where}: level {level.name!r} appears twice")
        names.add(level.name)
        levels.append(level)
    missing = [b for b in range(n_layers) if b not in covered]
    if missing:
        raise LayoutError(f"blocks {missing} are in no level; every block must belong to exactly one level")
    for required in ("embed", "head"):
        if required not in names:
            raise LayoutError(f"the layout has no {required!r} level")
    return Layout(levels=tuple(levels), n_layers=n_layers)


def grid_layout(*, n_layers: int, routed: list[int]) -> Layout:
    """Shared embedding and head; the blocks split evenly into one routed level per entry of `routed`."""
    if not routed or len(routed) > n_layers:
        raise LayoutError(f"need between 1 and {n_layers} routed levels, got {len(routed)}")
    per, extra = divmod(n_layers, len(routed))
    parts = ["embed:shared"]
    start = 0
    for i, k in enumerate(routed):
        size = per + (1 if i < extra else 0)
        parts.append(f"b{start}-{start + size - 1}:routed{k}")
        start += size
    parts.append("head:shared")
    return parse_layout(", ".join(parts), n_layers=n_layers)
