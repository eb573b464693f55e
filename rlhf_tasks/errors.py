"""The two kinds of failure the CLI maps to exit codes (2 bad input, 1 runtime)."""


class BadInput(Exception):
    """The user's input is wrong: nothing was launched or written (exit 2)."""


class StepFailed(Exception):
    """A runtime step failed (exit 1); `step` names it for the user."""

    def __init__(self, step: str, message: str):
        super().__init__(f"{step}: {message}")
        self.step = step


class HeadLost(StepFailed):
    """The cluster's head is gone (its process, or the run that holds it): the cluster has
    ended, and a relaunch (`launch --retry`) may bring the task back."""
