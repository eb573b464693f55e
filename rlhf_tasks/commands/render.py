"""`render`: the provider's native files, printed or written with -o; pure: no cluster, no network. Kept
apart from `check` for what writing needs: where the files go, their names, and never writing over the
task file or a file rlhf-tasks did not write."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import BadInput
from .inspection import warn_shared_storage, warn_working_dir_moved
from .targets import make_provider, read_task


def cmd_render(args) -> int:
    task = read_task(args.task)
    provider = make_provider(args.provider)
    plan = provider.plan(task)
    warn_shared_storage(provider, plan)
    warn_working_dir_moved(task, plan)
    if args.output:  # where the files go, for a provider whose CLI resolves paths from there
        provider.render_dir = Path(args.output) if (Path(args.output).is_dir() or args.output.endswith(os.sep)) \
            else Path(args.output).parent
    files = provider.render(plan)
    if not args.output:
        main_name, *others = files
        sys.stdout.write(files[main_name])
        if others:
            print(f"(with -o PATH, also written beside it: {', '.join(others)})", file=sys.stderr)
        return 0
    output = Path(args.output)
    if output.is_dir() or args.output.endswith(os.sep):  # a directory: every file under its own name
        targets = {name: output / name for name in files}
    else:
        targets = {name: (output if i == 0 else output.parent / name) for i, name in enumerate(files)}
        files = _renamed(files, next(iter(files)), output.name)
    _refuse_overwriting(targets, files, Path(args.task), args.force)
    for name, content in files.items():
        targets[name].parent.mkdir(parents=True, exist_ok=True)
        targets[name].write_text(content)
        print(f"wrote {targets[name]}", file=sys.stderr)
    return 0


def _refuse_overwriting(targets: dict[str, Path], files: dict[str, str], task: Path, force: bool) -> None:
    """BadInput, before anything is written, where a file would go over the task file itself (never
    done) or over a file rlhf-tasks did not write (its header says which it did: the user's), unless
    --force. A file already as it would be written, or one rlhf-tasks rendered before, is rewritten."""
    from ..providers.shipping import WRITTEN_BY, written_by_us

    theirs = []
    for name, target in targets.items():
        if not target.exists() and not target.is_symlink():
            continue
        if target.resolve() == task.resolve():
            raise BadInput(f"-o: {target} is the task file itself ({task}): render never writes over it, --force "
                           f"or not; nothing written; choose another path")
        if target.is_dir():
            raise BadInput(f"-o: {target} is a directory, where {name} would go; nothing written")
        try:
            old = target.read_text(errors="replace")
        except OSError as exc:
            raise BadInput(f"-o: {target} cannot be read ({exc}); nothing written") from None
        if old != files[name] and not written_by_us(old):
            theirs.append(target)
    if theirs and not force:
        more = f" (and {len(theirs) - 1} more: {', '.join(map(str, theirs[1:4]))}{', ...' if len(theirs) > 4 else ''})" \
            if len(theirs) > 1 else ""
        raise BadInput(f"-o: {theirs[0]}{more} exists and rlhf-tasks did not write it (it has no "
                       f"`{WRITTEN_BY}` header): nothing written; choose another path, or add --force to write "
                       f"over it")


def _renamed(files: dict[str, str], old: str, new: str) -> dict[str, str]:
    """The rendered files name each other by their default names (`sky launch ... NAME.sky.yaml`,
    `sbatch NAME.sbatch`); written under another name, the main file is named as written."""
    import re

    if old == new:
        return files
    whole = re.compile(rf"(?<![\w./-]){re.escape(old)}(?![\w.-])")
    return {name: whole.sub(lambda _: new, text) for name, text in files.items()}
