"""Reading a framework's own metric lines: the step (and the total), the reward (mean), the
policy loss, the KL and the step time, as each framework prints them. Pure: a reader is fed
the job's log one line at a time and answers a step's values or None; a line it cannot read
(another framework's, a half-written one, a shape it does not know) is left alone, never an
error. Each recipe picks its reader (`JobBase.metrics_reader`); the launcher follows.

The shapes, from the frameworks' own code at the versions the recipes pin, and at the
releases they support (verl 0.8.0, OpenRLHF 0.6.4 and 0.9.10; tests/test_metrics.py and
tests/test_bars.py feed them those releases' own lines):

- verl 0.9.1 and 0.8.0: `verl/utils/logger/aggregate_logger.py` concat_dict_to_str, printed by the
  console logger of `verl/utils/tracking.py`: `step:12 - actor/pg_loss:0.0123 - ...`, each
  value `pprint.pformat`ted (numpy 2's scalars as `np.float64(0.5)`); `verl/trainer/ppo/
  ray_trainer.py` prints `Total training steps: N`. Search-R1 (commit a14dc3a, a fork of an
  early verl): the same line with `{v:.3f}` values (its `verl/utils/logger/aggregate_logger.py`
  lines 21-27) and the same total line (its `verl/trainer/ppo/ray_trainer.py` line 429).
- OpenRLHF 0.11.2: `openrlhf/trainer/ppo_trainer.py` line 551 logs
  `✨ Global step 12: {'policy_loss': ..., 'kl': ..., 'reward': ..., 'timing/step_total': ...}`
  through `openrlhf/utils/logging_utils.py`'s logger (`INFO 11-28 06:40:01 ppo_trainer.py:551] ...`).
- OpenRLHF 0.9.10 prints the same line (`ppo_trainer.py` line 541) and no total; its
  `Episode [e/E]` bar, without a postfix, counts the episode's prompts (lines 514-518, 560).
- OpenRLHF 0.6.1, 0.6.4, 0.7.0 and OpenRLHF-M (0.6.1): no log line per step; the trainer's tqdm bar
  `Episode [1/1]` carries the step's status as its postfix (`ppo_trainer.py` lines 225-254:
  set_postfix(status), then update()): `Episode [1/1]:  12%|...| 12/100 [08:12<1:00:01,
  41.02s/it, policy_loss=0.0123, kl=0.000456, reward=0.43, ...]` (0.6.4 and 0.7.0: `trainer/ray/
  ppo_actor.py` lines 195-231 and 203-234).
- OpenRLHF's torchrun trainers (SFT, RM, DPO; 0.6.1 to 0.11.2): the tqdm bar `Train step of
  epoch E` with the batch's logs as postfix (`loss`, `chosen_reward`, `reject_reward`, `acc` for
  RM and DPO; `gpt_loss` for SFT), nested under the bar `Train epoch` that counts the epochs
  (TorchrunTrainerReader says which release sets the postfix before its update).
- tiny-grpo (rlhf_tasks/demo/train.py): `step 12/150  reward 0.431  loss +0.012  834 ms`.
"""

from __future__ import annotations

import ast
import math
import re

#: Longer lines are left alone: no framework prints a step's metrics in a megabyte.
MAX_LINE = 1 << 20
#: Ray's prefix of a worker's line, `(TaskRunner pid=123, ip=10.0.0.2) `, and terminal colours.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_RAY_PREFIX = re.compile(r"^\s*\(\w[\w.-]* pid=\d+(?:, ip=[\w.:-]+)?\)\s?")
_NUMBER = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$|^[-+]?(?:nan|inf|infinity)$", re.I)


def clean(line: str) -> str:
    """The line without colours, Ray's worker prefix and the line end."""
    line = _ANSI.sub("", line).strip("\r\n")
    return _RAY_PREFIX.sub("", line, count=1)


