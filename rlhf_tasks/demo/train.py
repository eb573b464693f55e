"""tiny-grpo trainer: GRPO on CPU with one Ray actor per node and DDP over gloo.

    python3 -m rlhf_tasks.demo.train --data DIR/prompts.jsonl --reward-url http://HEAD:PORT/score \\
        --ckpt-dir DIR --num-nodes 3 [--steps 150] [--save-every 25] [--group-size 16] \\
        [--prompts-per-step 32] [--lr 0.02] [--explore-coef 0.05] [--seed 0] [--pg-timeout 120]
        [--collective-timeout 120]

Shaped like the GPU frameworks: this process is the job driver on the head of a running
cluster (`ray.init(address="auto")`). It reserves one CPU on each of N nodes with a
STRICT_SPREAD placement group and starts one Worker actor per bundle; the workers form a
gloo process group and wrap a tiny policy in DistributedDataParallel. Every step each rank
draws its own prompts from its shard of the data, samples G completions per prompt,
scores them on the reward server over HTTP and takes a GRPO step: advantage = (reward -
group mean) / (group std + eps), loss = -mean(advantage * logprob) + an exploration term.

The defaults make the demo learn reliably: with 3 nodes the mean reward goes from about
0.1 (a random digit) to about 0.99 in 150 steps, above 0.7 after 20-30 of them. On an idle
2-core machine that takes about 5 s of training, about 15 s with the workers' start-up;
more steps are safe (the reward stays near 0.99).

Files in --ckpt-dir, written by rank 0 only (placed on the driver's node when it holds a
bundle, so nothing needs a shared filesystem): step_XXXXXX.pt every --save-every steps and
at the end (model, optimizer, step, every rank's RNG), and metrics.jsonl, one JSON line per
step. On start rank 0 loads the latest checkpoint and broadcasts it to all ranks, so a
relaunch resumes where the last checkpoint left off (metrics of steps after it are dropped
and run again); if --steps is already reached it says so and exits 0.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import re
import socket
import struct
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

PROMPT_CHARS = " 0123456789+-*="  # index 0 pads short prompts
ANSWER_CHARS = "0123456789"  # the policy answers with one digit
MAX_PROMPT_LEN = 8
CHECKPOINT_RE = re.compile(r"^step_(\d{6,})\.pt$")
METRICS_FILE = "metrics.jsonl"
REWARD_TIMEOUT_S = 10.0
REWARD_ATTEMPTS = 4
LOG_EVERY = 10
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


class TrainError(Exception):
    """A problem reported as one clear line, without a traceback."""


# ---------------------------------------------------------------- model and GRPO math


class Policy(nn.Module):
    """Embeds each prompt character at its position; an MLP maps the prompt to answer logits."""

    def __init__(self, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.chars = nn.Embedding(len(PROMPT_CHARS), dim, padding_idx=0)
        self.positions = nn.Parameter(torch.randn(MAX_PROMPT_LEN, dim) * 0.1)
        self.mlp = nn.Sequential(
            nn.Linear(MAX_PROMPT_LEN * dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, len(ANSWER_CHARS)),
        )

    def forward(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        return self.mlp((self.chars(prompt_ids) + self.positions).flatten(1))


def encode_prompts(prompts: list[str]) -> torch.Tensor:
    """Character ids, right-padded to MAX_PROMPT_LEN: [len(prompts), MAX_PROMPT_LEN]."""
    ids = torch.zeros(len(prompts), MAX_PROMPT_LEN, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt) > MAX_PROMPT_LEN or any(c not in PROMPT_CHARS[1:] for c in prompt):
            raise ValueError(f"prompt {prompt!r}: need at most {MAX_PROMPT_LEN} of {PROMPT_CHARS[1:]!r}")
        ids[row, : len(prompt)] = torch.tensor([PROMPT_CHARS.index(c) for c in prompt])
    return ids


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's critic-free baseline: each completion's reward relative to the other
    completions of the same prompt. rewards: [prompts, group_size]; a group whose
    rewards are all equal carries no signal and gets zero advantage."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)
    return (rewards - mean) / (std + eps)


def grpo_loss(logits: torch.Tensor, actions: torch.Tensor, advantages: torch.Tensor, explore_coef: float) -> torch.Tensor:
    """Policy gradient with group advantages (one on-policy update, so no ratio clipping),
    plus explore_coef * KL(uniform || policy). That term keeps every answer's probability
    away from zero, so an answer the policy wrote off for some prompts is still sampled and
    can be rediscovered; a plain entropy bonus cannot do this, its gradient vanishes for
    near-zero probabilities, and runs stall with a few prompts stuck on wrong answers."""
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(1, actions.unsqueeze(1)).squeeze(1)
    kl_from_uniform = -log_probs.mean(dim=-1) - math.log(logits.shape[-1])
    return -(advantages.detach() * chosen).mean() + explore_coef * kl_from_uniform.mean()


def grpo_step(model: nn.Module, optimizer: torch.optim.Optimizer, prompts: list[str], score, group_size: int,
              explore_coef: float, generator: torch.Generator) -> tuple[float, float]:
    """Sample group_size answers per prompt, score them with score(prompts, completions)
    and take one optimizer step. Returns (mean reward, loss) of this batch."""
    logits = model(encode_prompts(prompts).repeat_interleave(group_size, dim=0))
    actions = torch.multinomial(logits.detach().softmax(dim=-1), 1, generator=generator).squeeze(1)
    completions = [ANSWER_CHARS[a] for a in actions.tolist()]
    rewards = torch.tensor(score([p for p in prompts for _ in range(group_size)], completions), dtype=torch.float)
    advantages = group_advantages(rewards.view(-1, group_size)).view(-1)
    loss = grpo_loss(logits, actions, advantages, explore_coef)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return rewards.mean().item(), loss.item()


# ---------------------------------------------------------------- I/O helpers


def load_prompts(path: Path) -> list[str]:
    """The prompts of a prepare.py file, checked up front so a bad file fails in the driver."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TrainError(f"cannot read --data {path}: {exc.strerror}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
            encode_prompts([prompt])
        except (ValueError, KeyError, TypeError) as exc:
            raise TrainError(f"{path}:{number}: not a tiny-grpo prompt line ({exc})") from None
        prompts.append(prompt)
    if not prompts:
        raise TrainError(f"{path} has no prompts; run python3 -m rlhf_tasks.demo.prepare first")
    return prompts


