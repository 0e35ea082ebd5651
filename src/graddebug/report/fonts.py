"""Drawing user strings in graddebug's figures: fonts that have their glyphs, and quiet renders.

Layer names are the user's, in any script (``"层1"``, ``"注意力"``). matplotlib's default font,
DejaVu Sans, has no CJK glyphs, so each such character drew as a box with a ``UserWarning``
("Glyph 23618 (\\N{CJK UNIFIED IDEOGRAPH-5C42}) missing from font(s) DejaVu Sans.") printed for
every character of every figure of ``graddebug report --html``. Here the labels get a font
list of their own: the user's ``font.family``, then installed fonts that have the glyphs it
lacks (matplotlib >= 3.6 falls back through the list glyph by glyph). The list is set on the
labels' text objects, never in ``rcParams``. A glyph that no installed font has still draws as
a placeholder box; :func:`quiet_render` keeps its warning, and that of a layout that could not
be applied, out of the renders graddebug makes itself.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

__all__ = ["QUIET_WARNINGS", "fallback_families", "quiet_render"]

QUIET_WARNINGS: tuple[str, ...] = (
    # matplotlib >= 3.6: "Glyph 23618 (\N{CJK UNIFIED IDEOGRAPH-5C42}) missing from font(s)
    # DejaVu Sans."; earlier: "... missing from current font."
    r"Glyph \d+ \(.*\) missing from (font\(s\) |current font)",
    # matplotlib before 3.9, after the glyph warning for a script it cannot shape
    r"Matplotlib currently does not support \w+ natively",
    # Constrained layout that finds no room for the axes leaves the figure as it is.
    r"constrained_layout not applied because axes sizes collapsed to zero",
)
"""Messages (regular expressions, matched at the start) of the ``UserWarning`` s that
:func:`quiet_render` keeps quiet. A user's own renders of the figures that ``Report.plot_flow``
and ``Report.plot_heatmap`` return are not filtered."""

_LAST_RESORT = "Last Resort"
"""matplotlib >= 3.10 ships the Unicode Last Resort font, which has a placeholder glyph for
every code point and warns when one is drawn: it must not count as having the glyphs."""


@contextmanager
def quiet_render() -> Iterator[None]:
    """Around a render graddebug makes itself: the :data:`QUIET_WARNINGS` are ignored in the
    block, every other warning goes through as before, and the filters are restored after.
    Like every ``warnings.catch_warnings``, it swaps the process's filter list for the block:
    another thread that warns meanwhile sees these filters too."""
    with warnings.catch_warnings():
        for message in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


def fallback_families(labels: Iterable[str]) -> list[str] | None:
    """The font family list for text drawn from ``labels``.

    Args:
        labels: The strings to draw.

    Returns:
        The user's ``rcParams["font.family"]`` followed by installed fonts that have the
        glyphs its first font lacks; None when that font has them all (or no installed font
        adds any), so that the text keeps the user's settings untouched.
    """
    chars = frozenset(c for label in labels for c in label
                      if not c.isascii() and c.isprintable())
    if not chars:
        return None
    import matplotlib

    family = tuple(matplotlib.rcParams["font.family"])
    extra = _extra_families(chars, family)
    return [*family, *extra] if extra else None


@functools.lru_cache(maxsize=64)
def _extra_families(chars: frozenset[str], family: tuple[str, ...]) -> tuple[str, ...]:
    """Installed families, fewest first, that have the glyphs of ``chars`` that the first font
    of ``family`` lacks (a greedy cover: the family with the most of them first, then by
    name). Cached: the scan opens every installed font once."""
    from matplotlib import font_manager

    primary = font_manager.findfont(font_manager.FontProperties(family=list(family)))
    missing = chars - _glyphs(str(primary), chars)
    if not missing:
        return ()
    has: dict[str, frozenset[str]] = {}
    for name, path in sorted(_family_files(family).items()):
        found = _glyphs(path, missing)
        if found:
            has[name] = found
    chosen: list[str] = []
    while missing and has:
        name = max(sorted(has), key=lambda n: len(has[n] & missing))
        if not has[name] & missing:
            break
        chosen.append(name)
        missing -= has.pop(name)
    return tuple(chosen)


def _family_files(exclude: Iterable[str]) -> dict[str, str]:
    """One font file per installed family (its regular face where there is one), without the
    families in ``exclude`` and the Last Resort font."""
    from matplotlib import font_manager

    skip = set(exclude)
    files: dict[str, tuple[bool, str]] = {}
    for entry in font_manager.fontManager.ttflist:
        if entry.name in skip or entry.name.startswith(_LAST_RESORT):
            continue
        regular = entry.style == "normal" and entry.weight in (400, "normal", "regular")
        if entry.name not in files or (regular and not files[entry.name][0]):
            files[entry.name] = (regular, entry.fname)
    return {name: path for name, (_, path) in files.items()}


def _glyphs(path: str, chars: frozenset[str]) -> frozenset[str]:
    """The characters of ``chars`` that the font file at ``path`` has a glyph for (none when
    the file cannot be read). The file is opened alone: ``font_manager.get_font`` would chain
    matplotlib's own fallbacks, which have every glyph."""
    from matplotlib.ft2font import FT2Font

    try:
        font = FT2Font(path)
        return frozenset(c for c in chars if font.get_char_index(ord(c)))
    except (OSError, RuntimeError, ValueError):
        return frozenset()