def number(text: str) -> float | None:
    """A printed number: `0.43`, `1e-06`, `nan`, `np.float64(0.5)`, `tensor(0.5)`; None for anything else."""
    text = text.strip()
    if len(text) > 80:  # no number is that long; nor is it worth a regular expression's time
        return None
    wrapped = re.fullmatch(r"[\w.]+\(([^()]*?)(?:,.*)?\)", text)  # np.float64(0.5), tensor(0.5, device=...)
    if wrapped:
        text = wrapped.group(1).strip()
    if text in ("True", "False"):
        return None
    if not _NUMBER.match(text):
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value


def step_record(step: int, values: dict[str, float], total: int | None = None, reward: str | tuple = (),
                loss: str | tuple = (), kl: str | tuple = (), step_s: str | tuple = ()) -> dict:
    """One step's values: `step`, `total`, `reward`, `loss`, `kl`, `step_s` (those known, from
    the first of the framework's keys present) and `values`, every value read."""
    record: dict = {"step": step}
    if total:
        record["total"] = total
    for name, keys in (("reward", reward), ("loss", loss), ("kl", kl), ("step_s", step_s)):
        for key in (keys,) if isinstance(keys, str) else keys:
            value = values.get(key)
            if value is not None and math.isfinite(value):
                record[name] = value
                break
    record["values"] = values
    return record


#: Where one redraw of a tqdm bar ends and the next text begins: the carriage return before a
#: redraw, and the cursor moves a nested bar's redraw is wrapped in (tqdm's moveto: `\n` down to
#: its line, `ESC[A` back up), after which whatever is printed next lands on the bar's line.
_REDRAW_CUT = re.compile(r"\r|\x1b\[\d*[AB]")
_SGR = re.compile(r"\x1b\[[0-9;]*m")


def parts(line: str) -> list[str]:
    """A log line's parts: each redraw of a bar, and each text printed beside one (a `print` right
    after a nested redraw, on the bar's line), apart."""
    found = []
    for part in _REDRAW_CUT.split(_SGR.sub("", line)):
        part = clean(part)
        meter = tqdm_meter(part) if "%|" in part else None
        if meter and meter["end"] < len(part.rstrip()):  # a meter, then what was printed after it
            found += [part[:meter["end"]], part[meter["end"]:].strip()]
        elif part:
            found.append(part)
    return [part for part in found if part]


def finished_redraw(text: str) -> bool:
    """Whether `text`, the newest text of a log that no newline ended yet, is a whole redraw of a
    tqdm bar (its meter written up to its closing bracket), which the next redraw would only repeat
    or replace: it can be read now. Any other unended text waits for its newline."""
    text = clean(text)
    meter = tqdm_meter(text) if "%|" in text and len(text) < 65536 else None
    return bool(meter) and meter["end"] >= len(text.rstrip())


def redrawn(text: str) -> int:
    """How much of `text`, the newest text of a log that no newline ended yet, is redraws of a bar
    that are done: up to its last carriage return or cursor move, or to its end where that ends a
    whole redraw (`finished_redraw`). The rest (a line being written) waits for its newline."""
    if len(text) > MAX_LINE:
        return 0
    done = 0
    for cut in _REDRAW_CUT.finditer(text):
        done = cut.end()
    return len(text) if finished_redraw(text[done:]) else done


class Reader:
    """Reads one framework's lines; `records(line)` -> the steps its parts show (`read(line)`: the
    last of them, or None). Never raises."""

    def __init__(self, total: int | None = None):
        self.total = total

    def records(self, line: str) -> list[dict]:
        if len(line) > MAX_LINE:
            return []
        found = []
        try:
            for part in parts(line):  # a tqdm bar redraws itself after a carriage return
                record = self._read(part)
                if record is not None:
                    found.append(record)
        except Exception:  # noqa: BLE001 - an odd line is left alone, whatever it is
            return found
        return found

    def read(self, line: str) -> dict | None:
        found = self.records(line)
        return found[-1] if found else None

    def _read(self, line: str) -> dict | None:  # pragma: no cover - abstract
        raise NotImplementedError


_TOTAL_STEPS = re.compile(r"Total training steps: (\d+)")
_VERL_STEP = re.compile(r"(?:^|\s)step:(\d+) - (.+)$")


