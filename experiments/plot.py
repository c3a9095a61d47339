"""The one plotting path for experiment rows: lines and bars drawn from rows, saved as a PNG.

Every figure of the experiments is a few of these calls on rows read with ``experiments.rows``:
``lines`` draws one line per group of rows (a key's value against another's), ``bars`` draws
bars per category, stacked or side by side, ``rule`` a horizontal reference (the 160 ms beat) and
``labels`` writes a text from each row at its point.
A column is named as in ``rows.table`` (a dotted path into a nested dict, or a key scaled by a
constant: ``measured_ms*2``). matplotlib is imported only when a figure is drawn, so importing
this module (and the experiments that plot) costs nothing on a machine without it::

  PYTHONPATH=. python3 -m experiments.plot \\
      --rows=experiments/capacity/results/h200_reference.jsonl --where=kind=serve \\
      --x=sessions --y=p99_ms,p50_ms:s-- --group=policy --out=/tmp/p99.png
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from absl import app, flags

from experiments import rows as rows_lib


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure(
    nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (10, 6), **options: Any
) -> tuple:
    """A new figure and its axes (an array of them for more than one panel); ``options`` are
    any other ``pyplot.subplots`` keyword (``sharey=True``, ``squeeze=False``)."""
    return pyplot().subplots(nrows, ncols, figsize=size, **options)


@dataclasses.dataclass(frozen=True)
class Y:
    """One line of a group: the column drawn, its matplotlib format and label (``{group}`` is
    the group's value), and any other ``Axes.plot`` keyword (``alpha``)."""

    key: str
    fmt: str = "o-"
    label: str | None = None
    style: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _value(row: Mapping, key: str) -> Any:
    return rows_lib.column(row, key)


def groups(rows: Iterable[Mapping], group: str | None) -> dict[Any, list[Mapping]]:
    """The rows by ``group``'s value, in the order the values first appear (all in one group,
    keyed None, when ``group`` is None)."""
    out: dict[Any, list[Mapping]] = {}
    for r in rows:
        out.setdefault(None if group is None else _value(r, group), []).append(r)
    return out


def lines(
    ax: Any,
    rows: Iterable[Mapping],
    x: str,
    ys: Sequence[Y | str],
    *,
    group: str | None = None,
    sort: bool = True,
) -> dict[Any, Any]:
    """For each group of ``rows`` (``groups``), one ``Axes.plot`` per entry of ``ys`` of that
    column against ``x`` (ordered by ``x`` when ``sort``; rows without the column left out).
    Within a group every line after the first takes the first one's colour; without a group each
    takes the next colour of the cycle. Returns each group's colour."""
    ys = [y if isinstance(y, Y) else Y(y) for y in ys]
    colors: dict[Any, Any] = {}
    for name, members in groups(rows, group).items():
        if sort:
            members = sorted(members, key=lambda r: _value(r, x))
        for i, y in enumerate(ys):
            points = [(_value(r, x), _value(r, y.key)) for r in members]
            points = [(a, b) for a, b in points if a is not None and b is not None]
            style = dict(y.style)
            if y.label is not None:
                style["label"] = y.label.format(group=name)
            if i and group is not None:
                style["color"] = colors[name]
            (line,) = ax.plot([a for a, _ in points], [b for _, b in points], y.fmt, **style)
            colors.setdefault(name, line.get_color())
    return colors


def bars(
    ax: Any,
    rows: Iterable[Mapping],
    x: str,
    y: str,
    *,
    xs: Sequence[Any],
    stack: str | None = None,
    offset: float = 0.0,
    width: float = 0.8,
    colors: Sequence[Any] | None = None,
    **style: Any,
) -> None:
    """Bars of ``y`` at the categories ``xs`` of ``x`` (bar ``i`` at ``i + offset``); with
    ``stack``, one layer per value of that column (in the order they first appear, coloured from
    ``colors`` in turn and labelled with the value), a category without a row of a layer adding
    nothing to it."""
    rows = list(rows)
    layers = groups(rows, stack)
    bottom = [0.0] * len(xs)
    positions = [i + offset for i in range(len(xs))]
    for i, (name, members) in enumerate(layers.items()):
        values = [
            next((_value(r, y) for r in members if _value(r, x) == c), 0.0) or 0.0 for c in xs
        ]
        kwargs = dict(style)
        if stack is not None:
            kwargs.setdefault("label", name)
            if colors is not None:
                kwargs["color"] = colors[i % len(colors)]
            kwargs["bottom"] = bottom
        ax.bar(positions, values, width, **kwargs)
        bottom = [a + v for a, v in zip(bottom, values, strict=True)]


def rule(ax: Any, y: float, *, text: str | None = None, **style: Any) -> None:
    """A horizontal line at ``y`` (``Axes.axhline``), with ``text`` written just above it at
    the left edge, in its colour."""
    ax.axhline(y, **style)
    if text is not None:
        color = style.get("color", "black")
        ax.text(ax.get_xlim()[0], y + 1, text, color=color, fontsize=8)


def labels(ax: Any, rows: Iterable[Mapping], x: str, y: str, text: str, **style: Any) -> None:
    """At each row's point (``x``, ``y``: columns), ``text`` formatted with the row's keys
    (``"f={frames_per_tick}"``), by ``Axes.annotate`` with ``style`` (``fontsize``, ``xytext``
    with ``textcoords``); rows without either column are left out."""
    for r in rows:
        point = (_value(r, x), _value(r, y))
        if None not in point:
            ax.annotate(text.format_map(r), point, **style)


def save(fig: Any, path: str, dpi: int = 110) -> None:
    """Lay the figure out tightly and write it to ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags: defined only when this module runs as the program, so that
    importing it beside an experiment's own flags clashes with none of them."""
    flags.DEFINE_list("rows", None, "Row files (experiments.rows.load).")
    flags.DEFINE_multi_string(
        "where", [], "key=value or key!=value (a|b: either), as rows --table."
    )
    flags.DEFINE_string("x", None, "The x column.")
    flags.DEFINE_list("y", None, "The y columns, each key or key:matplotlib-format (o-, s--, ^).")
    flags.DEFINE_string("group", None, "One line per value of this column.")
    flags.DEFINE_string("title", None, "The figure's title.")
    flags.DEFINE_string("xlabel", None, "The x axis label (default: the x column).")
    flags.DEFINE_string("ylabel", None, "The y axis label.")
    flags.DEFINE_bool("logx", False, "A log x axis.")
    flags.DEFINE_bool("logy", False, "A log y axis.")
    flags.DEFINE_float("hline", None, "A horizontal reference line (e.g. 160 for the beat).")
    flags.DEFINE_string("out", None, "The PNG written.")


def main(argv: Sequence[str]) -> None:
    del argv
    if not (FLAGS.rows and FLAGS.x and FLAGS.y and FLAGS.out):
        raise app.UsageError("--rows, --x, --y and --out are needed")
    chosen = [
        r for path in FLAGS.rows for r in rows_lib.load(path) if rows_lib.matches(r, FLAGS.where)
    ]
    ys = []
    for spec in FLAGS.y:
        key, _, fmt = spec.partition(":")
        label = key if FLAGS.group is None else f"{{group}}: {key}"
        ys.append(Y(key, fmt or "o-", label=label))
    fig, ax = figure()
    lines(ax, chosen, FLAGS.x, ys, group=FLAGS.group)
    if FLAGS.hline is not None:
        rule(ax, FLAGS.hline, color="red", lw=1, ls="--")
    ax.set(xlabel=FLAGS.xlabel or FLAGS.x, ylabel=FLAGS.ylabel or "", title=FLAGS.title or "")
    if FLAGS.logx:
        ax.set_xscale("log")
    if FLAGS.logy:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save(fig, FLAGS.out)
    print(f"wrote {FLAGS.out} ({len(chosen)} rows)")


if __name__ == "__main__":
    define_flags()
    app.run(main)
