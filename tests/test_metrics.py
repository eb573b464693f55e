"""Each recipe reads its framework's own metric lines (rlhf_tasks/recipes/metrics.py), fed
lines that the frameworks' own logging code prints at the versions the recipes pin
(tests/frameworks.py loads it from their wheels); where that code cannot run here, the line
is formatted from their source, which the test reads from the wheel to check it is still
there. Search-R1 is not on PyPI: its shape is taken from its source (commit a14dc3a)."""

from __future__ import annotations

import contextlib
import io
import sys

import pytest

import frameworks
from conftest import need
from rlhf_tasks.recipes.metrics import OpenRLHFReader, TinyGrpoReader, TorchrunTrainerReader, VerlReader, number
from rlhf_tasks.recipes.openrlhf import OpenRLHFPPOJob
from rlhf_tasks.recipes.openrlhf_m import OpenRLHFMGrpoJob
from rlhf_tasks.recipes.search_r1 import SearchR1Job
from rlhf_tasks.recipes.tiny_grpo import TinyGrpoJob
from rlhf_tasks.recipes.torchrun import TorchrunJob
from rlhf_tasks.recipes.verl import VERL_VERSION, VerlPPOJob

OPENRLHF_CURRENT, OPENRLHF_M_BASE = "0.11.2", "0.6.1"

#: Lines a job's log also holds: none of them is a step, and none breaks a reader.
ODD = ["", "\n", "step:", "step:abc - x:1", "step:3 - ", "Global step 4: {broken", "Global step 5: {}",
       "Episode [1/1]:   0%|          | 0/10 [00:00<?, ?it/s]", "\x1b[31m(pid=1)\x1b[0m step:7 - a:b",
       "Traceback (most recent call last):", "step 1/x  reward y  loss z  1 ms", "\x00\xff\ufffd" * 50,
       "Train step of epoch 0:  50%|#####     | 5/10 [00:05<00:05, 1.00s/it]",
       "step:8 - k" + "1" * 100000, "Global step 6: {'reward': " + "[" * 5000 + "}", "(TaskRunner pid=1) step:9 - actor/pg_loss:[1, 2]"]


def captured(call) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        call()
    return out.getvalue()


def read_all(reader, text: str) -> list[dict]:
    return [found for line in text.splitlines(keepends=True) if (found := reader.read(line))]


# --- verl and Search-R1 ----------------------------------------------------------------------


@pytest.fixture(scope="module", params=[VERL_VERSION, "0.8.0"])
def verl_logger(request):
    """verl's console logger of the release the recipe pins, and of 0.8.0, which it supports."""
    module, why = frameworks.wheel_module("verl", request.param, "verl/utils/logger/aggregate_logger.py")
    need(module is not None, f"verl {request.param}: {why}")
    module.VERSION = request.param
    return module


def test_verl_reads_its_console_logger(verl_logger):
    numpy = pytest.importorskip("numpy")
    trainer, why = frameworks.wheel_source("verl", verl_logger.VERSION, "verl/trainer/ppo/ray_trainer.py")
    line = {VERL_VERSION: 441, "0.8.0": 444}[verl_logger.VERSION]
    assert trainer.splitlines()[line - 1].strip() == 'print(f"Total training steps: {self.total_training_steps}")'

    total = 1005
    log = f"Total training steps: {total}\n"
    logger = verl_logger.LocalLogger(print_to_console=True)
    for step in (1, 2, 120):
        metrics = {"actor/pg_loss": numpy.float64(0.12 / step), "actor/kl_loss": 0.001 * step,
                   "critic/score/mean": numpy.float64(0.1 * step % 1), "critic/rewards/mean": 5.0,
                   "timing_s/step": 41.25, "actor/lr": 1e-06, "training/global_step": step,
                   "response_length/mean": numpy.float32(211.5), "sample": "not a number"}
        log += captured(lambda: logger.log(data=metrics, step=step))
    # Ray prefixes the lines its workers print: the TaskRunner runs the trainer
    log = "".join(f"\x1b[36m(TaskRunner pid=4242)\x1b[0m {line}\n" for line in log.splitlines())
    assert "np.float64(" in log or "step:120 - actor/pg_loss:0.001" in log  # numpy 2 prints its scalars so
    steps = read_all(VerlPPOJob.model_validate({"recipe": "verl-ppo"}).metrics_reader(), log)
    assert [s["step"] for s in steps] == [1, 2, 120]
    last = steps[-1]
    assert last["total"] == total
    assert last["reward"] == pytest.approx(0.1 * 120 % 1)
    assert last["loss"] == pytest.approx(0.001)
    assert last["kl"] == pytest.approx(0.12)
    assert last["step_s"] == 41.25
    assert last["values"]["actor/lr"] == 1e-06 and last["values"]["response_length/mean"] == 211.5
    assert "sample" not in last["values"]


