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
#: Image name -> what its containers see. Ray's image is this machine's test virtualenv (Ray,
#: torch); an image the runner does not know fails to pull.
IMAGES = {f"rayproject/ray:{RAY_VERSION}": Image(path=[tbmod.BIN_DIR])}
#: Room for one of the tests' Ray pods each (a 1-CPU Ray container, plus the submitter's 500m on the head).
NODES = [Node(f"kube-node-{i}", {"cpu": "1500m", "memory": "8Gi", "ephemeral-storage": "100Gi"}) for i in (1, 2, 3)]


class KubeCluster:
    def __init__(self, dir: Path, shared=(), nodes: list[Node] = NODES, pod_hosts: int = 4,
                 images: dict[str, Image] = IMAGES):
        dir = Path(dir)
        started = time.monotonic()
        self.cp = ControlPlane(dir / "control-plane")
        self.tb = self.runner = self.operator = None
        try:
            self.cp.start()
            self.tb = tbmod.Testbed(1 + pod_hosts, dir / "hosts", shared=shared,
                                    names=["kuberay-operator", *[f"pod-host-{i}" for i in range(1, pod_hosts + 1)]])
            self.runner = NodeRunner(self.cp, self.tb, nodes, images, list(range(1, pod_hosts + 1))).start()
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