def fetch_rewards(url: str, prompts: list[str], completions: list[str]) -> list[float]:
    """POST to the reward server, retrying connection failures and 5xx answers."""
    body = json.dumps({"prompts": prompts, "completions": completions}).encode()
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is in-cluster
    error = "no attempt made"
    for attempt in range(REWARD_ATTEMPTS):
        if attempt:
            time.sleep(0.5 * 2**attempt)  # back off before retrying
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with opener.open(request, timeout=REWARD_TIMEOUT_S) as response:
                rewards = json.load(response)["rewards"]
        except urllib.error.HTTPError as exc:
            error = f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}"
            if exc.code < 500:
                break
        except (OSError, ValueError, KeyError, TypeError) as exc:
            error = repr(exc)
        else:
            if isinstance(rewards, list) and len(rewards) == len(completions):
                return [float(r) for r in rewards]
            error = f"expected {len(completions)} rewards, got {str(rewards)[:200]}"
    raise RuntimeError(f"reward server {url} failed after {attempt + 1} attempt(s): {error}")


def interface_with_address(ip: str) -> str | None:
    """The network interface whose IPv4 address is ip (Linux), for GLOO_SOCKET_IFNAME."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                info = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
        if socket.inet_ntoa(info[20:24]) == ip:
            return name
    return None


def latest_checkpoint(ckpt_dir: Path) -> tuple[int, Path] | None:
    steps = [(int(m.group(1)), p) for p in ckpt_dir.glob("step_*.pt") if (m := CHECKPOINT_RE.match(p.name))]
    return max(steps) if steps else None


def write_atomic(path: Path, write) -> None:
    """Call write(tmp_path), then rename over path, so readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _metrics_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # e.g. a line cut short by a crash