def test_search_r1_reads_its_three_decimals():
    """Search-R1 a14dc3a, verl/utils/logger/aggregate_logger.py lines 21-27: `f'{k}:{v:.3f}'`
    joined by ' - ' after `step:{step}` (not on PyPI: formatted here as its source does)."""
    metrics = {"critic/score/mean": 0.4312, "actor/pg_loss": -0.0123, "actor/kl_loss": 0.0009, "timing_s/step": 88.4,
               "env/number_of_valid_search": 2.0}
    line = " - ".join([f"step:{17}"] + [f"{k}:{v:.3f}" for k, v in metrics.items()])
    reader = SearchR1Job.model_validate({"recipe": "search-r1"}).metrics_reader()
    found = reader.read(line)
    assert found["step"] == 17 and found["total"] == 1005  # the recipe's total_training_steps
    assert (found["reward"], found["loss"], found["kl"], found["step_s"]) == (0.431, -0.012, 0.001, 88.4)
    assert reader.read("Total training steps: 300") is None and reader.read(line)["total"] == 300


# --- OpenRLHF and OpenRLHF-M -----------------------------------------------------------------


def test_openrlhf_reads_its_global_step_line():
    module, why = frameworks.wheel_module("openrlhf", OPENRLHF_CURRENT, "openrlhf/utils/logging_utils.py")
    need(module is not None, f"openrlhf {OPENRLHF_CURRENT}: {why}")
    trainer, _ = frameworks.wheel_source("openrlhf", OPENRLHF_CURRENT, "openrlhf/trainer/ppo_trainer.py")
    said = 'logger.info(f"✨ Global step {global_step}: {log_status}")'
    assert said in trainer  # ppo_trainer.py line 551
    out = io.StringIO()
    module._default_handler.setStream(out)  # its handler writes to the stdout of its import
    logger = module.init_logger("openrlhf.trainer.ppo_trainer")
    for global_step in (1, 2, 3):
        log_status = {"policy_loss": 0.5 / global_step, "kl": 0.0002 * global_step, "reward": 0.2 * global_step,
                      "return": 0.1, "response_length": 310.5, "actor_lr": 5e-07,
                      "timing/make_experience": 30.0, "timing/step_total": 40.0 + global_step}
        logger.info(f"✨ Global step {global_step}: {log_status}")
    log = out.getvalue()
    assert log.startswith("INFO ") and "] ✨ Global step 1: {" in log
    steps = read_all(OpenRLHFPPOJob.model_validate({"recipe": "openrlhf-ppo", "args": {"pretrain": "m", "prompt_data": "d", "reward_url": "http://h/r"}}).metrics_reader(), log)
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[-1]["reward"] == pytest.approx(0.6) and steps[-1]["loss"] == pytest.approx(0.5 / 3)
    assert steps[-1]["kl"] == pytest.approx(0.0006) and steps[-1]["step_s"] == 43.0
    assert "total" not in steps[-1]  # 0.11.2 prints no total


