"""Budget sweep: one config merged at several budgets, and where each lands on the
I/O-versus-quality curve.

Owns `run_sweep` (index once, then plan and merge per budget through the
pipeline), `deviation` (how far a merge is from the full-budget one, streamed
block by block through checkpoint.safetensors) and the renderings of the result: a
markdown table, CSV and a PNG plot (matplotlib, the `bench` extra). The plot's x-axis is
every byte a budget reads from the experts (their blocks and their sketches). A merge
restored from the store (an earlier run made that plan) read nothing this time: its
point is drawn hollow and labelled "restored", and its time is the computed merge's,
carried over from the folder's earlier sweep.csv, or shown as unknown. It writes no
files itself except through the pipeline's publisher; the CLI writes the table
and the plot (`write_results`, atomically), after `check_sweep_folder` has made sure
that the folder is new, empty or a sweep's (so a user's own folder, or its
sweep.md, is never written into without --force).

The deviation of budget B is reported two ways, ||M_B - M_full|| / ||M_full - W0||
(relative to the update the merge makes) and ||M_B - M_full|| / ||M_full||, both
over every float tensor, computed from the published (output-dtype) weights in
fp32 with fp64 sums. The full-budget merge is the reference; it is built too when
the budgets given do not include it.
"""
from __future__ import annotations

import csv
import io
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from mergepipe.errors import ConfigError, OutputError
from mergepipe.commands.pipeline import merge_plan, plan_config
from mergepipe.checkpoint.safetensors import FLOAT_DTYPES, CheckpointReader, as_tensor, open_checkpoint
from mergepipe.index.store import Store
from mergepipe.output import run_record
from mergepipe.units import Budget

CHUNK_BYTES = 16 << 20
RESULT_FILES = ("sweep.md", "sweep.csv", "sweep.png")
_MD_HEAD = "Budget sweep, method `"  # to_markdown's first line
_ATOMIC_TMP = re.compile(r"\.sweep\.(?:md|csv|png)\.[^/]*\.tmp")  # util.fs.atomic_write_bytes's temp names
_CSV_HEAD = "budget,budget_bytes,total_expert_bytes,"  # to_csv's first columns, in every version


def _ours(path: Path) -> bool:
    """Whether a result file is one a sweep wrote (its first bytes); a PNG counts only
    beside a table of ours (checked by the caller)."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    if path.name == "sweep.md":
        return head.startswith(_MD_HEAD.encode())
    if path.name == "sweep.csv":
        return head.startswith(_CSV_HEAD.encode())
    return head.startswith(b"\x89PNG\r\n\x1a\n")


def check_sweep_folder(out: Path, *, force: bool = False) -> None:
    """A sweep writes sweep.md, sweep.csv, sweep.png and models/<budget>/ into `out`: it may
    be new, empty, or hold only a previous sweep's files (tables that a sweep wrote, and
    under models/ only folders the publisher may replace). Anything else is a user's
    folder: refused unless `force` (which still never lets a model folder be replaced
    that mergepipe did not write: each models/<budget> is published as `merge` does).

    Raises:
        OutputError: `out` is a file, cannot be listed, or holds something a sweep did not write.
    """
    from mergepipe.output.publish import leftover_of
    from mergepipe.output.safety import replaceable
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        what = "a symbolic link" if out.is_symlink() else "a file"
        raise OutputError(f"{out}: sweep -o must be a folder (it is {what})")
    if force:
        return
    try:
        entries = sorted(out.iterdir())
    except OSError as e:
        raise OutputError(f"{out}: cannot list the sweep folder: {e.strerror}") from None
    entries = [p for p in entries if not _ATOMIC_TMP.fullmatch(p.name)]  # write_results cut short
    tables = [p for p in entries if p.name in RESULT_FILES[:2] and p.is_file() and not p.is_symlink() and _ours(p)]
    for p in entries:
        if p.name == "models" and p.is_dir() and not p.is_symlink():
            for m in sorted(p.iterdir()):
                why = None if leftover_of(m) or run_record.is_record(m) else replaceable(m)
                if why is not None:
                    raise OutputError(f"{out}: sweep folder's models/{m.name} {why}; refusing to write the sweep "
                                      "there (choose a new folder, or pass --force)")
            continue
        ok = p.name in RESULT_FILES and p.is_file() and not p.is_symlink() and _ours(p) and (
            p.name != "sweep.png" or bool(tables))
        if not ok:
            raise OutputError(f"{out}: is not a sweep folder (holds {p.name!r}, which a sweep did not write); "
                              "refusing to write the sweep there (choose a new folder, or pass --force)")


def write_results(out: Path, files: dict[str, bytes]) -> None:
    """The sweep's table, CSV and plot, each written atomically (a full disk leaves the previous ones)."""
    from mergepipe.util.fs import atomic_write_bytes
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        try:
            atomic_write_bytes(out / name, data)
        except OSError as e:
            raise OutputError(f"{out / name}: cannot write: {e.strerror}") from None


