"""kubectl, the one way this provider reaches Kubernetes: the user's kubeconfig, its context and a
namespace pinned at launch (so `status` and `down` later reach the same cluster whatever the
kubeconfig says by then), JSON answers parsed (never kubectl's human tables), failures in words.
Secret values only ever travel on kubectl's stdin."""

from __future__ import annotations

import base64
import json
import os
import re
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


#: A line of client-go's log (klog): `E1126 13:42:35.351026   10998 memcache.go:381] "..." err="..."`.
KLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [^ \]]+\] ")


def said(out: subprocess.CompletedProcess) -> str:
    """kubectl's own words about a failure (its last lines, each once), or its exit code. client-go's
    log lines (one per retry of the same request) are left out when kubectl said it in words too."""
    lines = [line.strip() for line in (out.stderr or "").strip().splitlines() if line.strip()]
    words = [line for line in lines if not KLOG_LINE.match(line)] or [KLOG_LINE.sub("", line) for line in lines]
    once = list(dict.fromkeys(words))
    return " ".join(once[-3:]) or f"exit code {out.returncode}"


#: What kubectl says when the API server does not answer (client-go's words, and Go's dialer's).
UNREACHABLE = ("The connection to the server", "Unable to connect to the server", "connection refused",
               "no such host", "i/o timeout", "no route to host")


def kubeconfig_words() -> str:
    """Which kubeconfig kubectl reads, in words."""
    named = os.environ.get("KUBECONFIG")
    return f"KUBECONFIG={named}" if named else "~/.kube/config"


@dataclass(frozen=True)
class Kubectl:
    """kubectl with a fixed context (None: the kubeconfig's current one) and namespace."""

    context: str | None
    namespace: str
    path: str = "kubectl"
    #: The context's API server, for messages (None: not known).
    server: str | None = None

    @property
    def where(self) -> str:
        """The context (and its API server) in words."""
        return f"context {self.context}" + (f" (API server {self.server})" if self.server else "")

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
        words = said(out)
        if context:
            raise BadInput(f"--context: kubectl cannot use --context {context} ({kubeconfig_words()}): {words}")
        if "current-context" in words:  # client-go: "current-context must exist in order to minify"
            raise BadInput(f"--provider kuberay: kubectl has no current context ({kubeconfig_words()} sets none: "
                           f"{words}); choose one with `kubectl config use-context NAME` (`kubectl config "
                           f"get-contexts` lists them), or pass --context NAME")
        raise BadInput(f"--provider kuberay: kubectl cannot read its kubeconfig ({kubeconfig_words()}): {words}")
    config = json.loads(out.stdout or "{}")
    contexts = config.get("contexts") or [{}]
    chosen = context or config.get("current-context") or contexts[0].get("name")
    server = ((config.get("clusters") or [{}])[0].get("cluster") or {}).get("server")
    return Kubectl(chosen, namespace or (contexts[0].get("context") or {}).get("namespace") or "default", path,
                   server)


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
    if any(sign in words for sign in UNREACHABLE):
        raise BadInput(f"--provider kuberay: kubectl cannot reach the API server of {kube.where}: {words}; is the "
                       f"cluster up, and this the context you meant? (--context picks another; nothing was launched)")
    raise BadInput(f"--provider kuberay: kubectl get crd rayjobs.ray.io failed in {kube.where}: {words} "
                   f"(KubeRay's CRDs must be installed, and kubectl able to reach the cluster: check the context, "
                   f"or pass --context)")


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