def openrlhf_0_9_10_log(prompts: int, rollout_batch_size: int, episodes: int) -> str:
    """OpenRLHF 0.9.10's PPO trainer as its ppo_trainer.py drives its log: the `Global step` line
    of each step (line 541) through its own logger, and the `Episode` bar over the episode's
    prompts (lines 514-518: `range(dataset_length)` of a loader of one prompt a batch, lines 45-47),
    advanced by the prompts each step consumed (line 560), no postfix; Ray relays each as a line."""
    from tqdm import tqdm

    module, why = frameworks.wheel_module("openrlhf", "0.9.10", "openrlhf/utils/logging_utils.py")
    need(module is not None, f"openrlhf 0.9.10: {why}")
    trainer, _ = frameworks.wheel_source("openrlhf", "0.9.10", "openrlhf/trainer/ppo_trainer.py")
    lines = trainer.splitlines()
    assert [lines[44].strip(), lines[45].strip(), lines[46].strip()] == [
        "prompts_dataloader = strategy.setup_dataloader(", "prompts_dataset,", "1,"]
    assert [line.strip() for line in lines[513:516]] == [
        "pbar = tqdm(", "range(dataset_length),", 'desc=f"Episode [{episode + 1}/{self.args.num_episodes}]",']
    assert lines[540].strip() == 'logger.info(f"✨ Global step {global_step}: {log_status}")'
    assert lines[559].strip() == "pbar.update(prompts_consumed)"
    out = io.StringIO()
    module._default_handler.setStream(out)
    logger = module.init_logger("openrlhf.trainer.ppo_trainer")
    global_step = 0
    for episode in range(episodes):
        pbar = tqdm(range(prompts), desc=f"Episode [{episode + 1}/{episodes}]", initial=0, file=out, mininterval=0)
        for _ in range(prompts // rollout_batch_size):
            global_step += 1
            log_status = {"policy_loss": 0.1, "kl": 0.001, "reward": 0.01 * global_step, "timing/step_total": 30.0}
            logger.info(f"✨ Global step {global_step}: {log_status}")
            pbar.update(rollout_batch_size)
    return "".join(f"(PPOTrainer pid=9) {part}\n" for part in out.getvalue().replace("\r", "\n").splitlines()
                   if part.strip())


def test_openrlhf_global_step_releases_total_from_the_recipe_and_the_episode_bar(tmp_path):
    """The `Global step` releases print no total: the recipe's rollout_batch_size and the Episode bar's prompts and
    episodes give it from the first step (0.9.10's bar counts prompts); a reader the recipe told
    nothing takes the bar's advance per step from the second step on, and until then the progress
    line says why it shows no time left."""
    from rlhf_tasks.progress import Training

    log = openrlhf_0_9_10_log(prompts=40, rollout_batch_size=8, episodes=2)
    job = OpenRLHFPPOJob.model_validate({"recipe": "openrlhf-ppo", "args": {
        "version": "0.9.10", "pretrain": "m", "prompt_data": "d", "reward_url": "http://h/r", "rollout_batch_size": 8,
        "num_episodes": 2}})
    steps = read_all(job.metrics_reader(), log)
    assert [s["step"] for s in steps] == list(range(1, 11))
    assert {s.get("total") for s in steps} == {10}
    told_nothing = read_all(OpenRLHFReader(), log)
    assert "total" not in told_nothing[0] and {s.get("total") for s in told_nothing[1:]} == {10}
    view = Training(OpenRLHFReader(), io.StringIO(), None, terminal=False, clock=lambda: 0.0)
    first = log[:log.index("Global step 2")]
    view.write(first[:first.rindex("\n") + 1])
    assert view.line().startswith("step 1 · reward 0.01") and "no time left: OpenRLHF prints no total" in view.line()
    view.write(log[len(first[:first.rindex("\n") + 1]):])
    assert view.line().startswith("step 10/10 · ") and "0 s left" in view.line()


def tqdm_log(desc: str, total: int, postfixes: list[dict], postfix_first: bool, **kwargs) -> str:
    """A tqdm bar as a trainer drives it, into a file that is not a terminal (a job's log)."""
    from tqdm import tqdm

    out = io.StringIO()
    bar = tqdm(range(total), desc=desc, file=out, mininterval=0, **kwargs)
    for postfix in postfixes:
        if postfix_first:
            bar.set_postfix(postfix)
            bar.update()
        else:
            bar.update()
            bar.set_postfix(postfix)
    bar.close()
    return out.getvalue()


@pytest.mark.parametrize("version,trainer_file", [(OPENRLHF_M_BASE, "openrlhf/trainer/ppo_trainer.py"),
                                                  ("0.6.4", "openrlhf/trainer/ray/ppo_actor.py")])
def test_openrlhf_m_reads_its_episode_bar(version, trainer_file):
    """OpenRLHF 0.6.1 (OpenRLHF-M's base): ppo_trainer.py sets the Episode bar's postfix to the
    step's status, then updates it (lines 225-254); 0.6.4 the same in trainer/ray/ppo_actor.py
    (lines 195-231)."""
    trainer, why = frameworks.wheel_source("openrlhf", version, trainer_file)
    need(trainer is not None, f"openrlhf {version}: {why}")
    assert 'desc=f"Episode [{episode + 1}/{args.num_episodes}]"' in trainer
    assert trainer.index("pbar.set_postfix(status)") < trainer.index("pbar.update()")
    statuses = [{"policy_loss": 0.3 - 0.01 * i, "kl": 0.0004, "reward": 0.1 * i, "return": 0.2,
                 "response_length": 120.0, "actor_lr": 1e-6} for i in range(1, 6)]
    log = tqdm_log("Episode [2/2]", 5, statuses, postfix_first=True)
    log = "".join(f"(ActorModelRayActor pid=77) {part}\n" for part in log.split("\r") if part.strip())
    reader = OpenRLHFMGrpoJob.model_validate({"recipe": "openrlhf-m-grpo"}).metrics_reader()
    steps = {}
    for found in read_all(reader, log):
        steps[found["step"]] = found
    assert sorted(steps) == [6, 7, 8, 9, 10]  # episode 2 of 2, 5 steps each
    assert steps[10]["total"] == 10
    assert steps[8]["reward"] == pytest.approx(0.3) and steps[8]["loss"] == pytest.approx(0.27)
    assert steps[10]["kl"] == pytest.approx(0.0004)


@pytest.mark.parametrize("module,postfix_first", [("openrlhf.cli.train_dpo", True), ("openrlhf.cli.train_rm", True),
                                                  ("openrlhf.cli.train_sft", False)])
def test_torchrun_trainers_read_their_step_bar(module, postfix_first):
    trainer_file = {"openrlhf.cli.train_dpo": "dpo_trainer.py", "openrlhf.cli.train_rm": "rm_trainer.py",
                    "openrlhf.cli.train_sft": "sft_trainer.py"}[module]
    trainer, why = frameworks.wheel_source("openrlhf", OPENRLHF_CURRENT, f"openrlhf/trainer/{trainer_file}")
    need(trainer is not None, f"openrlhf {OPENRLHF_CURRENT}: {why}")
    assert 'desc="Train step of epoch %d" % epoch' in trainer
    fit = trainer[trainer.index("def fit"):]
    assert (fit.index("step_bar.set_postfix(logs_dict)") < fit.index("step_bar.update()")) == postfix_first
    if "sft" in module:
        logs = [{"gpt_loss": 2.0 - 0.1 * i, "lr": 1e-5, "grad_norm": 1.0} for i in range(4)]
    else:
        logs = [{"loss": 0.69 - 0.05 * i, "acc": 0.5, "chosen_reward": 0.1 * i, "reject_reward": -0.1 * i,
                 "lr": 5e-7, "grad_norm": 3.0} for i in range(4)]
    from tqdm import tqdm

    epochs = io.StringIO()
    tqdm(range(3), desc="Train epoch", file=epochs).close()
    log = epochs.getvalue() + tqdm_log("Train step of epoch 1", 4, logs, postfix_first)
    job = TorchrunJob.model_validate({"recipe": "torchrun", "args": {"module": module}})
    steps = {}
    for found in read_all(job.metrics_reader(), log):
        steps[found["step"]] = found
    assert sorted(steps) == [5, 6, 7, 8]  # the second epoch of three, 4 steps each
    assert steps[8]["total"] == 12
    assert steps[8]["loss"] == pytest.approx(logs[3].get("loss", logs[3].get("gpt_loss")), abs=1e-3)
    assert steps[6]["loss"] == pytest.approx(logs[1].get("loss", logs[1].get("gpt_loss")), abs=1e-3)
    if "sft" not in module:
        assert steps[7]["reward"] == pytest.approx(0.2)


def test_tiny_grpo_reads_its_step_line():
    from conftest import ROOT

    source = (ROOT / "rlhf_tasks" / "demo" / "train.py").read_text()
    assert """print(f"step {step}/{args.steps}  reward {last['mean_reward']:.3f}  loss {last['loss']:+.3f}  "
                      f"{last['seconds'] * 1000:.0f} ms", flush=True)""" in source
    step, steps, last = 25, 150, {"mean_reward": 0.4312, "loss": 0.0121, "seconds": 0.8341}
    line = f"step {step}/{steps}  reward {last['mean_reward']:.3f}  loss {last['loss']:+.3f}  " \
           f"{last['seconds'] * 1000:.0f} ms"
    reader = TinyGrpoJob.model_validate({"recipe": "tiny-grpo"}).metrics_reader()
    found = reader.read(f"(JobSupervisor pid=1) {line}\n")
    assert (found["step"], found["total"], found["reward"], found["loss"], found["step_s"]) == \
        (25, 150, 0.431, 0.012, 0.834)


@pytest.mark.parametrize("reader", [VerlReader, OpenRLHFReader, TorchrunTrainerReader, TinyGrpoReader])
def test_odd_lines_are_left_alone(reader):
    r = reader()
    assert [r.read(line) for line in ODD] == [None] * len(ODD)


def test_numbers():
    assert number("np.float64(0.5)") == 0.5 and number("tensor(0.25, device='cuda:0')") == 0.25
    assert number("-.0005") == -0.0005 and number("1e-06") == 1e-06 and number("True") is None
    assert number("[1, 2]") is None and number("abc") is None


#: Long odd lines, of the shapes a regular expression's backtracking makes slow.
LONG = ["1" * 200_000, " " * 200_000, "1 " * 100_000, "step:1 - " + "a:" * 100_000, "x: " + "1" * 100_000 + "%|",
        "Episode [1/1]:  " + " 1" * 50_000, "step 1/2  reward " + " " * 100_000, "%|" * 100_000,
        "Episode [1/1]: 1%|" + "|" * 100_000, "Episode [1/1]: 1%|| 1/2 [" + "<" * 100_000 + "]",
        "Episode [1/1]: 1%|| 1/2 [0<0, " + ", " * 100_000 + "]", "(" * 100_000, "(a pid=1" + " " * 100_000,
        "x" * (2 << 20)]


@pytest.mark.parametrize("reader", [VerlReader, OpenRLHFReader, TorchrunTrainerReader, TinyGrpoReader])
def test_long_odd_lines_are_read_quickly(reader):
    import time

    r = reader()
    for line in LONG:
        started = time.perf_counter()
        assert r.read(line) is None
        assert time.perf_counter() - started < 1.0, line[:40]