@dataclass(frozen=True, slots=True)
class SweepRow:
    budget: str
    budget_bytes: int
    total_expert_bytes: int
    planned_expert_bytes: int
    expert_bytes_read: int
    base_bytes_read: int
    bytes_written: int
    plan_seconds: float
    merge_seconds: float
    restored: bool  # merge restored from the store (no weights read this time)
    bound_kind: str
    bound_relative: float
    deviation_update: float  # ||M_B - M_full|| / ||M_full - W0||
    deviation_weights: float  # ||M_B - M_full|| / ||M_full||
    plan_hash: str
    output: str
    sketch_bytes_read: int = 0  # strategy sketch: sketches read in place of expert blocks
    # the merge's wall time when it was computed: merge_seconds, or for a restored merge the
    # time an earlier sweep in this folder recorded for the plan (None: not known)
    computed_merge_seconds: float | None = None

    @property
    def bytes_read(self) -> int:
        """Every expert byte the merge read: full blocks and sketches."""
        return self.expert_bytes_read + self.sketch_bytes_read

    @property
    def read_fraction(self) -> float:
        """Expert I/O (full reads and sketches) over the experts' bytes."""
        return self.bytes_read / self.total_expert_bytes if self.total_expert_bytes else 0.0


@dataclass(frozen=True, slots=True)
class SweepResult:
    rows: list[SweepRow]
    method: str
    index_bytes_read: int
    index_seconds: float
    reference: str  # output folder of the full-budget merge


def _label(budget: Budget) -> str:
    return "budget-" + str(budget).replace("%", "pct").replace(".", "_")


def _sq(x: torch.Tensor) -> float:
    flat = x.reshape(-1)
    return float(torch.dot(flat, flat).double())