def trim_metrics(path: Path, last_step: int) -> None:
    """Drop metrics of steps after the checkpoint being resumed: they are about to rerun."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if (step := _metrics_step(line)) is not None and step <= last_step]
    if len(kept) != len(lines):
        write_atomic(path, lambda tmp: tmp.write_text("".join(kept)))


# ---------------------------------------------------------------- the per-node worker


@ray.remote(num_cpus=1)
class Worker:
    """One DDP rank. The driver calls setup() on all ranks at once (it is a rendezvous),
    then step() on all ranks for every step."""

    def __init__(self, args: argparse.Namespace):
        torch.set_num_threads(1)
        self.args = args

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def master_address(self) -> str:
        """A free port on this node, for the other ranks to rendezvous at."""
        host = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((host, 0))
            return f"{host}:{sock.getsockname()[1]}"

    def setup(self, rank: int, world_size: int, master: str, node_ids: list[str], shard: list[str]) -> tuple[int, str | None]:
        """Join the process group, build the policy and restore the latest checkpoint.
        Returns (step to continue from, checkpoint file name or None)."""
        args = self.args
        # gloo binds to what the hostname resolves to, on many images 127.0.1.1, which other
        # nodes cannot reach; Ray's node address is the one they can.
        interface = interface_with_address(ray.util.get_node_ip_address())
        if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
        dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=args.collective_timeout))
        self.rank, self.world_size, self.node_ids, self.shard = rank, world_size, node_ids, shard
        self.ckpt_dir = Path(args.ckpt_dir)
        torch.manual_seed(args.seed)  # identical initial weights on every rank
        policy = Policy()
        self.optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
        self.generator = torch.Generator().manual_seed(args.seed * 1000 + rank)

        found = latest_checkpoint(self.ckpt_dir) if rank == 0 else None
        payload = [torch.load(found[1]) if found else None, found[1].name if found else None]
        dist.broadcast_object_list(payload, src=0)  # only rank 0's node needs the files
        checkpoint, name = payload
        self.start_step = 0
        if checkpoint is not None:
            policy.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            if len(checkpoint["rng"]) == world_size:
                self.generator.set_state(checkpoint["rng"][rank])
            self.start_step = checkpoint["step"]
        self.ddp = DistributedDataParallel(policy)
        if rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            trim_metrics(self.ckpt_dir / METRICS_FILE, self.start_step)
        return self.start_step, name

    def step(self, step: int) -> dict | None:
        """One GRPO step on this rank's prompts; rank 0 returns (and records) the metrics."""
        args = self.args
        started = time.perf_counter()
        picks = torch.randint(len(self.shard), (args.prompts_per_step,), generator=self.generator)
        reward, loss = grpo_step(
            self.ddp,  # its backward averages the gradients over all ranks
            self.optimizer,
            [self.shard[i] for i in picks.tolist()],
            lambda prompts, completions: fetch_rewards(args.reward_url, prompts, completions),
            args.group_size,
            args.explore_coef,
            self.generator,
        )
        totals = torch.tensor([reward, loss])
        dist.all_reduce(totals)
        mean_reward, mean_loss = (totals / self.world_size).tolist()
        if step % args.save_every == 0 or step == args.steps:
            self._save(step)
        if self.rank != 0:
            return None
        metrics = {
            "step": step,
            "mean_reward": round(mean_reward, 6),
            "loss": round(mean_loss, 6),
            "seconds": round(time.perf_counter() - started, 4),
            "world_size": self.world_size,
            "node_ids": self.node_ids,
        }
        if step == self.start_step + 1 and self.start_step > 0:
            metrics["resumed_from"] = self.start_step
        with open(self.ckpt_dir / METRICS_FILE, "a") as out:
            out.write(json.dumps(metrics) + "\n")
        return metrics

    def _save(self, step: int) -> None:
        """Collective: every rank hands its RNG state to rank 0, which writes the file."""
        rng_states = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(self.generator.get_state(), rng_states, dst=0)
        if self.rank == 0:
            state = {
                "model": self.ddp.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "step": step,
                "rng": rng_states,
            }
            write_atomic(self.ckpt_dir / f"step_{step:06d}.pt", lambda tmp: torch.save(state, tmp))

    def close(self) -> None:
        dist.destroy_process_group()


# ---------------------------------------------------------------- the driver


