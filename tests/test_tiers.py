"""The two test tiers (tests/conftest.py): a test that starts a cluster carries the `cluster`
mark, from a fixture declared with `starts_cluster` or by hand, and one that starts a cluster
without it fails, so `make test-fast` cannot silently grow slow. Each case runs our conftest
in a pytest of its own (a subprocess: the guard is an audit hook, one per process)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import ROOT

pytest_plugins = ("pytester",)

TESTS = ROOT / "tests"


@pytest.fixture
def inner(pytester, monkeypatch):
    """A pytest run with our conftest and the testbed modules importable."""
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}:{ROOT}")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # hydra's and anyio's slow every start
    monkeypatch.delenv("RLHF_TASKS_TIMELINE", raising=False)  # the inner runs' tests are not the suite's
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    return pytester


def make_test_flags() -> list[str]:
    """`make test`'s pytest-xdist flags, as the Makefile gives them (PYTEST_WORKERS)."""
    return next(line.split(":=", 1)[1].split() for line in (ROOT / "Makefile").read_text().splitlines()
                if line.startswith("PYTEST_WORKERS"))


def one_worker(tmp_path, monkeypatch) -> tuple[list[str], Path]:
    """`make test`'s flags with one worker, so that the order is known, and the file where the inner tests say
    what ran (their environment's RAN)."""
    flags = make_test_flags()
    flags[flags.index("-n") + 1] = "1"
    record = tmp_path / "ran"
    monkeypatch.setenv("RAN", str(record))
    return flags, record


def test_fixtures_that_start_a_cluster_mark_their_tests_even_through_another_fixture(inner):
    inner.makepyfile(test_x="""
        import pytest
        import slurm_testbed
        import testbed
        from conftest import starts_cluster

        hosts = testbed.make_testbed_fixture(2)
        slurm = slurm_testbed.make_slurm_fixture(3)

        @pytest.fixture
        @starts_cluster
        def ray_cluster():
            return "cluster"

        @pytest.fixture
        def on_top(hosts):
            return hosts

        def test_pure(): pass
        def test_hosts(hosts): pass
        def test_on_top(on_top): pass
        def test_slurm(slurm): pass
        def test_ray(ray_cluster): pass
        def test_launch(cli_env): pass
        @pytest.mark.cluster
        def test_by_hand(): pass
    """)
    fast = inner.runpytest_subprocess("--collect-only", "-q", "-m", "not cluster")
    assert [line for line in fast.outlines if "::" in line] == ["test_x.py::test_pure"]
    fast.stdout.fnmatch_lines(["1/7 tests collected (6 deselected)*"])

def test_a_testbed_without_the_mark_fails_before_it_makes_a_namespace(inner):
    inner.makepyfile(test_x="""
        import testbed

        def test_sneaky(tmp_path, monkeypatch):
            made = []
            monkeypatch.setattr(testbed, "_ip", lambda *a, **k: made.append(a))
            try:
                testbed.Testbed(2, tmp_path / "tb")
            finally:
                assert made == []
    """)
    result = inner.runpytest_subprocess("-q")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_sneaky starts 2 namespace hosts (a Testbed) but has no `cluster` mark*"])


def test_slurm_ray_or_a_container_started_by_hand_needs_the_mark(inner, tmp_path):
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    for name in ("srun", "raylet", "podman", "ray"):  # stand-ins: they start nothing, the guard looks at the name
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    inner.makepyfile(test_x=f"""
        import subprocess
        import pytest

        PROGRAMS = ["srun", "raylet", "podman", "ray"]  # `ray start` too (issue 32, item 17)

        def run(program):
            assert subprocess.run([{str(bin_dir)!r} + "/" + program, "run"]).returncode == 0

        @pytest.mark.parametrize("program", PROGRAMS)
        def test_unmarked(program):
            run(program)

        @pytest.mark.cluster
        @pytest.mark.parametrize("program", PROGRAMS)
        def test_marked(program):
            run(program)

        def test_other_programs_are_fine():
            assert subprocess.run(["true"]).returncode == 0
    """)
    result = inner.runpytest_subprocess("-q")
    result.assert_outcomes(failed=4, passed=5)
    result.stdout.fnmatch_lines([f"test_x.py::test_unmarked?{name}? starts `*/{name} run` but has no `cluster` mark*"
                                 for name in ("srun", "raylet", "podman", "ray")])