def deviations(merged: list[Path], reference: Path, base: Path) -> list[dict[str, float]]:
    """How far each merge is from `reference`, over every float tensor, streamed.

    One pass reads the reference and the base once and every merge once, in chunks
    of ~16 MiB; chunks whose bytes equal the reference's add nothing and are not
    converted. Squares are summed in fp32 per chunk and in fp64 across chunks.
    Returns per merge: diff_sq = ||M - R||^2, update_sq = ||R - W0||^2,
    ref_sq = ||R||^2, max_abs = max |M - R|, relative_update = ||M - R|| / ||R - W0||
    and relative_weights = ||M - R|| / ||R|| (0 where a denominator is 0).
    """
    ck_ref, ck_base = open_checkpoint(reference), open_checkpoint(base)
    ck_m = [open_checkpoint(p) for p in merged]
    readers = [CheckpointReader(c, random_access=False) for c in (ck_ref, ck_base, *ck_m)]
    cks = [ck_ref, ck_base, *ck_m]

    def raw(i: int, name: str, r0: int, r1: int) -> bytearray:
        t = cks[i].tensors[name]
        return readers[i].read_range(t, t.begin, t.end) if not t.shape else readers[i].read_rows(name, r0, r1)

    diff_sq, max_abs = [0.0] * len(merged), [0.0] * len(merged)
    update_sq = ref_sq = 0.0
    try:
        for name, t in ck_ref.tensors.items():
            if t.dtype not in FLOAT_DTYPES or t.numel == 0:
                continue
            rows = t.shape[0] if t.shape else 1
            step = max(1, CHUNK_BYTES // max(1, t.row_bytes()))
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                shape = (r1 - r0, *t.shape[1:]) if t.shape else ()
                ref_raw = raw(0, name, r0, r1)
                ref = as_tensor(ref_raw, t.dtype, shape).float()
                w0 = as_tensor(raw(1, name, r0, r1), ck_base.tensors[name].dtype, shape).float()
                update_sq += _sq(ref - w0)
                ref_sq += _sq(ref)
                for j in range(len(merged)):
                    m_raw = raw(2 + j, name, r0, r1)
                    if m_raw == ref_raw:
                        continue
                    d = as_tensor(m_raw, ck_m[j].tensors[name].dtype, shape).float() - ref
                    diff_sq[j] += _sq(d)
                    max_abs[j] = max(max_abs[j], float(d.abs().max()))
    finally:
        for rd in readers:
            rd.close()
    out = []
    for dsq, mx in zip(diff_sq, max_abs):
        diff = math.sqrt(dsq)
        out.append({"diff_sq": dsq, "update_sq": update_sq, "ref_sq": ref_sq, "max_abs": mx,
                    "relative_update": diff / math.sqrt(update_sq) if update_sq else 0.0,
                    "relative_weights": diff / math.sqrt(ref_sq) if ref_sq else 0.0})
    return out


def deviation(merged: Path, reference: Path, base: Path) -> dict[str, float]:
    """`deviations` for one merge."""
    return deviations([merged], reference, base)[0]


def computed_times(out_dir: Path) -> dict[str, float]:
    """plan hash -> computed merge seconds, from the sweep.csv a sweep wrote in `out_dir`
    earlier (nothing when there is none, or it is not one of ours)."""
    path = out_dir / "sweep.csv"
    if path.is_symlink() or not path.is_file() or not _ours(path):
        return {}
    times = {}
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                seconds = row.get("computed_merge_seconds") or (
                    row.get("merge_seconds") if row.get("restored") == "False" else None)
                try:
                    value = float(seconds) if seconds else math.nan
                except ValueError:
                    continue
                if math.isfinite(value) and value >= 0 and isinstance(row.get("plan_hash"), str):
                    times[row["plan_hash"]] = value
    except (OSError, UnicodeDecodeError, csv.Error):
        return {}
    return times


def run_sweep(cfg, budgets: list[Budget], out_dir: Path, *, threads: int = 2, progress: bool = False,
              log: Callable[[str], None] = lambda _msg: None, protect: tuple[Path, ...] = ()) -> SweepResult:
    """Index once, then plan and merge `cfg` at each budget into out_dir/models/<label>.

    The full budget is merged as well (first, as the reference) if not listed;
    rows come back in the order the budgets were given, the reference last if
    it was added.
    """
    store = Store(cfg.cache_dir)
    earlier = computed_times(out_dir)  # before this sweep's table replaces it
    full = Budget("full")
    order = [full] + [b for b in budgets if b != full]
    t0 = time.monotonic()
    _, inputs = plan_config(cfg, store, budget=full, threads=threads, quiet=not progress)  # indexes every input once
    index_seconds = time.monotonic() - t0
    index_bytes = store.index_reads.total
    log(f"sweep: inputs indexed in {index_seconds:.1f} s ({index_bytes / 2**20:,.1f} MiB read)")
    merged: dict[Budget, tuple[object, dict, float, float, bool, Path]] = {}  # (PlanRecord, manifest, ...)
    for budget in order:
        t_plan = time.monotonic()
        plan, planned = plan_config(cfg, store, budget=budget, threads=threads, quiet=not progress)
        t_merge = time.monotonic()
        target = out_dir / "models" / _label(budget)
        # the sketches this budget's strategy reads (the default strategy may differ by budget)
        man = merge_plan(plan, replace(inputs, sketches=planned.sketches), target, store, threads=threads,
                         progress=progress, protect=protect)
        restored = "restored_from" in (run_record.read(target) or {})
        merged[budget] = (plan, man, t_merge - t_plan, time.monotonic() - t_merge, restored, target)
        b = man["bytes"]
        log(f"sweep: {budget}: read {b['expert_bytes_read'] / 2**20:,.1f} of "
            f"{b['total_expert_bytes'] / 2**20:,.1f} MiB expert bytes in {time.monotonic() - t_plan:.1f} s"
            + (" (restored from the store)" if restored else ""))
    reference = merged[full][5]
    listed = budgets if full in budgets else [*budgets, full]
    others = [b for b in listed if b != full]
    devs = dict(zip(others, deviations([merged[b][5] for b in others], reference, Path(cfg.base))))
    devs[full] = {"relative_update": 0.0, "relative_weights": 0.0}
    rows = []
    for budget in listed:
        plan, man, plan_s, merge_s, restored, target = merged[budget]
        dev = devs[budget]
        b = man["bytes"]
        computed = earlier.get(man["plan_hash"]) if restored else round(merge_s, 3)
        rows.append(SweepRow(str(budget), man["budget"]["bytes"], b["total_expert_bytes"],
                             b["planned_expert_bytes"], b["expert_bytes_read"], b["base_bytes_read"],
                             b["bytes_written"], round(plan_s, 3), round(merge_s, 3), restored,
                             man["bound"]["kind"], man["bound"]["relative"], dev["relative_update"],
                             dev["relative_weights"], man["plan_hash"], str(target),
                             b.get("sketch_bytes_read", 0), computed))
    return SweepResult(rows, cfg.method, index_bytes, round(index_seconds, 3), str(reference))


# ---------------------------------------------------------------- renderings

COLUMNS = [("budget", "budget"), ("expert_bytes_read", "expert MiB read"), ("sketch_bytes_read", "sketch MiB read"),
           ("read_fraction", "% of expert bytes"), ("base_bytes_read", "base MiB read"), ("plan_seconds", "plan s"),
           ("merge_seconds", "merge s"), ("bound_relative", "bound (rel.)"),
           ("deviation_update", "‖M_B−M_full‖/‖M_full−W0‖"), ("deviation_weights", "‖M_B−M_full‖/‖M_full‖")]


def _bound_name(kind: str) -> str:
    """What the plan's bound is (plan/bound_text.py): a bound only for additive methods."""
    return "certified bound" if kind == "certified" else "update left out (no bound)"


def _merge_time(row: SweepRow) -> str:
    if not row.restored:
        return f"{row.merge_seconds:.2f}"
    if row.computed_merge_seconds is None:
        return f"restored in {row.merge_seconds:.2f}"
    return f"{row.computed_merge_seconds:.2f} (restored in {row.merge_seconds:.2f})"


def _cell(key: str, row: SweepRow) -> str:
    if key == "merge_seconds":
        return _merge_time(row)
    v = row.read_fraction if key == "read_fraction" else getattr(row, key)
    if key.endswith("bytes_read"):
        return f"{v / 2**20:,.1f}"
    if key == "read_fraction":
        return f"{100 * v:.1f}"
    if key.endswith("seconds"):
        return f"{v:.2f}"
    if key in ("bound_relative", "deviation_update", "deviation_weights"):
        return f"{v:.3g}"
    return str(v)


def to_markdown(result: SweepResult) -> str:
    bound = f"{_bound_name(result.rows[0].bound_kind)} (rel.)"
    heads = [bound if k == "bound_relative" else h for k, h in COLUMNS]
    lines = [f"Budget sweep, method `{result.method}`; inputs indexed once in {result.index_seconds:.1f} s "
             f"({result.index_bytes_read / 2**20:,.1f} MiB index reads; 0 when cached).", "",
             "| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in result.rows:
        lines.append("| " + " | ".join(_cell(k, row) for k, _ in COLUMNS) + " |")
    if any(r.restored for r in result.rows):
        lines += ["", "restored: merged before with this plan and restored from the store (no weights read this "
                      "time); merge s is the computed merge's where an earlier sweep here recorded it."]
    return "\n".join(lines) + "\n"


def to_csv(result: SweepResult) -> str:
    buf = io.StringIO()
    fields = list(SweepRow.__dataclass_fields__)
    w = csv.DictWriter(buf, fieldnames=[*fields, "read_fraction"], lineterminator="\n")
    w.writeheader()
    for row in result.rows:
        w.writerow({**asdict(row), "read_fraction": row.read_fraction})
    return buf.getvalue()


def require_matplotlib() -> None:
    """Fail before any merge if the plot cannot be drawn.

    Raises:
        ConfigError: matplotlib is not installed.
    """
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("the sweep plot needs matplotlib: pip install 'mergepipe[bench]' "
                          "(or pass --no-plot for the table only)")


def _byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit the plot's byte axis is drawn in: the largest that keeps `largest` >= 1."""
    for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= scale:
            return name, scale
    return "B", 1


def _label_points(ax, points: list[tuple[float, float, str]]) -> None:
    """Annotate each (x, y) with its text, moving a label up or down (with a leader line)
    until it overlaps no label placed before it."""
    renderer = ax.figure.canvas.get_renderer()
    placed = []
    for x, y, text in points:
        for dy in (5, -13, 17, -25, 29, -37, 41, -49):
            arrow = None if dy == 5 else {"arrowstyle": "-", "lw": 0.5, "color": "0.6"}
            label = ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, dy), fontsize=7,
                                arrowprops=arrow, annotation_clip=False)
            box = label.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed):
                break
            label.remove()
        else:
            label = ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 5), fontsize=7)
            box = label.get_window_extent(renderer)
        placed.append(box)


