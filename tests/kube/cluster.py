"""One Kubernetes cluster for the whole test session: the real control plane
(controlplane.py), Node objects and their pods on namespace hosts (noderunner.py), and the
real KubeRay operator on a host of its own (kuberay.py). Namespaces keep tests apart."""
from __future__ import annotations

import importlib.metadata
import os
import re
import time
from pathlib import Path

import testbed as tbmod

from .controlplane import ControlPlane
from .kuberay import Operator
from .noderunner import Image, Node, NodeRunner

RAY_VERSION = importlib.metadata.version("ray")
#: NGC's PyTorch image, as the shipped GPU tasks name it: Python and torch, no Ray.
NO_RAY_IMAGE = "nvcr.io/nvidia/pytorch:26.03-py3"
#: Where an image without Ray has room for the `ray` command its setup installs (a pod's own /opt).
INSTALLED_BIN = "/opt/image-bin"


def images(root: Path) -> dict[str, Image]:
    """Image name -> what its containers see; an image the runner does not know fails to pull.
    Ray's image is this machine's test virtualenv (Ray, torch). The PyTorch image has `python3`
    and `python` but no `ray` command until its setup puts one in INSTALLED_BIN, as
    `pip install ray` would put it on PATH (its Python imports what the virtualenv holds)."""
    bare = root / "nvcr-pytorch" / "bin"
    bare.mkdir(parents=True, exist_ok=True)
    for name in ("python3", "python"):  # a script, not a link: a linked venv Python would not find its venv
        (bare / name).write_text(f'#!/bin/sh\nexec {tbmod.PYTHON} "$@"\n')
        (bare / name).chmod(0o755)
    return {f"rayproject/ray:{RAY_VERSION}": Image(path=[tbmod.BIN_DIR]),
            NO_RAY_IMAGE: Image(path=[INSTALLED_BIN, str(bare)])}
#: Room for one of the tests' 1-CPU pods each: a worker, or the head (which leaves 500m of its
#: node's CPU to KubeRay's submitter pod).
NODES = [Node(f"kube-node-{i}", {"cpu": "1", "memory": "8Gi", "ephemeral-storage": "100Gi"}) for i in (1, 2, 3)]


class KubeCluster:
    def __init__(self, dir: Path, shared=(), nodes: list[Node] = NODES, pod_hosts: int = 8):
        dir = Path(dir)
        started = time.monotonic()
        self.cp = ControlPlane(dir / "control-plane")
        self.tb = self.runner = self.operator = None
        try:
            self.cp.start()
            # the built programs (the operator's, kube-streams) are on every host wherever their cache is (/tmp too)
            self.tb = tbmod.Testbed(1 + pod_hosts, dir / "hosts", shared=[*shared, self.cp.bin],
                                    names=["kuberay-operator", *[f"pod-host-{i}" for i in range(1, pod_hosts + 1)]])
            self.runner = NodeRunner(self.cp, self.tb, nodes, images(dir / "images"),
                                     list(range(1, pod_hosts + 1))).start()
            self.operator = Operator(self.cp, self.tb, 0).start()
        except BaseException:
            self.close()
            raise
        self.started_s = time.monotonic() - started
        self._namespaces = 0

    def namespace(self, hint: str) -> str:
        """A fresh namespace for one test."""
        self._namespaces += 1
        name = f"{re.sub(r'[^a-z0-9-]', '-', hint.lower())[:40].strip('-')}-{self._namespaces}"
        self.cp.kubectl("create", "namespace", name)
        return name

    def env(self, base: dict | None = None) -> dict[str, str]:
        """An environment whose `kubectl` is the real one, pointed at this cluster."""
        env = dict(os.environ if base is None else base)
        env["KUBECONFIG"] = str(self.cp.kubeconfig)
        env["PATH"] = f"{self.cp.bin}{os.pathsep}{env.get('PATH', '')}"
        return env

    def check(self) -> None:
        """Raise what went wrong in the node runner or the operator since the last look."""
        if self.runner.error is not None:
            error, self.runner.error = self.runner.error, None
            raise AssertionError(f"the node runner failed: {error!r}")
        if not self.operator.running():
            raise AssertionError(f"the KubeRay operator exited:\n{self.operator.log.read_text()[-3000:]}")

    def close(self) -> None:
        for part in (self.operator, self.runner):
            if part is not None:
                part.stop()
        if self.tb is not None:
            self.tb.close()
        self.cp.stop()
