"""Layout parsing, validation messages, and the path -> module mapping (DiPaCo §2.1)."""

from __future__ import annotations

import pytest

from modules import LayoutError, grid_layout, parse_layout

TWO_BY_TWO = "embed:shared, b0-0:routed2, b1-1:routed2, head:shared"


def test_parse_2x2() -> None:
    layout = parse_layout(TWO_BY_TWO, n_layers=2)
    assert layout.num_paths == 4
    assert [lv.name for lv in layout.levels] == ["embed", "b0-0", "b1-1", "head"]
    assert [lv.sharing for lv in layout.levels] == ["shared", "routed", "routed", "shared"]
    assert [layout.num_modules(i) for i in range(4)] == [1, 2, 2, 1]
    assert layout.spec() == TWO_BY_TWO
    assert parse_layout(layout.spec(), n_layers=2) == layout


def test_single_block_and_private_and_whitespace() -> None:
    layout = parse_layout(" embed : private ,b0:routed3,  b1-3:shared, head:path_private ", n_layers=4)
    assert layout.num_paths == 3
    assert layout.levels[1].first_block == layout.levels[1].last_block == 0
    assert layout.num_modules(0) == 3  # private: one module per path
    assert layout.levels[3].spec() == "head:private"


def test_path_modules_mixed_radix_2x2() -> None:
    layout = parse_layout(TWO_BY_TWO, n_layers=2)
    # First routed level most significant; shared levels always module 0.
    assert [layout.path_modules(p) for p in range(4)] == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 1, 1, 0]]


def test_path_modules_mixed_radix_uneven_and_private() -> None:
    layout = parse_layout("embed:private, b0:routed2, b1:routed3, head:shared", n_layers=2)
    assert layout.num_paths == 6
    got = [layout.path_modules(p) for p in range(6)]
    assert got == [[p, p // 3, p % 3, 0] for p in range(6)]
    # every path is a distinct combination of routed modules
    assert len({tuple(m[1:3]) for m in got}) == 6


def test_path_modules_out_of_range() -> None:
    layout = parse_layout(TWO_BY_TWO, n_layers=2)
    with pytest.raises(LayoutError, match="path 4 out of range: the layout has 4 paths"):
        layout.path_modules(4)
    with pytest.raises(LayoutError, match="path -1 out of range"):
        layout.path_modules(-1)


def test_level_of() -> None:
    layout = parse_layout(TWO_BY_TWO, n_layers=2)
    assert layout.level_of("tok_emb.weight") == 0
    assert layout.level_of("pos_emb.weight") == 0
    assert layout.level_of("blocks.0.attn.qkv.weight") == 1
    assert layout.level_of("blocks.1.mlp.fc.bias") == 2
    assert layout.level_of("ln_f.weight") == 3
    assert layout.level_of("lm_head.weight") == 3
    with pytest.raises(LayoutError, match="'blocks.7.ln1.weight' belongs to no level"):
        layout.level_of("blocks.7.ln1.weight")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "layout is empty"),
        (" , ,", "layout is empty"),
        ("embed:shared, b0-1:routed0, head:shared", "routed level needs at least 1 module, got 'routed0'"),
        ("embed:shared, b0-1:shared, b1:routed2, head:shared", "block 1 is already in level 'b0-1'"),
        ("embed:shared, b0:shared, head:shared", r"blocks \[1\] are in no level"),
        ("embed:shared, b0-1:sometimes, head:shared", "unknown sharing 'sometimes'; use shared, private or routedK"),
        ("embed:shared, mlp0:shared, head:shared", "unknown place 'mlp0'; use embed, head, bI or bI-J"),
        ("embed:shared, b0-2:shared, head:shared", "block 2 does not exist; the model has 2 blocks"),
        ("embed:shared, b1-0:shared, head:shared", "block range 'b1-0' is reversed"),
        ("b0-1:shared, head:shared", "the layout has no 'embed' level"),
        ("embed:shared, b0-1:shared", "the layout has no 'head' level"),
        ("embed:shared, embed:shared, b0-1:shared, head:shared", "level 'embed' appears twice"),
        ("embed:shared, b0-1, head:shared", "expected 'WHERE:SHARING'"),
    ],
)
def test_bad_layouts(text: str, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        parse_layout(text, n_layers=2)


def test_error_names_the_level() -> None:
    with pytest.raises(LayoutError, match=r"level 1 \('b0-1:routedX'\)"):
        parse_layout("embed:shared, b0-1:routedX, head:shared", n_layers=2)


def test_grid_layout() -> None:
    layout = grid_layout(n_layers=5, routed=[2, 3])
    assert layout.spec() == "embed:shared, b0-2:routed2, b3-4:routed3, head:shared"
    assert layout.num_paths == 6
    with pytest.raises(LayoutError, match="need between 1 and 2 routed levels, got 3"):
        grid_layout(n_layers=2, routed=[2, 2, 2])