SKIPPERS = """
    import pytest
    from conftest import need

    def test_need():
        need(False, "a package this machine lacks")

    def test_importorskip():
        pytest.importorskip("no_such_module_rlhf_tasks")

    def test_skip():
        pytest.skip("a helper's own skip")
"""


@pytest.mark.parametrize("ci", ["true", "True", "TRUE"])
def test_in_ci_nothing_skips_whatever_the_case_of_ci(inner, monkeypatch, ci):
    """need(), pytest.importorskip and a bare skip all fail in CI, with CI=true in any case (issue 32,
    item 17: the testbed lowercases CI where the conftest compared it case-sensitively)."""
    monkeypatch.setenv("CI", ci)
    inner.makepyfile(test_x=SKIPPERS)
    result = inner.runpytest_subprocess("-q", "-rf")
    result.assert_outcomes(failed=3)
    result.stdout.fnmatch_lines(["*required in CI: a package this machine lacks*",
                                 "*skipped in CI, where nothing may skip*no_such_module_rlhf_tasks*",
                                 "*skipped in CI, where nothing may skip*a helper's own skip*"])


def test_outside_ci_they_skip_with_the_reason(inner, monkeypatch):
    monkeypatch.setenv("CI", "false")
    inner.makepyfile(test_x=SKIPPERS)
    inner.runpytest_subprocess("-q").assert_outcomes(skipped=3)


def test_a_stand_in_the_test_declares_is_not_a_cluster(inner, tmp_path):
    """A `ray` that only records its argv, declared with conftest.stand_in: the guard lets it run;
    the same name elsewhere on PATH still needs the mark."""
    inner.makepyfile(test_x="""
        import os
        import subprocess
        from conftest import stand_in

        def make(tmp_path):
            ray = tmp_path / "bin" / "ray"
            ray.parent.mkdir()
            ray.write_text("#!/bin/sh\\nexit 0\\n")
            ray.chmod(0o755)
            return ray

        def test_declared(tmp_path):
            stand_in(make(tmp_path))
            env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
            assert subprocess.run(["ray", "start"], env=env).returncode == 0

        def test_undeclared(tmp_path):
            env = dict(os.environ, PATH=f"{make(tmp_path).parent}:{os.environ['PATH']}")
            subprocess.run(["ray", "start"], env=env)
    """)
    result = inner.runpytest_subprocess("-q")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_undeclared starts `ray start` but has no `cluster` mark*"])


def test_make_tests_workers_keep_each_group_together_the_kubernetes_tests_first(inner, tmp_path, monkeypatch):
    """`make test` runs its pytest-xdist workers with the Makefile's flags: the tests of a fixture wider
    than one test (here a module's) run in one worker, so it starts once; the tests of the Kubernetes
    build (`kube_cluster`, `real_kubectl`) too, first in theirs; the rest go wherever a worker is free.
    (pytest 9 with xdist 3.8 ignored every group: pyproject.toml pins pytest 8.)"""
    flags = make_test_flags()
    record = tmp_path / "ran"
    monkeypatch.setenv("RAN", str(record))
    inner.makepyfile(test_x="""
        import os
        import pytest

        def ran(kind):
            with open(os.environ["RAN"], "a") as f:
                f.write(os.environ["PYTEST_XDIST_WORKER"] + " " + kind + "\\n")

        @pytest.fixture(scope="module")
        def module_wide():
            return 1

        @pytest.fixture(scope="session")
        def kube_cluster():
            return 1

        @pytest.mark.parametrize("i", range(4))
        def test_alone(i):
            ran("alone")

        @pytest.mark.parametrize("i", range(4))
        def test_grouped(module_wide, i):
            ran("grouped")

        @pytest.mark.parametrize("i", range(3))
        def test_kube(kube_cluster, i):
            ran("kube")
    """)
    result = inner.runpytest_subprocess("-p", "xdist", *flags, "-q")
    result.assert_outcomes(passed=11)
    lines = [line.split() for line in record.read_text().splitlines()]
    workers = {kind: {w for w, k in lines if k == kind} for kind in ("alone", "grouped", "kube")}
    assert len(workers["grouped"]) == 1 and len(workers["kube"]) == 1, lines
    assert len({w for w, _ in lines}) == int(flags[flags.index("-n") + 1]), lines  # every worker worked
    kube_worker = workers["kube"].pop()
    assert [k for w, k in lines if w == kube_worker][:3] == ["kube"] * 3, lines


