"""tiny-grpo: a real, CPU-sized RLHF job shaped like the GPU frameworks.

`prepare` writes a toy prompt set, `reward_server` scores completions over HTTP (a
stand-in for a remote reward model), and `train` runs GRPO with one Ray actor per node
and PyTorch DDP over gloo between them.
"""
