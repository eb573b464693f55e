"""The Kubernetes tests' cluster itself (tests/kube/): the real API server, controllers and
scheduler place a pod, the node runner runs it on a namespace host as a kubelet would, and the
real kubectl reaches it (logs, port-forward) through the API server."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest
import yaml

from rlhf_tasks.agent.protocol.ports import free_port

pytestmark = pytest.mark.cluster


def wait(fn, timeout: float, what: str, cluster=None):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if cluster is not None:
            cluster.check()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def get(cluster, ns: str, *what: str) -> dict | None:
    out = cluster.cp.kubectl("-n", ns, "get", *what, "-o", "json", "--ignore-not-found")
    return json.loads(out.stdout) if out.stdout.strip() else None


SERVER = r"""
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("%s %s %s" % (os.environ["POD_IP"], os.environ["GREETING"], open("/srv/greeting/text").read())).encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a): pass
print("serving", flush=True)
http.server.HTTPServer(("0.0.0.0", 8080), H).serve_forever()
"""


def test_pod_runs_with_its_volumes_env_probe_logs_and_port_forward(kube_cluster, tmp_path):
    """A pod's init container, ConfigMap volume, fieldRef and $(VAR) env, readiness probe and
    Service: the scheduler binds it, it becomes Ready, its Service resolves from another pod, and
    `kubectl logs` and `kubectl port-forward` reach it through the API server."""
    cluster = kube_cluster
    ns = cluster.namespace("pod")
    image = next(iter(cluster.runner.images))
    objects = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "greeting"}, "data": {"text": "from-configmap"}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
         "spec": {"clusterIP": "None", "selector": {"app": "web"}, "ports": [{"port": 8080}]}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web", "labels": {"app": "web"}}, "spec": {
            "initContainers": [{"name": "init", "image": image, "command": ["bash", "-c", "echo init-ran"]}],
            "containers": [{
                "name": "server", "image": image, "command": ["python3", "-c", SERVER],
                "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "WHO", "value": "kubelet"}, {"name": "GREETING", "value": "hello-$(WHO)"}],
                "volumeMounts": [{"name": "greeting", "mountPath": "/srv/greeting", "readOnly": True}],
                "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}}],
            "volumes": [{"name": "greeting", "configMap": {"name": "greeting"}}]}},
    ]
    cluster.cp.kubectl("-n", ns, "apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
    pod = wait(lambda: (lambda p: p if p and any(c["type"] == "Ready" and c["status"] == "True"
                                                 for c in p["status"].get("conditions", [])) else None)(
        get(cluster, ns, "pod", "web")), 60, "pod web Ready", cluster)
    assert pod["spec"]["nodeName"].startswith("kube-node-")
    ip = pod["status"]["podIP"]
    assert cluster.cp.kubectl("-n", ns, "logs", "web", "-c", "init").stdout.strip() == "init-ran"
    assert "serving" in cluster.cp.kubectl("-n", ns, "logs", "web", "-c", "server").stdout

    # the Service's name resolves on the pods' hosts, to the address its EndpointSlice lists
    def resolved():  # once the EndpointSlice controller has listed the ready pod
        out = cluster.tb.run(0, ["python3", "-c", f"import socket; print(socket.gethostbyname('web.{ns}.svc.cluster.local'))"],
                             background=False)
        return out.output.strip() if out.returncode == 0 else None
    assert wait(resolved, 30, "the Service's name to resolve") == ip

    port = free_port()
    forward = subprocess.Popen([str(cluster.cp.bin / "kubectl"), f"--kubeconfig={cluster.cp.kubeconfig}", "-n", ns,
                                "port-forward", "svc/web", f"{port}:8080"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        body = wait(lambda: _fetch(f"http://127.0.0.1:{port}/"), 30, "the forwarded port")
        assert body == f"{ip} hello-kubelet from-configmap"
    finally:
        forward.terminate()
        forward.wait(10)

    cluster.cp.kubectl("-n", ns, "delete", "pod", "web", "--wait=true", "--timeout=60s")
    assert get(cluster, ns, "pod", "web") is None


def test_failing_container_restarts_with_back_off_and_a_pod_that_ends(kube_cluster):
    """restartPolicy Always: a container that exits 3 is restarted (restartCount, lastState);
    restartPolicy Never: the pod ends Failed with the exit code."""
    cluster = kube_cluster
    ns = cluster.namespace("restarts")
    image = next(iter(cluster.runner.images))
    for name, policy in (("again", "Always"), ("once", "Never")):
        cluster.cp.kubectl("-n", ns, "apply", "-f", "-", stdin=yaml.safe_dump(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
             "spec": {"restartPolicy": policy, "containers": [
                 {"name": "c", "image": image, "command": ["bash", "-c", "echo try; exit 3"]}]}}))
    once = wait(lambda: (lambda p: p if p and p["status"].get("phase") == "Failed" else None)(
        get(cluster, ns, "pod", "once")), 60, "pod once Failed", cluster)
    assert once["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    again = wait(lambda: (lambda p: p if p and p["status"]["containerStatuses"][0]["restartCount"] >= 1 else None)(
        get(cluster, ns, "pod", "again")), 60, "pod again restarted", cluster)
    assert again["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 3
    cluster.cp.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s")


def test_an_unknown_image_does_not_pull(kube_cluster):
    cluster = kube_cluster
    ns = cluster.namespace("image")
    cluster.cp.kubectl("-n", ns, "apply", "-f", "-", stdin=yaml.safe_dump(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
         "spec": {"containers": [{"name": "c", "image": "nvcr.io/nvidia/unknown:1", "command": ["true"]}]}}))
    status = wait(lambda: (lambda p: p["status"]["containerStatuses"][0]["state"].get("waiting")
                           if p and p["status"].get("containerStatuses") else None)(get(cluster, ns, "pod", "p")),
                  60, "the pod's waiting state", cluster)
    assert status["reason"] == "ErrImagePull"
    cluster.cp.kubectl("delete", "namespace", ns, "--wait=false")


def _fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.read().decode()
    except OSError:
        return None
