"""torchrun: a torch.distributed program on every node, no Ray. For the trainings
OpenRLHF runs without Ray (SFT, reward model, DPO: `torchrun ... -m openrlhf.cli.train_dpo`,
examples/scripts/train_nonrl_slurm.sh), where the docs hand-write `--node_rank
$SLURM_PROCID --master_addr $(scontrol show hostnames ... | head -n 1)`.

Every node's agent starts the same command with its own rank filled in, once the head
has run `prepare` and its services answer; the job's exit code is the command's. The
rendezvous is torchrun's static one on the head (`--rdzv-endpoint head:port`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import JobBase, RecipeOutput, Shape, StrictModel, infeasible
from .metrics import TorchrunTrainerReader


class TorchrunArgs(StrictModel):
    module: str | None = Field(None, description="run a module: torchrun ... -m MODULE (e.g. openrlhf.cli.train_dpo)")
    script: str | None = Field(None, description="or a script path, as every node sees it")
    args: list[str] = Field([], description="the program's arguments; {rank}, {nodes}, {head_addr}, {node_addr} "
                                            "are filled in on each node")
    nproc_per_node: int | None = Field(None, ge=1, description="processes per node (default: the node's GPUs, "
                                                                "or 1 without GPUs)")
    port: int = Field(29500, ge=1024, le=65535, description="the rendezvous port on the head")

    @model_validator(mode="after")
    def _one_program(self):
        if (self.module is None) == (self.script is None):
            raise ValueError("give exactly one of module and script")
        return self


class TorchrunJob(JobBase):
    """torchrun on every node (static rendezvous on the head); no Ray cluster."""

    recipe_summary = "torchrun on every node, no Ray (OpenRLHF's SFT, RM, DPO trainers; any torch.distributed program)"
    recipe_needs = "torch (torchrun) on every node, and the program"

    recipe: Literal["torchrun"]
    args: TorchrunArgs

    def metrics_reader(self):
        # OpenRLHF 0.11's SFT trainer updates its bar before it sets the postfix, its RM and DPO trainers and
        # every trainer of 0.10.2 and before after; the bar's first redraws tell which (metrics.TqdmBar)
        return TorchrunTrainerReader(postfix_first="train_sft" not in (self.args.module or self.args.script or ""))

    def build(self, shape: Shape) -> RecipeOutput:
        a = self.args
        nproc = a.nproc_per_node or shape.gpus_per_node or 1
        if shape.gpus_per_node and nproc > shape.gpus_per_node:
            raise infeasible(f"nproc_per_node {nproc} is more than the {shape.gpus_per_node} GPUs per node",
                             f"set job.args.nproc_per_node to at most {shape.gpus_per_node}")
        program = ["-m", a.module] if a.module else [a.script]
        return RecipeOutput(
            mode="every_node",
            entrypoint=["torchrun", "--nnodes", str(shape.nodes), "--nproc-per-node", str(nproc),
                        "--node-rank", "{rank}", "--rdzv-endpoint", f"{{head_addr}}:{a.port}",
                        *program, *a.args],
        )
