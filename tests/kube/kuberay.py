"""The KubeRay operator, the real one (build.sh), run as a default Helm install runs it: the
chart's arguments (values.yaml and templates/deployment.yaml at the built version), no
environment of its own, so ENABLE_INIT_CONTAINER_INJECTION, the probes and the feature gates
are the chart's defaults.

It runs where a Deployment's pod would: on a namespace host of its own on the pods' network,
so it reaches the head's dashboard by the head Service's name as in a cluster, and the API
server through `ApiRelay` (the `kubernetes` Service a pod would use).
"""
from __future__ import annotations

import ctypes
import os
import socket
import threading
from pathlib import Path

import yaml

from .controlplane import ControlPlane

#: The chart's `args` with its default values: no batch scheduler, every namespace watched,
#: JSON logs, leader election on, metrics on, concurrency 1, QPS 100, burst 200, its feature
#: gates. `--leader-election-namespace` is what a pod reads from its service account.
HELM_ARGS = ["--log-stdout-encoder", "json", "--log-file-encoder", "json", "--enable-leader-election=true",
             "--enable-metrics=true", "--reconcile-concurrency=1", "--qps=100", "--burst=200",
             "--feature-gates=RayClusterStatusConditions=true,RayJobDeletionPolicy=true,RayMultiHostIndexing=true,"
             "RayServiceIncrementalUpgrade=false,RayCronJob=false"]
NAMESPACE = "kuberay-system"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL("libc.so.6", use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


class ApiRelay:
    """127.0.0.1:`port` inside a host's network namespace, relayed to the API server on this
    machine's loopback (TLS passes through untouched). A thread of this process listens there:
    it enters the namespace only to open the listening socket."""

    def __init__(self, netns: str, target: tuple[str, int], port: int = 6443):
        self.netns, self.target, self.port = netns, target, port
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        other = os.open(netns, os.O_RDONLY)
        try:
            _setns(other)
            try:
                self.sock = socket.socket()
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self.sock.bind(("127.0.0.1", port))
                self.sock.listen(64)
            finally:
                _setns(own)
        finally:
            os.close(own)
            os.close(other)
        threading.Thread(target=self._serve, name=f"api-relay-{port}", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


class Operator:
    """The operator on testbed host `host`, watching every namespace."""

    def __init__(self, cp: ControlPlane, tb, host: int):
        self.cp, self.tb, self.host = cp, tb, host
        self.log = Path(tb.dir) / "kuberay-operator.log"
        self.proc = None
        self.relay = None

    def start(self) -> "Operator":
        self.cp.kubectl("create", "namespace", NAMESPACE)
        self.relay = ApiRelay(f"/run/netns/{self.tb.hosts[self.host].netns}", ("127.0.0.1", self.cp.port))
        config = yaml.safe_load(self.cp.kubeconfig.read_text())
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{self.relay.port}"
        kubeconfig = Path(self.tb.dir) / "kuberay-operator.kubeconfig"
        kubeconfig.write_text(yaml.safe_dump(config))
        self.proc = self.tb.run(self.host, [str(self.cp.bin / "ray-operator"), f"--kubeconfig={kubeconfig}",
                                            f"--leader-election-namespace={NAMESPACE}", *HELM_ARGS],
                                env={"PATH": "/usr/bin:/bin", "HOME": "/root"}, cwd="/", log=self.log,
                                name="kuberay-operator")
        return self

    def running(self) -> bool:
        return self.proc is not None and self.proc.running()

    def stop(self) -> None:
        if self.proc is not None and self.proc.running():
            self.proc.send_signal()
            try:
                self.proc.wait(15)
            except Exception:  # noqa: BLE001 - killed below
                self.proc.kill()
        if self.relay is not None:
            self.relay.close()
