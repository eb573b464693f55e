"""The two test tiers (tests/conftest.py): a test that starts a cluster carries the `cluster`
mark, from a fixture declared with `starts_cluster` or by hand, and one that starts a cluster
without it fails, so `make test-fast` cannot silently grow slow. Each case runs our conftest
in a pytest of its own (a subprocess: the guard is an audit hook, one per process)."""

from __future__ import annotations

import pytest

from conftest import ROOT

pytest_plugins = ("pytester",)

TESTS = ROOT / "tests"


@pytest.fixture
def inner(pytester, monkeypatch):
    """A pytest run with our conftest and the testbed modules importable."""
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}:{ROOT}")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # hydra's and anyio's slow every start
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    return pytester


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
