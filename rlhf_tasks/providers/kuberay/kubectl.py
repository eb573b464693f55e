"""kubectl, the one way this provider reaches Kubernetes: the user's kubeconfig, its context and a
namespace pinned at launch (so `status` and `down` later reach the same cluster whatever the
kubeconfig says by then), JSON answers parsed (never kubectl's human tables), failures in words.
Secret values only ever travel on kubectl's stdin."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from dataclasses import dataclass

from ...errors import BadInput, StepFailed

INSTALL = "install it (https://kubernetes.io/docs/tasks/tools/) and point it at your cluster (kubeconfig, --context)"
#: The field manager of the Secret `launch` makes (server-side apply: no value in an annotation).
FIELD_MANAGER = "rlhf-tasks"


def kubectl_path() -> str:
    path = shutil.which("kubectl")
    if path is None:
        raise BadInput(f"--provider kuberay: the `kubectl` command is not on PATH; {INSTALL}")
    return path


def said(out: subprocess.CompletedProcess) -> str:
    """kubectl's own words about a failure (its last lines), or its exit code."""
    lines = [line for line in (out.stderr or "").strip().splitlines() if line.strip()]
    return " ".join(lines[-3:]) or f"exit code {out.returncode}"


@dataclass(frozen=True)
class Kubectl:
    """kubectl with a fixed context (None: the kubeconfig's current one) and namespace."""

    context: str | None
    namespace: str
    path: str = "kubectl"

    def argv(self, *args: str, namespaced: bool = True) -> list[str]:
        head = [self.path] + (["--context", self.context] if self.context else [])
        return head + (["-n", self.namespace] if namespaced else []) + list(args)

    def run(self, *args: str, stdin: str | None = None, namespaced: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(self.argv(*args, namespaced=namespaced), input=stdin, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise StepFailed(f"kubectl {args[0]}", f"no answer within {timeout:.0f}s") from None

    def must(self, step: str, *args: str, stdin: str | None = None) -> str:
        """Run; its stdout, or StepFailed naming `step` with kubectl's words."""
        out = self.run(*args, stdin=stdin)
        if out.returncode != 0:
            raise StepFailed(step, f"kubectl {args[0]}: {said(out)}")
        return out.stdout

    def get(self, kind: str, name: str) -> dict | None:
        """One object as JSON; None when it does not exist."""
        out = self.run("get", kind, name, "-o", "json", "--ignore-not-found")
        if out.returncode != 0:
            raise StepFailed(f"asking Kubernetes for {kind} {name}", said(out))
        return json.loads(out.stdout) if out.stdout.strip() else None

    def pods(self, selector: str) -> list[dict]:
        out = self.run("get", "pods", "-l", selector, "-o", "json")
        if out.returncode != 0:
            raise StepFailed(f"listing the pods {selector}", said(out))
        return json.loads(out.stdout).get("items") or []

    def events(self, kind: str, name: str) -> list[dict]:
        """The events recorded about one object (the operator's: a pod it could not create)."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        out = self.run("get", "events", "--field-selector", selector, "-o", "json")
        if out.returncode != 0:
            raise StepFailed(f"listing the events of {kind} {name}", said(out))
        return json.loads(out.stdout).get("items") or []

    def delete(self, objects: list[tuple[str, str]]) -> str:
        """Delete kind/name pairs (those already gone are fine): kubectl's words."""
        if not objects:
            return ""
        return self.must("deleting " + ", ".join(f"{k} {n}" for k, n in objects), "delete",
                         *[f"{kind}/{name}" for kind, name in objects], "--ignore-not-found").strip()


def resolve(context: str | None, namespace: str | None) -> Kubectl:
    """kubectl pinned to a context (the given one, else the kubeconfig's current) and a namespace
    (the given one, else the context's, else `default`)."""
    path = kubectl_path()
    base = Kubectl(context, namespace or "default", path)
    out = base.run("config", "view", "--minify", "-o", "json", namespaced=False)
    if out.returncode != 0:
        where = f"--context {context}" if context else "the kubeconfig's current context"
        raise BadInput(f"--context: kubectl cannot use {where}: {said(out)}")
    config = json.loads(out.stdout or "{}")
    contexts = config.get("contexts") or [{}]
    chosen = context or config.get("current-context") or contexts[0].get("name")
    return Kubectl(chosen, namespace or (contexts[0].get("context") or {}).get("namespace") or "default", path)


def require_crds(kube: Kubectl) -> None:
    """KubeRay's CRDs are installed (else nothing here can run): BadInput saying what to do."""
    out = kube.run("get", "crd", "rayjobs.ray.io", "-o", "json", namespaced=False)
    if out.returncode == 0:
        return
    words = said(out)
    if "NotFound" in words or "not found" in words:
        raise BadInput(f"--provider kuberay: KubeRay's CRDs are not installed in context {kube.context} "
                       f"(kubectl get crd rayjobs.ray.io: {words}); install the KubeRay operator first, e.g. "
                       f"helm install kuberay-operator kuberay/kuberay-operator --version 1.7.0")
    raise BadInput(f"--provider kuberay: kubectl get crd rayjobs.ray.io failed in context {kube.context}: {words} "
                   f"(KubeRay's CRDs must be installed, and kubectl able to reach the cluster)")


def secret_object(name: str, task: str, values: dict[str, str]) -> str:
    """The Secret `launch` makes from the launcher's environment, as JSON for kubectl's stdin."""
    return json.dumps({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                       "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "rlhf-tasks",
                                                             "rlhf-tasks/task": task}},
                       "data": {k: base64.b64encode(v.encode()).decode() for k, v in sorted(values.items())}})


def apply_secret(kube: Kubectl, name: str, text: str) -> str:
    """Server-side apply: no `last-applied-configuration` annotation holds the values."""
    return kube.must(f"creating Secret {name}", "apply", "--server-side", "--force-conflicts",
                     f"--field-manager={FIELD_MANAGER}", "-f", "-", stdin=text).strip()
