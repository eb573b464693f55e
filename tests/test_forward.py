"""`rlhf-tasks forward`'s part every provider's tunnel shares (providers/base.py: `start_tunnel`,
`hold_forward`; KubeRay's `kubectl port-forward`, dstack's `dstack attach`, SkyPilot's `ssh -L`): the
address is said only once the head's dashboard answers through the tunnel, a tunnel that dies says its
own words, Ctrl-C ends it. The tunnels here are real processes; the dashboard a real HTTP server on
loopback. Each provider's tunnel to a real cluster: test_kuberay_cluster.py, test_dstack_cluster.py,
test_sky_slurm.py."""

from __future__ import annotations

import http.server
import signal
import sys
import threading
import time

import pytest

from rlhf_tasks import console, state
from rlhf_tasks.errors import StepFailed
from rlhf_tasks.agent.protocol.ports import free_port
from rlhf_tasks.providers.base import hold_forward, start_tunnel

#: A tunnel that holds until it is ended.
HOLDS = [sys.executable, "-c", "import time; print('forwarding', flush=True); time.sleep(600)"]


@pytest.fixture
def dashboard():
    """A head's dashboard on loopback: /api/gcs_healthz answers 200."""
    class Healthz(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/api/gcs_healthz" else 404)
            self.end_headers()
            self.wfile.write(b"success")

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Healthz)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_tunnel_that_exits_first_fails_in_its_own_words_and_nothing_is_recorded(rlhf_home):
    state.save("c", {"provider": "kuberay", "cluster_id": "c1"})
    tunnel, said = start_tunnel([sys.executable, "-c", "import sys; print('error: unable to listen on port 8265: "
                                                      "address already in use'); sys.exit(1)"])
    with pytest.raises(StepFailed) as failed:
        hold_forward("c", tunnel, "kubectl port-forward", f"http://127.0.0.1:{free_port()}", timeout=30, said=said,
                     recorded=True, then="nothing")
    assert str(failed.value) == ("forwarding the dashboard of c: kubectl port-forward exited with code 1: error: "
                                 "unable to listen on port 8265: address already in use"), str(failed.value)
    assert "dashboard" not in state.load("c")


def test_a_dashboard_silent_through_a_live_tunnel_fails_at_the_deadline_and_the_tunnel_is_ended(rlhf_home):
    tunnel, said = start_tunnel(HOLDS)
    started = time.monotonic()
    with pytest.raises(StepFailed) as failed:
        hold_forward("c", tunnel, "ssh -L", f"http://127.0.0.1:{free_port()}", timeout=2, said=said, recorded=False,
                     then="nothing", silent_head=" (is the cluster's Ray still running?)")
    assert time.monotonic() - started < 20
    assert str(failed.value).startswith("forwarding the dashboard of c: ") and \
        str(failed.value).endswith(" (is the cluster's Ray still running?)"), str(failed.value)
    assert tunnel.poll() is not None  # ended, not left holding the port


def test_the_address_is_recorded_and_said_once_the_dashboard_answers_then_ctrl_c_ends_the_tunnel(
        rlhf_home, dashboard, monkeypatch):
    state.save("c", {"provider": "dstack", "cluster_id": "c1"})
    lines: list[str] = []
    monkeypatch.setattr(console, "say", lines.append)
    tunnel, said = start_tunnel(HOLDS)
    readied = []

    def ctrl_c_once_said():  # the user's Ctrl-C while the forward is held
        deadline = time.monotonic() + 30
        while not lines and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    threading.Thread(target=ctrl_c_once_said, daemon=True).start()
    code = hold_forward("c", tunnel, "dstack attach", dashboard, timeout=30, said=said, recorded=True,
                        ready=lambda: readied.append(state.load("c").get("dashboard")),
                        then="eval \"$(rlhf-tasks env c)\"")
    assert code == 0 and tunnel.poll() is not None
    assert lines == [f"the dashboard of c is at {dashboard} (Ctrl-C closes it); in another shell: "
                     f"eval \"$(rlhf-tasks env c)\""]
    assert state.load("c")["dashboard"] == dashboard and readied == [dashboard]