def wait_all(refs: list) -> list:
    """ray.get for a list that raises as soon as any task fails, instead of first
    blocking on an earlier one that may wait forever for the failed rank."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        ray.get(ready)
    return ray.get(refs)


def reserve_nodes(num_nodes: int, timeout: float, resource: str | None = None):
    """One CPU on each of num_nodes distinct nodes (with `resource`: nodes that have it, a node group's), or a
    clear error after timeout."""
    bundle = {"CPU": 1, **({resource: 1} if resource else {})}
    group = placement_group([bundle] * num_nodes, strategy="STRICT_SPREAD")
    if group.wait(timeout_seconds=timeout):
        return group
    remove_placement_group(group)
    alive = [n for n in ray.nodes() if n["Alive"]]
    cpus = sorted(n["Resources"].get("CPU", 0) for n in alive)
    raise TrainError(
        f"placement group for {num_nodes} nodes not ready after {timeout:.0f}s: cluster has "
        f"{len(alive)} alive node(s) with CPUs {cpus}, available now {ray.available_resources().get('CPU', 0)}; "
        f"STRICT_SPREAD needs 1 free CPU on each of {num_nodes} distinct nodes"
    )


def start_workers(args: argparse.Namespace, group, prompts: list[str]) -> tuple[list, int, str | None]:
    """Start and set up one worker per bundle; rank 0 goes on the driver's node if it
    holds a bundle, so the checkpoints and metrics land next to the job driver."""
    n = args.num_nodes
    workers = [
        Worker.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)).remote(args)
        for i in range(n)
    ]
    node_ids = wait_all([w.node_id.remote() for w in workers])
    here = ray.get_runtime_context().get_node_id()
    order = sorted(range(n), key=lambda i: node_ids[i] != here)
    workers, node_ids = [workers[i] for i in order], [node_ids[i] for i in order]
    master = ray.get(workers[0].master_address.remote())
    results = wait_all([w.setup.remote(rank, n, master, node_ids, prompts[rank::n]) for rank, w in enumerate(workers)])
    start_step, checkpoint_name = results[0]
    if args.node_resource:  # where Ray put the ranks, as its own node records say (their node group's label)
        labels = {node["NodeID"]: node.get("Labels", {}).get("rlhf-tasks/group") for node in ray.nodes()}
        print(f"ranks on nodes with {args.node_resource}: node groups {[labels.get(i) for i in node_ids]} "
              f"(Ray's labels)", flush=True)
    return workers, start_step, checkpoint_name


def train(args: argparse.Namespace, prompts: list[str]) -> None:
    group = reserve_nodes(args.num_nodes, args.pg_timeout, args.node_resource)
    try:
        workers, start_step, checkpoint_name = start_workers(args, group, prompts)
        if start_step >= args.steps:
            print(f"already at step {start_step} ({checkpoint_name}), --steps is {args.steps}: nothing to do")
            return
        if checkpoint_name:
            print(f"resuming from {checkpoint_name}: steps {start_step + 1}..{args.steps}")
        print(f"training on {args.num_nodes} node(s), {len(prompts)} prompts, "
              f"{args.prompts_per_step}x{args.group_size} completions per rank per step", flush=True)
        first = last = None
        started = time.monotonic()
        for step in range(start_step + 1, args.steps + 1):
            last = wait_all([w.step.remote(step) for w in workers])[0]
            first = first or last
            if step == start_step + 1 or step % LOG_EVERY == 0 or step == args.steps:
                print(f"step {step}/{args.steps}  reward {last['mean_reward']:.3f}  loss {last['loss']:+.3f}  "
                      f"{last['seconds'] * 1000:.0f} ms", flush=True)
        wait_all([w.close.remote() for w in workers])
        print(f"done: steps {start_step + 1}..{args.steps} in {time.monotonic() - started:.1f}s, "
              f"reward {first['mean_reward']:.2f} -> {last['mean_reward']:.2f}")
    finally:
        remove_placement_group(group)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 -m rlhf_tasks.demo.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, type=Path, help="prompts.jsonl written by rlhf_tasks.demo.prepare")
    parser.add_argument("--reward-url", required=True, help="reward server endpoint, e.g. http://HEAD:23080/score")
    parser.add_argument("--ckpt-dir", required=True, type=Path, help="checkpoints and metrics.jsonl (on rank 0's node)")
    parser.add_argument("--num-nodes", required=True, type=int, help="nodes to train on, one rank each")
    parser.add_argument("--steps", type=int, default=150, help="total steps; a resumed run continues to this count (default 150)")
    parser.add_argument("--save-every", type=int, default=25, help="checkpoint every this many steps and at the end (default 25)")
    parser.add_argument("--group-size", type=int, default=16, help="completions per prompt, G (default 16)")
    parser.add_argument("--prompts-per-step", type=int, default=32, help="prompts per rank per step (default 32)")
    parser.add_argument("--lr", type=float, default=0.02, help="Adam learning rate (default 0.02)")
    parser.add_argument("--explore-coef", type=float, default=0.05, help="weight of KL(uniform || policy) in the loss (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--node-resource", default=None,
                        help="train only on nodes with this Ray resource, one each (a node group's name)")
    parser.add_argument("--pg-timeout", type=float, default=120.0, help="seconds to wait for the N nodes (default 120)")
    parser.add_argument("--collective-timeout", type=float, default=120.0,
                        help="seconds a rank waits in a collective for the others before it fails (Gloo's own "
                             "default is 30 minutes; default 120)")
    args = parser.parse_args(argv)
    for name in ("num_nodes", "steps", "save_every", "prompts_per_step"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.group_size < 2:
        parser.error("--group-size must be at least 2: GRPO compares completions within a group")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found = latest_checkpoint(args.ckpt_dir)  # rank 0 decides; this only skips a no-op launch
    if found and found[0] >= args.steps:
        print(f"already at step {found[0]} ({found[1].name}), --steps is {args.steps}: nothing to do")
        return 0
    try:
        prompts = load_prompts(args.data)
        if len(prompts) < args.num_nodes:
            raise TrainError(f"{args.data} has {len(prompts)} prompts, fewer than the {args.num_nodes} ranks to shard them over")
        try:
            ray.init(address="auto")
        except ConnectionError as exc:
            raise TrainError(f"cannot connect to the Ray cluster: {exc}") from None
        try:
            train(args, prompts)
        finally:
            ray.shutdown()
    except TrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ray.exceptions.RayError as exc:
        print(f"error: a training worker failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
