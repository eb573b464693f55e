"""job.working_dir as dstack's `files:` ships it: where it lands on every node (JOB_DIR), what
`dstack apply` archives of it (dstack's own walk, .gitignore and .dstackignore respected), and the
server's limit on an archive, which `check`, `render` and `launch` hold it to.
"""

from __future__ import annotations

import os
from pathlib import Path

from ... import workdir

#: Where the task's job.working_dir lands on every node (dstack's `files:`), and the directory the job's
#: commands run in (dstack's `working_dir`; without it, the image's, `/` in many). Not dstack's repo directory
#: (/workflow), nor below /opt/rlhf-tasks: dstack's runner replaces a `files:` target whole (executor/files.go,
#: as tests/dstack/agent.py plays it), so no image's directory and no other archive's may be it.
JOB_DIR = "/opt/rlhf-tasks-workdir"

#: dstack's server refuses a `files:` archive above this (DSTACK_SERVER_CODE_UPLOAD_LIMIT, 2 MiB by default:
#: server/settings.py); read from this environment too, for a server started here with another limit.
DEFAULT_UPLOAD_LIMIT = 2 * 2**20


def dstack_packs(path: str) -> workdir.Measure:
    """What `dstack apply` archives of a `files:` directory (utils/files.py create_file_archive: the `ignore`
    walk with .gitignore and .dstackignore, .git left out, hidden files kept), as bytes of its tar."""
    root = Path(path).absolute()
    out = workdir.Measure(str(path), how="dstack's own walk (the ignore package)")
    sizes: dict[str, int] = {}

    def add(p: Path) -> None:
        rel = p.relative_to(root)
        if not rel.parts:
            return
        size = 512 + (-(-p.stat().st_size // 512) * 512 if p.is_file() else 0)  # a tar header, the data padded
        sizes[rel.parts[0]] = sizes.get(rel.parts[0], 0) + size

    try:
        import ignore
        import ignore.overrides
    except ImportError:
        out.how = "rlhf-tasks' own walk (dstack is not installed here; it follows .gitignore and .dstackignore)"
        rules = [lambda p: p.name == ".git" and p.is_dir()]
        workdir._travel(root, rules, add, ignore_files=(".gitignore", ".dstackignore"))
    else:
        walk = (ignore.WalkBuilder(root).overrides(ignore.overrides.OverrideBuilder(root).add("!/.git/").build())
                .hidden(False).require_git(False).add_custom_ignore_filename(".dstackignore").build())
        for entry in walk:
            add(Path(entry.path()))
    out.size = sum(sizes.values()) + 1024  # the tar's two end blocks
    out.biggest = sorted(sizes.items(), key=lambda item: -item[1])
    return out


def upload_limit() -> int:
    return int(os.environ.get("DSTACK_SERVER_CODE_UPLOAD_LIMIT") or DEFAULT_UPLOAD_LIMIT)
