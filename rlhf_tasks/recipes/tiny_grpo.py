"""tiny-grpo: the CPU demo. A real GRPO run, shaped like the GPU recipes: rank 0
prepares data, a reward model server runs on the head (or on a node group of its own:
`reward_where: group NAME`), one trainer actor per node (with node groups, per node of the
first group, the head's)."""

from __future__ import annotations

import shlex
from typing import Literal

from pydantic import Field

from .base import JobBase, RecipeOutput, Service, Shape, StrictModel, infeasible
from .metrics import TinyGrpoReader


#: pyproject.toml's `demo` extra (a test keeps them equal) but LAUNCHER_ONLY: installed on a node only when missing.
REQUIREMENTS = ["ray[default]==2.60.0", "torch>=2.3,<=2.13.0", "numpy"]
#: What of the `demo` extra only the launcher uses: the summary's picture (progress.picture), never a node.
LAUNCHER_ONLY = ["matplotlib>=3.7"]
#: Their import names, looked up without importing them (importing torch takes seconds).
IMPORTS = ["ray", "torch", "numpy"]
#: The least collective timeout: a rank may wait that long for another's reward-server retries
#: (4 attempts of up to 10 s, with back-off), which is not a silent node.
COLLECTIVE_FLOOR_S = 60.0
_MISSING = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))"
#: Every node: install the demo's third-party needs unless they are there (idempotent).
SETUP = (shlex.join(["python3", "-c", _MISSING, *IMPORTS]) + " || "
         + shlex.join(["python3", "-m", "pip", "install", *REQUIREMENTS]))


class TinyGrpoArgs(StrictModel):
    steps: int = Field(150, ge=1, description="GRPO steps in total (a resumed run continues to this count)")
    save_every: int = Field(25, ge=1, description="checkpoint every this many steps")
    group_size: int = Field(16, ge=2, description="completions sampled per prompt (GRPO needs > 1)")
    prompts_per_step: int = Field(32, ge=1, description="prompts per rank per step")
    lr: float = Field(0.02, gt=0, description="Adam learning rate")
    num_prompts: int = Field(2000, ge=10, description="size of the prepared toy dataset")
    reward_port: int = Field(23080, ge=1024, le=65535, description="port of the reward server on the head")
    reward_where: str = Field("head", pattern=r"^(head|group [a-z0-9][a-z0-9-]*)$", description=(
        "where the reward server runs: head, or `group NAME` (every node of that node group; the trainers reach "
        "the one with the lowest address)"))
    seed: int = 0


class TinyGrpoJob(JobBase):
    """Toy GRPO on CPU: PyTorch DDP over gloo across all nodes, remote reward server."""

    recipe_summary = "tiny GRPO on CPU across all nodes (the demo)"
    recipe_needs = ("python3 on every node (setup installs ray, torch and numpy where missing; the demo's code "
                    "travels with the node agent); 1 CPU per node; no GPUs")

    recipe: Literal["tiny-grpo"]
    args: TinyGrpoArgs = TinyGrpoArgs()

    def metrics_reader(self):
        return TinyGrpoReader(total=self.args.steps)

    def build(self, shape: Shape) -> RecipeOutput:
        if shape.checkpoint_dir is None:
            raise infeasible("tiny-grpo needs a checkpoint directory", "set checkpoints.path",
                             fields=("checkpoints.path",))
        a = self.args
        ckpt = shape.checkpoint_dir
        data = f"{ckpt}/data"
        groups = [g.name for g in shape.groups]
        reward_group = a.reward_where.removeprefix("group ") if a.reward_where != "head" else None
        if reward_group is not None and reward_group not in groups:
            have = f"its groups: {', '.join(groups)}" if groups else "it has no groups"
            raise infeasible(f"the task has no group {reward_group!r} ({have})", "name one of its groups, or head",
                             args=("reward_where",))
        host = f"{{group_addr:{reward_group}}}" if reward_group else "{head_addr}"
        reward_url = f"http://{host}:{a.reward_port}/score"
        # with node groups the trainers are the first group's nodes (the head's), one each (its Ray resource)
        trainers = shape.groups[0] if shape.groups else None
        probe = {"prompts": ["1+2="], "completions": ["3"]}
        return RecipeOutput(
            prepare=[f"python3 -m rlhf_tasks.demo.prepare --out {data} --num-prompts {a.num_prompts} --seed {a.seed}"],
            services=[Service.model_validate({
                "name": "reward",
                "where": a.reward_where,
                "command": f"python3 -m rlhf_tasks.demo.reward_server --host {{node_addr}} --port {a.reward_port}",
                "ready": {"http": f"http://{{node_addr}}:{a.reward_port}/score", "method": "POST", "json": probe},
                "timeout": "2m",
            })],
            entrypoint=[
                "python3", "-m", "rlhf_tasks.demo.train",
                "--data", f"{data}/prompts.jsonl",
                "--reward-url", reward_url,
                "--ckpt-dir", ckpt,
                "--num-nodes", str(trainers.nodes if trainers else shape.nodes),
                *(["--node-resource", trainers.name] if trainers else []),
                "--steps", str(a.steps),
                "--save-every", str(a.save_every),
                "--group-size", str(a.group_size),
                "--prompts-per-step", str(a.prompts_per_step),
                "--lr", str(a.lr),
                "--seed", str(a.seed),
                # a rank stuck in a collective with a silent peer fails within this (Gloo's default: 30 min)
                "--collective-timeout", "%.0f" % max(shape.node_silence_s, COLLECTIVE_FLOOR_S),
            ],
            setup=[SETUP],
            modules=["rlhf_tasks.demo"],
            summary={"metrics": f"{ckpt}/metrics.jsonl"},
            checkpoint_files=["step_*.pt"],  # demo/train.py's CHECKPOINT_RE
        )
