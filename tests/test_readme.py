"""README's first commands work as written in a fresh shell (issue 32, item 11): a new shell
has no `.venv/bin` on its PATH, so `rlhf-tasks` alone is "command not found" until README's
`source .venv/bin/activate`. README keeps exactly two commands for a fresh machine."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, need

README = (ROOT / "README.md").read_text()


def blocks(section: str) -> list[list[str]]:
    """The indented code blocks of README's `## section`, as their command lines."""
    text = README.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = re.findall(r"(?:^    \S.*\n)+", text, flags=re.M)
    return [[line[4:].split("  #")[0].strip() for line in block.splitlines()] for block in found]


def fresh_shell(script: str, home: Path) -> subprocess.CompletedProcess:
    """bash as a new login would start it here: no rc files, a PATH without this venv, a home of its own (what the
    commands write there, SkyPilot's `~/.sky/user_hash` among it, stays out of the checkout)."""
    return subprocess.run(["env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin", f"HOME={home}", "bash", "--norc",
                           "--noprofile", "-e", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_fresh_machine_has_exactly_two_commands():
    assert blocks("On a fresh machine")[0] == ["make demo", "make test"]


def test_the_commands_after_make_work_in_a_fresh_shell(tmp_path):
    venv = ROOT / ".venv"
    need(Path(sys.prefix).resolve() == venv.resolve(), f"the tests run from {venv} (make test), as README's user has it")
    after = blocks("On a fresh machine")[1]
    assert after[0].startswith("source .venv/bin/activate"), after
    assert any(line.startswith("rlhf-tasks ") for line in after[1:])
    bare = fresh_shell("\n".join(after[1:]), tmp_path)  # without the line that says how: not found, as the issue saw
    assert bare.returncode == 127 and "rlhf-tasks: command not found" in bare.stderr, bare.stderr
    out = fresh_shell("\n".join(after), tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tiny-grpo" in out.stdout and "tasks/tiny-grpo.yaml: ok" in out.stdout


def test_make_demo_says_where_the_command_is():
    out = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "source .venv/bin/activate" in out.stdout, out.stdout


# ------------------------------------------------------------ README as a front page, the rest as docs/ (issue 37, item 5)

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """The text without its code blocks (fenced, or indented by four spaces after a blank line)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"(?:\n\n)(?:    .*\n?)+", "\n\n", text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lowercase, punctuation but - and _ dropped, spaces to dashes."""
    heads = re.findall(r"^#{1,6} (.+)$", prose(page.read_text()), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def links(page: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not ours to check


def test_every_relative_link_in_readme_and_docs_resolves():
    assert len(PAGES) > 10, PAGES  # README and its pages
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.relative_to(ROOT)}: {target}: no heading #{anchor} in {file.name}")
    assert not broken, "\n".join(broken)


def test_readme_is_a_front_page():
    """What it is, the two commands, a quickstart per provider, the CLI table, where to read more: about 250 lines."""
    assert len(README.splitlines()) <= 250, len(README.splitlines())
    quick = README.split("## Quickstart per provider\n", 1)[1].split("\n## ", 1)[0]
    for provider, page in [("local", "local"), ("dstack", "dstack"), ("SkyPilot", "skypilot"), ("RunPod", "runpod"),
                           ("Slurm", "slurm"), ("KubeRay", "kuberay")]:
        assert f"**{provider}**" in quick and f"(docs/{page}.md)" in quick, provider
    assert "| `rlhf-tasks check TASK" in README.split("## The CLI\n", 1)[1]
    read_more = README.split("## Read more\n", 1)[1]
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= set(re.findall(r"\((docs/[\w-]+\.md)\)", read_more))


def test_a_provider_pages_rows_are_the_rows_of_the_table_that_compares_them():
    """A provider's page repeats its rows of a table that compares the providers (cost, lost nodes, the bundle,
    checkpoints, how to use it): the same rows, so an edit of one is an edit of both or this fails."""
    seen = 0
    for page in PAGES[1:]:
        text = page.read_text()
        for table, source in re.findall(r"((?:^\|.*\|\n)+)\n\(The same rows? as in \[[^\]]*\]\(([^)#]+)", text, flags=re.M):
            rows = (page.parent / source).read_text().splitlines()
            for row in table.splitlines()[2:]:
                assert row in rows, f"{page.name}: a row not in {source}'s table: {row[:80]}"
                first = row.split("|")[1].lower()
                assert {"skypilot": "sky"}.get(page.stem, page.stem) in first, f"{page.name}: another's row: {row[:80]}"
                seen += 1
    assert seen >= 30, seen
    dash = [p.read_text().split("## Reaching the head's dashboard\n", 1)[1].split("\n## ", 1)[0]
            for p in (ROOT / "docs" / "dstack.md", ROOT / "docs" / "skypilot.md")]
    assert dash[0] == dash[1] and "dstack attach" in dash[0] and "ssh -L" in dash[0]


def example(page: str) -> str:
    """The task file under a provider page's `## An example task file`."""
    section = (ROOT / "docs" / page).read_text().split("\n## An example task file\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```yaml\n", 1)[1].split("```", 1)[0]


def test_the_dstack_and_skypilot_pages_example_tasks_check_and_render_as_they_say(tmp_path, rlhf_home, capsys):
    """Each example is a task `check` takes without a warning and `render` turns into what the page says
    the provider reads from it: the shared checkpoints, dstack's fleets, retry and max_duration, SkyPilot's bucket."""
    import yaml

    from rlhf_tasks.cli import main

    for page, provider, out in (("dstack.md", "dstack", "v.dstack.yml"), ("skypilot.md", "sky", "v.sky.yaml")):
        task = tmp_path / f"{provider}.yaml"
        task.write_text(example(page))
        assert main(["check", str(task), "--provider", provider]) == 0, page
        warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        if provider == "sky":  # a bucket holds no cache (docs/skypilot.md): each node fetches the model, as said
            assert len(warnings) == 1 and warnings[0].startswith("warning: models: Qwen/Qwen2.5-7B-Instruct: each of "
                                                                 "the 2 nodes fetches them"), warnings
            warnings = []
        assert not warnings, page
        assert main(["render", str(task), "--provider", provider, "-o", str(tmp_path / provider / out)]) == 0
        rendered = yaml.safe_load((tmp_path / provider / out).read_text())
        if provider == "dstack":
            assert {"name": "ckpt", "path": "/checkpoints/verl-ppo-gsm8k"} in rendered["volumes"]
            assert rendered["fleets"] == ["h100-cluster"] and rendered["max_duration"] == 72 * 3600
            assert rendered["retry"] and rendered["max_price"] == 16.0  # price_per_hour per instance (issue 48)
        else:
            assert rendered["file_mounts"]["/checkpoints/verl-ppo-gsm8k"]["source"] == "s3://my-bucket/verl"
            assert rendered["resources"]["max_hourly_cost"] == 16.0  # price_per_hour per instance (issue 48)