def test_a_cluster_test_marked_alone_runs_with_no_other_cluster_test_beside_it(inner, tmp_path, monkeypatch):
    """The workers start together: an `alone` test and another cluster test never overlap (the workers'
    lock), while two fast tests do not wait for each other's worker."""
    flags = make_test_flags()
    monkeypatch.setenv("SEEN", str(tmp_path))
    inner.makepyfile(test_x="""
        import os
        import time
        from pathlib import Path
        import pytest

        def hold(me):
            # running for 2 s; says whether any other test ran meanwhile
            seen = Path(os.environ["SEEN"])
            (seen / f"running-{me}").touch()
            others = set()
            end = time.monotonic() + 2
            while time.monotonic() < end:
                others |= {p.name for p in seen.glob("running-*")} - {f"running-{me}"}
                time.sleep(0.05)
            (seen / f"running-{me}").unlink()
            (seen / f"beside-{me}").write_text(" ".join(sorted(others)))

        @pytest.mark.cluster
        @pytest.mark.alone
        def test_alone():
            hold("alone")

        @pytest.mark.cluster
        def test_cluster():
            hold("cluster")
    """)
    inner.runpytest_subprocess("-p", "xdist", *flags, "-q").assert_outcomes(passed=2)
    assert (tmp_path / "beside-alone").read_text() == "" and (tmp_path / "beside-cluster").read_text() == ""


def test_at_most_two_cluster_tests_run_at_once_and_one_that_waits_runs_beside_them(inner, tmp_path, monkeypatch):
    """Whatever the workers (four here), two cluster tests hold the two slots and a third waits for one (2 cores),
    while a test marked `waits` runs beside both."""
    flags = make_test_flags()
    flags[flags.index("-n") + 1] = "4"
    monkeypatch.setenv("SEEN", str(tmp_path))
    inner.makepyfile(test_x="""
        import os
        import time
        from pathlib import Path
        import pytest

        def hold(me, seconds):
            # running for a while; records the most cluster tests (and tests of any kind) seen running at once
            seen = Path(os.environ["SEEN"])
            (seen / f"running-{me}").touch()
            most = [0, 0]
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                running = [p.name for p in seen.glob("running-*")]
                most = [max(most[0], sum(not n.endswith("waits") for n in running)), max(most[1], len(running))]
                time.sleep(0.05)
            (seen / f"running-{me}").unlink()
            (seen / f"most-{me}").write_text(" ".join(map(str, most)))

        @pytest.mark.cluster
        @pytest.mark.waits
        def test_waits():
            hold("waits", 4)

        @pytest.mark.cluster
        @pytest.mark.parametrize("i", range(3))
        def test_cluster(i):
            hold(f"c{i}", 1.5)
    """)
    inner.runpytest_subprocess("-p", "xdist", *flags, "-q").assert_outcomes(passed=4)
    most = {p.name[5:]: [int(n) for n in p.read_text().split()] for p in tmp_path.glob("most-*")}
    assert max(m[0] for m in most.values()) == 2, most  # never three cluster tests at once
    assert most["waits"][1] == 3, most  # the waiting one ran beside two others


