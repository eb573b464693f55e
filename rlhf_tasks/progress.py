"""The training as the launcher follows it: the job's log passes through `Training` (a
file-like object the followers write to) once, line by line; the recipe's reader picks the
steps out of it. While following, a progress line (`step 120/1005 · reward 0.43 · loss 0.12
· 41 s/step · 10 h 05 m left · $312 so far`) stands in place under the log on a terminal, and
is printed as a plain line every few minutes otherwise; every step read goes to
runs/NAME/metrics.jsonl as it is read; at the end, `summary_lines` gives reward and loss
first -> last and best, a small curve of the reward, and a picture of the curves where
matplotlib is installed. A line the reader cannot read, or a reader that fails, costs the
progress line, never the log or the run."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

#: Seconds between plain progress lines when the output is not a terminal (a CI log, nohup).
PLAIN_EVERY_S = float(os.environ.get("RLHF_TASKS_PROGRESS_EVERY", "300"))
METRICS_FILE = "metrics.jsonl"
PICTURE_FILE = "metrics.png"
#: W&B's own line with the run's address: `wandb: 🚀 View run NAME at: https://wandb.ai/...`.
WANDB_RUN = re.compile(r"wandb:.*View run\b.*?\b(https?://\S+)")
SPARKS = "▁▂▃▄▅▆▇█"


def figure(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def duration(seconds: float) -> str:
    """`10 h 05 m`, `4 m 10 s`, `12 s`."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} m"
    if minutes:
        return f"{minutes} m {secs:02d} s"
    return f"{secs} s"


def per_step(seconds: float) -> str:
    return f"{seconds:.0f} s/step" if seconds >= 10 else f"{seconds:.2g} s/step"


def money(dollars: float) -> str:
    return f"${dollars:.0f}" if dollars >= 100 else f"${dollars:.2f}"