class VerlReader(Reader):
    """verl's (and Search-R1's) console logger."""

    REWARD = ("critic/score/mean", "critic/rewards/mean")
    LOSS = ("actor/pg_loss",)
    KL = ("actor/kl_loss", "actor/reward_kl_penalty", "critic/kl")
    STEP_S = ("timing_s/step",)

    def _read(self, line: str) -> dict | None:
        total = _TOTAL_STEPS.search(line)
        if total:
            self.total = int(total.group(1))
            return None
        found = _VERL_STEP.search(line)
        if not found:
            return None
        values = {}
        for part in found.group(2).split(" - "):
            key, sep, text = part.rpartition(":")
            value = number(text) if sep else None
            if key and value is not None:
                values[key.strip()] = value
        if not values:
            return None
        return step_record(int(found.group(1)), values, self.total, self.REWARD, self.LOSS, self.KL, self.STEP_S)


_GLOBAL_STEP = re.compile(r"Global step (\d+): (\{.*\})\s*$")
_PAIR = re.compile(r"'([^']+)': ([^,{}]+)")


_EPISODE = re.compile(r"Episode \[(\d+)/(\d+)\]")


class OpenRLHFReader(Reader):
    """OpenRLHF's PPO/GRPO trainer: the `Global step N: {status}` line (0.8.11 to 0.11.2 read), or
    the postfix of its `Episode [e/E]` tqdm bar (0.6.1, 0.6.4, 0.7.0 and OpenRLHF-M).

    The `Global step` releases print no total: it is the episodes times the steps of one, which
    their `Episode` bar (no postfix) gives with the recipe's `bar_counts`: "prompts" (0.9.10 to
    0.11.2: the bar counts an episode's prompts, `ppo_trainer.py` lines 514-518 and 560 of 0.9.10,
    and a step takes `rollout_batch_size` of them) or "batches" (0.8.11 and 0.9.0: one a step,
    0.8.11's lines 458-472); told neither, the bar's own advance over a step gives them from the
    second step on."""

    REWARD = ("reward",)
    LOSS = ("policy_loss",)
    KL = ("kl",)
    STEP_S = ("timing/step_total",)
    #: What the progress line says while no total is known.
    NO_TOTAL = "no time left: OpenRLHF prints no total (its Episode bar gives one once it moves)"

    def __init__(self, total: int | None = None, rollout_batch_size: int | None = None, bar_counts: str | None = None):
        super().__init__(total)
        self.bar = TqdmBar(r"Episode \[(\d+)/(\d+)\]", postfix_first=True)
        self.per_step = rollout_batch_size if bar_counts == "prompts" else 1 if bar_counts == "batches" else None
        self.episode: tuple[int, int, int, int] | None = None  # the bare Episode bar: episode, episodes, n, total
        self.no_total = self.NO_TOTAL

    def _episode_bar(self, line: str) -> None:
        """A redraw of the Episode bar without a postfix (the `Global step` releases): its counts kept."""
        meter = tqdm_meter(line) if "Episode [" in line else None
        episode = _EPISODE.search(meter["desc"]) if meter and not meter["postfix"] else None
        if not episode:
            return
        now = (int(episode.group(1)), int(episode.group(2)), int(meter["n"]), int(meter["total"]))
        if self.episode and self.episode[:2] == now[:2] and now[2] > self.episode[2]:
            self.per_step = now[2] - self.episode[2]  # its advance over one step
        self.episode = now

    def steps_total(self) -> int | None:
        if self.total:
            return self.total
        if self.episode and self.per_step:
            return self.episode[1] * (self.episode[3] // self.per_step) or None
        return None

    def _read(self, line: str) -> dict | None:
        found = _GLOBAL_STEP.search(line)
        if found:
            try:
                status = ast.literal_eval(found.group(2))
                values = {str(k): float(v) for k, v in status.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)}
            except (ValueError, SyntaxError, TypeError, AttributeError):
                values = {k: v for k, text in _PAIR.findall(found.group(2)) if (v := number(text)) is not None}
            if not values:
                return None
            return step_record(int(found.group(1)), values, self.steps_total(), self.REWARD, self.LOSS, self.KL,
                               self.STEP_S)
        self._episode_bar(line)  # and its bar, postfix or not, for the order its first redraws show (TqdmBar)
        return bar_record(self.bar, line, self.total, self.REWARD, self.LOSS, self.KL,
                          ("timing/step_total", "tqdm/s_per_it"))


