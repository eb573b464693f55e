"""rlhf-tasks: one task file -> a multi-node Ray cluster on any provider -> an RLHF job."""

__version__ = "0.1.0"