def sweep_figure(result: SweepResult, *, title: str | None = None):
    """The plot as a matplotlib Figure. Left: bytes read (expert blocks + sketches) against
    the deviation from the full merge (realized, and the plan's bound); a log x-axis where
    the reads span more than a decade. Right: plan + merge wall time per budget, the
    computed merge's: a restored merge's bar is hollow, at the time an earlier sweep here
    recorded, or empty and labelled "restored" when none did. Needs matplotlib."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    rows = sorted(result.rows, key=lambda r: (r.bytes_read, r.budget_bytes))
    unit, scale = _byte_unit(max(r.bytes_read for r in rows))
    x = [r.bytes_read / scale for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=90, gridspec_kw={"width_ratios": [3, 2]})
    series = [("deviation_update", "o", "-", "realized ‖M_B−M_full‖/‖M_full−W0‖"),
              ("bound_relative", "s", "--", f"{_bound_name(rows[0].bound_kind)} (rel.)"),
              ("deviation_weights", "^", ":", "realized ‖M_B−M_full‖/‖M_full‖")]
    handles = []
    for key, marker, style, name in series:
        y = [getattr(r, key) for r in rows]
        (line,) = ax1.plot(x, y, linestyle=style, marker=marker, markersize=5, label=name)
        # a restored merge's marker is hollow: it read nothing this time
        line.set_markevery([i for i, r in enumerate(rows) if not r.restored])
        restored = [(xi, yi) for xi, yi, r in zip(x, y, rows) if r.restored]
        if restored:
            ax1.plot(*zip(*restored), linestyle="none", marker=marker, markersize=5, color=line.get_color(),
                     markerfacecolor="none")
        handles.append(line)
    if any(r.restored for r in rows):
        handles.append(Line2D([], [], linestyle="none", marker="o", color="0.3", markerfacecolor="none",
                              label="hollow: restored from the store"))
    positive = [xi for xi in x if xi > 0]
    if positive and max(positive) > 10 * min(positive):  # more than a decade: a log axis
        if len(positive) < len(x):
            ax1.set_xscale("symlog", linthresh=min(positive))
        else:
            ax1.set_xscale("log")
            ax1.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax1.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax1.xaxis.set_minor_formatter(NullFormatter())
    ax1.set_yscale("symlog", linthresh=1e-3)
    highest = max(getattr(r, key) for r in rows for key, *_ in series)
    ax1.set_ylim(0, 3 * highest if highest > 1e-3 else None)  # a deviation is a norm; room above for labels
    ax1.set_xlabel(f"bytes read: expert blocks + sketches ({unit})")
    ax1.set_ylabel("relative deviation from the full merge")
    ax1.grid(alpha=0.3)
    ax1.legend(handles=handles, fontsize=7)
    _time_bars(ax2, rows)
    fig.suptitle(title or f"mergepipe sweep ({result.method})", fontsize=10)
    fig.tight_layout()
    fig.canvas.draw()  # the layout, scales and limits the labels are placed in
    _label_points(ax1, [(xi, r.deviation_update, r.budget + (" (restored)" if r.restored else ""))
                        for xi, r in zip(x, rows)])
    return fig


def _time_bars(ax, rows: list[SweepRow]) -> None:
    names = [r.budget for r in rows]
    known = [r.computed_merge_seconds is not None for r in rows]
    heights = [r.plan_seconds + r.computed_merge_seconds if k else 0.0 for r, k in zip(rows, known)]
    fill = ["none" if r.restored else "tab:gray" for r in rows]
    bars = ax.bar(names, heights, color=fill, edgecolor="tab:gray")
    for bar, r, k in zip(bars, rows, known):
        if r.restored:
            bar.set_hatch("//")
            ax.annotate("restored" if k else "restored, not timed", (bar.get_x() + bar.get_width() / 2, 0),
                        textcoords="offset points", xytext=(0, 3), ha="center", va="bottom", rotation=90,
                        fontsize=7)
    ax.set_ylim(0, 1.15 * max(heights) if max(heights) > 0 else 1.0)
    ax.set_xlabel("budget (by bytes read)")
    ax.set_ylabel("plan + merge wall time (s)")
    ax.grid(alpha=0.3, axis="y")


def plot_png(result: SweepResult, *, title: str | None = None) -> bytes:
    """`sweep_figure` as PNG bytes."""
    fig = sweep_figure(result, title=title)
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