def bar_record(bar: "TqdmBar", line: str, total, reward, loss, kl, step_s) -> dict | None:
    """The step a tqdm bar's line shows, its rate (seconds per step) among its values."""
    seen = bar.read(line)
    if seen is None:
        return None
    step, bar_total, values, rate_s = seen
    if rate_s is not None:
        values.setdefault("tqdm/s_per_it", rate_s)
    return step_record(step, values, bar_total or total, reward, loss, kl, step_s)


#: What follows a tqdm bar: `| 12/100 [08:12<1:00:01, 41.02s/it, k=v, k=v]` (matched after the bar).
_TQDM_TAIL = re.compile(r"\s*(?P<n>\d+)/(?P<total>\d+)\s+\[(?P<elapsed>[^<\]]*)<(?P<left>[^,\]]*)"
                        r"(?:,\s*(?P<rate>[^,\]]*))?(?:,\s*(?P<postfix>[^\]]*))?\]")
_PERCENT = re.compile(r"(\d{1,3})\s*$")


def tqdm_meter(line: str) -> dict | None:
    """A tqdm bar's printed meter, `DESC:  12%|bar| 12/100 [08:12<1:00:01, 41.02s/it, k=v]`, as
    {desc, n, total, rate, postfix, end} (`end`: where its closing bracket ends it in `line`; what
    follows was printed after it); found from its `%|` (no regular expression over the whole line,
    whose backtracking a long odd line could make slow)."""
    at = line.find("%|")
    if at < 0:
        return None
    percent = _PERCENT.search(line, max(0, at - 8), at)
    end = line.find("|", at + 2)
    if percent is None or end < 0:
        return None
    tail = _TQDM_TAIL.match(line, end + 1)
    if tail is None:
        return None
    desc = line[:percent.start()].rstrip().removesuffix(":")
    return {"desc": desc, **tail.groupdict(), "end": tail.end()}


def tqdm_rate(text: str | None) -> float | None:
    """Seconds per iteration from tqdm's `41.02s/it` or `1.50it/s`."""
    found = re.fullmatch(r"\s*([\d.]+)\s*(s/it|it/s)\s*", text or "")
    if not found:
        return None
    value = float(found.group(1))
    if found.group(2) == "s/it":
        return value
    return 1.0 / value if value else None


def tqdm_postfix(text: str | None) -> dict[str, float]:
    values = {}
    for part in (text or "").split(", "):
        key, sep, raw = part.partition("=")
        value = number(raw) if sep else None
        if value is not None:
            values[key.strip()] = value
    return values