def sparkline(values: list[float], width: int = 60) -> str:
    """The values as one line of block characters, averaged into at most `width` buckets."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return ""
    buckets = min(width, len(values))
    means = []
    for i in range(buckets):
        part = values[i * len(values) // buckets:(i + 1) * len(values) // buckets] or values[-1:]
        means.append(sum(part) / len(part))
    low, high = min(means), max(means)
    span = (high - low) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - low) / span * len(SPARKS)))] for v in means)


class Training:
    """The job's log on its way to `out`, and what the recipe's `reader` reads in it.

    `price_per_hour`: what the cluster costs (the progress line's `$ so far`, counted from
    `started`); `run_dir`: where metrics.jsonl goes; `terminal`: draw the progress line in place
    (default: whether `out` is a terminal)."""

    def __init__(self, reader, out=None, run_dir: Path | None = None, price_per_hour: float | None = None,
                 started: float | None = None, terminal: bool | None = None, say=None,
                 clock=time.monotonic, plain_every_s: float | None = None, on_wandb=None):
        self.reader, self.out = reader, out or sys.stdout
        self.run_dir, self.price = run_dir, price_per_hour
        self.clock = clock
        self.started = started if started is not None else clock()
        if terminal is None:
            try:
                terminal = bool(self.out.isatty()) and os.environ.get("TERM") != "dumb"
            except (AttributeError, ValueError):
                terminal = False
        self.terminal = terminal
        self._last_drawn: str | None = None
        if terminal:
            from . import console

            console.before_say.append(self._clear)  # a message of the launcher's takes the line first
        self.say, self.on_wandb = say, on_wandb
        self.plain_every_s = PLAIN_EVERY_S if plain_every_s is None else plain_every_s
        self.steps: dict[int, dict] = {}
        self.order: list[int] = []           # steps in the order read (a restart reads some again)
        self.seen_at: list[tuple[float, int]] = []  # (clock, step) of each step read, for the pace
        self.pending = ""                  # the log's text after its last newline
        self.pending_read = 0              # how much of it was read (a bar's redraws)
        self.drawn = False
        self.last_plain = self.started
        self.plain_step: int | None = None
        self.wandb_url: str | None = None
        self.failed = False
        self._file = None
        if run_dir is not None:
            try:
                run_dir.mkdir(parents=True, exist_ok=True)
                self._file = open(run_dir / METRICS_FILE, "w")
            except OSError:
                self._file = None

    # ---------------------------------------------------------------- the log passing through

    def write(self, text: str) -> None:
        """The log's next text: shown, and its lines read once each as they end. Of a line not
        ended yet, the redraws of a bar that are done are read at once (a nested tqdm bar's newest
        redraw ends in no newline, and may stand for minutes); the rest waits for its newline."""
        if not text:
            return
        self._clear()
        self.out.write(text)
        data = self.pending + text
        cut = data.rfind("\n") + 1
        if len(data) - cut > 1 << 20:  # a line without end (a tqdm bar redrawing itself): read what is there
            cut = len(data)
        complete, self.pending = data[self.pending_read:cut] if cut else "", data[cut:]
        if cut:
            self.pending_read = 0
        for line in complete.splitlines():
            self._read(line)
        if self.reader is not None and not self.failed:
            from .recipes.metrics import redrawn

            newest = self.pending[self.pending_read:]
            done = redrawn(newest)
            if done:
                self._read(newest[:done])
                self.pending_read += done
        if text.endswith("\n"):
            self._show()

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return self.terminal

    def tick(self) -> None:
        """Called while waiting with nothing new in the log: the plain line may be due."""
        self._show()

    def _read(self, line: str) -> None:
        if self.wandb_url is None and "View run" in line and "wandb" in line and len(line) < 4096:
            found = WANDB_RUN.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
            if found:
                self.wandb_url = found.group(1).rstrip(".,)")
                if self.say:
                    self._clear()
                    self.say(f"W&B run: {self.wandb_url}")
                if self.on_wandb:
                    try:
                        self.on_wandb(self.wandb_url)
                    except Exception:  # noqa: BLE001
                        pass
        if self.reader is None or self.failed:
            return
        try:
            records = self.reader.records(line) if hasattr(self.reader, "records") else [self.reader.read(line)]
        except Exception:  # noqa: BLE001 - a reader's bug loses the progress line, never the run
            self.failed = True
            return
        for record in records:
            if record and isinstance(record.get("step"), int):
                self._record(record)

    def _record(self, record: dict) -> None:
        step = record["step"]
        now = self.clock()
        record = {**record, "at": round(time.time(), 3)}
        self.steps[step] = {**self.steps.get(step, {}), **record,
                            "values": {**self.steps.get(step, {}).get("values", {}), **record.get("values", {})}}
        self.order.append(step)
        self.seen_at.append((now, step))
        if self._file is not None:
            try:
                self._file.write(json.dumps(self.steps[step]) + "\n")
                self._file.flush()
            except (OSError, ValueError):
                self._file = None

    # ---------------------------------------------------------------- the progress line

    def last(self) -> dict | None:
        return self.steps[self.order[-1]] if self.order else None

    def pace_s(self) -> float | None:
        """Seconds per step: the framework's own step time (the median of the last few), else
        the launcher's clock between the steps it read."""
        timed = [self.steps[s]["step_s"] for s in self.order[-5:] if self.steps[s].get("step_s")]
        if timed:
            return sorted(timed)[len(timed) // 2]
        if len(self.seen_at) >= 2:
            (t0, s0), (t1, s1) = self.seen_at[0], self.seen_at[-1]
            if s1 > s0:
                return (t1 - t0) / (s1 - s0)
        return None

    def line(self) -> str | None:
        last = self.last()
        if last is None:
            return None
        total = last.get("total")
        parts = [f"step {last['step']}/{total}" if total else f"step {last['step']}"]
        for name in ("reward", "loss", "kl"):
            if last.get(name) is not None:
                parts.append(f"{name} {figure(last[name])}")
        pace = self.pace_s()
        if pace:
            parts.append(per_step(pace))
            if total and total >= last["step"]:
                parts.append(f"{duration((total - last['step']) * pace)} left")
        if not total and getattr(self.reader, "no_total", None):
            parts.append(self.reader.no_total)
        if self.price:
            parts.append(f"{money(self.price * (self.clock() - self.started) / 3600)} so far")
        return " · ".join(parts)

    def _show(self) -> None:
        try:
            text = self.line()
        except Exception:  # noqa: BLE001
            return
        if text is None:
            return
        if self.terminal:
            if self.pending or (self.drawn and text == self._last_drawn):
                return  # the log's line is not ended (a bar stands on it): the line waits for its end
            width = shutil.get_terminal_size((120, 24)).columns
            self.out.write("\r\x1b[K" + text[: max(20, width - 1)])
            self.out.flush()
            self.drawn, self._last_drawn = True, text
            return
        now = self.clock()
        if now - self.last_plain >= self.plain_every_s and self.order[-1] != self.plain_step:
            self.last_plain, self.plain_step = now, self.order[-1]
            self.out.write(("\n" if self.pending else "") + f"[{time.strftime('%H:%M:%S')}] rlhf-tasks: {text}\n")
            self.out.flush()

    def _clear(self) -> None:
        if self.drawn:
            self.out.write("\r\x1b[K")
            self.drawn = False

    def close(self) -> None:
        """The end of following: the last partial line is read, the in-place line goes, and
        metrics.jsonl is rewritten with one line per step (the last reading of a step wins)."""
        if self.pending[self.pending_read:]:
            self._read(self.pending[self.pending_read:])
        self.pending, self.pending_read = "", 0
        self._clear()
        self.out.flush()
        from . import console

        if self._clear in console.before_say:
            console.before_say.remove(self._clear)
        if self._file is not None:
            self._file.close()
            self._file = None
            try:
                (self.run_dir / METRICS_FILE).write_text(
                    "".join(json.dumps(self.steps[s]) + "\n" for s in sorted(self.steps)))
            except OSError:
                pass

    # ---------------------------------------------------------------- the end

    def summary_lines(self) -> list[str]:
        steps = [self.steps[s] for s in sorted(self.steps)]
        lines = []
        for name, best_of in (("reward", max), ("loss", min)):
            known = [(s["step"], s[name]) for s in steps if s.get(name) is not None and math.isfinite(s[name])]
            if not known:
                continue
            best = best_of(known, key=lambda pair: pair[1])
            lines.append(f"{name} {figure(known[0][1])} -> {figure(known[-1][1])} over steps "
                         f"{known[0][0]}..{known[-1][0]}, best {figure(best[1])} at step {best[0]}")
            if name == "reward" and len(known) > 1:
                lines.append(f"reward curve: {sparkline([v for _, v in known])} "
                             f"({figure(min(v for _, v in known))}..{figure(max(v for _, v in known))})")
        if self.run_dir is not None and steps:
            lines.append(f"training metrics: {self.run_dir / METRICS_FILE} ({len(steps)} steps)")
            lines.append(picture(steps, self.run_dir / PICTURE_FILE))
        elif self.reader is not None and not steps:
            lines.append("training metrics: no step of the framework's metric lines was read from the log")
        if self.wandb_url:
            lines.append(f"W&B run: {self.wandb_url}")
        return lines


def picture(steps: list[dict], path: Path) -> str:
    """The curves (reward, loss, KL over the steps) drawn into `path` with matplotlib, where it
    is installed; the summary line that says where, or why not."""
    try:
        import matplotlib
    except ImportError:
        return f"no picture of the curves: matplotlib is not installed in {sys.executable}'s environment " \
               f"(pip install matplotlib draws {path.name} next time)"
    try:
        matplotlib.use("Agg")
        from matplotlib import pyplot

        names = [n for n in ("reward", "loss", "kl") if any(s.get(n) is not None for s in steps)]
        if not names:
            return "no picture of the curves: no reward, loss or KL was read"
        fig, axes = pyplot.subplots(len(names), 1, figsize=(8, 2.6 * len(names)), sharex=True, squeeze=False)
        for ax, name in zip(axes[:, 0], names):
            points = [(s["step"], s[name]) for s in steps if s.get(name) is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=1.2)
            ax.set_ylabel(name)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        pyplot.close(fig)
    except Exception as exc:  # noqa: BLE001 - a picture is not worth a failed summary
        return f"no picture of the curves: matplotlib failed ({type(exc).__name__}: {exc})"
    return f"curves: {path}"


def last_step(run_dir: Path) -> dict | None:
    """The last step recorded in run_dir's metrics.jsonl (for `status NAME`)."""
    try:
        with open(run_dir / METRICS_FILE, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 65536))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "step" in record:
            return record
    return None


def status_line(record: dict, now: float | None = None) -> str:
    """`step 120/1005 · reward 0.43 · loss 0.12 · kl 0.001 (read 2 m 10 s ago)`."""
    total = record.get("total")
    parts = [f"step {record['step']}/{total}" if total else f"step {record['step']}"]
    for name in ("reward", "loss", "kl"):
        if record.get(name) is not None:
            parts.append(f"{name} {figure(record[name])}")
    if record.get("step_s"):
        parts.append(per_step(record["step_s"]))
    line = " · ".join(parts)
    if record.get("at"):
        line += f" (read {duration((now or time.time()) - record['at'])} ago)"
    return line