def test_a_test_marked_alone_runs_last_after_the_fast_tier(inner, tmp_path, monkeypatch):
    """An `alone` test holds every other cluster test back while it runs; dispatched last, after the fast
    tier (which takes no lock), it keeps no worker waiting. (One worker here, so the order is known.)"""
    flags, record = one_worker(tmp_path, monkeypatch)
    inner.makepyfile(test_x="""
        import os
        import pytest

        def ran(what):
            with open(os.environ["RAN"], "a") as f:
                f.write(what + "\\n")

        @pytest.mark.cluster
        @pytest.mark.alone
        def test_alone():
            ran("alone")

        def test_fast():
            ran("fast")

        @pytest.mark.cluster
        def test_cluster():
            ran("cluster")
    """)
    inner.runpytest_subprocess("-p", "xdist", *flags, "-q").assert_outcomes(passed=3)
    assert record.read_text().split() == ["cluster", "fast", "alone"]


def test_a_module_group_that_waits_goes_before_the_other_cluster_tests(inner, tmp_path, monkeypatch):
    """The dstack files, each a module's bed whose tests mostly wait on dstack's own pace: dispatched right after
    the Kubernetes group, each to a worker of its own, not after the other cluster tests, where the longest chain
    of the run would start last. (One worker here, so the order is known.)"""
    flags, record = one_worker(tmp_path, monkeypatch)
    inner.makepyfile(test_a="""
        import os
        import pytest

        @pytest.mark.cluster
        def test_cluster():
            with open(os.environ["RAN"], "a") as f:
                f.write("cluster\\n")
    """, test_b="""
        import os
        import pytest

        pytestmark = [pytest.mark.cluster, pytest.mark.waits]

        @pytest.fixture(scope="module")
        def bed():
            return 1

        @pytest.mark.parametrize("i", range(2))
        def test_waits(bed, i):
            with open(os.environ["RAN"], "a") as f:
                f.write("waits\\n")
    """)
    inner.runpytest_subprocess("-p", "xdist", *flags, "-q").assert_outcomes(passed=3)
    assert record.read_text().split() == ["waits", "waits", "cluster"]


def test_a_session_wide_cluster_ends_after_its_groups_last_test_not_at_the_sessions_end(inner, tmp_path, monkeypatch):
    """In `make test`'s workers the Kubernetes control plane and the dstack server (session-wide fixtures that
    start a cluster) end once their group's tests are done, what depends on them first, so that their polling
    takes no CPU from the tests after them. (One worker here, so the order is known: the Kubernetes group, the
    other session group, then the rest.)"""
    flags, record = one_worker(tmp_path, monkeypatch)
    inner.makepyfile(test_x="""
        import os
        import pytest
        from conftest import starts_cluster

        def ran(what):
            with open(os.environ["RAN"], "a") as f:
                f.write(what + "\\n")

        @pytest.fixture(scope="session")
        @starts_cluster
        def kube_cluster():
            ran("kube up")
            yield 1
            ran("kube down")

        @pytest.fixture(scope="session")
        @starts_cluster
        def server():
            ran("server up")
            yield 1
            ran("server down")

        @pytest.fixture(scope="session")
        def fleet(server):
            ran("fleet up")
            yield 1
            ran("fleet down")

        @pytest.mark.parametrize("i", range(2))
        def test_kube(kube_cluster, i):
            ran("kube test")

        @pytest.mark.parametrize("i", range(2))
        def test_fleet(fleet, i):
            ran("fleet test")

        def test_after():
            ran("after")
    """)
    result = inner.runpytest_subprocess("-p", "xdist", *flags, "-q")
    result.assert_outcomes(passed=5)
    assert record.read_text().splitlines() == [
        "kube up", "kube test", "kube test", "kube down",
        "server up", "fleet up", "fleet test", "fleet test", "fleet down", "server down", "after"]


def test_launchers_get_their_ctrl_c_when_the_suite_was_started_in_the_background(inner):
    """A shell without job control starts a background job (`make test &`) with SIGINT ignored, which every
    process under it inherits: a launcher a test starts would ignore the Ctrl-C the test sends it. The conftest
    makes it the default again for what the tests start."""
    import signal
    import subprocess
    import sys

    inner.makepyfile(test_x="""
        import subprocess, sys

        def test_child():
            said = subprocess.run([sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT))"],
                                  capture_output=True, text=True).stdout
            assert "default_int_handler" in said, said
    """)
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=inner.path,
                         capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert ran.returncode == 0 and "1 passed" in ran.stdout, ran.stdout + ran.stderr