class TqdmBar:
    """One tqdm bar whose description matches `desc` (groups: the epoch and, optionally, the
    epochs), read from its printed meter. Its count `n` of `total` per epoch becomes a step
    over all epochs.

    Where a trainer sets the postfix to a step's values matters: set before its update
    (`postfix_first`), the new values are drawn beside the old count (a changed postfix is step
    n + 1, an unchanged one, the update's redraw, step n); set after it, the update's redraw shows
    the new count beside the previous step's values (not read) and the postfix's redraw step n.
    The bar itself tells which: a trainer that sets the postfix first draws one before the bar's
    count ever moved; one that updates first draws its first postfix at a count the bar moved to,
    in the redraw after the update's. Until a bar from its start was seen, `postfix_first` (the
    recipe's release) decides."""

    def __init__(self, desc: str, postfix_first: bool, epoch_base: int = 1):
        self.desc = re.compile(desc)
        self.postfix_first, self.epoch_base = postfix_first, epoch_base
        self.order: bool | None = None  # postfix first, as the bar showed it; None: not seen yet
        self.epochs: int | None = None
        self._bar: str | None = None  # the description of the bar being drawn
        self._start: tuple[int, bool] | None = None  # its first count, and whether it had no postfix then
        self.last_n: int | None = None
        self.last_postfix: str | None = None

    def read(self, line: str) -> tuple[int, int | None, dict[str, float], float | None] | None:
        found = tqdm_meter(line)
        if not found:
            return None
        desc = self.desc.search(found["desc"])
        if not desc:
            return None
        n, per_epoch, postfix = int(found["n"]), int(found["total"]), found["postfix"] or ""
        if found["desc"] != self._bar or (self.last_n is not None and n < self.last_n):  # a new bar
            self._bar, self._start, self.last_n, self.last_postfix = found["desc"], (n, not postfix), None, None
        before_n, before_postfix = self.last_n, self.last_postfix
        self.last_n, self.last_postfix = n, postfix
        values = tqdm_postfix(postfix)
        if not values:
            return None
        if self.order is None and self._start[1] and not before_postfix:  # the bar's first postfix
            if n == self._start[0]:
                self.order = True
            elif before_n == n:
                self.order = False
        if self.postfix_first if self.order is None else self.order:
            n = n + 1 if postfix != before_postfix else n
        elif before_n is not None and before_n != n:
            return None  # the update's redraw: the previous step's values beside the new count
        if n < 1 or n > per_epoch:
            return None
        epoch = int(desc.group(1)) - self.epoch_base if desc.groups() else 0
        epochs = int(desc.group(2)) if desc.groups() and desc.re.groups >= 2 and desc.group(2) else self.epochs
        total = per_epoch * epochs if epochs else None
        return epoch * per_epoch + n, total, values, tqdm_rate(found["rate"])


_EPOCHS_BAR = re.compile(r"^Train epoch:?\s+\d+%\|[^|]*\|\s*\d+/(\d+)\s")


class TorchrunTrainerReader(Reader):
    """OpenRLHF's SFT, RM and DPO trainers (torchrun): the `Train step of epoch E` bar, nested
    under `Train epoch`. RM and DPO set the postfix before the update in every release (0.11.2:
    `rm_trainer.py` lines 192-193, `dpo_trainer.py` lines 200-201); SFT did so up to 0.10.2
    (0.9.10: `sft_trainer.py` lines 179-180; 0.6.1 and 0.6.4: lines 200-201) and updates first
    since 0.11 (0.11.2: line 161, then 205). A torchrun task names no release: `postfix_first`
    is the pinned release's order (0.11.2), and the bar itself tells its release's (TqdmBar)."""

    REWARD = ("chosen_reward",)
    LOSS = ("loss", "gpt_loss")

    def __init__(self, postfix_first: bool = True, total: int | None = None):
        super().__init__(total)
        self.bar = TqdmBar(r"^Train step of epoch (\d+)", postfix_first, epoch_base=0)

    def _read(self, line: str) -> dict | None:
        epochs = _EPOCHS_BAR.match(line)
        if epochs:
            self.bar.epochs = int(epochs.group(1))
            return None
        return bar_record(self.bar, line, self.total, self.REWARD, self.LOSS, (), ("tqdm/s_per_it",))


_TINY = re.compile(r"^step (\d+)/(\d+)\s+reward (\S+)\s+loss (\S+)\s+(\d+) ms\s*$")


class TinyGrpoReader(Reader):
    """The demo's trainer (rlhf_tasks/demo/train.py)."""

    def _read(self, line: str) -> dict | None:
        found = _TINY.match(line)
        if not found:
            return None
        reward, loss = number(found.group(3)), number(found.group(4))
        if reward is None or loss is None:
            return None
        values = {"mean_reward": reward, "loss": loss, "seconds": int(found.group(5)) / 1000}
        return step_record(int(found.group(1)), values, int(found.group(2)), "mean_reward", "loss", (), "seconds")
